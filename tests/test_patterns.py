"""The pass on transformers' rotate_half RoPE and the RMSNorm forms under every graph variant:
AOTAutograd's default and core-ATen decompositions, default and min-cut
partitioners, static and dynamic shapes, fp32/fp16/bf16; and near misses."""
import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from npu_fusion.plugin.pass_manager import COUNTER
from npu_fusion_testing.capture import VARIANTS, Capture, compile_and_compare

ROPE = "rotary_position_embedding_grad"
RMS = "rms_norm_grad"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
ROPE_DECOMPOSED = {"slice_backward", "slice_scatter", "neg"}


def assert_no_dead_nodes(graph):
    for node in graph.nodes:
        if node.op == "call_function":
            assert node.users, f"dead node {node.name} left in the graph"


def rope_inputs(dtype, b=2, hq=4, hkv=2, s=6, d=16, cos_grad=False):
    torch.manual_seed(0)
    q = torch.randn(b, hq, s, d, dtype=dtype, requires_grad=True)
    k = torch.randn(b, hkv, s, d, dtype=dtype, requires_grad=True)
    cos = torch.randn(b, s, d, dtype=dtype, requires_grad=cos_grad)
    sin = torch.randn(b, s, d, dtype=dtype, requires_grad=cos_grad)
    return [q, k, cos, sin]


def hf_rope(q, k, cos, sin):
    return apply_rotary_pos_emb(q, k, cos, sin)


@pytest.mark.parametrize("variant", VARIANTS, ids="-".join)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("cos_grad", [False, True], ids=["cos_const", "cos_grad"])
def test_hf_rope_fuses_q_and_k(variant, dtype, cos_grad):
    torch._dynamo.utils.counters.clear()
    inputs = rope_inputs(dtype, cos_grad=cos_grad)
    capture = compile_and_compare(hf_rope, inputs, partitioner=variant[0], decompositions=variant[1])
    assert capture.fused(ROPE) == 2
    assert torch._dynamo.utils.counters[COUNTER][ROPE] == 2
    before, after = capture.before[0], capture.after[0]
    counts = capture.after_counts()
    assert not ROPE_DECOMPOSED & set(counts), counts
    assert any(n.op == "call_function" and n.target in (torch.ops.aten.slice_backward.default,
                                                        torch.ops.aten.slice_scatter.default)
               for n in before.nodes)
    fused = [n for n in after.nodes if n.target == torch.ops.npu_fusion.rotary_position_embedding_grad.default]
    # x is passed exactly when cos/sin require grad, and then dcos/dsin are wired
    assert all((n.args[3] is not None) == cos_grad for n in fused)
    sites = [s for s in capture.results[0].sites if s.op == "rotary_position_embedding_grad"]  # the backward's
    assert all(set(s.outputs) == ({"dx", "dcos", "dsin"} if cos_grad else {"dx"}) for s in sites)
    assert_no_dead_nodes(after)


@pytest.mark.parametrize("variant", VARIANTS, ids="-".join)
@pytest.mark.parametrize("cos_grad", [False, True], ids=["cos_const", "cos_grad"])
def test_hf_rope_dynamic_batch_and_sequence(variant, cos_grad):
    inputs = rope_inputs(torch.float32, cos_grad=cos_grad)
    capture = compile_and_compare(hf_rope, inputs, dynamic_dims={0: (0, 2), 1: (0, 2), 2: (0, 1), 3: (0, 1)},
                                  partitioner=variant[0], decompositions=variant[1])
    graph = capture.after[0]
    placeholders = [n for n in graph.nodes if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.SymInt)]
    assert placeholders, "the backward graph should be symbolic"
    assert capture.fused(ROPE) == 2


class LlamaStyle(torch.nn.Module):
    def __init__(self, form, hidden, dtype):
        super().__init__()
        self.form = form
        if form == "llama":
            self.norm = LlamaRMSNorm(hidden, eps=1e-6)
        else:
            self.norm = torch.nn.RMSNorm(hidden, eps=1e-5)
        with torch.no_grad():
            self.norm.weight.normal_()
        self.to(dtype)

    def forward(self, x):
        if self.form == "functional":
            return F.rms_norm(x, (x.shape[-1],), self.norm.weight, eps=1e-5)
        return self.norm(x)


@pytest.mark.parametrize("variant", VARIANTS, ids="-".join)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("form", ["llama", "nn", "functional"])
def test_rms_norm_forms(variant, dtype, form):
    torch._dynamo.utils.counters.clear()
    model = LlamaStyle(form, 32, dtype)
    x = torch.randn(2, 5, 32, dtype=dtype, requires_grad=True)
    capture = compile_and_compare(model, [x], params=list(model.parameters()),
                                  partitioner=variant[0], decompositions=variant[1])
    assert capture.fused(RMS) == 1
    assert torch._dynamo.utils.counters[COUNTER][RMS] == 1
    counts = capture.after_counts()
    assert not {"pow", "mean", "rsqrt", "sum"} & set(counts), counts
    site = capture.results[0].sites[0]
    assert set(site.outputs) == {"dx", "dgamma"}
    assert_no_dead_nodes(capture.after[0])


