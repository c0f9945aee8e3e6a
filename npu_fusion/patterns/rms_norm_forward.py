"""Fuse forward RMSNorm on the joint graph into ``npu_fusion.rms_norm``, paired with its backward.

Unfused, as AOTAutograd writes the forward of HF ``LlamaRMSNorm`` in bf16::

    x32  = _to_copy(x, float32)
    rstd = rsqrt(add(mean(pow(x32, 2), [-1], keepdim), eps))
    y    = mul(weight, _to_copy(mul(x32, rstd), bfloat16))

Fused::

    y, rstd = npu_fusion.rms_norm(x, weight, eps)

and every reader of the program's ``rstd`` (the fused ``rms_norm_grad`` of the backward rule)
reads the fused op's rstd instead, so nothing recomputes it and the partitioner saves the one
float32 keep-dim statistic.

How a match is found, by value in the backward rule's exact algebra (:class:`NormEvaluator`,
:mod:`.algebra`) run on the forward nodes: a candidate rstd is an ``rsqrt`` (or ``** -0.5``)
node, a leaf of the algebra; its argument must equal ``S[x*x]/N + eps`` for some node x of the
graph and a number eps >= 0 (eps inside the root, the mean over exactly the normalized axes of
the square of the very value the output multiplies); y is a node whose value is
``rstd * x * gamma`` for a leaf gamma over the normalized axes (Gemma's ``1 + weight`` is one
leaf), or ``rstd * x`` when no such node exists (a norm without weight). Casts are identities
of the algebra: the rounding rules of :func:`~.evaluator.rounding_problem` judge each output
(an HF bf16 norm rounds the normalized value and then the product to bf16; the fused op rounds
once to bf16, which is allowed; a float32 program that rounds inside to bf16 is refused).

Pairing. The rule runs after the backward rules in each round (:data:`~npu_fusion.patterns.RULES`)
and fuses a forward only where nothing but the site itself and fused ops reads its values: its
backward is a fused ``rms_norm_grad`` reading rstd (or the norm has no backward). A forward
whose statistic or intermediates a decomposed backward still reads stays as it is this round (a
miss with that reason, decided again in the next round), so the backward rules always see the
forward they were written for, and the backward's ``unexplained`` sees every statistic it looks
for. Only on a joint graph and on an inference graph (:class:`~.evaluator.InferenceProvenance`:
no backward, so each norm fuses unpaired where the target takes it): a backward graph has no
forward to fuse.
"""
from __future__ import annotations

import dataclasses
from fractions import Fraction
from typing import Dict, List, Optional

import torch
import torch.fx as fx

from ..lowering import FUSED_OPS, RMS_NORM as OP, RMS_NORM_GRAD
from ..lowering.ops.rms_norm_grad import RMS_NORM_DTYPES, rms_norm_target_problem
from ..lowering.sizes import same_shape, static_int
from .algebra import Expr
from .evaluator import JointProvenance, Provenance, Unsupported, kept_precision, rounding_problem
from .nodes import (CAST_TARGETS, VIEWS, aten, downstream, dtype, gradient_dependent,
                    is_value_preserving_cast, last_of, normalize_dim, outermost, outside_users, region_of, shape, val)
from .rewrite import Insertion, Miss, RuleContext, commit, emit_fused_op, exact_common_dtype, replacement_of
from .layout import memory_order, permuted, same_layout
from .norm_algebra import NormEvaluator, size_key
from .pairing import NORM_SITE, calls, site_key, source
from .rms_norm import (_is_centred, _rms_root, norm_evaluator, rms_statistic_operand, spelled_root, unmatched_spelling,
                       whole_forward_misses)
from .rule import Form, FusionRule, RoundReport, SiteProbe

#: uses from an rstd to the output y (rstd * x, a cast, the weight, a cast)
Y_DEPTH = 5


@dataclasses.dataclass
class ForwardNormMatch:
    y: fx.Node                  # the node whose value is rstd * x * gamma (outermost of its casts)
    x: fx.Node
    gamma: Optional[fx.Node]    # None: a norm without weight
    rstd: fx.Node               # the program's rsqrt (or ** -0.5) node
    eps: float
    ev: NormEvaluator

    @property
    def dx(self) -> fx.Node:
        """The node a transaction runs under (the rules' common key)."""
        return self.y

    @property
    def roles(self):
        return (self.x, self.rstd, self.gamma)


