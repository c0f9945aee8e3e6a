"""``npu_fusion.explain`` on code written here (not a bundled model): its report against an
independent count of the sites, its gradient check, its text, and its JSON against the command line's."""
import argparse
import json
import sys

import pytest
import torch
import torch.nn.functional as F

import npu_fusion
from npu_fusion.models import bundled
from npu_fusion.report import command as report
from npu_fusion.lowering import RMS_NORM_GRAD, ROPE_GRAD
from npu_fusion.measure.sites import SiteCounter

ROPE, RMS = ROPE_GRAD.name, RMS_NORM_GRAD.name


class UserRMSNorm(torch.nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.scale = torch.nn.Parameter(1 + 0.1 * torch.randn(dim))

    def forward(self, x):
        return self.scale * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


def rotate(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin):
    return q * cos + rotate(q) * sin, k * cos + rotate(k) * sin


class UserBlock(torch.nn.Module):
    """Pre-norm attention and MLP, the way a user might write one."""

    def __init__(self, dim=32, heads=2):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.norm1, self.norm2 = UserRMSNorm(dim), UserRMSNorm(dim)
        self.qkv, self.out = torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 2 * dim), torch.nn.SiLU(), torch.nn.Linear(2 * dim, dim))

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, self.heads, self.head_dim).transpose(1, 2) for t in self.qkv(self.norm1(x)).chunk(3, -1))
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        attention = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(attention.transpose(1, 2).reshape(b, s, -1))
        return x + self.mlp(self.norm2(x))


