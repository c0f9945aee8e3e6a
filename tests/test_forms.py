"""The RoPE and RMSNorm spellings real models use beyond Llama's: every mode,
partial rotary, every layout and table shape, Gemma/T5/weightless/per-head/multi-axis
RMSNorm, and per-target gating. Each is compiled through the real pass and checked for
fusion, leftovers and gradients against eager and float64."""
import pytest
import torch

from npu_fusion.models import rotate_every_two, rotate_half
from npu_fusion_testing.capture import compile_and_compare, decomposed_leftovers

pytestmark = pytest.mark.smoke  # in the version matrix's smoke set: a sample of forms

ROPE = "rotary_position_embedding_grad"
RMS = "rms_norm_grad"


def quarter_rotate(x):
    a, b, c, d = x.chunk(4, dim=-1)
    return torch.cat((-b, a, -d, c), dim=-1)


def deinterleave(x):
    *lead, d = x.shape
    return x.view(*lead, d // 2, 2).transpose(-1, -2).reshape(*lead, d)


def deepseek_v3_interleave(x):  # transformers' apply_rotary_pos_emb_interleave spelling
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


def half_rope(x, cos, sin):
    return x * cos + rotate_half(x) * sin


ROTATIONS = {  # name: (mode, forward of one tensor given broadcastable cos/sin)
    "half": (0, lambda x, c, s: x * c + rotate_half(x) * s),
    "interleave_gptj": (1, lambda x, c, s: x * c + rotate_every_two(x) * s),
    "interleave_cohere": (1, lambda x, c, s: x * c + torch.stack(
        (-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2) * s),
    "quarter": (2, lambda x, c, s: x * c + quarter_rotate(x) * s),
    "interleave_half_view": (3, lambda x, c, s: half_rope(deinterleave(x), c, s)),
    "interleave_half_slices": (3, lambda x, c, s: half_rope(deepseek_v3_interleave(x), c, s)),
}

LAYOUTS = {  # name: (q shape, k shape, cos/sin shape)
    "BNSD_B1SD": ((2, 4, 6, 16), (2, 2, 6, 16), (2, 1, 6, 16)),
    "BNSD_11SD": ((2, 4, 6, 16), (2, 2, 6, 16), (1, 1, 6, 16)),
    "BNSD_BNSD": ((2, 4, 6, 16), (2, 4, 6, 16), (2, 4, 6, 16)),
    "BSND_1S1D": ((2, 6, 4, 16), (2, 6, 2, 16), (1, 6, 1, 16)),
    "BSND_BS1D": ((2, 6, 4, 16), (2, 6, 2, 16), (2, 6, 1, 16)),
    "SBND_S11D": ((6, 2, 4, 16), (6, 2, 2, 16), (6, 1, 1, 16)),
    "SBND_SB1D": ((6, 2, 4, 16), (6, 2, 2, 16), (6, 2, 1, 16)),
    "TND_T1D": ((12, 4, 16), (12, 2, 16), (12, 1, 16)),
    "TND_TND": ((12, 4, 16), (12, 4, 16), (12, 4, 16)),
    "plain_SD": ((2, 4, 6, 16), (2, 2, 6, 16), (6, 16)),
}


def rope_case(rotation, layout, dtype=torch.float32, cos_grad=False):
    mode, forward = ROTATIONS[rotation]
    q_shape, k_shape, table = LAYOUTS[layout]
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(q_shape, generator=gen).to(dtype).requires_grad_()
    k = torch.randn(k_shape, generator=gen).to(dtype).requires_grad_()
    cos = torch.randn(table, generator=gen).to(dtype).requires_grad_(cos_grad)
    sin = torch.randn(table, generator=gen).to(dtype).requires_grad_(cos_grad)

    def fn(q, k, cos, sin):
        return forward(q, cos, sin), forward(k, cos, sin)

    return mode, fn, [q, k, cos, sin]


@pytest.mark.parametrize("rotation", list(ROTATIONS))
@pytest.mark.parametrize("layout", ["BNSD_B1SD", "BSND_1S1D", "TND_T1D", "plain_SD"])
def test_every_mode_and_layout_fuses(rotation, layout):
    mode, fn, inputs = rope_case(rotation, layout)
    capture = compile_and_compare(fn, inputs)
    sites = [s for r in capture.results for s in r.sites if s.op == ROPE]
    assert len(sites) == 2, capture.misses()
    assert {s.mode for s in sites} == {["half", "interleave", "quarter", "interleave-half"][mode]}
    assert not decomposed_leftovers(capture.after[0])


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cos_sin_layouts_with_grad_tables(layout, dtype):
    _, fn, inputs = rope_case("half", layout, dtype=dtype, cos_grad=True)
    capture = compile_and_compare(fn, inputs, decompositions="core")
    sites = [s for r in capture.results for s in r.sites if s.op == ROPE]
    assert len(sites) == 2
    assert all(set(s.outputs) == {"dx", "dcos", "dsin"} for s in sites)
    assert not decomposed_leftovers(capture.after[0])


@pytest.mark.parametrize("rotation", ["half", "interleave_gptj"])
@pytest.mark.parametrize("rotary_dim", [8, 32], ids=["quarter_of_head", "whole_head"])
def test_partial_rotary_fuses_the_rotated_slice(rotation, rotary_dim):
    """GPT-NeoX rotary_pct / GPT-J rotary_dim: only the first rotary_dim features rotate."""
    _, forward = ROTATIONS[rotation]
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 6, 32, generator=gen).requires_grad_()
    k = torch.randn(2, 4, 6, 32, generator=gen).requires_grad_()
    cos = torch.randn(2, 1, 6, rotary_dim, generator=gen)
    sin = torch.randn(2, 1, 6, rotary_dim, generator=gen)

    def fn(q, k, cos, sin):
        out = []
        for t in (q, k):  # Phi-3 splits even when rotary_dim is the whole head: a zero-width rest
            rot, rest = t[..., :rotary_dim], t[..., rotary_dim:]
            out.append(torch.cat((forward(rot, cos, sin), rest), dim=-1))
        return tuple(out)

    capture = compile_and_compare(fn, [q, k, cos, sin])
    assert capture.fused(ROPE) == 2, capture.misses()


TARGET_CASES = [  # (rotation, layout, target, fused?, reason fragment)
    ("quarter", "BNSD_B1SD", "950", True, None),
    ("quarter", "BNSD_B1SD", "a2", False, "runs only on Ascend 950"),
    ("interleave_half_view", "BNSD_B1SD", "a3", False, "runs only on Ascend 950"),
    ("half", "BNSD_B1SD", "a2", True, None),
    ("half", "BNSD_BNSD", "a2", True, None),
    ("interleave_gptj", "BNSD_11SD", "a2", True, None),
    ("interleave_gptj", "BNSD_B1SD", "a2", False, "11SD/1S1D/S11D"),
    ("half", "TND_T1D", "a2", False, "4-D"),
    ("half", "TND_T1D", "950", True, None),
    ("half", "plain_SD", "a2", True, None),  # [S, D] tables widened to 11SD, as the forward widens them
]


@pytest.mark.parametrize("rotation, layout, target, fused, reason", TARGET_CASES)
def test_per_target_gating(rotation, layout, target, fused, reason):
    _, fn, inputs = rope_case(rotation, layout)
    capture = compile_and_compare(fn, inputs, target=target)
    assert capture.fused(ROPE) == (2 if fused else 0)
    if not fused:
        misses = [m for m in capture.misses() if m.op == ROPE]
        assert len(misses) == 2 and all(reason in m.reason for m in misses), misses


@pytest.mark.parametrize("q_shape, table_shape, reason", [
    ((1, 2, 4, 896), (1, 1, 4, 896), "D < 896"),
    ((8, 2, 6, 16), (8, 1, 6, 16), "B < S for B1SD"),
], ids=["head_dim", "batch_not_below_sequence"])
def test_a2_rope_limits_name_the_rule(q_shape, table_shape, reason):
    """What A2/A3 cannot run stays unfused with the rule named; 950 takes it."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(q_shape, generator=gen).requires_grad_()
    cos, sin = torch.randn(table_shape, generator=gen), torch.randn(table_shape, generator=gen)
    fn = lambda q, cos, sin: q * cos + rotate_half(q) * sin  # noqa: E731
    a2 = compile_and_compare(fn, [q, cos, sin], target="a2")
    assert a2.fused(ROPE) == 0 and reason in a2.misses()[0].reason
    assert compile_and_compare(fn, [q, cos, sin], target="950").fused(ROPE) == 1


# -- RMSNorm forms ------------------------------------------------------------------

class Gemma(torch.nn.Module):
    """Gemma: normalize in fp32, multiply by (1 + weight) in fp32, cast back."""

    def __init__(self, size):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(size) * 0.1)

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return (h * (1.0 + self.weight.float())).type_as(x)


class T5(torch.nn.Module):
    """T5: variance in fp32, the normalized input cast to the weight's dtype."""

    def __init__(self, size, dtype):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(size).to(dtype))

    def forward(self, x):
        variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + 1e-6)
        if self.weight.dtype in (torch.float16, torch.bfloat16):
            x = x.to(self.weight.dtype)
        return self.weight * x


