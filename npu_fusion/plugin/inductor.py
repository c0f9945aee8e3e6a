"""Hook the npu-fusion pass into Inductor (stock, or torch_npu's) on the joint and inference graphs.

Inductor's partition runs its joint-graph passes first, and they call
``torch._inductor.config.joint_custom_pre_pass`` with the joint forward-and-backward graph;
Inductor runs the same passes on an inference graph (AOTAutograd's graph under
``torch.no_grad()`` or when no input needs a gradient, which is never partitioned) before it
compiles it. :func:`install_inductor` puts the pass there, so ``backend="inductor"`` (and
Hugging Face's Trainer with ``torch_compile_backend="inductor"``) fuses as the ``npu_fusion``
backend does: on a joint graph, the min-cut partitioner sees the fused ops and saves what they
read; on an inference graph, the forward rules fuse each norm and rotation. The fused ops are custom
ops with fake kernels, so Inductor runs them as fallback kernels (their reference kernel on a
CPU, torch_npu's on an NPU)::

    import npu_fusion
    npu_fusion.install_inductor(target="auto")
    model = torch.compile(model)  # backend="inductor"

Under ``dynamic=True`` Dynamo passes a norm's float ``eps`` as a 0-d tensor input; a second
hook, ``torch._inductor.config.pre_grad_custom_pass`` (run on Dynamo's graph before AOTAutograd),
specializes it under a guard (:mod:`.specialize`) as the ``npu_fusion`` backend does.

Inductor's table decomposes ``aten.silu`` and ``aten.silu_backward`` before its joint passes;
with a SwiGLU option on, the pass first puts them back where the graph holds exactly the trace of
their decomposition (:func:`recompose_decomposed`), and decomposes again into that trace what it
leaves unfused (:func:`decompose_what_inductor_refuses`), so SwiGLU fuses here as on the
``npu_fusion`` backend and the unfused graph is Inductor's own.

A pass already in the slot keeps running, first; installing again replaces the earlier
npu-fusion pass rather than stacking it. The pass is a ``CustomGraphPass`` whose ``uuid()``
hashes the package's sources and the options, so the FX graph cache stays valid; a chained
pass without a uuid of its own makes it None (Inductor then bypasses the cache, as it would
for that pass alone). Graphs that are not joint ones reach the pass too: inference graphs
(fused with ``fuse_inference``), and a compiled-autograd graph, which is only a backward
(fused with ``fuse_backward``).
"""
from __future__ import annotations

import pathlib
from typing import Any, Optional

from ..compat import custom_graph_pass_base, hash_for_files, inductor_config
from .options import FusionOptions

#: options Inductor decides itself: it partitions with min-cut and decomposes with its own table
NOT_HONOURED = ("partitioner", "decompositions")


def _sources() -> tuple:
    root = pathlib.Path(__file__).resolve().parent.parent
    return tuple(str(p) for sub in ("lowering", "patterns", "plugin") for p in sorted((root / sub).rglob("*.py")))


def _make_pass_class():
    class NpuFusionJointPass(custom_graph_pass_base()):
        """Inductor's ``joint_custom_pre_pass`` (joint and inference graphs): ``previous`` first,
        then npu-fusion."""

        def __init__(self, options: FusionOptions, previous: Any = None):
            self.options, self.previous = options, previous

        def __call__(self, graph) -> None:
            for previous in _as_passes(self.previous):
                previous(graph)
            from .joint import is_joint_graph
            from .pass_manager import fuse_backward, fuse_inference, fuse_joint, in_compiled_autograd

            gm = graph.owning_module
            if gm is None:
                return
            recomposed = recompose_decomposed(gm, self.options)
            if is_joint_graph(graph):
                result = fuse_joint(gm, self.options, copy_op=_copy_by_multiplying, partitioner="min_cut")
            elif in_compiled_autograd():  # the whole backward, compiled as an inference graph
                result = fuse_backward(gm, self.options)
            else:  # Inductor runs these passes on no other graph: an inference graph (no backward)
                result = fuse_inference(gm, self.options)
            if result.sites or recomposed:
                decompose_what_inductor_refuses(gm)

        def uuid(self) -> Optional[bytes]:
            previous = [p.uuid() if hasattr(p, "uuid") else None for p in _as_passes(self.previous)]
            if any(p is None for p in previous):
                return None
            extra = repr((self.options, self.options.resolved_target(), previous))
            return hash_for_files(_sources(), extra)

    return NpuFusionJointPass


