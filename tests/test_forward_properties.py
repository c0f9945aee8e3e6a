"""Property tests of the forward rules (``rms_norm_forward``, ``rope_forward``, issue 24): random
forward programs around one RMSNorm or RoPE (npu_fusion_testing/forward_programs.py: dtypes with
HF's upcasts and casts back, rounding before or after the weight, gamma, none or ``1 + w``, eps
values, residual sums, sandwich and post norms, half and interleave RoPE with partial rotary and
tables broadcast in BNSD and BSND, and near misses), compiled with both forward rules on
(``strict``, the pass on the joint graph as the ``npu_fusion`` backend runs it), under either
partitioner, with static or dynamic shapes. Each example must hold:

(a) no false rewrite: every output and every gradient within the float64 criterion (docs/testing.md: at
    most 4x further from float64 than eager, plus the per-dtype floor) and no further from the
    program's math with its explicit roundings kept than eager is, plus two ulps of the program's
    final rounding (what the float64 run cannot see: a dropped or an added rounding);
(b) a near miss is never fused: a program whose perturbation leaves no RMSNorm or RoPE formula has
    no fused forward op;
(c) outputs keep eager's dtypes and shapes (each site's output is a program output, maybe cast);
(d) every site of an exact program is fused or a recorded miss, and only once (issue 30).

The backward generators of tests/test_properties.py are drawn here too with the forward rules on
(their spellings, perturbations and wrappers, checked by (a) and (c)). Counts go to
test_properties' summary (``forward:`` keys); profiles and ``NPU_FUSION_PROPERTY_KEEP_GOING`` /
``NPU_FUSION_PROPERTY_LOG`` as there. The ``ci`` profile runs a thirtieth of its examples here (5
per property) to keep the suite's time; the long profile is where the evidence is.
"""
from __future__ import annotations

import collections
import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from npu_fusion.measure.grads import assert_close_as_unfused, grad_error, run_grads, ulps_apart
from npu_fusion_testing.capture import Capture
from npu_fusion.patterns.rope.sites import SYMBOLIC_REASON
from npu_fusion.plugin.options import forward_options
from npu_fusion_testing.forward_programs import NORM_OP, ROPE_OP, ForwardProgram, RopeForward, norm_forward_programs, \
    rope_forward_program, rope_forward_programs
from npu_fusion_testing.programs import F16, Program, RopeForm, precision_programs, rms_norm_programs, rope_program, \
    rope_programs
from test_properties import (FAILURE_LOG, FAILURES, KEEP_GOING, STATS, ULPS, BeyondEagerRounding, CompiledRunError,
                             Config,
                             PassError, UndefinedMadeDefined, WrongGradient, WrongOutput, assert_safe_compute_dtypes,
                             final_rounding, from_the_pass, grads_keeping_roundings, note_if_testing, widened)