def _statistic_nodes(graph: fx.Graph, forward) -> Dict[tuple, tuple]:
    """The forward nodes that may be a norm's rstd, grouped by the axes they normalize.

    {norm shape key: (norm shape, [rstd candidates])}: forward ``rsqrt(a)`` and ``a ** -0.5``
    nodes of a keep-dim shape, grouped by the trailing axes of the keep-dim mean or sum they
    are built on (a hint for the evaluator's abstract axes; the match itself is by value)."""
    found: Dict[tuple, tuple] = {}
    for node in graph.nodes:
        if node not in forward or not _is_root(node) or val(node) is None:
            continue
        for reduction in _reductions_below(node.args[0]):
            src = reduction.args[0]
            rank = len(shape(src))
            dims = sorted(normalize_dim(d, rank) for d in reduction.args[1])
            if dims != list(range(rank - len(dims), rank)) or len(dims) == rank:
                continue
            tail = tuple(shape(src)[rank - len(dims):])
            entry = found.setdefault(tuple(size_key(s) for s in tail), (tail, []))
            if node not in entry[1]:
                entry[1].append(node)
    return found


def _is_root(node: fx.Node) -> bool:
    return node.op == "call_function" and isinstance(node.args[0], fx.Node) and (
        node.target in (aten.rsqrt.default, aten.sqrt.default)
        or (node.target is aten.pow.Tensor_Scalar and node.args[1] == -0.5))


def _root_power(root: fx.Node) -> int:
    """rstd as a power of the program's root: 1, or -1 for the ``sqrt`` the program divides by."""
    return -1 if root.target is aten.sqrt.default else 1


def _reductions_below(node: fx.Node, depth: int = 4) -> List[fx.Node]:
    """Means and sums among ``node`` and its inputs up to ``depth`` steps above it (keeping their
    axes or not: the algebra reads a statistic that drops them, :attr:`NormValue.dropped`)."""
    found, frontier = [], [node]
    for _ in range(depth):
        nxt = []
        for n in frontier:
            if n.op != "call_function":
                continue
            if n.target in (aten.mean.dim, aten.sum.dim_IntList) and len(n.args) > 1 and n.args[1]:
                found.append(n)
            nxt.extend(n.all_input_nodes)
        frontier = nxt
    return found


def _eps(argument: Expr) -> Optional[Fraction]:
    """The constant term of ``mean(x*x) + eps`` (0 when there is none), if it is a number >= 0."""
    eps = argument.terms.get((), 0)
    return eps if eps >= 0 else None


