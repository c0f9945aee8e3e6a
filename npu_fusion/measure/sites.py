"""Counting the fused ops' sites (RoPE, RMSNorm) independently of the pass, and accounting for each of them.

A site is one RMSNorm call or one RoPE application (one rotated tensor) whose output receives a
gradient: only those have a backward for a fused op to replace. In an inference step (grad mode
off: evaluation, generation) there is no backward, and each call is a forward site as it runs. :class:`SiteCounter` finds them by
forward hooks on a library's module classes of each kind (a norm, a RoPE module), or by a wrapper
around its functions of a kind (apply-RoPE), and records each by ``(kind, module path)``: the hooked
module's path, or, for a kind whose op says so (:attr:`~npu_fusion.lowering.CountedSite.path_of_caller`:
RoPE), the path of the module whose forward made the call (RoPE modules are often one instance
shared by every layer, so their own path would name one layer only); a wrapped function's site is
always its caller's. The kinds are the rules' site probes (:data:`KINDS`); nothing here names one.

The same counter tells which sites ran outside every compiled graph: hooks and wrappers that run
while dynamo traces (``torch.compiler.is_compiling()``) record nothing, so during a compiled run
the counter sees exactly the sites whose Python code ran eagerly (a graph break around them, a
frame dynamo skipped). Those cannot fuse; everything else it counted in the eager run was inside a
compiled graph and must end fused or as a recorded miss.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import sys
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from ..lowering import RMS_NORM_GRAD, ROPE_GRAD
from ..patterns import RULES

ROPE_OP, NORM_OP = ROPE_GRAD.name, RMS_NORM_GRAD.name
#: the counter's kinds (each rule's site probe: one site per forward call) and the fused op
#: each one should become; a forward rule's kind counts its backward's sites (the same norm call or
#: rotation is a forward site and a backward site)
KINDS = {rule.site_probe.kind: rule.op.name for rule in RULES if rule.site_probe is not None}
PROBES = {rule.site_probe.kind: rule.site_probe for rule in RULES if rule.site_probe is not None}
_RULE_OF_KIND = {rule.site_probe.kind: rule for rule in RULES if rule.site_probe is not None}
#: the fused ops of forward rules (whose sites are their backward's): their nodes land in the
#: partition's forward graph
FORWARD_OPS = {KINDS[kind] for kind, probe in PROBES.items() if probe.same_sites_as}
#: the kinds counted on their own (a forward kind's sites are its backward's), and how the counter
#: sees a site of each (its op's :class:`~npu_fusion.lowering.CountedSite`)
COUNTED_SITES = {kind: _RULE_OF_KIND[kind].op.counted_site for kind, probe in PROBES.items()
                 if not probe.same_sites_as and _RULE_OF_KIND[kind].op.counted_site is not None}


def kinds_enabled(options=None) -> Dict[str, str]:
    """:data:`KINDS` of the rules ``options`` turn on (every kind when ``options`` is None): a
    kind whose rule is off has no site the pass could account for."""
    if options is None:
        return dict(KINDS)
    return {kind: op for kind, op in KINDS.items() if options.enables(_RULE_OF_KIND[kind])}

_MODULE_CALL = ("torch/nn/modules/module.py", __file__)


def grad_tensors(out) -> List[torch.Tensor]:
    """The tensors of a module's or function's output that require grad, in order."""
    if isinstance(out, torch.Tensor):
        return [out] if out.requires_grad else []
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in grad_tensors(o)]
    return []


def floating_tensors(out) -> List[torch.Tensor]:
    """The floating tensors of a module's or function's output (nested tuples, lists and dicts,
    a ``ModelOutput``), in order."""
    if isinstance(out, torch.Tensor):
        return [out] if out.is_floating_point() else []
    if isinstance(out, dict):
        out = list(out.values())
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in floating_tensors(o)]
    return []


def _caller_module(skip):
    """The nn.Module whose own forward is running below this call (not ``skip``, not the
    machinery of ``Module.__call__`` or of this file)."""
    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if (isinstance(owner, torch.nn.Module) and owner is not skip
                and not frame.f_code.co_filename.endswith(_MODULE_CALL)):
            return owner
        frame = frame.f_back
    return None


def expected_for(options, expected: Optional[Dict[str, int]]) -> Optional[Dict[str, int]]:
    """Expected sites by fused-op name for a run with ``options``: a forward op expects its
    backward's sites where its rule is on, and nothing where it is off."""
    if expected is None:
        return None
    enabled = set(kinds_enabled(options).values())
    out = {}
    for kind, op in KINDS.items():
        same = PROBES[kind].same_sites_as
        if op in enabled and (op in expected or (same and KINDS[same] in expected)):
            out[op] = expected.get(op, expected.get(KINDS.get(same)))
    out.update({op: n for op, n in expected.items() if op not in KINDS.values()})
    return out


