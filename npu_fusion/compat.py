"""Every torch and torchair internal whose presence depends on the version, in one place.

npu-fusion supports torch 2.6 to the newest release and the torchair of every
torch_npu release line from 2.6.0 on. The rest of the package calls what is here
instead of reaching for a private name that only some releases have:

* :func:`guard_or_true`: ``symbolic_shapes.guard_or_true`` appeared in torch 2.8;
  2.6 and 2.7 get an equivalent built from a guard.
* :func:`outside_fake_mode`: torch 2.6 and 2.7 run backward compilers inside
  AOTAutograd's fake mode; meta computations of the pass step out of it.
* :func:`trace_artifact`: a structured-trace (``TORCH_TRACE``) artifact, written
  through ``torch._logging.trace_structured`` when this torch has it.
* :func:`torchair_pass_slot`: the ``CompilerConfig`` attribute through which
  torchair runs a user FX pass on the backward graph. The torchair of the newest
  release of every torch_npu line from 2.6.0 to 2.14.0 has ``post_grad_custom_pre_pass``
  (read in the wheels: 2.6.0.post5, 2.7.1.post11, 2.8.0.post5, 2.9.0.post9, 2.9.1,
  2.10.0.post7, 2.11.0.post3, 2.12.0.post3, 2.13.0, 2.14.0; 2.7.1.post2 too).
  torch_npu 2.7.1 itself has no user pass hook at all (its backward compiler is
  built inside the backend from the config, with no callback), so installing there
  raises :class:`UnsupportedTorchair` naming the release.
* :func:`op_schema`, :func:`check_with`: an op overload's ``FunctionSchema`` and
  ``torch._check_with`` (the fused ops' declarations and input checks).
* :func:`torchair_converter_api`: what the GE converters use of torchair, which sits in
  its private modules (``_ge_concrete_graph``, ``ge._ge_graph``) in every release.
* :data:`FUSED_RMS_NORM`, :data:`FUSED_RMS_NORM_BACKWARD`: ``aten._fused_rms_norm`` and
  ``aten._fused_rms_norm_backward``, the whole RMSNorm ops torch routes ``F.rms_norm`` to
  on a device with its own kernel (None on a torch without them).
* The FX, fake-tensor and Dynamo internals the pass reads (:func:`is_erased`,
  :func:`empty_graph_like`, :func:`fake_tensor_type`, :func:`symbolic_expr`,
  :func:`size_hint`, :func:`current_compile_id`, :func:`dynamo_counters`, :func:`graph_argument`,
  :func:`guard_constant`, :func:`specialize_size`, :func:`guardable_example`,
  :func:`guard_size_condition`, :func:`marked_dynamic_source`): private names of
  every supported torch, kept here so that a release that renames one is fixed in one place.
"""
from __future__ import annotations

import importlib.util
import json
from typing import Any, Callable, Optional

import torch
from torch.fx.experimental import symbolic_shapes

#: the CompilerConfig attribute torchair calls with ``fn(gm, example_inputs, config)``
#: on every graph after the forward/backward partition (docs/how-it-works.md#the-hooks).
TORCHAIR_PASS_SLOT = "post_grad_custom_pre_pass"

#: ``aten._fused_rms_norm.default`` and ``aten._fused_rms_norm_backward.default`` where this
#: torch has them, else None (they are not in every torch the package supports)
#: whether AOTAutograd describes its graphs' outputs (``PlainAOTOutput`` for the user's, on a
#: partitioned forward's output node, ``meta["desc"]``): newer torch only
AOT_OUTPUT_DESCRIPTIONS = importlib.util.find_spec("torch._functorch._aot_autograd.descriptors") is not None
FUSED_RMS_NORM = getattr(getattr(torch.ops.aten, "_fused_rms_norm", None), "default", None)
FUSED_RMS_NORM_BACKWARD = getattr(getattr(torch.ops.aten, "_fused_rms_norm_backward", None), "default", None)


def _guard_or_true_by_guard(condition) -> bool:
    """For torch 2.6 and 2.7: decide the condition (a guard on backed sizes); only a
    data-dependent size, which no guard can decide, reads as True."""
    try:
        return bool(condition)
    except symbolic_shapes.GuardOnDataDependentSymNode:
        return True


_GUARD_OR_TRUE = getattr(symbolic_shapes, "guard_or_true", _guard_or_true_by_guard)


