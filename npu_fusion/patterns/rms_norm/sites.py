"""RMSNorm forward sites on the joint graph: the statistic, the normalized value and the weighted output, matched by value."""
from __future__ import annotations

import dataclasses
from fractions import Fraction
from typing import Dict, List, Optional

import torch
import torch.fx as fx

from ...lowering import RMS_NORM as OP
from ...lowering.ops.rms_norm_grad import RMS_NORM_DTYPES
from ...lowering.sizes import same_shape, static_int
from ..algebra import Expr
from ..evaluator import JointProvenance, Unsupported, kept_precision, rounding_problem
from ..nodes import (aten, calls_to, downstream, dtype, gradient_dependent, is_value_preserving_cast, normalize_dim, outermost,
                     region_of, shape, val)
from ..rewrite import Miss, RuleContext, exact_common_dtype
from ..norm_algebra import NormEvaluator, size_key
from ..rms_statistic import (eps_outside_reason, is_centred, is_scalar_eps, norm_evaluator, rms_statistic_operand,
                             written_statistic)
from ..rule import RoundReport


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
    for node in calls_to(graph, *ROOT_TARGETS):
        if node not in forward or not is_root(node) or val(node) is None:
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


#: the calls a root of a statistic is (:func:`is_root`, :func:`~..rms_statistic.resembling_statistic`)
ROOT_TARGETS = (aten.rsqrt.default, aten.sqrt.default, aten.pow.Tensor_Scalar)


def is_root(node: fx.Node) -> bool:
    return node.op == "call_function" and isinstance(node.args[0], fx.Node) and (
        node.target in (aten.rsqrt.default, aten.sqrt.default)
        or (node.target is aten.pow.Tensor_Scalar and node.args[1] == -0.5))


def root_power(root: fx.Node) -> int:
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
    if len(rest.terms) != 1 or len(sums) != (0 if ev.unit else 1):
        return []
    # over unit axes the mean is its summand (x*x itself): no sum's body names x, what is squared does
    body = ev.sum_body[sums[0]] if sums else ()
    if any(e % 2 for _, e in body):
        return []
    half = tuple((s, e // 2) for s, e in body)
    kept = ev.k - ev.memo[rstd].dropped  # the normalized axes rstd keeps (of size 1)
    x_shape = tuple(shape(rstd)[:len(shape(rstd)) - kept]) + tuple(ev.norm_shape)
    squared = [n for n in _squared_operands(rstd) if ev.memo.get(n) is not None and same_shape(shape(n), x_shape)]
    by_value = ev.nodes_varying_as(half, x_shape) if half else []
    return [x for x in dict.fromkeys(squared + by_value)
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
    leaves = [ev.node_of[s] for s in sorted(expr.free_symbols) if s in ev.node_of and (s in ev.varying or ev.unit)]
    return [g for g in leaves if isinstance(val(g), torch.Tensor) and len(shape(g)) == ev.k
            and same_shape(shape(g), ev.norm_shape)] + [None]


def _outputs(ev: NormEvaluator, graph: fx.Graph, rstd: fx.Node, x: fx.Node, forward) -> List[tuple]:
    """(node, gamma) of the forward nodes near ``rstd`` whose value is ``rstd * x * gamma``."""
    normalized = ev.symbol(rstd) ** root_power(rstd) * ev.value_of(x)
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
    written = written_statistic(rstd, eps)
    head = "an RMS statistic" if written == "rsqrt(mean(x*x) + eps)" else "a root"
    return Miss(OP.name, rstd.name, f"{head} {written} of {inputs[0].name}, but {reasons[0]}")


def _eps_outside(root: fx.Node) -> bool:
    """A number is added to ``root`` itself (eps outside the root: ``sqrt(mean(x*x)) + eps``)."""
    return any(u.op == "call_function" and u.target in (aten.add.Tensor, aten.add.Scalar)
               and any(a is not root and is_scalar_eps(a) for a in u.args[:2]) for u in root.users)


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
    if not chosen and not eps and _eps_outside(rstd):
        return eps_outside_reason(written_statistic(rstd, 0))
    if not chosen:
        return ("no node near it is rstd * x * gamma (or rstd * x): the statistic scales something else "
                "(eps outside the root, another tensor normalized)")
    if len(chosen) > 1:
        return f"{len(chosen)} nodes compute its normalized output ({', '.join(o[0].name for o in chosen)})"
    site = ForwardNormMatch(chosen[0][0], x, chosen[0][1], rstd, eps, ev)
    if weighted and rounds_inside(site):
        site = _normalized_value_site(site, outputs) or site
    foreign = _foreign_inputs(site, site_region(site))
    if foreign:
        return (f"the norm also reads {foreign[0].name}, equal to {x.name} only up to casts, where the fused op "
                f"would read {x.name} alone")
    return site


def _one_output(ev: NormEvaluator, outputs: List[tuple]) -> List[tuple]:
    return _without_readers_of_others(ev, outermost(outputs, node=lambda o: o[0]))


def rounds_inside(site: ForwardNormMatch) -> Optional[str]:
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
    if rounds_inside(site) or site_dtypes(site)[0] != kept_precision(site.y):
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
            and ev.is_full(shape(arg))

    def tensor_sum(n):
        return n.target in (aten.add.Tensor, aten.sub.Tensor) and spanning(n.args[0]) and spanning(n.args[1])

    def centred(n):
        return n.target is aten.sub.Tensor and spanning(n.args[0]) and is_centred(n, None)

    def leading_sum(n):
        if n.target is not aten.sum.dim_IntList or not n.args[1:2] or not n.args[1] or not spanning(n.args[0]):
            return False
        rank = len(shape(n.args[0]))
        return spanning(n) and all(normalize_dim(d, rank) < rank - ev.k for d in n.args[1])
    candidates = calls_to(graph, aten.add.Tensor, aten.sub.Tensor, aten.sum.dim_IntList)  # the only ops read
    return {n for n in candidates if n in forward and isinstance(val(n), torch.Tensor)
            and len(shape(n)) > ev.k and (tensor_sum(n) or leading_sum(n) or centred(n))}


# -- the rewrite --------------------------------------------------------------

def site_region(site: ForwardNormMatch) -> List[fx.Node]:
    """The nodes the fused op replaces: what computes y and the statistic from x and gamma."""
    roles = {n for n in site.roles if n is not None}
    interior = lambda n: n in site.ev.interpreted and n not in roles  # noqa: E731
    return list(dict.fromkeys(region_of([site.y, site.rstd.args[0]], interior) + [site.rstd]))


def site_dtypes(site: ForwardNormMatch) -> tuple:
    """(x's, gamma's) dtypes for the fused op: x in the narrowest dtype that holds x and the
    precision the program keeps y at (y comes out in x's dtype, rounded once); gamma in its own
    dtype where the op takes that pair, else widened exactly. The op never rounds an operand."""
    compute = exact_common_dtype((dtype(site.x), kept_precision(site.y)))
    if site.gamma is None:
        return compute, compute
    own = dtype(site.gamma)
    wide = exact_common_dtype((compute, own))
    return compute, own if (compute, own) in RMS_NORM_DTYPES or (compute, wide) not in RMS_NORM_DTYPES else wide