def first_half_of(gate) -> Optional[torch.Tensor]:
    """The tensor whose first half along the last axis ``gate`` can be, in memory, or None.

    Read off the storage, not the program: ``gate`` is a view (of a projection: ``chunk``,
    ``split``, a slice), and ``gate`` widened to twice its last axis, with its strides, is a
    tensor whose rows do not overlap, inside the same storage."""
    if not isinstance(gate, torch.Tensor) or gate.dim() == 0 or gate._base is None or not gate.numel():
        return None
    width, step = gate.shape[-1], gate.stride(-1)
    if step < 1 or any(size > 1 and stride < 2 * width * step for size, stride in zip(gate.shape[:-1], gate.stride()[:-1])):
        return None
    shape = (*gate.shape[:-1], 2 * width)
    last = gate.storage_offset() + sum((size - 1) * stride for size, stride in zip(shape, gate.stride()))
    if last * gate.element_size() >= gate.untyped_storage().nbytes():
        return None
    return gate.as_strided(shape, gate.stride(), gate.storage_offset())


def second_half_of(up, gate) -> bool:
    """Whether ``up`` is, in memory, the half of the tensor that follows ``gate`` on the last axis."""
    return (isinstance(up, torch.Tensor) and up.shape == gate.shape and up.stride() == gate.stride()
            and up.untyped_storage().data_ptr() == gate.untyped_storage().data_ptr()
            and up.storage_offset() - gate.storage_offset() == gate.shape[-1] * gate.stride(-1))


def _saved(node, name):
    try:
        return getattr(node, name)
    except (AttributeError, RuntimeError):  # nothing saved under that name, or freed by a backward
        return None


def gated_product_reached(outputs, gate, gated) -> bool:
    """Whether ``outputs`` were computed from ``gated * up`` (either order), with ``up`` the half after ``gate``.

    Read off the autograd graph that leads to ``outputs``: a product node that saved ``gated``
    and the other half of ``gate``'s tensor. Only nodes made after ``gated`` can read it, so the
    walk stops at older ones (autograd numbers its nodes in the order it makes them)."""
    made = gated.grad_fn._sequence_nr()
    stack = [t.grad_fn for t in floating_tensors(outputs) if t.grad_fn is not None]
    seen = set()
    while stack:
        node = stack.pop()
        if node is None or node in seen or node._sequence_nr() <= made:
            continue
        seen.add(node)
        if type(node).__name__ == "MulBackward0":
            a, b = _saved(node, "_saved_self"), _saved(node, "_saved_other")
            if (a is gated and second_half_of(b, gate)) or (b is gated and second_half_of(a, gate)):
                return True
        stack.extend(n for n, _ in node.next_functions)
    return False