def guard_or_true(condition) -> bool:
    """False only when a (possibly symbolic) condition is known to be false."""
    return condition if isinstance(condition, bool) else bool(_GUARD_OR_TRUE(condition))


def trace_artifact(name: str, payload_fn: Callable[[], Any], *, as_json: bool = False) -> None:
    """Write a named artifact into the structured trace (``TORCH_TRACE=<dir>``), next
    to Dynamo's and AOTAutograd's for the same compile id; ``tlparse`` lists it on that
    compile's page. ``as_json``: the payload is a dict or list, written as JSON.
    Costs nothing when tracing is off: ``payload_fn`` is only called when it is on."""
    try:
        from torch._logging import trace_structured
    except ImportError:  # a torch without structured tracing: nothing to write to
        return
    encoding = "json" if as_json else "string"
    payload = (lambda: json.dumps(payload_fn(), default=str)) if as_json else payload_fn
    trace_structured("artifact", metadata_fn=lambda: {"name": name, "encoding": encoding}, payload_fn=payload)


def outside_fake_mode():
    """A context in which tensor factories make real (meta) tensors even where the caller
    runs inside a fake mode: torch 2.6 and 2.7 run the backward compiler, and so the pass,
    with AOTAutograd's fake mode active; later releases do not."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    return unset_fake_temporarily()


def plain_dispatch():
    """A context in which ops dispatch without the Python dispatcher.

    Their C++ kernels run (``torch._C._DisablePythonDispatcher``), where AOTAutograd enables the
    Python dispatcher around the backward compiler: a factory or ``as_strided`` on meta tensors then
    costs microseconds, not a Python dispatch."""
    return torch._C._DisablePythonDispatcher()


def active_fake_mode():
    """The fake mode active in this thread, or None."""
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)


def tensor_metadata(value):
    """``make_fx``'s ``tensor_meta`` of a tensor (``torch.fx.passes.shape_prop._extract_tensor_metadata``)."""
    from torch.fx.passes.shape_prop import _extract_tensor_metadata

    return _extract_tensor_metadata(value)


def set_value_meta(node, value, tensor_meta=None) -> None:
    """Give a node the pass inserts its fake ``value`` as ``make_fx`` does: ``val``, and for a
    tensor ``tensor_meta`` too (``tensor_meta`` when the caller has it). Torch 2.6 and 2.7's default
    partitioner reads a forward node without ``tensor_meta`` as a tuple (it saves its users, and
    asserts they are all getitems), which a fused forward op's outputs are not."""
    node.meta["val"] = value
    if isinstance(value, torch.Tensor):
        node.meta["tensor_meta"] = tensor_meta if tensor_meta is not None else tensor_metadata(value)


class UnsupportedTorchair(RuntimeError):
    """The installed torchair offers no hook through which npu-fusion could run."""


def torchair_release() -> str:
    """Which torchair this is, for messages: the torch_npu distribution that ships it,
    or, where torchair was unpacked on its own, its location and the torch version."""
    import importlib.metadata
    import sys

    import torch

    try:
        return f"torch_npu {importlib.metadata.version('torch_npu')}"
    except importlib.metadata.PackageNotFoundError:
        module = sys.modules.get("torchair")
        where = getattr(module, "__file__", None) or "an unknown location"
        return f"the torchair at {where} (torch {torch.__version__})"


def torchair_pass_slot(compiler_config) -> str:
    """The name of the attribute of ``compiler_config`` that holds a user backward-graph
    pass, or :class:`UnsupportedTorchair` when this torchair has none."""
    if hasattr(compiler_config, TORCHAIR_PASS_SLOT):
        return TORCHAIR_PASS_SLOT
    if type(compiler_config).__name__ != "CompilerConfig":
        raise TypeError(f"npu_fusion.install needs a torchair CompilerConfig, got {type(compiler_config).__name__}")
    raise UnsupportedTorchair(
        f"npu_fusion.install: {torchair_release()} has no CompilerConfig.{TORCHAIR_PASS_SLOT} and no other hook "
        f"that runs a user pass on the backward graph (torch_npu 2.7.1 is such a release; its post releases "
        f"from 2.7.1.post2 on have the hook): install the newest post release of your torch_npu line "
        f"(2.7.1.post11 at present), or compile with backend='npu_fusion'")