def _statistic_inputs(ev: NormEvaluator, rstd: fx.Node, argument: Expr, eps) -> List[fx.Node]:
    """The nodes x of the full shape with ``argument == S[x*x]/N + eps``: what the program squares
    first (through exact casts), then any other node of that value, the least rounded first."""
    rest = argument - eps
    sums = [s for s in rest.free_symbols if s in ev.sum_body]
    if len(sums) != 1 or len(rest.terms) != 1:
        return []
    body = ev.sum_body[sums[0]]
    if any(e % 2 for _, e in body):
        return []
    half = tuple((s, e // 2) for s, e in body)
    kept = ev.k - ev.memo[rstd].dropped  # the normalized axes rstd keeps (of size 1)
    x_shape = tuple(shape(rstd)[:len(shape(rstd)) - kept]) + tuple(ev.norm_shape)
    squared = [n for n in _squared_operands(rstd) if ev.memo.get(n) is not None and same_shape(shape(n), x_shape)]
    return [x for x in dict.fromkeys(squared + ev.nodes_varying_as(half, x_shape))
            if len(shape(x)) > ev.k and rest == ev.sum_over_normalized(ev.value_of(x) ** 2) / ev.n]


def _squared_operands(rstd: fx.Node, depth: int = 5) -> List[fx.Node]:
    """What the program squares under ``rstd``, each with the tensors it exactly widens.

    What the program squares under ``rstd`` (``pow(a, 2)``, ``a * a``), each followed by the
    tensors it is an exact widening of, the source last first: the x the program reads, tried
    before any other node of the same value (a less rounded copy would change the function)."""
    found, frontier = [], [rstd.args[0]]
    for _ in range(depth):
        frontier = [n for n in frontier if n.op == "call_function"]
        for n in frontier:
            if (n.target is aten.pow.Tensor_Scalar and n.args[1] == 2) or \
                    (n.target is aten.mul.Tensor and n.args[0] is n.args[1]):
                chain = [n.args[0]]
                while is_value_preserving_cast(chain[-1]):
                    chain.append(chain[-1].args[0])
                found += reversed(chain)
        frontier = [a for n in frontier for a in n.all_input_nodes]
    return [n for n in found if isinstance(n, fx.Node)]


def _gamma_candidates(ev: NormEvaluator, expr: Expr) -> List[Optional[fx.Node]]:
    """Leaves of ``expr`` over exactly the normalized axes (a weight), then None (no weight)."""
    leaves = [ev.node_of[s] for s in sorted(expr.free_symbols) if s in ev.node_of and s in ev.varying]
    return [g for g in leaves if isinstance(val(g), torch.Tensor) and len(shape(g)) == ev.k
            and same_shape(shape(g), ev.norm_shape)] + [None]


def _outputs(ev: NormEvaluator, graph: fx.Graph, rstd: fx.Node, x: fx.Node, forward) -> List[tuple]:
    """(node, gamma) of the forward nodes near ``rstd`` whose value is ``rstd * x * gamma``."""
    normalized = ev.symbol(rstd) ** _root_power(rstd) * ev.value_of(x)
    found = []
    for node in downstream(graph, [rstd], Y_DEPTH):
        value = val(node)  # a tuple (a MoE router's topk) or nothing: no output of a norm
        if node not in forward or node is rstd or not isinstance(value, torch.Tensor) \
                or not value.dtype.is_floating_point or not same_shape(shape(node), shape(x)):
            continue
        v = ev.value(node)
        if v is None or v.lead_sum is not None:
            continue
        for gamma in _gamma_candidates(ev, v.expr):
            if gamma is not x and v.expr == normalized * ev.value_of(gamma):
                found.append((node, gamma))
                break
    return found


def _without_readers_of_others(ev: NormEvaluator, outputs: List[tuple]) -> List[tuple]:
    """Drop an output computed from another one (through nodes the algebra read): it reads y,
    it is not y. A post-norm's ``x.float()`` of the previous norm's bf16 output, autocast's bf16
    copy of y for each projection it feeds, Falcon-H1's ``y * attention_in_multiplier`` and
    ``y * ssm_in_multiplier`` (multipliers of 1.0) equal y by value; the fused op computes the y
    they all read, and they read it as before."""
    nodes = {o[0] for o in outputs}

    def reads_another(node):
        above = region_of([a for a in node.all_input_nodes], lambda n: n in ev.interpreted or n in nodes)
        return any(n in nodes for n in above)
    return [o for o in outputs if not reads_another(o[0])]


#: why a norm whose eps is a tensor keeps its forward (the npu_fusion backend specializes a float eps
#: that dynamic=True passes as a graph input, :mod:`npu_fusion.plugin.specialize`; other paths do not)
EPS_TENSOR_REASON = ("eps is a tensor here (dynamic=True passes a float eps as a graph input, which backend="
                     "'npu_fusion', npu_fusion.install_inductor() and npu_fusion.get_npu_backend(config) read back "
                     "as its value under a guard; torchair's own get_npu_backend does not), and the fused op takes "
                     "eps as a number: compile through one of those, set torch._dynamo.config.specialize_float = "
                     "True, or pass eps as a Python float")


def _match_statistic(ev: NormEvaluator, graph: fx.Graph, rstd: fx.Node, forward):
    """A :class:`ForwardNormMatch` at ``rstd``, a :class:`Miss` for a statistic whose output is
    not a norm's, or None when ``rstd`` is no RMS statistic."""
    argument = ev.value(rstd.args[0])
    ev.value(rstd)  # the statistic: a leaf of the algebra
    if argument is None or argument.lead_sum is not None or rstd not in ev.symbol_of:
        return None
    eps = _eps(argument.expr)
    inputs = _statistic_inputs(ev, rstd, argument.expr, eps) if eps is not None else []
    if not inputs and _tensor_eps(ev, argument.expr):
        return Miss(OP.name, rstd.name, EPS_TENSOR_REASON)
    reasons = []
    for x in inputs:
        site = _site_at(ev, graph, rstd, x, float(eps), forward)
        if isinstance(site, ForwardNormMatch):
            return site
        reasons.append(site)
    if not reasons:
        return None
    return Miss(OP.name, rstd.name, f"an RMS statistic rsqrt(mean(x*x) + eps) of {inputs[0].name}, but {reasons[0]}")


def _tensor_eps(ev: NormEvaluator, argument: Expr) -> bool:
    """The argument is ``mean(x*x) + e`` with ``e`` a one-element tensor leaf."""
    return any(len(mono) == 1 and mono[0][1] == 1 and coef == 1 and mono[0][0] in ev.node_of
               and all(static_int(n) == 1 for n in shape(ev.node_of[mono[0][0]]))
               for mono, coef in argument.split_terms())


def _site_at(ev: NormEvaluator, graph: fx.Graph, rstd: fx.Node, x: fx.Node, eps: float, forward):
    """The site normalizing ``x`` by ``rstd``, or why there is none (a reason)."""
    outputs = _outputs(ev, graph, rstd, x, forward)
    weighted = [o for o in outputs if o[1] is not None]
    chosen = _one_output(ev, weighted or outputs)
    if not chosen:
        return ("no node near it is rstd * x * gamma (or rstd * x): the statistic scales something else "
                "(eps outside the root, another tensor normalized)")
    if len(chosen) > 1:
        return f"{len(chosen)} nodes compute its normalized output ({', '.join(o[0].name for o in chosen)})"
    site = ForwardNormMatch(chosen[0][0], x, chosen[0][1], rstd, eps, ev)
    if weighted and _rounds_inside(site):
        site = _normalized_value_site(site, outputs) or site
    foreign = _foreign_inputs(site, _region(site))
    if foreign:
        return (f"the norm also reads {foreign[0].name}, equal to {x.name} only up to casts, where the fused op "
                f"would read {x.name} alone")
    return site


def _one_output(ev: NormEvaluator, outputs: List[tuple]) -> List[tuple]:
    return _without_readers_of_others(ev, outermost(outputs, node=lambda o: o[0]))


def _rounds_inside(site: ForwardNormMatch) -> Optional[str]:
    return rounding_problem(site.ev, {"y": site.y, "rstd": site.rstd.args[0]}, [site.x, site.rstd, site.gamma])


def _normalized_value_site(weighted: ForwardNormMatch, outputs: List[tuple]) -> Optional[ForwardNormMatch]:
    """The site of a norm's weightless normalized value, where the program rounds it before its weight.

    The weightless site ``y' = rstd * x`` where the program rounds y' before its weight
    multiplies it more coarsely than it keeps the product (autocast: a bf16 input's normalized
    value rounded to bf16, times a float32 weight, Qwen3's q/k norms): the fused op with a weight
    of ones computes y' rounded once to the dtype the program rounds it to, and the program's
    weight multiply (and the decomposed dgamma, which reads y') stay as they are. None where y'
    is no single node, or the op would not round it as the program does."""
    plain = _one_output(weighted.ev, [o for o in outputs if o[1] is None])
    if len(plain) != 1:
        return None
    site = dataclasses.replace(weighted, y=plain[0][0], gamma=None)
    if _rounds_inside(site) or _dtypes(site)[0] != kept_precision(site.y):
        return None
    return site


def _foreign_inputs(site: ForwardNormMatch, region) -> List[fx.Node]:
    """Tensors the site's nodes read that are neither inside it nor its inputs (x, gamma, rstd):
    a second copy of x (rounded differently) the fused op would not read."""
    inside, roles = set(region), {n for n in site.roles if n is not None}
    return [a for n in region for a in n.all_input_nodes
            if a not in inside and a not in roles and val(a) is not None]


def find_sites(graph: fx.Graph, ctx: RuleContext) -> RoundReport:
    """The forward RMSNorm sites of a joint graph and their near misses; none elsewhere."""
    if not isinstance(ctx.provenance, JointProvenance):
        return RoundReport()
    gradient = gradient_dependent(graph) or set()
    forward = {n for n in graph.nodes if n not in gradient and n.op != "output"}
    matches, misses, pending = [], [], 0
    for norm_shape, roots in _statistic_nodes(graph, forward).values():
        try:
            ev = norm_evaluator(norm_shape)  # the forward's own values: no provenance, no gradient cut
        except Unsupported:
            continue
        ev.forced_leaves |= _forward_inputs(ev, graph, forward)
        for rstd in roots:
            found = ctx.examine(rstd, _match_statistic, ev, graph, rstd, forward)
            if isinstance(found, Miss):
                misses.append(found)
            elif found is not None:
                matches.append(found)
            elif rms_statistic_operand(rstd, None) is not None:
                # undecided: a post-norm's residual still holds an unfused norm this round may fuse
                pending += 1
        ctx.evaluated(ev)
    return RoundReport(matches, misses, pending)


def _forward_inputs(ev: NormEvaluator, graph: fx.Graph, forward) -> set:
    """The forward values a norm reads as its x, each a leaf of the algebra.

    Forward values a norm reads as its x, each a leaf, as the backward rule reads them:

    - sums of two tensors that span the normalized axes (a residual stream ``h + attn(h)``,
      Gemma's ``embedding * normalizer + attn``, a post-norm's ``residual + norm(h)``).
      Expanded, a sum whose operand holds a constant along the normalized axes (the normalizer,
      an earlier norm's rstd) makes ``x*x`` a sum of cross terms that no single tensor x is seen
      to square, and the residual stream's leaves would grow with depth;
    - sums over leading axes (hyper-connections collapsing their streams, DeepSeek-V4, HY-V4):
      the algebra keeps such a sum aside as a weight's gradient, which no forward value is;
    - centred values ``a - mean(a)``: an RMSNorm of a centred value (``c * rsqrt(mean(c*c) + eps)``,
      a LayerNorm without bias spelled as one) is a norm of c, which the fused op computes on c;
      expanded, ``c*c`` is a sum of cross terms no single tensor is seen to square."""
    def spanning(arg):
        return isinstance(arg, fx.Node) and isinstance(val(arg), torch.Tensor) and len(shape(arg)) > 0 \
            and ev.spans(shape(arg)) is True

    def tensor_sum(n):
        return n.target in (aten.add.Tensor, aten.sub.Tensor) and spanning(n.args[0]) and spanning(n.args[1])

    def centred(n):
        return n.target is aten.sub.Tensor and spanning(n.args[0]) and _is_centred(n, None)

    def leading_sum(n):
        if n.target is not aten.sum.dim_IntList or not n.args[1:2] or not n.args[1] or not spanning(n.args[0]):
            return False
        rank = len(shape(n.args[0]))
        return spanning(n) and all(normalize_dim(d, rank) < rank - ev.k for d in n.args[1])
    return {n for n in graph.nodes if n in forward and n.op == "call_function" and isinstance(val(n), torch.Tensor)
            and len(shape(n)) > ev.k and (tensor_sum(n) or leading_sum(n) or centred(n))}


# -- the rewrite --------------------------------------------------------------

def _region(site: ForwardNormMatch) -> List[fx.Node]:
    """The nodes the fused op replaces: what computes y and the statistic from x and gamma."""
    roles = {n for n in site.roles if n is not None}
    interior = lambda n: n in site.ev.interpreted and n not in roles  # noqa: E731
    return list(dict.fromkeys(region_of([site.y, site.rstd.args[0]], interior) + [site.rstd]))


def _readers(node: fx.Node, region) -> List[fx.Node]:
    """The nodes outside the site that read ``node``, seen through casts, views and detaches (the
    decomposed backward reads rstd through ``detach``; a statistic taken with ``keepdim=False``
    through the site's own ``unsqueeze(-1)``)."""
    copies = CAST_TARGETS | VIEWS
    found, stack, seen = [], [u for u in node.users if u not in region or u.target in copies], set()
    while stack:
        user = stack.pop()
        if user in seen:
            continue
        seen.add(user)
        if user.op == "call_function" and user.target in copies:
            stack.extend(user.users)
        else:
            found.append(user)
    return found


def _unfused_readers(node: fx.Node, region, gradient) -> List[fx.Node]:
    """Backward nodes other than a fused op that read ``node`` from outside the site (:func:`_readers`)."""
    fused_ops = {op.overload for op in FUSED_OPS}
    return [u for u in _readers(node, region) if u.target not in fused_ops and u in gradient]


def _pairing_problem(site: ForwardNormMatch, region, graph: fx.Graph) -> Optional[str]:
    """Why the site cannot fuse yet, or None.

    Why the site cannot fuse yet: a decomposed backward reads its statistic (the forward fuses
    paired with a fused backward, or with none), or, unpaired, a node outside it reads an
    intermediate (a fused dgamma-only backward reads the normalized value as its x). None when
    nothing but the site and fused ops reads its statistic; paired with its fused backward, an
    intermediate another node reads stays (:func:`_kept`)."""
    gradient, fused_ops = gradient_dependent(graph) or set(), {op.overload for op in FUSED_OPS}
    readers = [(n, u) for n in outside_users(region, [site.y, site.rstd]) for u in n.users if u not in region]
    decomposed = _unfused_readers(site.rstd, region, gradient)
    paired = _read_by_fused_backward(site.rstd, region)
    if not paired:
        decomposed += [u for _, u in readers if u in gradient and u.target not in fused_ops]
    if decomposed:
        return (f"a decomposed backward node ({decomposed[0].name}) reads the forward's statistic or intermediates "
                f"(its backward is unfused): the forward fuses only where its fused backward reads its statistic")
    if readers and not paired:
        node, user = readers[0]
        return f"intermediate {node.name} has a user outside the norm ({user.name})"
    return None


def _read_by_fused_backward(rstd: fx.Node, region) -> bool:
    """Whether a fused ``rms_norm_grad`` reads ``rstd``.

    A fused ``rms_norm_grad`` reads ``rstd`` (:func:`_readers`): the norm's backward is fused, and
    what of it the rewrite left to the program (a dgamma whose gradient is rounded more coarsely
    than it is kept, torchtitan's Qwen3 q/k norms in bf16) is the program's own."""
    return any(u.target == RMS_NORM_GRAD.overload for u in _readers(rstd, region))


def _kept(site: ForwardNormMatch, region) -> List[fx.Node]:
    """The site's intermediates that a node outside it reads, and what they are computed from.

    The site's intermediates that a node outside it reads, and what they are computed from
    inside it, up to the fused op's outputs: they stay, computing what they computed, from the
    fused op's rstd (the normalized value the program's decomposed dgamma reads)."""
    inside, outputs = set(region), {site.y, site.rstd}
    read_outside = [n for n in region if n not in outputs and any(u not in inside for u in n.users)]
    return region_of(read_outside, lambda n: n in inside and n not in outputs)


def _backward_readers_of_y(site: ForwardNormMatch, graph: fx.Graph, provenance) -> set:
    """The backward nodes, other than fused ops, that read a norm's output y under min-cut.

    Backward nodes other than fused ops that read y itself (a modulation's gradient
    ``sum(dy * y)``, DiT's adaLN ``norm(x) * (1 + scale) + shift``), where min-cut partitions the
    graph: the default partitioner (torchair's) saves y either way, and the program's y kept for
    them would only be computed twice in the forward."""
    if not getattr(provenance, "min_cut", False):
        return set()
    gradient, fused_ops = gradient_dependent(graph) or set(), {op.overload for op in FUSED_OPS}
    return {u for u in site.y.users if u in gradient and u.op == "call_function" and u.target not in fused_ops}


def _computing_y(site: ForwardNormMatch, region, readers, anchor: fx.Node) -> List[fx.Node]:
    """Where the backward reads y: y and what computes it from x inside the site, kept for those
    readers and reading the fused rstd. Min-cut recomputes them from x and rstd as it does unfused;
    the opaque fused op's y it would save (twice the activations of a modulated norm). None where
    one of them comes before the fused op (a weight computed after x): all read the fused y then."""
    if not readers:
        return []
    inside = set(region)
    kept = region_of([site.y], lambda n: n in inside and n is not site.rstd)
    return [] if any(n < anchor for n in kept) else kept


def _dtypes(site: ForwardNormMatch) -> tuple:
    """(x's, gamma's) dtypes for the fused op: x in the narrowest dtype that holds x and the
    precision the program keeps y at (y comes out in x's dtype, rounded once); gamma in its own
    dtype where the op takes that pair, else widened exactly. The op never rounds an operand."""
    compute = exact_common_dtype((dtype(site.x), kept_precision(site.y)))
    if site.gamma is None:
        return compute, compute
    own = dtype(site.gamma)
    wide = exact_common_dtype((compute, own))
    return compute, own if (compute, own) in RMS_NORM_DTYPES or (compute, wide) not in RMS_NORM_DTYPES else wide


def emit(ctx: RuleContext, site: ForwardNormMatch):
    """One site rewritten into one fused call (a :class:`Site`), or a :class:`Miss` saying why not."""
    graph = ctx.graph
    site.x, site.gamma = ctx.current(site.x), ctx.current(site.gamma)
    region = _region(site)
    # the site's own verdicts first (the one its backward was given, then its roundings), then
    # whether it fuses this round (paired with a fused backward)
    problem = ctx.context.judgements.binding(site_key(NORM_SITE, site.rstd)) or _rounds_inside(site) \
        or _pairing_problem(site, region, graph)
    compute, gamma_dtype = _dtypes(site)
    problem = problem or rms_norm_target_problem(ctx.target, compute, gamma_dtype, shape(site.x), site.ev.k,
                                                  ge_op=OP.ge_op)
    kept = set(_kept(site, region)) if problem is None else set()
    anchor = last_of(graph, [n for n in (site.x, site.gamma) if n is not None])
    readers = _backward_readers_of_y(site, graph, ctx.provenance) if problem is None else set()
    computing_y = _computing_y(site, region, readers, anchor)
    readers, kept = (readers, kept | set(computing_y)) if computing_y else (set(), kept)
    late = [u for out in (site.y, site.rstd) for u in out.users if (u not in region or u in kept) and u < anchor]
    if problem is None and late:
        problem = f"{late[0].name} reads the norm's output before its weight is computed"
    # the op runs in y's memory order (a q/k norm of a transposed q); where the normalized axes are
    # not innermost in memory, in the shape's order, its outputs then copied into the program's layouts
    order = memory_order(site.y, site.ev.k) or list(range(len(shape(site.y))))
    if problem is not None:
        return Miss(OP.name, site.y.name, problem)
    outputs = {"y": site.y, "rstd": site.rstd}
    with Insertion(graph, anchor) as inserted:
        emitted = _emit_call(ctx, site, compute, gamma_dtype, outputs, order)
        if isinstance(emitted, Miss):
            return emitted
        fused, replacements = emitted
        if _root_power(site.rstd) != 1:
            _replace_root(ctx.edit, site.rstd, replacements)
    moved = [old for old, new in replacements.items() if not same_layout(new, old)]
    if moved:  # the program's views of its outputs rely on their strides
        return Miss(OP.name, site.y.name, f"{moved[0].name} has strides {list(val(moved[0]).stride())}, the fused "
                                          f"op's output in {site.y.name}'s memory order has others")
    added = inserted.nodes()
    _as_forward_work(added, site.y)
    replaced = [n for n in region if n not in kept]
    fused_y = replacements.pop(site.y) if readers else None
    done = commit(ctx.edit, OP.name, None, replaced, outputs, replacements, {"x": site.x, "gamma": site.gamma},
                  added, fused)
    if fused_y is not None:  # the forward reads the fused y, the backward the program's, recomputable
        site.y.replace_all_uses_with(fused_y, delete_user_cb=lambda user: user not in readers)
    return done


def _replace_root(edit, root: fx.Node, replacements) -> None:
    """Rewire the readers of the program's root to the fused op's rstd.

    The program's root (``x / sqrt(...)``) is the reciprocal of the fused op's rstd, which
    ``replacements`` holds for it: the root's readers read that reciprocal, and the ``root ** -1``
    the fused backward reads as its rstd reads the fused rstd itself."""
    rstd = replacements[root]
    for user in list(root.users):
        if user.target is aten.pow.Tensor_Scalar and user.args[1] == -1:
            replacements[user] = replacement_of(edit, rstd, user)
    replacements[root] = edit.call(aten.reciprocal.default, (rstd,))


def _emit_call(ctx: RuleContext, site: ForwardNormMatch, compute: torch.dtype, gamma_dtype: torch.dtype, outputs,
               order):
    x = permuted(ctx.edit, ctx.edit.cast(site.x, compute), order)
    if site.gamma is not None:
        gamma = ctx.edit.cast(site.gamma, gamma_dtype)
    elif all(isinstance(s, int) for s in site.ev.norm_shape):
        gamma = ctx.edit.call(aten.full.default, (list(site.ev.norm_shape), 1.0),
                              {"dtype": compute, "device": val(site.x).device})
    else:
        return Miss(OP.name, site.y.name, "a norm without weight over a symbolic size: mark the hidden size static")
    return emit_fused_op(ctx, OP, site.y, (x, gamma, site.eps), outputs, order)


#: what a node inserted as forward work takes from the node it replaces: the partitioner's
#: forward tag, activation checkpointing's policy and region, and where it came from
FORWARD_META = ("partitioner_tag", "recompute", "ac_graph_id", "seq_nr", "stack_trace", "nn_module_stack")


def _as_forward_work(nodes: List[fx.Node], like: fx.Node) -> None:
    """Mark inserted nodes as forward nodes (``partitioner_tag`` ``is_forward``): the joint
    graph's preparation (:mod:`npu_fusion.plugin.joint`) leaves them where they are."""
    for node in nodes:
        for key in FORWARD_META:
            if key in like.meta:
                node.meta[key] = like.meta[key]
        node.meta["partitioner_tag"] = "is_forward"


def unexplained(graph: fx.Graph, provenance: Optional[Provenance], misses: List[Miss]) -> List[Miss]:
    """No silent misses: a forward RMS statistic ``rsqrt(mean(x*x) + eps)`` left in a joint graph
    after the pass, that no recorded miss accounts for (one at it or at a node it reaches), is a
    forward RMSNorm no form matched; each becomes a miss."""
    if not isinstance(provenance, JointProvenance):
        return []
    gradient = gradient_dependent(graph) or set()
    missed = {m.node for m in misses}
    found = [n for n in graph.nodes if n not in gradient and n.op == "call_function" and _is_root(n)
             and rms_statistic_operand(n, None) is not None
             and not any(r.name in missed for r in downstream(graph, [n], Y_DEPTH))]
    spelled = {}  # one miss per root, at its first reader: recomputed copies read it too
    for n in graph.nodes:
        root = spelled_root(n, None) if n not in gradient and n.op == "call_function" and n.target in (
            aten.div.Tensor, aten.rsqrt.default, aten.pow.Tensor_Scalar) else None
        if root is not None and root not in spelled and not any(
                r.name in missed for r in downstream(graph, [n], Y_DEPTH)):
            spelled[root] = (n, unmatched_spelling(n, None))
        elif _reciprocal_root(n) and n not in gradient and not any(
                r.name in missed for r in downstream(graph, [n], Y_DEPTH)):
            spelled[n] = (n, RECIPROCAL_REASON)
    statistics = [Miss(OP.name, n.name, "a forward RMS statistic rsqrt(mean(x*x) + eps) that no forward RMSNorm "
                                        "form matched (run with TORCH_LOGS=npu_fusion and dump_graphs to see it)")
                  for n in found]
    spellings = [Miss(OP.name, n.name, reason) for n, reason in spelled.values()]
    whole = whole_forward_misses(graph, provenance, OP.name)
    return statistics + spellings + whole + _unpaired_backwards(graph, gradient, misses + statistics + spellings + whole)


#: why a forward RMSNorm whose statistic is the reciprocal of the root fuses in no form
RECIPROCAL_REASON = ("an RMS statistic spelled 1 / sqrt(mean(x*x) + eps) (the reciprocal of the root): no forward "
                     "form reads it; write torch.rsqrt(mean(x*x) + eps), the same value, to fuse it")


def _reciprocal_root(node: fx.Node) -> bool:
    """``node`` is ``reciprocal(sqrt(mean(y*y) + eps))`` (``1 / torch.sqrt(...)`` traces to it)."""
    return (node.op == "call_function" and node.target is aten.reciprocal.default and isinstance(node.args[0], fx.Node)
            and _rms_root(node.args[0], None, lambda r: r.target is aten.sqrt.default) is not None)


def _unpaired_backwards(graph: fx.Graph, gradient: set, misses: List[Miss]) -> List[Miss]:
    """The fused RMSNorm backwards whose forward neither fused nor was recorded as a miss.

    A fused ``rms_norm_grad`` whose rstd is no fused forward op's and near which no forward miss
    was recorded: its forward ran and matched no form (``x / sqrt(...)``, a statistic built
    otherwise), each a miss named by the backward node (:mod:`.pairing`)."""
    missed, used, out = {m.node for m in misses}, set(), []
    for grad in calls(graph, RMS_NORM_GRAD):
        rstd = source(grad.args[2])
        if not isinstance(rstd, fx.Node) or rstd.target == OP.overload:
            continue
        near = {n.name for n in downstream(graph, [rstd], Y_DEPTH) + list(rstd.all_input_nodes)
                if n not in gradient} & missed
        if near:
            used |= near
            continue
        out.append(Miss(OP.name, grad.name, _unpaired_reason(grad, rstd)))
    # a miss recorded elsewhere on the site (its y, a reader of an intermediate) accounts for one
    return out[len(missed - used):]


def _unpaired_reason(grad: fx.Node, rstd: fx.Node) -> str:
    return (f"this norm's backward fused ({grad.name}), but its forward matched no forward RMSNorm form: its "
            f"statistic {rstd.name} ({_spelling(rstd)}) is no rsqrt(mean(x*x) + eps) with eps a number; spell it "
            f"as x * torch.rsqrt(...) to fuse it")


def _spelling(node: fx.Node) -> str:
    """What a statistic node is, for a miss's reason."""
    name = getattr(node.target, "__name__", str(node.target)) if node.op == "call_function" else node.op
    reads = ", ".join(getattr(a.target, "__name__", a.op) for a in node.all_input_nodes[:2])
    return f"{name} of {reads}" if reads else name


class RmsNormForwardRule(FusionRule):
    """RMSNorm's forward on the joint graph, matched by value in the norm algebra, rewritten into
    ``rms_norm`` once its backward is a fused ``rms_norm_grad`` (which then reads its rstd)."""

    stage = "joint"
    domain = "norm"
    ops = (OP,)
    reads_constant_floats = True  # the fused op's eps is an attribute
    #: each norm call the model runs is one forward site, the backward's site
    site_probe = SiteProbe(kind=OP.option, same_sites_as="rms_norm")
    forms = tuple(Form(*row) for row in (
        ("forward on the joint graph, paired with its fused backward (which reads the forward's rstd): "
         "fp32 statistics with the casts, `nn.RMSNorm`/`F.rms_norm` with or without weight, `1 + weight`, "
         "T5's cast, per-head, gated, post and sandwich norms, under activation checkpointing",
         "HF `LlamaRMSNorm`, Qwen3 (q/k norms), Gemma, T5, PyTorch"),
    ))

    def find(self, graph: fx.Graph, ctx: RuleContext) -> RoundReport:
        return find_sites(graph, ctx)

    def emit(self, ctx: RuleContext, match: ForwardNormMatch):
        return emit(ctx, match)

    def unexplained(self, graph: fx.Graph, ctx: RuleContext, misses) -> List[Miss]:
        return unexplained(graph, ctx.provenance, misses)