class Weightless(torch.nn.Module):
    def forward(self, x):
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), eps=1e-5)


class PerHead(torch.nn.Module):
    """Qwen3's q/k norm: RMSNorm over head_dim of a [B, S, H, D] tensor."""

    def __init__(self, head_dim):
        super().__init__()
        self.norm = torch.nn.RMSNorm(head_dim, eps=1e-6)
        with torch.no_grad():
            self.norm.weight.normal_()

    def forward(self, x):
        return self.norm(x.view(*x.shape[:2], -1, 8)).flatten(2)


class TwoAxes(torch.nn.Module):
    """gamma over the last two axes: gamma.shape == x.shape[n:], n = dim - 2."""

    def __init__(self):
        super().__init__()
        self.norm = torch.nn.RMSNorm((4, 8), eps=1e-6)
        with torch.no_grad():
            self.norm.weight.normal_()

    def forward(self, x):
        return self.norm(x)


RMS_FORMS = {
    "gemma": lambda dt: Gemma(32).to(dt) if dt == torch.float32 else Gemma(32),
    "t5": lambda dt: T5(32, dt),
    "weightless": lambda dt: Weightless(),
    "per_head": lambda dt: PerHead(8).to(dt),
    "two_axes": lambda dt: TwoAxes().to(dt),
}