def torchair_pass(compiler_config) -> Optional[Callable]:
    """The pass currently set in the config's slot (torchair wraps it in a ``CallableValue``)."""
    slot = getattr(compiler_config, torchair_pass_slot(compiler_config))
    return getattr(slot, "value", slot)


def inductor_config():
    """Inductor's config module, where its joint-graph hook lives.

    ``torch._inductor.config``: where Inductor reads its joint-graph hook
    (``joint_custom_pre_pass``, called with the joint graph before the partition)."""
    import torch._inductor.config as config

    return config


def custom_graph_pass_base() -> type:
    """Inductor's ``CustomGraphPass``: a pass with a ``uuid()``, which the FX graph cache puts
    in its key (a bare callable in a custom-pass slot makes the cache bypass the graph)."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    return CustomGraphPass


def hash_for_files(paths: tuple, extra: str = "") -> bytes:
    """Inductor's hash of source files (``get_hash_for_files``), for a custom pass's uuid."""
    from torch._inductor.custom_graph_pass import get_hash_for_files

    return get_hash_for_files(tuple(paths), extra)


def inductor_decompositions() -> dict:
    """Inductor's decomposition table (``select_decomp_table``): what its joint graphs are made of."""
    from torch._inductor.decomposition import select_decomp_table

    return select_decomp_table()


def inductor_refuses(target) -> bool:
    """Whether Inductor's graph lowering raises on a call of ``target``: an ATen op it has no
    lowering for, yet decomposes (its implicit fallback asserts there is no decomposition)."""
    import torch
    from torch._inductor import lowering

    allowed = getattr(lowering, "FALLBACK_ALLOW_LIST", ())  # ops Inductor falls back on despite a decomposition
    return (isinstance(target, torch._ops.OpOverload) and target not in lowering.lowerings
            and target.name().split(".")[0] not in allowed and target in inductor_decompositions())


def traced_decomposition(fn, values, decompositions: dict):
    """Trace ``fn`` on ``values`` into a graph of the ops ``decompositions`` leaves.

    The values are fake tensors and SymInts of the graph's fake mode, which is active; the trace
    is the one Inductor's own pattern replacements make (``make_fx`` in real mode over the fake
    values, under the Python dispatcher)."""
    from torch._dispatch.python import enable_python_dispatcher
    from torch.fx.experimental.proxy_tensor import make_fx

    with enable_python_dispatcher():
        return make_fx(fn, decompositions, tracing_mode="real")(*values)


def torchair_decompositions(compiler_config) -> dict:
    """The decompositions ``torchair.get_npu_backend`` gives AOTAutograd for this config.

    The decompositions ``torchair.get_npu_backend`` gives AOTAutograd for this config: its
    defaults with its patches applied (``npu_fx_compiler._get_merged_decompositions``), or, in a
    torchair without that helper, its defaults (``_utils.get_npu_default_decompositions``)."""
    try:
        from torchair.npu_fx_compiler import _get_merged_decompositions
    except ImportError:
        from torchair._utils import get_npu_default_decompositions

        return get_npu_default_decompositions()
    return _get_merged_decompositions(compiler_config, {})


def no_compile_caches():
    """A context without Inductor's FX graph cache and AOTAutograd's cache, so that a compile
    runs every pass again (a cache hit skips the joint-graph passes, the npu-fusion pass among them)."""
    import contextlib

    import torch._functorch.config as functorch_config

    stack = contextlib.ExitStack()
    stack.enter_context(inductor_config().patch(fx_graph_cache=False))
    if hasattr(functorch_config, "enable_autograd_cache"):
        stack.enter_context(functorch_config.patch(enable_autograd_cache=False))
    return stack


def inductor_backend():
    """The ``"inductor"`` torch.compile backend as a function (Dynamo's registry lookup)."""
    from torch._dynamo import lookup_backend

    return lookup_backend("inductor")


# -- FX, fake-tensor and Dynamo internals the pass reads --------------------------------------

def is_erased(node) -> bool:
    """Whether an FX node was erased from its graph (``Node._erased``)."""
    return node._erased


def empty_graph_like(graph):
    """A new empty FX graph with ``graph``'s owning module, tracer and code generator (the
    private ``_tracer_cls``, ``_tracer_extras`` and ``_codegen`` of ``fx.Graph``)."""
    import torch.fx as fx

    new = fx.Graph(owning_module=graph.owning_module, tracer_cls=graph._tracer_cls,
                   tracer_extras=graph._tracer_extras)
    new.set_codegen(graph._codegen)
    return new