class GatedProducts:
    """Finds SwiGLU's value where gate activation modules run: ``act(x[..., :H]) * x[..., H:]``.

    A call of one of ``activations`` (module instances, a SiLU) is a site when, in the forward of
    a module that holds it as a child, its input is the first half of a tensor along the last
    axis (:func:`first_half_of`) and its output is multiplied by the second half of that tensor
    (:func:`gated_product_reached`, checked when that forward returns). Read by value in the eager
    run, not by names or by the pass's matcher: a projection named otherwise is counted, a gate
    or an up transformed before the product (clamped, scaled, cast) is not. In an inference step
    (no autograd graph) a call whose input is a first half is one. ``on_site(parent, output)``
    is called once per site, with the activation's output."""

    def __init__(self, model: torch.nn.Module, activations: Sequence[torch.nn.Module], on_site):
        self.model, self.on_site = model, on_site
        wanted = {id(a) for a in activations}
        self.parents = {m: [c for c in m.children() if id(c) in wanted] for m in model.modules()}
        self.parents = {m: children for m, children in self.parents.items() if children}
        self.frames: List[Tuple[torch.nn.Module, list]] = []  # the parents' forwards running now

    def hooks(self) -> List:
        """Register the hooks; returns their handles (``.remove()`` each to take it off)."""
        handles, activations = [], {c for children in self.parents.values() for c in children}
        for parent in self.parents:
            handles.append(parent.register_forward_pre_hook(self._enter))
            handles.append(parent.register_forward_hook(self._leave, always_call=True))
        for activation in activations:
            handles.append(activation.register_forward_hook(self._on_activation))
        return handles

    def _enter(self, parent, _inputs):
        if not torch.compiler.is_compiling():
            self.frames.append((parent, []))

    def _on_activation(self, activation, inputs, out):
        if torch.compiler.is_compiling() or not inputs or first_half_of(inputs[0]) is None:
            return
        for parent, calls in self.frames:
            if activation in self.parents[parent]:
                calls.append((inputs[0], out))

    def _leave(self, parent, _inputs, outputs):
        if torch.compiler.is_compiling() or not self.frames or self.frames[-1][0] is not parent:
            return
        _, calls = self.frames.pop()
        for gate, out in calls:
            if not isinstance(out, torch.Tensor):
                continue
            if out.grad_fn is None:  # no autograd graph (an inference step, or nothing to differentiate)
                if not torch.is_grad_enabled():
                    self.on_site(parent, out)
            elif gated_product_reached(outputs, gate, out):
                self.on_site(parent, out)


class SiteCounter:
    """Counts the sites of one eager run (a context manager; read ``counted`` afterwards).

    ``modules``: by kind (:data:`COUNTED_SITES`: ``"rms_norm"``, ``"rope"``, ``"swiglu"``, each
    its op's :attr:`~npu_fusion.lowering.FusedOp.option`), module classes (or module instances:
    a gated MLP's gate activation) whose every call is a site (a RoPE module may return q and k:
    one site each); ``functions``: by kind, ``(namespace, name)``
    pairs of functions (apply-RoPE), replaced by a counting wrapper while the counter is active;
    ``gated``: by kind, gate activation modules (instances) whose calls are a site where they
    compute SwiGLU's value (:class:`GatedProducts`), at the path of the module that holds them."""

    def __init__(self, model: torch.nn.Module, modules: Optional[Mapping[str, Sequence[type]]] = None,
                 functions: Optional[Mapping[str, Sequence[Tuple[object, str]]]] = None,
                 gated: Optional[Mapping[str, Sequence[torch.nn.Module]]] = None):
        modules, functions, gated = dict(modules or {}), dict(functions or {}), dict(gated or {})
        unknown = sorted((set(modules) | set(functions) | set(gated)) - set(COUNTED_SITES))
        if unknown:
            raise ValueError(f"SiteCounter: unknown site kind(s) {unknown}; the kinds are {sorted(COUNTED_SITES)}")
        self.model = model
        #: the kinds the caller gave (a kind given with nothing to hook counts 0 sites; a kind not
        #: given is not counted at all)
        self.watched = tuple(kind for kind in COUNTED_SITES if kind in modules or kind in functions or kind in gated)
        self.modules = {kind: tuple(types) for kind, types in modules.items() if types}
        self.gated = {kind: tuple(activations) for kind, activations in gated.items() if activations}
        self.functions = {kind: list(pairs) for kind, pairs in functions.items() if pairs}
        self.names = {m: n for n, m in model.named_modules(remove_duplicate=False)}
        self.counted: collections.Counter = collections.Counter()   # (kind, path) -> sites
        self._undo: List = []

    def module_types(self) -> Tuple[type, ...]:
        """Every module class the counter hooks, of any kind."""
        return tuple(t for types in self.modules.values() for t in types if isinstance(t, type))

    def _counts(self, module, hooked) -> bool:
        return any(module is h or (isinstance(h, type) and isinstance(module, h)) for h in hooked)

    def _watch(self, kind: str, where: str, out) -> None:
        if not torch.is_grad_enabled():  # an inference step: each floating output is a forward site
            self.counted[(kind, where)] += len(floating_tensors(out))
            return
        for t in grad_tensors(out):
            # a view's own backward node is bypassed when the caller later writes into a view of it
            # (torchtune's Gemma 2 scales q in place after RoPE's flatten): its base's node is not
            base = t._base if t._base is not None and t._base.requires_grad else t
            base.register_hook(functools.partial(self._reached, (kind, where)))

    def _reached(self, key, _grad) -> None:
        self.counted[key] += 1

    def _on_module(self, kind, module, _inputs, out):
        if not torch.compiler.is_compiling():
            owner = _caller_module(module) if COUNTED_SITES[kind].path_of_caller else module
            self._watch(kind, self.names.get(owner, "?"), out)

    def _wrap(self, kind, fn):
        @functools.wraps(fn)
        def counting(*args, **kwargs):
            out = fn(*args, **kwargs)
            if not torch.compiler.is_compiling():
                self._watch(kind, self.names.get(_caller_module(None), "?"), out)
            return out
        return counting

    def __enter__(self) -> "SiteCounter":
        for m in self.model.modules():
            for kind, types in self.modules.items():
                if self._counts(m, types):
                    self._undo.append(m.register_forward_hook(functools.partial(self._on_module, kind)).remove)
        for kind, pairs in self.functions.items():
            for namespace, name in pairs:
                original = getattr(namespace, name)
                setattr(namespace, name, self._wrap(kind, original))
                self._undo.append(functools.partial(setattr, namespace, name, original))
        for kind, activations in self.gated.items():
            self._undo += [h.remove for h in GatedProducts(self.model, activations,
                                                            functools.partial(self._on_gated, kind)).hooks()]
        return self

    def _on_gated(self, kind, parent, out) -> None:
        self._watch(kind, self.names.get(parent, "?"), out)

    def __exit__(self, *exc) -> None:
        while self._undo:
            self._undo.pop()()

    def total(self, kind: str) -> int:
        counted_as = PROBES[kind].counted_kind if kind in PROBES else kind
        return sum(n for (k, _), n in self.counted.items() if k == counted_as)

    def sites_of(self, kind: str) -> List[Tuple[str, int]]:
        """``(module path, sites)`` of one kind (a forward kind: its backward's sites)."""
        counted_as = PROBES[kind].counted_kind if kind in PROBES else kind
        return [(path, n) for (k, path), n in sorted(self.counted.items()) if k == counted_as]

    @property
    def counts(self) -> Dict[str, int]:
        """Counted sites by fused-op name (what ``npu-fusion report`` expects), of the kinds counted
        on their own that the caller gave: :func:`expected_for` adds the forward ops, whose sites
        these are too."""
        return {KINDS[kind]: self.total(kind) for kind in self.watched}