FORWARD_OPTIONS = dict.fromkeys(forward_options(), True)  # the forward rules' switches
OPS = (NORM_OP, ROPE_OP, "rms_norm_grad", "rotary_position_embedding_grad")
LARGEST_OUTPUT = "forward: largest output distance from the roundings beyond eager's (ulps of the final rounding)"
#: a thirtieth of the profile's examples per property (5 in ci: about a minute on two cores for the
#: four); the long profile's count as it is
EXAMPLES = settings(max_examples=max(1, settings().max_examples // (30 if settings().derandomize else 1)))


class NearMissFused(AssertionError):
    """A program with no RMSNorm or RoPE formula left has a fused forward op."""


class SilentMiss(AssertionError):
    """A site of an exact program is neither fused nor a recorded miss."""


class CountedTwice(AssertionError):
    """An exact program's sites are fused or recorded more times than it has sites."""


@st.composite
def configs(draw):
    route = draw(st.sampled_from(["capture", "aot"]))
    dynamic = "static" if route == "aot" else draw(st.sampled_from(["static", "static", "mark", "all"]))
    return Config(route=route, partitioner=draw(st.sampled_from(["default", "min_cut"])),
                  decompositions=draw(st.sampled_from(["none", "none", "core"])), dynamic=dynamic,
                  target=draw(st.sampled_from(["generic", "generic", "950", "a2"])), seed=draw(st.integers(0, 3)))


class Compiled:
    """``fn`` compiled with the pass and both forward rules on, as ``config`` says."""

    def __init__(self, fn, config: Config):
        self.capture = Capture(partitioner=config.partitioner, decompositions=config.decompositions,
                               target=config.target, **FORWARD_OPTIONS)
        torch._dynamo.reset()
        if config.route == "aot":
            self.fn = self.capture.aot_function(fn)
        else:
            self.fn = torch.compile(fn, backend=self.capture, dynamic=True if config.dynamic == "all" else None)

    def __call__(self, *args):
        return self.fn(*args)

    def fused(self, op: str) -> int:
        return self.capture.fused(op)

    def misses(self, op: str) -> list:
        return [m for m in self.capture.misses() if m.op == op]

    def graphs(self):
        return self.capture.after


def as_tuple(outputs):
    return tuple(outputs) if isinstance(outputs, (tuple, list)) else (outputs,)


def check_outputs_and_gradients(compiled, program: Program, inputs):
    """(a) and (c): every output and every gradient keeps eager's dtype and shape, is within the
    float64 criterion against eager, and is no further from the program's explicit roundings than
    eager (:func:`assert_no_further_from_the_roundings`); a NaN of float64 stays NaN."""
    eager_fn, wide_fn = program.build(), program.build(wide=True)
    rounded_fn = program.build(wide=True, keep_narrowing=True)
    with torch.no_grad():
        eager = as_tuple(eager_fn(*inputs))
        exact, rounded = as_tuple(wide_fn(*widened(inputs))), as_tuple(rounded_fn(*widened(inputs)))
    eager_grads, grad_outputs = run_grads(eager_fn, inputs)
    exact_grads, _ = run_grads(wide_fn, widened(inputs), grad_outputs=[g.double() for g in grad_outputs])
    rounded_grads = grads_keeping_roundings(rounded_fn, inputs, grad_outputs)
    try:
        got_grads, _ = run_grads(compiled, inputs, grad_outputs=grad_outputs)
        got = tuple(o.detach() for o in as_tuple(compiled(*inputs)))  # with grad: the graph just compiled
    except Exception as exc:
        raise (PassError if from_the_pass(exc) else CompiledRunError)(f"{type(exc).__name__}: {exc}") from exc
    trained = [i.name for i, t in zip(program.inputs, inputs) if t.requires_grad]
    values = [(f"output {i}", None, *v) for i, v in enumerate(zip(got, eager, exact, rounded))]
    values += [(f"grad of {n}", program.grad_rounding.get(n), *v)
               for n, *v in zip(trained, got_grads, eager_grads, exact_grads, rounded_grads)]
    for name, after, g, e, x, r in values:
        assert_close_to_float64(name, g, e, x)
        assert_no_further_from_the_roundings(name, g, e, r, after)


def assert_close_to_float64(name, got, eager, exact):
    """The float64 criterion (docs/testing.md: at most 4x further from float64 than eager, plus the per-dtype
    floor) where float64 and eager are finite; dtype and shape as eager's; NaN of float64 kept."""
    if got.dtype != eager.dtype or got.shape != eager.shape:
        raise (WrongOutput if name.startswith("output") else WrongGradient)(
            f"{name}: {got.dtype}{list(got.shape)}, eager {eager.dtype}{list(eager.shape)}")
    exact = exact.double()
    if (torch.isnan(exact) & ~torch.isnan(got.double())).any():
        raise UndefinedMadeDefined(f"{name}: a number where float64 is NaN")
    keep = torch.isfinite(exact) & torch.isfinite(eager.double())
    if not keep.any():
        return
    try:
        assert_close_as_unfused(got[keep], eager[keep], exact[keep], factor=4.0)
    except AssertionError as exc:
        err_fused, err_eager, floor = exc.args[0]
        raise (WrongOutput if name.startswith("output") else WrongGradient)(
            f"{name} ({got.dtype}): max error vs float64 {err_fused:.4g}, eager's {err_eager:.4g} "
            f"(allowed {4 * err_eager + floor:.4g})") from None


def assert_no_further_from_the_roundings(name, got, eager, rounded, after_sites=None):
    """The value is no further from ``rounded`` (the program's math in float64 with its explicit
    roundings kept) than eager is, beyond :data:`ULPS` ulps of the program's final rounding of it.
    A rewrite that drops an explicit rounding is caught (it is as far from ``rounded`` as from
    eager); one that computes inside a site more finely than the program's implicit half-precision
    arithmetic is not (closer to ``rounded`` than eager: the measured reason not to compare the
    output with eager's itself, as the gradients are: a plain bf16 norm times a float32 weight,
    whose output is float32, differs from eager's by 1.5x eager's own error while being closer
    to float64 than eager; a plain bf16 sandwich norm's dx, one norm fused forward and backward,
    4 bf16 ulps from eager's, whose own error is 1.76, is 2.24 from the roundings). ``after_sites``:
    :attr:`Program.grad_rounding`, as in test_properties' check."""
    keep = torch.isfinite(eager) & torch.isfinite(rounded)
    if not keep.any():
        return
    dtype = final_rounding(eager, after_sites)
    got, eager, rounded = got[keep], eager[keep], rounded[keep].double()
    distance, own = ulps_apart(got, rounded, dtype), ulps_apart(eager, rounded, dtype)
    beyond = distance - own if math.isfinite(distance) else math.inf
    STATS[LARGEST_OUTPUT] = max(STATS[LARGEST_OUTPUT], round(beyond, 3))
    if beyond > ULPS:
        raise BeyondEagerRounding(f"{name} ({got.dtype}): {distance:.4g} ulps of {dtype} from the program's math with "
                                  f"its roundings, eager {own:.4g} (allowed {ULPS:g} beyond it)")


def check_sites(compiled: Compiled, program: Program):
    """(b) and (d) for a drawn forward program."""
    if not isinstance(program, ForwardProgram):
        return
    fused, missed = compiled.fused(program.op), len(compiled.misses(program.op))
    if program.breaking and fused:
        raise NearMissFused(f"{fused} {program.op} fused although {', '.join(program.breaking)} leaves no formula")
    if program.exact and fused + missed < program.sites:
        raise SilentMiss(f"{program.sites} {program.op} sites: {fused} fused, {missed} recorded misses")
    if program.exact and fused + missed > program.sites:
        raise CountedTwice(f"{program.sites} {program.op} sites: {fused} fused, {missed} recorded misses "
                           f"({', '.join(m.node for m in compiled.misses(program.op))})")


def record(program: Program, config: Config, compiled: Compiled, failure):
    """The counts (in test_properties' summary) and, for a failure, its note and log entry."""
    fused = {op: compiled.fused(op) for op in OPS}
    STATS["forward: examples"] += 1
    STATS[f"forward: examples: {program.family}"] += 1
    for op, count in fused.items():
        STATS[f"forward: sites fused: {op}"] += count
    if isinstance(program, ForwardProgram):
        kind = "near misses" if program.breaking else ("exact" if program.exact else "other perturbations")
        STATS[f"forward: {program.family}: {kind}"] += 1
        STATS[f"forward: {program.family}: {kind} with the forward fused"] += bool(fused[program.op])
        STATS[f"forward: {program.family}: {kind}, recorded misses"] += len(compiled.misses(program.op))
    if FAILURE_LOG:
        with open(FAILURE_LOG + ".counts", "w") as counts:
            counts.write("".join(f"{key}: {value}\n" for key, value in sorted(STATS.items())))
    if failure is None:
        return
    kind = type(failure).__name__
    STATS[f"forward: failures: {kind}"] += 1
    if isinstance(failure, (WrongGradient, BeyondEagerRounding, UndefinedMadeDefined, WrongOutput, NearMissFused)) \
            and fused[NORM_OP] + fused[ROPE_OP]:
        STATS["forward: false rewrites"] += 1
    text = f"{program}# compiled with {config}\n# {kind}: {failure}; fused: {fused}"
    note_if_testing(f"# {kind}: {failure}; fused: {fused}")
    FAILURES.append((kind, text))
    if FAILURE_LOG:
        with open(FAILURE_LOG, "a") as log:
            log.write(f"--- {kind}\n{text}\n")
    if not KEEP_GOING:
        raise failure


def check_forward_program(program: Program, config: Config):
    """Compile with the forward rules on, run, and check (a) to (d)."""
    note_if_testing(f"{program}# compiled with {config}", [f"{program.family}: {n}" for n in program.perturbations])
    inputs = program.tensors(config.seed)
    if config.dynamic == "mark":
        for index, axes in program.dynamic_dims().items():
            for axis in axes:
                torch._dynamo.mark_dynamic(inputs[index], axis)
    compiled = Compiled(program.build(), config)
    failure = None
    try:
        check_outputs_and_gradients(compiled, program, inputs)
        assert_safe_compute_dtypes(compiled.graphs())
        check_sites(compiled, program)
    except (AssertionError, PassError, CompiledRunError) as exc:
        failure = exc
    record(program, config, compiled, failure)


@EXAMPLES
@given(program=norm_forward_programs(), config=configs())
def test_rms_norm_forward_programs(program, config):
    check_forward_program(program, config)


@EXAMPLES
@given(program=rope_forward_programs(), config=configs())
def test_rope_forward_programs(program, config):
    check_forward_program(program, config)


@EXAMPLES
@given(program=rms_norm_programs(), config=configs())
def test_rms_norm_programs_with_the_forward_rules(program, config):
    check_forward_program(program, config)


@EXAMPLES
@given(program=rope_programs(), config=configs())
def test_rope_programs_with_the_forward_rules(program, config):
    check_forward_program(program, config)


@EXAMPLES
@given(program=norm_forward_programs(wrappers=True), config=configs())
def test_rms_norm_forward_programs_with_wrappers(program, config):
    """Norms with what the backward's generators draw around a site (forward_programs.NORM_WRAPPERS):
    roundings per lane and per copy, the statistic returned, in-place updates, strided inputs and
    views of the output returned."""
    check_forward_program(program, config)


@EXAMPLES
@given(program=rope_forward_programs(wrappers=True), config=configs())
def test_rope_forward_programs_with_wrappers(program, config):
    """Rotations with forward_programs.ROPE_WRAPPERS: the table rounded on half of its lanes or in
    one copy, the rotated half returned, in-place updates, a view of the output returned."""
    check_forward_program(program, config)


@EXAMPLES
@given(program=st.sampled_from(["rope", "rms_norm"]).flatmap(precision_programs), config=configs())
def test_precision_programs_with_the_forward_rules(program, config):
    """The backward's precision generator (autocast regions, mixed dtypes, bf16/fp16/fp8 round trips
    around exact sites) with the forward rules on."""
    check_forward_program(program, config)


# -- regressions found by the long profile ------------------------------------------------------

def test_rotation_of_a_symbolic_head_dim_fuses_under_a_guard():
    """``dynamic=True`` makes the head dim symbolic; the pass proves RoPE per position of a static
    head dim, so it guards the head dim to its example value (batch and sequence stay symbolic)
    and the rotations fuse (the program as the long profile drew it: q frozen, k trained, tables
    rebuilt from half-width ones; once a silent miss, then a recorded one)."""
    form = RopeForward(mode=0, layout="BSND", table_layout="S1D", tables="rebuilt", casts="none", head_dim=16,
                       width=16, sizes=(2, 1, 3), dtype=torch.float32, table_dtype=torch.float32, with_k=True,
                       q_grad=False, after="times")
    program = rope_forward_program(form, ())
    config = Config(route="capture", partitioner="default", decompositions="none", dynamic="all", target="generic",
                    seed=0)
    compiled = Compiled(program.build(), config)
    inputs = program.tensors(config.seed)
    check_outputs_and_gradients(compiled, program, inputs)
    assert compiled.fused(ROPE_OP) == 2 and not compiled.misses(ROPE_OP), compiled.misses(ROPE_OP)


@pytest.mark.parametrize("target", ["a2", "generic"])
def test_interleaved_rotation_of_a_symbolic_head_dim(target):
    """The same under ``dynamic=True`` in mode 1 (``stack((-x2, x1), -1).flatten(-2)``) on HF's BSND q
    transposed, found by the long profile as a silent miss (the sum is four uses from the element
    moves). With the head dim guarded it fuses; on A2 the batch stays symbolic, and the interleave
    mode's limit (B*N < 1000), which no symbolic batch can be proved to keep, is kept under a guard
    the example sizes satisfy, so it fuses there too."""
    form = RopeForward(mode=1, layout="BSND_T", table_layout="1SD", tables="rebuilt", casts="tables_to_x",
                       head_dim=16, width=16, sizes=(3, 1, 2), dtype=torch.float32, table_dtype=torch.float32,
                       with_k=True, q_grad=False, after="none")
    config = Config(route="capture", partitioner="default", decompositions="none", dynamic="all", target=target,
                    seed=3)
    program = rope_forward_program(form, ())
    compiled = Compiled(program.build(), config)
    check_outputs_and_gradients(compiled, program, program.tensors(config.seed))
    misses = compiled.misses(ROPE_OP)
    assert compiled.fused(ROPE_OP) == 2 and not misses, misses


# -- the fp16 example at the tables' scale of 3e4: the criterion's margin, measured -------------

#: the long profile's example: an autograd.Function RoPE (its backward the one of swapped tables)
#: of fp16 q and k with fp16 tables of scale 3e4, each output times o; o's gradient sums the
#: products of the rotated values (up to 3.8e4) and the output gradients
FP16_SCALED = rope_program(RopeForm(
    spelling="function", mode=1, layout="TND", table_layout="T1D", head_dim=8, width=4, sizes=(2, 1, 2, 4),
    dtype=F16, table_dtype=F16, table_grad=False, table_scale=3e4, with_k=True, k_one_head=False, upcast=False,
    deinterleave="slices", after="times"), ("bw_swap_tables",))
FP16_SCALED_CONFIG = Config(route="capture", partitioner="default", decompositions="core", dynamic="static",
                            target="generic", seed=1)
PROGRAM_ROTATION = "return x * cos + rot(x) * sin"


def rotated_once(program: Program) -> Program:
    """``program`` with its rotation computed in float64 and rounded once to x's dtype: what any
    correctly rounded rotation returns, the rest of the program (its fp16 arithmetic) as it is."""
    wide = "(x.to(torch.float64) * cos.to(torch.float64) + rot(x.to(torch.float64)) * sin.to(torch.float64))"
    source = program.source.replace(PROGRAM_ROTATION, f"return {wide}.to(x.dtype)")
    assert source != program.source
    return dataclasses.replace(program, source=source)


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and bool(((a == b) | (a.isnan() & b.isnan())).all())


def half_ulp_fp16(values: torch.Tensor) -> torch.Tensor:
    """Half the spacing of fp16 in each value's binade: a round-to-nearest's largest error there."""
    binade = torch.floor(torch.log2(values.double().abs().clamp_min(2.0 ** -14)))
    return torch.exp2(binade - 11)


def grad_o_rounding_bound(xs, rotated_exact, output_grads) -> torch.Tensor:
    """The largest error of o's gradient that the program's own fp16 arithmetic allows after a
    correctly rounded rotation (``rotated_exact``: the float64 rotations of the rotary lanes of
    ``xs``), first order: per output, each rotated value's rounding times its output gradient,
    each product's rounding to fp16, and the rounding to fp16 of the products' sum (accumulated in
    float32 on the CPU: 2**-20 of the sum of magnitudes covers that); then the rounding of the
    two outputs' sum."""
    bound, total = 0.0, 0.0
    for x, exact, dy in zip(xs, rotated_exact, output_grads):
        width = exact.shape[-1]
        value = torch.cat((exact.to(F16), x.detach()[..., width:]), dim=-1).double()
        rounding = torch.zeros_like(value)
        rounding[..., :width] = half_ulp_fp16(exact)
        products = value * dy.double()  # exact: two fp16 values
        bound = bound + (rounding * dy.double().abs() + half_ulp_fp16(products)
                         + products.abs() * 2.0 ** -20).sum((0, 1))
        partial = products.to(F16).double().sum((0, 1))
        bound, total = bound + half_ulp_fp16(partial), total + partial.to(F16).double()
    return bound + half_ulp_fp16(total)


def rotations(x, cos, sin):
    """Mode 1's rotation of x's first four lanes: in float64, by the program in fp16 (three
    roundings), and by the fused op the pass put in the program's place (float32, one rounding)."""
    x = x.detach()[..., :4]
    wide, cos64, sin64 = x.double(), cos.double(), sin.double()
    rot = lambda t: torch.stack((-t[..., 1::2], t[..., 0::2]), dim=-1).flatten(-2)  # noqa: E731
    return (wide * cos64 + rot(wide) * sin64, x * cos + rot(x) * sin,
            torch.ops.npu_fusion.rotary_position_embedding(x, cos, sin, 1))


def fp16_scaled_margin(seeds) -> dict:
    """:data:`FP16_SCALED` compiled once and run on the inputs of each seed: for o's gradient, how
    often it equals the rounded-once program's (:func:`rotated_once`) bit for bit, how often the
    float64 criterion fails it against eager, and how often eager would fail it against the
    compiled run (the same criterion, the roles swapped), with both mean errors where the large
    lanes are finite. A diagnostic: run it over many seeds by hand."""
    compiled = Compiled(FP16_SCALED.build(), FP16_SCALED_CONFIG)
    eager_fn, wide_fn = FP16_SCALED.build(), FP16_SCALED.build(wide=True)
    once_fn = rotated_once(FP16_SCALED).build()
    counts = collections.Counter()
    errors = {"compiled": 0.0, "eager": 0.0}
    for seed in seeds:
        inputs = FP16_SCALED.tensors(seed)
        got, output_grads = run_grads(compiled, inputs)
        eager, once = (run_grads(fn, inputs, grad_outputs=output_grads)[0][-1] for fn in (eager_fn, once_fn))
        exact = run_grads(wide_fn, widened(inputs), grad_outputs=[g.double() for g in output_grads])[0][-1]
        counts["seeds"] += 1
        counts["o's gradient as rounded once"] += same_values(got[-1], once)
        finite = exact.isfinite() & eager.isfinite()
        counts["large lanes finite"] += bool((exact.abs() > 1e3)[finite].any())
        compiled_error = grad_error(got[-1][finite], eager[finite], exact[finite], factor=4.0)
        swapped = grad_error(eager[finite], got[-1][finite], exact[finite], factor=4.0)
        counts["criterion fails the compiled run"] += not compiled_error.ok
        counts["criterion fails eager against the compiled run"] += not swapped.ok
        errors["compiled"] += compiled_error.fused
        errors["eager"] += compiled_error.unfused
    return dict(counts, **{f"mean error, {run}": total / max(1, counts["seeds"]) for run, total in errors.items()})


def test_fp16_rope_at_table_scale_3e4_is_the_correctly_rounded_program():
    """Found by the long profile: o's gradient 49.11 from float64 with the forward fused, eager's
    3.056, allowed 4 * 3.056 + the fp16 floor 24.25 = 36.48. Not the rewrite: the fused rotation is
    the correctly rounded one (eager's rounds three times, 8 of its 32 values more than half an
    ulp off), and the compiled outputs and o's gradient are bit for bit those of the program with
    its rotation computed in float64 and rounded once; 49.11 is the program's own fp16 arithmetic
    after it (products up to 3.8e4 and a partial sum of 5.6e4, an ulp of 32, cancelling to 2.4e4),
    within that arithmetic's rounding bound, where eager's errors cancelled by chance."""
    program, config = FP16_SCALED, FP16_SCALED_CONFIG
    compiled = Compiled(program.build(), config)
    inputs = program.tensors(config.seed)
    q, k, cos, sin, _ = inputs
    exact_rotations = []
    for x in (q, k):
        exact, eager, fused = rotations(x, cos, sin)
        overflow = exact.abs() >= 65520  # rounds to infinity in fp16
        assert same_values(fused.isinf(), overflow) and bool((exact[overflow].sign() == fused[overflow].sign()).all())
        assert ((fused.double() - exact).abs() <= half_ulp_fp16(exact))[~overflow].all()
        finite = ~overflow & eager.isfinite()
        assert (fused.double() - exact)[finite].abs().max() <= (eager.double() - exact)[finite].abs().max()
        exact_rotations.append(exact)
    got_grads, output_grads = run_grads(compiled, inputs)
    assert compiled.fused(ROPE_OP) == 2
    rounded_once = rotated_once(program).build()
    once_grads, _ = run_grads(rounded_once, inputs, grad_outputs=output_grads)
    outputs = zip(as_tuple(compiled(*inputs)), as_tuple(rounded_once(*inputs)))  # with grad: the joint graph's
    assert all(same_values(got.detach(), once.detach()) for got, once in outputs)
    assert same_values(got_grads[-1], once_grads[-1])
    eager_grads, _ = run_grads(program.build(), inputs, grad_outputs=output_grads)
    exact_grads, _ = run_grads(program.build(wide=True), widened(inputs),
                               grad_outputs=[g.double() for g in output_grads])
    error = (got_grads[-1].double() - exact_grads[-1]).abs()
    bound = grad_o_rounding_bound((q, k), exact_rotations, output_grads)
    finite = exact_grads[-1].isfinite() & eager_grads[-1].isfinite()
    assert (error <= bound)[finite].all(), (error, bound)  # 28.94 and 49.11 in its large lanes, bounds 97.28, 116.0
    # still the example it was found as: the criterion's factor of 4 over eager's lucky error does not hold
    assert error[finite].max() > 4 * (eager_grads[-1].double() - exact_grads[-1]).abs()[finite].max()
    for name, got, eager, exact in zip("qk", got_grads, eager_grads, exact_grads):
        assert_close_to_float64(f"grad of {name}", got, eager, exact)
    margin = fp16_scaled_margin(range(32))
    assert margin["o's gradient as rounded once"] == margin["seeds"] == 32, margin


@pytest.mark.parametrize("wrapper", ["lane_rounded_table", "rounded_table_copy"])
def test_rotation_reading_its_table_rounded_on_half_of_its_lanes_keeps_the_roundings(wrapper):
    """Found by the wrappers' generator at once (issue 30's wrong forward output): a float32 rotation
    whose ``x * cos`` reads cos exactly on its first half of lanes and ``cos.to(bf16)`` on the second
    fused with the rounded copy as its table, 1390 ulps from the program's math. The rounding check
    now also sees a site reading a role's value rounded otherwise than the copy bound to the role:
    a recorded miss. A table read rounded in one copy only fuses with that copy, as it may."""
    form = RopeForward(mode=0, layout="BNSD", table_layout="SD", tables="full", casts="none", head_dim=8, width=8,
                       sizes=(2, 1, 2), dtype=torch.float32, table_dtype=torch.float32, with_k=False, q_grad=True,
                       after="none")
    program = rope_forward_program(form, (wrapper,))
    config = Config(route="aot", partitioner="default", decompositions="none", dynamic="static", target="950", seed=0)
    compiled = Compiled(program.build(), config)
    check_outputs_and_gradients(compiled, program, program.tensors(config.seed))
    if wrapper == "lane_rounded_table":
        misses = compiled.misses(ROPE_OP)
        # refused for the rounding: by the site's one judgement (the rounding inside the site, as the
        # backward judges it) or by the copy check (a role read rounded otherwise than its bound copy)
        assert not compiled.fused(ROPE_OP) and len(misses) == 1, misses
        assert "rounded otherwise" in misses[0].reason or "rounds a value inside the site" in misses[0].reason, misses
    else:
        assert compiled.fused(ROPE_OP) + len(compiled.misses(ROPE_OP)) == 1


@pytest.mark.parametrize("partitioner", ["default", "min_cut"])
def test_issue_30_rotation_reading_a_cache_rounded_on_half_of_its_lanes_stays_unfused(partitioner):
    """Issue 30's program as filed: the table read from a flattened cache, exact on the first half of
    the lanes and through a bf16 round trip on the second; the forward fused it with one copy
    (4.8e-3 from float64 against eager's 1.4e-7). Now a recorded forward miss; outputs and
    gradients by the float64 criterion."""
    from npu_fusion.models import rotate_half
    from test_forward_fusion import check

    def rounded(t):
        return t.to(torch.bfloat16).to(t.dtype)

    def f(q, cache, sin):
        d, h = q.shape[-1], q.shape[-1] // 2
        c = cache.flatten(-2)[..., :d]
        return torch.cat((q[..., :h] * c[..., :h], q[..., h:] * rounded(c)[..., h:]), -1) + rotate_half(q) * sin

    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, 2, 4, 8, generator=generator).requires_grad_()
    cache, sin = torch.randn(4, 4, 2, generator=generator), torch.randn(4, 8, generator=generator)
    result, _, _ = check(f, [q, cache, sin], partitioner=partitioner, **FORWARD_OPTIONS)
    assert result.fused(ROPE_OP) == 0 and [m.op for m in result.misses].count(ROPE_OP) == 1, result.misses