def fake_tensor_type() -> type:
    """``torch._subclasses.fake_tensor.FakeTensor``."""
    from torch._subclasses.fake_tensor import FakeTensor

    return FakeTensor


def symbolic_expr(size):
    """The sympy expression of a ``torch.SymInt`` (``size.node.expr``)."""
    return size.node.expr


def size_hint(size) -> Optional[int]:
    """The example value of a ``torch.SymInt`` (``size.node.hint``), or None when it has none."""
    return size.node.hint


def implied_by_guards(condition) -> bool:
    """Whether the guards the shape environment already holds imply ``condition`` (a ``torch.SymBool``).

    ``statically_known_true`` reads the symbols' ranges only: a guard on a product (``s0*s1 <
    1000``, installed while the forward was compiled) narrows no range, so the backward of the same
    compilation, compiled later with the same shape environment, could not prove it. The guards are
    checked on every call that reaches the compiled graphs, so they are facts there. False where
    this torch's shape environment has no such query."""
    node = getattr(condition, "node", None)
    env = getattr(node, "shape_env", None)
    if env is None:
        return False
    try:  # the guards read afresh: the environment's cached get_axioms() misses guards added since its last call
        axioms = tuple(dict.fromkeys(guard.expr for guard in env.guards))
        return bool(env._maybe_evaluate_static(node.expr, axioms=axioms) is sympy_true())
    except (AttributeError, TypeError):
        return False


def sympy_true():
    """sympy's ``true`` (what a shape environment answers for a condition it proves)."""
    import sympy

    return sympy.true


def current_compile_id():
    """Dynamo's id of the compilation in progress (``torch._guards.CompileContext``), or None."""
    try:
        from torch._guards import CompileContext

        return CompileContext.current_compile_id()
    except Exception:
        return None


def graph_argument(placeholder):
    """Dynamo's record of what a placeholder of its graph is (``meta["grapharg"]``: source, example), or None."""
    return placeholder.meta.get("grapharg")


def guard_constant(source) -> bool:
    """Guard the compilation in progress on ``source`` keeping its present value (Dynamo's
    ``EQUALS_MATCH``, the guard a specialized constant gets); False where there is no
    compilation in progress or this torch has no such guard."""
    try:
        from torch._dynamo.guards import GuardBuilder, install_guard
        from torch._guards import TracingContext
    except ImportError:
        return False
    if TracingContext.try_get() is None:
        return False
    install_guard(source.make_guard(GuardBuilder.EQUALS_MATCH))
    return True


def specialize_size(size) -> bool:
    """Guard the compilation in progress on a symbolic size keeping its example value.

    The size then reads as that number (``guard_int``: the shape environment replaces the
    symbol). False where no Dynamo compilation owns the size's shape environment (a graph
    compiled later, after Dynamo made its guards, must not specialize) or where the user
    marked the size dynamic with ``mark_dynamic`` (:func:`marked_dynamic_source`)."""
    if guardable_example(size) is None:
        return False
    symbolic_shapes.guard_int(size)
    return True


def _user_constraints(env) -> dict:
    """The sizes the user constrained, as Dynamo checks them: ``{symbol: [(source name, constraint)]}``.

    Read from the shape environment's tracked inputs, as ``produce_guards`` reads them: a
    ``mark_dynamic`` size has a constraint that is not ``warn_only`` (``RelaxedUnspecConstraint``:
    no guard may pin it to one value; ``StrictMinMaxConstraint``, from ``mark_dynamic(min=, max=)``:
    no guard its range does not imply). ``maybe_mark_dynamic``, ``dynamic=True`` and automatic
    dynamic sizes have none (or a ``warn_only`` one), and may be guarded."""
    constrained = {}
    for tracked in getattr(env, "tracked_fakes", None) or ():
        constraints = getattr(tracked.symbolic_context, "constraint_sizes", None) or ()
        sizes = tracked.fake.size() if isinstance(tracked.fake, torch.Tensor) else ()
        for axis, (size, constraint) in enumerate(zip(sizes, constraints)):
            if constraint is None or getattr(constraint, "warn_only", False) or not isinstance(size, torch.SymInt):
                continue
            constrained.setdefault(size.node.expr, []).append((f"{tracked.source.name}.size()[{axis}]", constraint))
    return constrained