@dataclasses.dataclass
class Accounting:
    """Where every counted site of one kind ended. Sites count as they ran: a compiled graph that
    dynamo reuses for each layer holds a site once and runs it once per layer."""
    op: str
    counted: int            # sites of the eager run (independent of the pass)
    fused: int              # of them, replaced by the fused op
    missed: int             # of them, left unfused with a recorded miss
    misses: List[str]       # the recorded misses: "node: reason" (with "[graph ran N times]")
    outside: List[str]      # module paths of sites that ran outside every compiled graph
    paths: Dict[str, int] = dataclasses.field(default_factory=dict)  # counted sites by module path

    @property
    def inside(self) -> int:
        return self.counted - len(self.outside)

    @property
    def unexplained(self) -> int:
        """Sites inside compiled graphs that neither fused nor left a recorded miss (negative when
        the pass found more than the counter counted)."""
        return self.inside - self.fused - self.missed


def account(counted: SiteCounter, outside: SiteCounter, capture, inference: bool = False) -> Dict[str, Accounting]:
    """Where each counted site ended, per kind: fused, a recorded miss, outside, or unexplained.

    Per kind: the counted sites, and of them the fused ones and the recorded misses (from the
    capture's ``FusionResult`` s and backward-graph runs) and those that ran outside every
    compiled graph (``outside``: the same counter, active during the compiled run). An
    ``inference`` step has the forward kinds only (no backward ran)."""
    table = {}
    for kind, op in kinds_enabled(getattr(capture, "options", None)).items():
        if inference and not PROBES[kind].same_sites_as:
            continue
        away = [path for path, n in outside.sites_of(kind) for _ in range(n)]
        misses, missed = [], 0
        for result, runs in zip(capture.results, capture.runs):
            for m in (m for m in result.misses if m.op == op):
                missed += runs
                misses.append(f"{m.node}: {m.reason}" + (f" [graph ran {runs} times]" if runs != 1 else ""))
        paths = dict(counted.sites_of(kind))
        table[kind] = Accounting(op, counted.total(kind), capture.fused_runs(op), missed, misses, away, paths)
    return table