@pytest.mark.parametrize("form", list(RMS_FORMS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("partitioner", ["default", "min_cut"])
def test_rms_norm_forms(form, dtype, partitioner):
    model = RMS_FORMS[form](dtype)
    shape = (2, 5, 4, 8) if form == "two_axes" else (2, 5, 32)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(dtype).requires_grad_()
    capture = compile_and_compare(model, [x], params=list(model.parameters()), partitioner=partitioner)
    assert capture.fused(RMS) == 1, capture.misses()
    assert not decomposed_leftovers(capture.after[0])


DGAMMA_ONLY_FORMS = {  # forms with a weight, applied to an input that takes no gradient
    "llama": lambda dt: torch.nn.RMSNorm(32, eps=1e-6).to(dt),
    **{name: RMS_FORMS[name] for name in ("gemma", "t5", "per_head", "two_axes")},
}


@pytest.mark.parametrize("form", list(DGAMMA_ONLY_FORMS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("partitioner", ["default", "min_cut"])
def test_rms_norm_of_an_input_without_gradient_fuses_its_dgamma(form, dtype, partitioner):
    """A norm applied to a model input: the backward computes only the weight's gradient, from
    the saved normalized value (default partitioner: rstd passed as ones) or from x and rstd
    (min_cut), or on the joint graph from whichever the graph shows (it differs between torch
    releases). It becomes rms_norm_grad with only dgamma used; the gradient is checked. Run on the
    joint graph and on the backward graph after the partition (torchair's hook)."""
    model = DGAMMA_ONLY_FORMS[form](dtype)
    shape = (2, 5, 4, 8) if form == "two_axes" else (2, 5, 32)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(dtype)
    for stage in ("backward", "joint"):
        capture = compile_and_compare(model, [x], params=list(model.parameters()), partitioner=partitioner,
                                      stage=stage)
        assert capture.fused(RMS) == 1, capture.misses()
        [site] = [s for s in capture.results[0].sites if s.op == RMS]
        assert set(site.outputs) == {"dgamma"} and not [m for m in capture.misses() if m.op == RMS]
        assert not decomposed_leftovers(capture.after[0])
        # the forward (a joint graph's) fuses where the backward reads x and rstd; where it reads the
        # normalized value, which the fused forward does not output, it stays, a miss saying so
        forward_misses = [m for m in capture.misses() if m.op != RMS]
        assert capture.fused("rms_norm") + len(forward_misses) == (stage == "joint"), capture.misses()
        assert all(m.op == "rms_norm" and ("has a user outside the norm" in m.reason or "reads the norm's "
                   "output before its weight" in m.reason) for m in forward_misses), forward_misses


@pytest.mark.parametrize("partitioner", ["default", "min_cut"])
def test_rms_norm_of_an_input_without_gradient_under_the_rounding_rules(partitioner):
    """Autocast's spelling on an input without gradient: a bf16 x normalized in float32, rounded to
    bf16, times a float32 weight; dgamma is float32. Saved as the rounded value (default), the
    fused op reads that value as it is and fuses; recomputed from x and rstd (min_cut), the
    rounding is inside the site, coarser than dgamma's float32: a recorded miss saying so. (On the
    backward graph after the partition, where the two differ.)"""
    weight = torch.nn.Parameter(torch.randn(32, generator=torch.Generator().manual_seed(1)))

    def fn(x):
        h = x.float()
        return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)

    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(0)).bfloat16()
    capture = compile_and_compare(fn, [x], params=[weight], partitioner=partitioner, stage="backward")
    if partitioner == "default":
        assert capture.fused(RMS) == 1 and not capture.misses()
    else:
        assert capture.fused(RMS) == 0
        [miss] = capture.misses()
        assert "rounds a value inside the site to torch.bfloat16" in miss.reason and "dgamma" in miss.reason


@pytest.mark.parametrize("partitioner", ["default", "min_cut"])
def test_rms_norm_of_an_input_without_gradient_that_no_form_matches_is_a_miss(partitioner):
    """A weight per position ([S, D] on [B, S, D]): its gradient sums dy * x_hat over the batch
    only, no RmsNormGrad dgamma. It stays unfused, and the no-silent-miss scan records it."""
    weight = torch.nn.Parameter(torch.randn(5, 32, generator=torch.Generator().manual_seed(1)))

    def fn(x):
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))

    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(0))
    capture = compile_and_compare(fn, [x], params=[weight], partitioner=partitioner)
    assert capture.fused(RMS) == 0
    [miss] = capture.misses()
    assert "normalized value" in miss.reason and "summed as a weight's gradient" in miss.reason