def marked_dynamic_source(value) -> Optional[str]:
    """Where the user marked a symbol of a size or size condition dynamic with ``mark_dynamic`` (``"L['q'].size()[3]"``), or None.

    The first input axis one of the symbols of ``value`` (a ``torch.SymInt`` or ``torch.SymBool``)
    stands for whose constraint limits the guards on it (:func:`_user_constraints`); None for a
    number, a shape environment no longer tracking its inputs, or sizes nobody constrained."""
    if not isinstance(value, (torch.SymInt, torch.SymBool)):
        return None
    constrained = _user_constraints(value.node.shape_env)
    marks = [mark for symbol in sorted(value.node.expr.free_symbols, key=str) for mark in constrained.get(symbol, ())]
    return marks[0][0] if marks else None


def _may_guard(env, expr, values, specializing: bool) -> bool:
    """Whether a guard on ``expr`` (pinning it to its example where ``specializing``) keeps the user's constraints.

    A symbol marked dynamic (:func:`_user_constraints`) may take no specialization; one
    with a range takes no other guard (the guards its range implies were proved already); one with
    no range takes a condition that at least one other value of it also meets (Dynamo's
    ``RelaxedUnspecConstraint``: a guard that leaves it one value is a violation)."""
    constrained = _user_constraints(env)
    for symbol in expr.free_symbols:
        marks = constrained.get(symbol, ())
        if marks and (specializing or any(not isinstance(c, symbolic_shapes.RelaxedUnspecConstraint)
                                          for _, c in marks)):
            return False
        if marks:
            others = {s: values[s] for s in expr.free_symbols if s is not symbol}
            if not any(bool(expr.xreplace({**others, symbol: values[symbol] + step})) for step in (-1, 1)
                       if int(values[symbol]) + step > 1):
                return False
    return True


def guardable_example(value):
    """The example value of a symbolic size or size condition whose guard would reach Dynamo, or None.

    None where no Dynamo compilation owns its shape environment (a graph compiled later, after
    Dynamo made its guards: a frozen environment ignores new guards), where a symbol has no
    example (data dependent), or where the guard would break a constraint the user put on a size
    with ``mark_dynamic`` (:func:`_may_guard`: a size is specialized by its guard, a condition only
    narrows it). ``maybe_mark_dynamic`` sizes and ``dynamic=True``'s carry no constraint."""
    from sympy.logic.boolalg import BooleanAtom
    from torch._guards import TracingContext

    context = TracingContext.try_get()
    fake_mode = getattr(context, "fake_mode", None)
    env = getattr(fake_mode, "shape_env", None)
    if env is None or env is not value.node.shape_env or getattr(env, "frozen", False):
        return None
    expr = value.node.expr
    values = getattr(env, "backed_var_to_val", None) or getattr(env, "var_to_val", {})
    if not all(symbol in values for symbol in expr.free_symbols):
        return None
    if not _may_guard(env, expr, values, specializing=not isinstance(value, torch.SymBool)):
        return None
    example = expr.xreplace({symbol: values[symbol] for symbol in expr.free_symbols})
    if isinstance(example, BooleanAtom):
        return bool(example)
    return int(example) if example.is_Integer else None


def guard_size_condition(condition) -> bool:
    """Guard the compilation in progress on a condition of symbolic sizes (a ``torch.SymBool``) that holds.

    Dynamo then recompiles a call whose sizes break it (the shape environment also narrows
    the symbols' ranges, so later checks prove it). False, with no guard, where
    :func:`guardable_example` finds no guard can reach Dynamo or the example values break it."""
    if guardable_example(condition) is not True:
        return False
    return symbolic_shapes.guard_bool(condition) is True


def dynamo_counters(name: str):
    """Dynamo's counter table ``name`` (``torch._dynamo.utils.counters[name]``)."""
    return torch._dynamo.utils.counters[name]


def fresh_compile_caches():
    """A context with empty, private Inductor and AOTAutograd caches (a temporary directory)."""
    import torch._inductor.utils as inductor_utils

    fresh = getattr(inductor_utils, "fresh_cache", None) or inductor_utils.fresh_inductor_cache
    return fresh()


# -- what the report and its measurements (npu_fusion.report, npu_fusion.measure) reach for ---------