class NpuFusionPreGradPass:
    """Inductor's ``pre_grad_custom_pass``: ``previous`` first, then the model constants specialized.

    It has no ``uuid()`` on purpose: Inductor then runs it before its caches' lookups (the
    "early" timing), so the key hashes the graph with the constants in it and every compile,
    a cache hit too, installs the guard; a pass run after the lookup would reuse a graph
    specialized to another eps with no guard."""

    def __init__(self, previous: Any = None):
        self.previous = previous
        self.timing = None  # the pre_grad_pass_timing installing it set, restored by uninstalling

    def __call__(self, graph) -> None:
        for previous in _as_passes(self.previous):
            previous(graph)
        from .specialize import specialize_model_constants

        if graph.owning_module is not None:
            specialize_model_constants(graph.owning_module)


def _copy_by_multiplying(graph, fake_mode, value):
    """A copy Inductor keeps: ``x * 1`` (exact for every float; Inductor removes a ``clone``, a
    same-dtype convert and ``_to_copy`` has no lowering, only a decomposition)."""
    import torch

    from ..patterns.rewrite import call

    return call(graph, fake_mode, torch.ops.aten.mul.Tensor, (value, 1))


def decompose_what_inductor_refuses(gm) -> int:
    """Decompose, in place and with Inductor's own table, each call Inductor's lowering would refuse.

    Those are the ATen ops the pass emits after AOTAutograd decomposed the graph (casts, ones of
    a norm without weight or input gradient, a rotation table rebuilt by ``stack`` or
    ``repeat_interleave``...) that Inductor only knows by their decomposition: its implicit
    fallback asserts there is none. Returns how many calls were decomposed."""
    from ..compat import inductor_decompositions, inductor_refuses
    from ..patterns.context import fake_mode_of

    refused = [n for n in gm.graph.nodes if n.op == "call_function" and inductor_refuses(n.target)]
    if refused:
        table, fake_mode = inductor_decompositions(), fake_mode_of(gm.graph)
        for node in refused:
            _replace_by_decomposition(gm, node, table, fake_mode)
        gm.graph.lint()
        gm.recompile()
    return len(refused)


def recompose_decomposed(gm, options: FusionOptions) -> int:
    """Put ``aten.silu`` and ``aten.silu_backward`` back, in place, where the graph holds exactly their decomposition.

    Inductor's table decomposes them before its joint passes run, and the SwiGLU rules read them
    as leaves. A subgraph is recomposed only where it is, node for node, the trace of the op's
    decomposition (Inductor's own table) on the same inputs, so the op has its value bit for bit;
    one the pass leaves unfused is decomposed again (:func:`decompose_what_inductor_refuses`) into
    that same trace. Returns how many calls were recomposed."""
    import torch

    from ..patterns import RULES

    wanted = {name for rule in RULES if options.enables(rule) for name in rule.reads_whole}
    if not wanted:
        return 0
    from ..compat import inductor_decompositions
    from ..patterns.context import fake_mode_of

    table, fake_mode, aten, count = inductor_decompositions(), fake_mode_of(gm.graph), torch.ops.aten, 0
    for name in sorted(wanted):
        op = getattr(aten, name).default
        if op not in table:
            continue
        erased = set()
        for inputs in list(_decomposition_inputs(gm.graph, name)):
            if not erased.intersection(inputs):
                done = _recompose(gm, op, inputs, table, fake_mode)
                count += done is not None
                erased.update(done or ())
    if count:
        gm.graph.lint()
        gm.recompile()
    return count


def _uncast(node):
    """What ``node`` converts, where it is a dtype conversion (the decompositions upcast their inputs), then ``node``.

    The source first: the op recomposed on it is the one the program called, casts included."""
    import torch

    out = [node]
    if getattr(node, "target", None) is torch.ops.prims.convert_element_type.default:
        out.insert(0, node.args[0])
    return out


