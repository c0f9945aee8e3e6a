"""Tiny random models of torchtitan, torchtune and Megatron-core, compiled with the pass.

For each library's own model code: the RoPE, RMSNorm and SwiGLU sites an independent counter sees in an
eager step (checked against the architecture's own numbers), every one of them that ran inside a
compiled graph replaced by its fused op, and every parameter gradient within the float64
criterion (``assert_close_as_unfused``, factor 4). The CPU-only workarounds these libraries need
are in ``npu_fusion_testing.cpu_workarounds``.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

from npu_fusion_testing.frameworks import FRAMEWORKS, NORM, Framework, measure
from npu_fusion.measure.sites import SiteCounter

#: sites per eager step, from the architectures (2 layers): RoPE on q and k of each layer; norms
#: before attention and MLP of each layer and a final one, plus per-head q/k norms (Qwen3, Megatron
#: qk_layernorm), MLA's kv norm (DeepSeek-V3) or the post-norms of Gemma 2's sandwich
EXPECTED_SITES = {
    "torchtitan:llama3": (4, 5), "torchtitan:qwen3": (4, 9), "torchtitan:deepseek_v3": (4, 7),
    "torchtune:llama3": (4, 5), "torchtune:llama3_1": (4, 5), "torchtune:gemma": (4, 5),
    "torchtune:gemma2": (4, 9), "megatron:gpt": (4, 5), "megatron:gpt-interleaved-qknorm": (4, 9),
}
#: SwiGLU sites per eager step: Megatron's gated linear unit (one fc1 chunked in two) in each layer;
#: torchtitan's and torchtune's MLPs have separate gate and up projections (w1, w3): no site
SWIGLU_SITES = {name: 2 if name.startswith("megatron:") else 0 for name in EXPECTED_SITES}

#: forms the matchers do not fuse yet, by model: xfail(strict=True) with the reason, so that a fix
#: shows as XPASS (every model fuses every site as of the RoPE matcher reading select_backward and
#: a reshaped reduction as dy: torchtune's RoPE, DeepSeek-V3's single-head k_pe)
NOT_YET_FUSED = {}

#: bf16 for the models with bf16-specific forms (Qwen3's per-head norms with a bf16 gamma, Gemma 2's
#: sandwich norms), to keep the file short; NPU_FUSION_FRAMEWORKS_BF16=all runs every model in bf16
#: (benchmarks/framework_coverage.py always does)
BF16 = tuple(FRAMEWORKS) if os.environ.get("NPU_FUSION_FRAMEWORKS_BF16") == "all" else (
    "torchtitan:qwen3", "torchtune:gemma2")


def _cases():
    for name in FRAMEWORKS:
        for dtype in (torch.float32,) + ((torch.bfloat16,) if name in BF16 else ()):
            reason = NOT_YET_FUSED.get(name)
            marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
            yield pytest.param(name, dtype, marks=marks, id=f"{name}-{str(dtype)[6:]}")


def _library(framework):
    pytest.importorskip(framework.library)
    if framework.library == "torchtune":
        pytest.importorskip("torchao")  # torchtune imports it at import time


@pytest.mark.parametrize("name,dtype", list(_cases()))
def test_framework_model_fuses_every_site_in_compiled_graphs(name, dtype):
    framework = FRAMEWORKS[name]
    _library(framework)
    coverage = measure(framework, dtype)  # strict: an internal error of the pass raises
    assert not coverage.grad_failures, coverage.grad_failures
    rope, norm = coverage.sites["rope"], coverage.sites["rms_norm"]
    assert (rope.counted, norm.counted) == EXPECTED_SITES[name]
    assert coverage.sites["swiglu"].counted == SWIGLU_SITES[name]
    for sites in coverage.sites.values():  # every kind, forward ones too (their rules are on by default)
        assert sites.fused == sites.inside, (sites.op, sites.fused, sites.inside, sites.misses, sites.outside)
        assert sites.missed == 0 and sites.unexplained == 0


class _TwoNorms(torch.nn.Module):
    """Two RMSNorms; the second is called outside every compiled graph."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(128, 32)
        self.inner, self.eager = torch.nn.RMSNorm(32), torch.nn.RMSNorm(32)
        self.proj, self.head = torch.nn.Linear(32, 32), torch.nn.Linear(32, 128)

    def forward(self, ids):
        h = self.proj(self.inner(self.embed(ids)))
        return self.head(torch.compiler.disable(self.eager)(h))