#: the class of an ATen overload (``aten.mul.Tensor``); the report names op counts by it
OpOverload = torch._ops.OpOverload


def aot_function(fn, **aot_options):
    """AOTAutograd on a plain function, without Dynamo (the recording backend's ``aot_function``)."""
    from torch._functorch.aot_autograd import aot_function as _aot_function

    return _aot_function(fn, **aot_options)


def mark_dynamic(tensor: torch.Tensor, dim: int) -> None:
    """Compile ``tensor``'s dimension ``dim`` as dynamic (Dynamo's ``mark_dynamic``)."""
    torch._dynamo.mark_dynamic(tensor, dim)


def compiled_autograd_enabled():
    """A context in which ``torch.compile`` compiles the backward with compiled autograd."""
    return torch._dynamo.config.patch(compiled_autograd=True)


def decompositions_of(*ops) -> dict:
    """PyTorch's own decompositions of ``ops`` (a table for AOTAutograd)."""
    from torch._decomp import get_decompositions

    return get_decompositions(list(ops))


def math_attention():
    """A context in which ``scaled_dot_product_attention`` runs PyTorch's math form."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.MATH])


def op_schema(overload):
    """``overload``'s ``torch._C.FunctionSchema`` (its arguments' names and defaults, its returns)."""
    return overload._schema


def check_with(error_type, condition, message) -> None:
    """Raise ``error_type`` unless ``condition`` holds, as ``torch._check_with`` does.

    ``torch._check_with``: raise ``error_type`` unless ``condition``; a SymBool gets a guard or a
    runtime assertion."""
    torch._check_with(error_type, condition, message)


def torchair_converter_api():
    """torchair's converter API, under the names the GE converters use.

    torchair's converter API, by the names the GE converters use: ``ge`` (its op builders,
    ``ge_apis``), ``IrDef`` and ``ge_op`` (builders written from an IR; ``compat_ir``), ``GeGraph``
    and ``ge_type_to_torch_type`` (``ge._ge_graph``), ``Support`` and ``specs`` (``{torch dtype:
    F32/F16/BF16}``, ``supported_declaration``), and ``declare_supported`` (None where this torchair
    lacks it)."""
    import types

    from torchair._ge_concrete_graph import ge_apis
    from torchair._ge_concrete_graph.compat_ir import IrDef, ge_op
    from torchair._ge_concrete_graph.supported_declaration import BF16, F16, F32, Support
    from torchair.ge._ge_graph import GeGraph, ge_type_to_torch_type

    try:
        from torchair._ge_concrete_graph.fx2ge_converter import declare_supported
    except ImportError:
        declare_supported = None
    return types.SimpleNamespace(ge=ge_apis, IrDef=IrDef, ge_op=ge_op, GeGraph=GeGraph,
                                 ge_type_to_torch_type=ge_type_to_torch_type, Support=Support,
                                 specs={torch.float32: F32, torch.float16: F16, torch.bfloat16: BF16},
                                 declare_supported=declare_supported)


# -- what the backend and the logs reach for (plugin/backend.py, plugin/logs.py) ------------------

def aot_autograd(**kwargs):
    """Dynamo's AOTAutograd backend factory (``torch._dynamo.backends.common.aot_autograd``)."""
    from torch._dynamo.backends.common import aot_autograd as _aot_autograd

    return _aot_autograd(**kwargs)


def make_boxed_func(fn):
    """``fn`` taking AOTAutograd's boxed (list) arguments."""
    from torch._functorch.aot_autograd import make_boxed_func as _make_boxed_func

    return _make_boxed_func(fn)


def partition_function(name: str):
    """AOTAutograd's partitioner by the option's name: ``default`` or ``min_cut``."""
    from torch._functorch import partitioners

    return {"default": partitioners.default_partition,
            "min_cut": partitioners.min_cut_rematerialization_partition}[name]


def core_aten_decompositions() -> dict:
    from torch._decomp import core_aten_decompositions as _core

    return _core()


def register_log_name(name: str) -> None:
    """Make ``TORCH_LOGS`` accept ``name`` (torch's log registry); nothing on a torch without it."""
    try:
        from torch._logging import _internal

        if name not in _internal.log_registry.log_alias_to_log_qnames:
            _internal.register_log(name, name)
            _internal._init_logs()
    except Exception:  # an older or newer torch without this hook: plain logging still works
        pass