@pytest.mark.parametrize("variant", VARIANTS, ids="-".join)
def test_rms_norm_dynamic_batch_and_sequence(variant):
    model = LlamaStyle("llama", 32, torch.bfloat16)
    x = torch.randn(3, 5, 32, dtype=torch.bfloat16, requires_grad=True)
    capture = compile_and_compare(model, [x], params=list(model.parameters()), dynamic_dims={0: (0, 1)},
                                  partitioner=variant[0], decompositions=variant[1])
    assert capture.fused(RMS) == 1


# -- near misses: these must stay unfused and still be right ---------------------------

def rope_wrong_sign(q, k, cos, sin):
    def rot(x):  # both halves negated: no mode, and no table negated as a whole, gives this
        x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
        return torch.cat((-x2, -x1), dim=-1)
    return q * cos.unsqueeze(1) + rot(q) * sin.unsqueeze(1), k * cos.unsqueeze(1) + rot(k) * sin.unsqueeze(1)


def rope_wrong_split(q, k, cos, sin):
    def rot(x):
        x1, x2 = x[..., :6], x[..., 6:]
        return torch.cat((-x2, x1), dim=-1)
    return q * cos.unsqueeze(1) + rot(q) * sin.unsqueeze(1), k * cos.unsqueeze(1) + rot(k) * sin.unsqueeze(1)


def rope_scaled_rotation(q, k, cos, sin):
    def rot(x):
        x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
        return torch.cat((-x2, x1), dim=-1)
    # the same op sequence as RoPE, but the rotated term is doubled
    return q * cos.unsqueeze(1) + 2 * rot(q) * sin.unsqueeze(1), k * cos.unsqueeze(1) + 2 * rot(k) * sin.unsqueeze(1)


@pytest.mark.parametrize("fn", [rope_wrong_sign, rope_wrong_split, rope_scaled_rotation])
@pytest.mark.parametrize("variant", VARIANTS[:2], ids="-".join)
def test_rope_near_misses_stay_unfused(fn, variant):
    capture = compile_and_compare(fn, rope_inputs(torch.float32), partitioner=variant[0],
                                  decompositions=variant[1])
    assert capture.fused(ROPE) == 0
    # the diagnostics name both near-miss sites (q and k) and why
    misses = [m for m in capture.misses() if m.op == ROPE]
    assert len(misses) == 2 and all("no mode's formula" in m.reason for m in misses)


class EpsOutsideSqrt(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(32))

    def forward(self, x):
        return self.weight * (x / (x.pow(2).mean(-1, keepdim=True).sqrt() + 1e-6))


class MeanNotSquared(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(32))

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.abs().mean(-1, keepdim=True) + 1e-6))


class NormOverWrongAxis(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(32))

    def forward(self, x):  # mean over the sequence axis, not the hidden one
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(1, keepdim=True) + 1e-6))


@pytest.mark.parametrize("cls", [EpsOutsideSqrt, MeanNotSquared, NormOverWrongAxis])
@pytest.mark.parametrize("variant", VARIANTS[:2], ids="-".join)
def test_rms_norm_near_misses_stay_unfused(cls, variant):
    model = cls()
    x = torch.randn(2, 5, 32, requires_grad=True)
    capture = compile_and_compare(model, [x], params=list(model.parameters()), partitioner=variant[0],
                                  decompositions=variant[1])
    assert capture.fused(RMS) == 0
    if cls is not NormOverWrongAxis:  # that one does not normalize the last axis at all
        misses = [m for m in capture.misses() if m.op == RMS]
        # eps outside the root is named as the program wrote it (the other near miss: terms that differ)
        expected = "eps is added outside the root" if cls is EpsOutsideSqrt else "terms differ"
        assert len(misses) == 1 and expected in misses[0].reason, misses


def test_inductor_decompositions_and_no_false_diagnostics():
    """Inductor's decomposition table (prims.convert_element_type, full + slice_scatter, decomposed
    softmax backward): every site fuses and softmax's backward is not reported as a near miss."""
    from torch._inductor.decomposition import select_decomp_table

    from npu_fusion.models import bundled

    model = bundled("llama", dtype=torch.bfloat16)
    torch._dynamo.reset()
    capture = Capture(decompositions=select_decomp_table())
    torch.compile(model.loss, backend=capture)(torch.randint(0, 128, (2, 16))).backward()
    results = capture.results
    seen = {getattr(n.target, "__name__", "") for n in capture.before[0].nodes}
    assert {"convert_element_type.default", "slice_scatter.default"} <= seen
    assert results[0].fused(RMS) == 5 and results[0].fused(ROPE) == 4
    assert results[0].misses == []


def test_routing_weight_normalization_is_not_a_near_miss():
    """DeepSeek-V3's MoE router divides top-k weights by their sum: no RMSNorm, no diagnostic."""
    def route(w):
        top = w.softmax(-1).topk(2, -1).values
        return top / (top.sum(-1, keepdim=True) + 1e-20)

    capture = compile_and_compare(route, [torch.randn(32, 8, requires_grad=True)])
    assert capture.fused(RMS) == 0 and capture.misses() == []