def test_sites_that_ran_outside_compiled_graphs_are_named():
    framework = Framework("torch:two-norms", "torch", lambda layers: _TwoNorms(), lambda m, ids: m(ids),
                          lambda m: SiteCounter(m, modules={NORM: (torch.nn.RMSNorm,)}))
    coverage = measure(framework)
    norm = coverage.sites[NORM]
    assert not coverage.grad_failures, coverage.grad_failures
    assert (norm.counted, norm.outside, norm.fused, norm.unexplained) == (2, ["eager"], 1, 0)


def test_megatron_cpu_workarounds_are_undone():
    pytest.importorskip("megatron.core")
    from megatron.core import parallel_state, tensor_parallel

    from npu_fusion_testing.cpu_workarounds import cpu_workarounds_megatron

    before = (torch.cuda.current_device, tensor_parallel.get_cuda_rng_tracker)
    with cpu_workarounds_megatron():
        assert torch.cuda.current_device() == "cpu"
        assert parallel_state.model_parallel_is_initialized()
    assert (torch.cuda.current_device, tensor_parallel.get_cuda_rng_tracker) == before
    assert not parallel_state.model_parallel_is_initialized()
    assert not torch.distributed.is_initialized()


def test_harness_stays_out_of_the_package():
    """Importing npu_fusion, its backend, its pass, what it measures and the report loads nothing of
    the test harness (whose CPU workarounds patch torch and Megatron) and not hypothesis, though the
    harness is importable here (the repository root is on the path)."""
    code = ("import sys, npu_fusion, npu_fusion.plugin.backend, npu_fusion.plugin.pass_manager, npu_fusion.cli, "
            "npu_fusion.measure.recording, npu_fusion.measure.sites, npu_fusion.measure.grads, "
            "npu_fusion.report.command, npu_fusion.report.explanation, npu_fusion.report.fullsize, "
            "npu_fusion.report.html, npu_fusion_testing; "
            "print([m for m in sys.modules if m.startswith(('npu_fusion_testing.', 'hypothesis'))])")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # this checkout's package and harness
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root).stdout
    assert out.strip() == "[]"


def test_report_builds_a_framework_model_and_accounts_for_its_sites(capsys):
    pytest.importorskip("torchtune")
    pytest.importorskip("torchao")
    from npu_fusion_testing.report import main

    status = main(["report", "--framework", "torchtune:gemma", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert status == 0 and report["gradients"]["passed"]
    for op, count in zip(("rotary_position_embedding_grad", "rms_norm_grad"), EXPECTED_SITES["torchtune:gemma"]):
        sites = report["accounting"][op]
        assert sites["expected"] == report["ops"][op]["expected"] == count
        assert (sites["fused"], sites["missed"], sites["outside"], sites["unexplained"]) == (count, 0, 0, 0)


def test_every_site_fuses_on_950():
    """Ascend 950 runs RotaryPositionEmbeddingGrad and RmsNormGrad: every site inside the compiled
    graph fuses, gradients by the float64 criterion."""
    framework = FRAMEWORKS["torchtune:gemma"]
    _library(framework)
    coverage = measure(framework, target="950")
    assert not coverage.grad_failures, coverage.grad_failures
    rope, norm = coverage.sites["rope"], coverage.sites["rms_norm"]
    assert (rope.fused, rope.counted) == (4, 4)
    assert (norm.fused, norm.missed, norm.unexplained, norm.counted) == (5, 0, 0, 5)


def test_sites_a_target_refuses_are_recorded_misses():
    """A float64 model on Ascend 950: RotaryPositionEmbeddingGrad takes no float64, so every RoPE
    site inside the compiled graph is a recorded miss naming the dtype, none unexplained (the norms
    compute their statistic in float32 and fuse)."""
    framework = FRAMEWORKS["torchtune:gemma"]
    _library(framework)
    coverage = measure(framework, dtype=torch.float64, target="950")
    assert not coverage.grad_failures, coverage.grad_failures
    rope = coverage.sites["rope"]
    assert (rope.fused, rope.missed, rope.unexplained, rope.counted) == (0, 4, 0, 4)
    assert all("dtype torch.float64" in m for m in rope.misses), rope.misses