class UserModel(torch.nn.Module):
    def __init__(self, layers=2, dim=32, heads=2):
        super().__init__()
        self.project = torch.nn.Linear(dim, dim)  # features in: the first norm's input takes a gradient
        self.blocks = torch.nn.ModuleList(UserBlock(dim, heads) for _ in range(layers))
        self.norm = UserRMSNorm(dim)
        inv_freq = 1.0 / 10000 ** (torch.arange(0, dim // heads, 2).float() / (dim // heads))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x):
        angles = torch.arange(x.shape[1], dtype=x.dtype)[:, None] * self.inv_freq.to(x.dtype)
        emb = torch.cat((angles, angles), -1)
        cos, sin = emb.cos(), emb.sin()
        x = self.project(x)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.norm(x)


def count_sites(model, *inputs):
    """The test's own count: its norm class and its RoPE function, by hooks on an eager step."""
    with SiteCounter(model, modules={RMS_NORM_GRAD.option: (UserRMSNorm,)},
                     functions={ROPE_GRAD.option: [(sys.modules[__name__], "apply_rotary_pos_emb")]}) as c:
        model(*inputs).sum().backward()
    model.zero_grad(set_to_none=True)
    return c.counts


def test_explain_a_user_module_against_an_independent_count():
    torch.manual_seed(0)
    model, x = UserModel(layers=2), torch.randn(2, 8, 32)
    counted = count_sites(model, x)
    assert counted == {ROPE: 4, RMS: 5}  # 2 RoPE (q, k) and 2 norms per block, one final norm

    explained = npu_fusion.explain(model, x, loss=lambda y: y.pow(2).mean(), target="generic")
    r = explained.report
    for op, n in counted.items():
        assert r["ops"][op]["expected"] == n and r["ops"][op]["fused"] == n and r["ops"][op]["unfused"] == 0
        assert r["accounting"][op]["unexplained"] == 0 and r["accounting"][op]["outside"] == 0
    assert r["ops"][ROPE]["modes"] == {"half": 4}
    assert r["misses"] == [] and r["pass_errors"] == []
    assert r["op_counts"]["after"]["npu_fusion.rms_norm_grad.default"] == counted[RMS]
    # the forward rules (on by default) count the same sites, each fused too
    for op, backward in (("rms_norm", RMS), ("rotary_position_embedding", ROPE)):
        assert r["ops"][op]["expected"] == r["ops"][op]["fused"] == counted[backward], r["ops"][op]
    assert r["op_counts"]["nodes_after"] < r["op_counts"]["nodes_before"]
    # every parameter's gradient was checked against float64, and the user's model was not replaced
    assert r["gradients"]["passed"] and r["gradients"]["per_dtype"]["float32"]["params"] == len(list(model.parameters()))
    assert explained.passed and all(p.grad is None for p in model.parameters())

    text = str(explained)
    assert "rms_norm_grad: all 5 sites fused" in text and "inputs float32[2, 8, 32]" in text
    assert "## Saved for the backward" in text and r["saved_activations"]["graphs"] == r["backward_graphs"] == 1
    assert json.loads(explained.to_json()) == explained.to_dict()
    # each site is placed in the module that made it, on the page as in the data
    assert sorted(s["module"] for s in r["sites"] if s["op"] == RMS) == [
        "blocks.0.norm1", "blocks.0.norm2", "blocks.1.norm1", "blocks.1.norm2", "norm"]
    page = explained.to_html()
    assert page.count("<tr class='fused'>") == 2 * 9 and "blocks.1.norm2" in page and "layer 1" in page
    assert "<span class='ok'>PASSED</span>" in page


def test_explain_a_function_names_the_chip_refusal():
    """A plain function: its inputs that require grad are checked; head_dim 960 is past A2's D < 896."""
    torch.manual_seed(0)
    q, k = (torch.randn(1, 2, 4, 960, requires_grad=True) for _ in range(2))
    cos, sin = torch.randn(1, 1, 4, 960), torch.randn(1, 1, 4, 960)
    on_a2 = npu_fusion.explain(apply_rotary_pos_emb, q, k, cos, sin, target="a2")
    assert on_a2.fused(ROPE) == 0 and on_a2.report["ops"][ROPE]["unfused"] == 2
    assert all("896" in m["reason"] for m in on_a2.report["misses"])
    assert on_a2.report["ops"][ROPE]["expected"] == 2 and on_a2.passed
    generic = npu_fusion.explain(apply_rotary_pos_emb, q, k, cos, sin, target="generic")
    assert generic.fused(ROPE) == 2 and generic.passed
    assert generic.report["gradients"]["per_dtype"]["float32"]["params"] == 2  # q and k
    assert q.grad is None


def test_explain_serializes_like_the_command_line():
    """The bundled model through explain() and through ``npu-fusion report --json``: the same report
    (explain adds where each counted site ended, as the command line does for ``--framework``)."""
    parser = argparse.ArgumentParser()
    report.add_arguments(parser)
    cli = report.collect(parser.parse_args(["--layers", "1", "--target", "generic"]))
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    model = bundled("llama", 1)
    mine = npu_fusion.explain(model, ids, loss=lambda logits: F.cross_entropy(
        logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten()), target="generic").to_dict()
    assert set(mine) == set(cli) | {"accounting"} and set(mine["settings"]) == set(cli["settings"]) | {"inputs"}
    for key in ("misses", "sites", "memory_traffic", "backward_graphs", "pass_errors"):
        assert mine[key] == cli[key], key
    # the backward ops match; the graphs the pass ran on are joint ones, whose forward part holds
    # each caller's own loss (the test's casts its logits)
    assert {k: v for k, v in mine["op_counts"].items() if not k.startswith("nodes_")} == \
           {k: v for k, v in cli["op_counts"].items() if not k.startswith("nodes_")}
    for op in (ROPE, RMS):
        assert {k: v for k, v in mine["ops"][op].items() if k != "expected"} == \
               {k: v for k, v in cli["ops"][op].items() if k != "expected"}
    assert mine["gradients"]["loss"] == pytest.approx(cli["gradients"]["loss"])


def test_a_norm_on_an_input_without_gradient_is_accounted_for():
    """Once a known silent miss: the first norm's backward computes only dgamma. It fuses now
    (rms_norm_grad with only its dgamma output used), and the gradients pass the check."""
    torch.manual_seed(0)
    model, x = UserModel(layers=1), torch.randn(2, 8, 32)
    model.project = torch.nn.Identity()  # the first norm now reads the input, which needs no gradient
    r = npu_fusion.explain(model, x, target="generic").report
    assert r["accounting"][RMS]["expected"] == 3
    assert r["accounting"][RMS]["unexplained"] == 0
    assert r["accounting"][RMS]["fused"] == 3
    assert r["gradients"]["passed"], r["gradients"]
    assert sum(set(s["outputs"]) == {"dgamma"} for s in r["sites"] if s["op"] == RMS) == 1


# -- accounting: each counted site recorded once, forward and backward (issue 30) ---------------

class CenteredRMSNorm(torch.nn.Module):
    """An RMSNorm of the centred value (a LayerNorm without bias spelled as an RMSNorm)."""

    def __init__(self, dim):
        super().__init__()
        self.weight = torch.nn.Parameter(1 + 0.1 * torch.randn(dim))

    def forward(self, x):
        xf = x.float()
        c = xf - xf.mean(-1, keepdim=True)
        return self.weight * (c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)


class WholeRMSNorm(torch.nn.Module):
    """``F.rms_norm``: a whole ``aten._fused_rms_norm`` the joint graph decomposes."""

    def __init__(self, dim):
        super().__init__()
        self.weight = torch.nn.Parameter(1 + 0.1 * torch.randn(dim))

    def forward(self, x):
        return F.rms_norm(x, (x.shape[-1],), self.weight, 1e-6)


class ResidualNorms(torch.nn.Module):
    """Two residual layers ``x + norm(linear(x))``; explain compiles the loss with them, so the
    first norm's dy is the loss's gradient plus the second layer's (a dy of several terms)."""

    def __init__(self, norm, dim=32, checkpointed=False):
        super().__init__()
        self.checkpointed = checkpointed
        self.linears = torch.nn.ModuleList(torch.nn.Linear(dim, dim) for _ in range(2))
        self.norms = torch.nn.ModuleList(norm(dim) for _ in range(2))

    def forward(self, x):
        for linear, norm in zip(self.linears, self.norms):
            layer = lambda t, linear=linear, norm=norm: norm(linear(t))  # noqa: E731
            x = x + (torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False) if self.checkpointed
                     else layer(x))
        return x


@pytest.mark.parametrize("norm, dtype, checkpointed", [
    (CenteredRMSNorm, torch.float32, False), (CenteredRMSNorm, torch.bfloat16, True),
    (UserRMSNorm, torch.float32, False), (WholeRMSNorm, torch.bfloat16, False)],
    ids=["centred-fp32", "centred-bf16-checkpointed", "decomposed-fp32", "whole-bf16"])
def test_each_norm_is_fused_forward_and_backward_and_counted_once(norm, dtype, checkpointed):
    """Once a silent forward miss and a double count: the centred norm's forward matched no form and
    no scan saw it (its statistic is of a centred square), and the first layer's norm, whose dy sums
    two gradients, matched no backward form and was recorded as two misses (its dx and its dgamma),
    -1 unexplained. Each norm now fuses both ways; the accounting is exact and the gradients pass
    the float64 check."""
    torch.manual_seed(0)
    model, x = ResidualNorms(norm, checkpointed=checkpointed).to(dtype), torch.randn(2, 8, 32, dtype=dtype)
    r = npu_fusion.explain(model, x, target="generic").report
    for op in (RMS, "rms_norm"):
        assert r["accounting"][op] == {"expected": 2, "fused": 2, "missed": 0, "outside": 0, "unexplained": 0,
                                       "outside_paths": []}, (op, r["accounting"][op], r["misses"])
        assert r["ops"][op]["found"] == r["ops"][op]["fused"] == 2
    assert r["misses"] == [] and r["pass_errors"] == []
    assert r["gradients"]["passed"], r["gradients"]