def _decomposition_inputs(graph, name: str):
    """Candidate inputs of a decomposed ``name`` (``silu``: ``exp(neg(x))``; ``silu_backward``: ``dy * sigmoid(x)``)."""
    import torch

    aten = torch.ops.aten
    for node in list(graph.nodes):
        if name == "silu" and node.target is aten.neg.default:
            for x in _uncast(node.args[0]):
                yield (x,)
        elif name == "silu_backward" and node.target is aten.sigmoid.default:
            for user in node.users:
                if user.target is aten.mul.Tensor and len(user.args) == 2 and user.args[1] is node:
                    for dy in _uncast(user.args[0]):
                        for x in _uncast(node.args[0]):
                            yield (dy, x)


def _same_argument(a, b) -> bool:
    """Whether two call arguments are the same: the same nodes, equal constants of one type, alike sequences."""
    import torch.fx as fx

    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same_argument(x, y) for x, y in zip(a, b))
    if isinstance(a, fx.Node) or isinstance(b, fx.Node):
        return a is b
    return type(a) is type(b) and a == b


def _match_trace(traced, inputs):
    """The graph's nodes that are, node for node, ``traced`` run on ``inputs``: (its output's node, the calls matched), or (None, [])."""
    import torch.fx as fx

    env, placeholders, matched, root = {}, iter(inputs), [], None
    for inner in traced.nodes:
        if inner.op == "placeholder":
            env[inner] = next(placeholders)
        elif inner.op == "output":
            root = env.get(inner.args[0]) if isinstance(inner.args[0], fx.Node) else None
        elif inner.op != "call_function":
            return None, []
        else:
            args, kwargs = fx.node.map_arg((inner.args, inner.kwargs), env.__getitem__)
            readers = inner.all_input_nodes
            if not readers:
                return None, []
            found = next((u for u in env[readers[0]].users if u.op == "call_function" and u.target is inner.target
                          and _same_argument(u.args, args) and _same_argument(dict(u.kwargs), dict(kwargs))
                          and u not in matched), None)
            if found is None:
                return None, []
            env[inner] = found
            matched.append(found)
    return root, matched


def _recompose(gm, op, inputs, table: dict, fake_mode):
    """Replace the subgraph that is the trace of ``op(*inputs)``'s decomposition by one call of ``op``.

    Returns the nodes it erased (None where the subgraph is not there). An intermediate that
    something else reads stays for that reader: the call has the root's value whatever reads it."""
    import contextlib

    import torch.fx as fx

    from ..compat import traced_decomposition

    if any(not isinstance(i, fx.Node) or i.op == "output" or i.meta.get("val") is None for i in inputs):
        return None
    try:  # read-only until the match is whole: a failure costs only this candidate
        with fake_mode if fake_mode is not None else contextlib.nullcontext():
            traced = traced_decomposition(lambda *a: op(*a), [i.meta["val"] for i in inputs], table)
        root, matched = _match_trace(traced.graph, inputs)
    except Exception:  # inputs the op does not take (a dtype or shape it refuses), or a graph it cannot read
        return None
    if root is None or root in inputs:
        return None
    graph = gm.graph
    with graph.inserting_before(root):
        call = graph.call_function(op, tuple(inputs))
    call.meta = dict(root.meta)
    root.replace_all_uses_with(call)
    erased = []
    for node in reversed(matched):
        if not node.users:
            graph.erase_node(node)
            erased.append(node)
    return erased


#: node meta that describes a call's value (the trace of its decomposition has its own)
VALUE_META = ("val", "tensor_meta", "example_value")