@pytest.mark.parametrize("eps", [1e-5, 1e-6, 1e-12])
def test_rms_norm_eps_values(eps):
    model = torch.nn.RMSNorm(32, eps=eps)
    x = torch.randn(2, 5, 32, requires_grad=True)
    assert compile_and_compare(model, [x], params=list(model.parameters())).fused(RMS) == 1


def test_rms_norm_gamma_widened_to_float32_when_the_table_needs_it():
    """fp16 activations with a bf16 weight: (fp16, bf16) is not in RmsNormGrad's table but
    (fp16, fp32) is, and float32 holds every bf16 value, so gamma is cast up exactly. The
    program's dgamma (bf16) reads the normalized x rounded to fp16, which does not hold every
    bf16 value (range): dgamma is left to the program, with a note, and dx fuses."""
    weight = torch.nn.Parameter(torch.randn(32, dtype=torch.bfloat16))

    def fn(x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return weight * h.to(torch.float16)

    x = torch.randn(2, 5, 32, dtype=torch.float16, requires_grad=True)
    capture = compile_and_compare(fn, [x], params=[weight])
    assert capture.fused(RMS) == 1
    fused = [n for n in capture.after[0].nodes if n.target == torch.ops.npu_fusion.rms_norm_grad.default]
    dy, x, rstd, gamma = (a.meta["val"].dtype for a in fused[0].args)
    assert (dy, gamma) == (x, torch.float32) and rstd == torch.float32
    [site] = [s for s in capture.results[0].sites if s.op == RMS]
    assert set(site.outputs) == {"dx"} and site.note.startswith("dgamma")


def test_rms_norm_dtype_outside_the_table_stays_unfused():
    """float64 is in no row of RmsNormGrad's table."""
    model = torch.nn.RMSNorm(32, dtype=torch.float64)
    x = torch.randn(2, 5, 32, dtype=torch.float64, requires_grad=True)
    capture = compile_and_compare(model, [x], params=list(model.parameters()))
    assert capture.fused(RMS) == 0
    assert any("not in SPEC's table" in m.reason for m in capture.misses())


def test_rms_norm_not_on_950():
    model = torch.nn.RMSNorm(32)
    x = torch.randn(2, 5, 32, requires_grad=True)
    capture = compile_and_compare(model, [x], params=list(model.parameters()), target="950")
    assert capture.fused(RMS) == 0 and "Ascend 950" in capture.misses()[0].reason


def test_complex_rope_llama4_and_deepseek_v2():
    """view_as_complex(x) * freqs_cis as transformers writes Llama 4 and DeepSeek-V2: the fused
    op gets full-width cos/sin rebuilt from the complex table (mode 1, interleave)."""
    import transformers.models.deepseek_v2.modeling_deepseek_v2 as deepseek_v2
    import transformers.models.llama4.modeling_llama4 as llama4

    gen = torch.Generator().manual_seed(0)
    for apply, layout in ((llama4.apply_rotary_emb, (2, 6, 4, 16)), (deepseek_v2.apply_rotary_emb, (2, 4, 6, 16))):
        q = torch.randn(layout, generator=gen).requires_grad_()
        k = torch.randn(layout, generator=gen).requires_grad_()
        angles = torch.randn(2, 6, 8, generator=gen)

        def fn(q, k, angles, apply=apply):
            return apply(q, k, torch.polar(torch.ones_like(angles), angles))

        capture = compile_and_compare(fn, [q, k, angles])
        sites = [s for r in capture.results for s in r.sites]
        for op in (ROPE, "rotary_position_embedding"):  # forward and backward, each q and k
            assert [s.mode for s in sites if s.op == op] == ["interleave", "interleave"], capture.misses()
        assert not any(n.target == torch.ops.aten.view_as_complex.default for g in capture.after for n in g.nodes)


def test_half_width_tables():
    """cos/sin kept at D/2 and applied to both halves (x1*cos - x2*sin, x2*cos + x1*sin)."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 6, 16, generator=gen).requires_grad_()
    cos, sin = torch.randn(6, 8, generator=gen), torch.randn(6, 8, generator=gen)

    def fn(q, cos, sin):
        x1, x2 = q[..., :8], q[..., 8:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    capture = compile_and_compare(fn, [q, cos, sin])
    assert capture.fused(ROPE) == 1, capture.misses()
    assert not decomposed_leftovers(capture.after[0])


@pytest.mark.parametrize("rotation", list(ROTATIONS))
def test_modes_with_dynamic_batch_and_sequence(rotation):
    _, fn, inputs = rope_case(rotation, "BNSD_B1SD")
    capture = compile_and_compare(fn, inputs, dynamic_dims={i: (0, 2) for i in range(4)})
    assert any(isinstance(n.meta.get("val"), torch.SymInt) for n in capture.after[0].nodes)
    assert capture.fused(ROPE) == 2, capture.misses()


@pytest.mark.parametrize("form", ["gemma", "t5", "weightless", "per_head"])
def test_rms_norm_forms_with_dynamic_shapes(form):
    model = RMS_FORMS[form](torch.bfloat16)
    x = torch.randn(3, 5, 32, generator=torch.Generator().manual_seed(0)).bfloat16().requires_grad_()
    capture = compile_and_compare(model, [x], params=list(model.parameters()), dynamic_dims={0: (0, 1)})
    assert capture.fused(RMS) == 1, capture.misses()


def test_rope_output_scaled_before_use():
    """q * scale after RoPE (and SDPA's math path scaling q): the scaled gradient is dy."""
    weight = torch.nn.Parameter(torch.randn(16, 16, generator=torch.Generator().manual_seed(1)))

    def fn(q, cos, sin):
        return ((q * cos + rotate_half(q) * sin) * 0.125) @ weight

    _, _, (q, _, cos, sin) = rope_case("half", "BNSD_B1SD")
    capture = compile_and_compare(fn, [q, cos, sin], params=[weight])
    assert capture.fused(ROPE) == 1, capture.misses()


@pytest.mark.parametrize("rotation", list(ROTATIONS))
def test_every_mode_with_grad_tables(rotation):
    _, fn, inputs = rope_case(rotation, "BNSD_B1SD", cos_grad=True)
    capture = compile_and_compare(fn, inputs)
    sites = [s for r in capture.results for s in r.sites if s.op == ROPE]
    assert len(sites) == 2 and all(set(s.outputs) == {"dx", "dcos", "dsin"} for s in sites), \
        ([s.outputs for s in sites], capture.misses())