def _replace_by_decomposition(gm, node, table: dict, fake_mode) -> None:
    """Put the trace of ``node``'s decomposition (``table``) in place of ``node`` in ``gm``."""
    import contextlib
    import operator

    import torch.fx as fx
    import torch.utils._pytree as pytree

    from ..compat import traced_decomposition

    leaves, spec = pytree.tree_flatten((node.args, node.kwargs))
    inputs = [i for i, leaf in enumerate(leaves) if isinstance(leaf, fx.Node)]

    def as_called(*values):
        filled = list(leaves)
        for i, value in zip(inputs, values):
            filled[i] = value
        args, kwargs = pytree.tree_unflatten(filled, spec)
        return node.target(*args, **kwargs)

    with fake_mode if fake_mode is not None else contextlib.nullcontext():
        traced = traced_decomposition(as_called, [leaves[i].meta["val"] for i in inputs], table)
    graph, env, placeholders = gm.graph, {}, iter(leaves[i] for i in inputs)
    with graph.inserting_before(node):
        for inner in traced.graph.nodes:
            if inner.op == "placeholder":
                env[inner] = next(placeholders)
            elif inner.op == "get_attr":  # a constant the decomposition made: moved into gm
                name = f"_decomposed_{node.name}_{inner.target}"
                setattr(gm, name, getattr(traced, inner.target))
                env[inner] = graph.get_attr(name)
                env[inner].meta = dict(inner.meta)
            elif inner.op == "output":
                result = fx.node.map_arg(inner.args[0], env.__getitem__)
            else:
                env[inner] = copied = graph.node_copy(inner, env.__getitem__)
                # the replaced call's partitioner tag and recompute policy, the trace's own values
                copied.meta = {**{k: v for k, v in node.meta.items() if k not in VALUE_META}, **copied.meta}
    if isinstance(result, fx.Node):
        node.replace_all_uses_with(result)
    else:  # an op of several outputs: its users are getitems
        for user in list(node.users):
            assert user.target is operator.getitem, user
            user.replace_all_uses_with(result[user.args[1]])
            graph.erase_node(user)
    graph.erase_node(node)


def _as_passes(slot) -> tuple:
    if slot is None:
        return ()
    return tuple(slot) if isinstance(slot, (list, tuple)) else (slot,)


_PASS_CLASS = []


def joint_pass(options: FusionOptions, previous: Any = None):
    """The ``CustomGraphPass`` running the npu-fusion pass on Inductor's joint graphs."""
    if not _PASS_CLASS:
        _PASS_CLASS.append(_make_pass_class())
    return _PASS_CLASS[0](options, previous)


def install_inductor(**options: Any):
    """Install the npu-fusion pass into ``torch._inductor.config.joint_custom_pre_pass``; returns
    the pass. The specializing pass goes into ``pre_grad_custom_pass`` (chained the same way).
    ``options`` are :class:`~npu_fusion.plugin.options.FusionOptions` fields; ``partitioner`` and ``decompositions`` are Inductor's own to decide, and naming them is an
    error (use ``backend="npu_fusion"`` to choose them)."""
    given = sorted(set(options) & set(NOT_HONOURED))
    if given:
        raise ValueError(f"npu_fusion.install_inductor: option(s) {given} are not honoured on this path (Inductor "
                         f"partitions with min-cut and decomposes with its own table); compile with "
                         f"backend='npu_fusion' to choose them")
    opts = FusionOptions.from_mapping(options)
    config = inductor_config()
    previous = config.joint_custom_pre_pass
    if previous is not None and isinstance(previous, _PASS_CLASS[0] if _PASS_CLASS else ()):
        previous = previous.previous  # re-install: keep what ours had chained
    config.joint_custom_pre_pass = joint_pass(opts, previous)
    _install_pre_grad(config, opts)
    return config.joint_custom_pre_pass


def _install_pre_grad(config, options: FusionOptions) -> None:
    """Put (or, where no enabled rule reads a constant float, take) the specializing pass in ``pre_grad_custom_pass``."""
    from .specialize import reads_constant_floats

    _uninstall_pre_grad(config)
    if reads_constant_floats(options):
        config.pre_grad_custom_pass = NpuFusionPreGradPass(config.pre_grad_custom_pass)
        if getattr(config, "pre_grad_pass_timing", None) == "default":  # what a pass without uuid gets, said once
            config.pre_grad_pass_timing = config.pre_grad_custom_pass.timing = "early"


def _uninstall_pre_grad(config) -> None:
    current = config.pre_grad_custom_pass
    if isinstance(current, NpuFusionPreGradPass):
        config.pre_grad_custom_pass = current.previous
        if current.timing is not None and config.pre_grad_pass_timing == current.timing:
            config.pre_grad_pass_timing = "default"


def uninstall_inductor() -> None:
    """Take the npu-fusion passes out of ``joint_custom_pre_pass`` and ``pre_grad_custom_pass``, leaving what they chained."""
    config = inductor_config()
    current = config.joint_custom_pre_pass
    if _PASS_CLASS and isinstance(current, _PASS_CLASS[0]):
        config.joint_custom_pre_pass = current.previous
    _uninstall_pre_grad(config)
