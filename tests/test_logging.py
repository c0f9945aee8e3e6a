"""Logging through torch._logging (TORCH_LOGS) and the backward-graph dumps, each in a fresh
process since TORCH_LOGS is read when torch is imported."""
import logging
import os
import subprocess
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# one layer of the DeepSeek-style model on A2: RMSNorm sites fuse, the mode-3 RoPE sites are misses
SCRIPT = """
import torch
from npu_fusion.models import bundled
model = bundled("deepseek", 1)
ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
step = torch.compile(lambda i: model.loss(i), backend="npu_fusion", options={"target": "a2"})
step(ids).backward()
print("step done")
"""


def run_script(**env_extra):
    env = {k: v for k, v in os.environ.items() if k not in ("TORCH_LOGS", "NPU_FUSION_DUMP_GRAPHS")}
    env.update(env_extra)
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step done" in proc.stdout
    return proc.stderr


def test_torch_logs_info_shows_fused_and_unfused_sites():
    err = run_script(TORCH_LOGS="npu_fusion")
    fused = [line for line in err.splitlines() if "npu_fusion: fused rms_norm_grad" in line]
    unfused = [line for line in err.splitlines()
               if "npu_fusion: left rotary_position_embedding_grad at " in line and " unfused: " in line]
    assert len(fused) == 3, err[-3000:]
    assert len(unfused) == 2 and all("950" in line for line in unfused), err[-3000:]
    # the forward rules (on by default) log their sites the same way: each norm's forward fused,
    # each rotation's forward refused by the chip as its backward is
    fused_forward = [line for line in err.splitlines() if "npu_fusion: fused rms_norm (" in line]
    unfused_forward = [line for line in err.splitlines()
                       if "npu_fusion: left rotary_position_embedding at " in line and " unfused: " in line]
    assert len(fused_forward) == 3 and len(unfused_forward) == 2, err[-3000:]
    assert all("950" in line for line in unfused_forward), err[-3000:]
    assert "npu_fusion: joint graph " in err and "6 fused" in err and "4 left unfused" in err
    assert "modelled bytes" not in err  # debug detail only with +npu_fusion
    assert "class GraphModule" not in err  # no dump unless asked for


def test_torch_logs_debug_adds_site_detail():
    err = run_script(TORCH_LOGS="+npu_fusion")
    detail = [line for line in err.splitlines() if "modelled bytes" in line]
    assert len(detail) == 6 and all("fused-op minimum" in line for line in detail), err[-3000:]  # 3 norms, both ways


def test_dump_env_var_dumps_the_graph_before_and_after_without_torch_logs():
    err = run_script(NPU_FUSION_DUMP_GRAPHS="1")
    before = err.find("npu_fusion: joint graph before the pass")
    after = err.find("npu_fusion: joint graph after the pass")
    assert 0 <= before < after, err[-3000:]
    assert "aten.pow.Tensor_Scalar" in err[before:after]
    assert "npu_fusion.rms_norm_grad.default" in err[after:]
    assert "npu_fusion.rms_norm_grad.default" not in err[before:after]
    assert "npu_fusion: fused" not in err  # matches stay at INFO, which is off without TORCH_LOGS


def test_dump_graphs_option(monkeypatch):
    """The option alone dumps, with the npu_fusion log at its default level (WARNING)."""
    monkeypatch.delenv("NPU_FUSION_DUMP_GRAPHS", raising=False)
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    log = logging.getLogger("npu_fusion")
    handler = Keep(logging.DEBUG)
    log.addHandler(handler)
    try:
        def f(x, w):
            return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))

        torch._dynamo.reset()
        compiled = torch.compile(f, backend="npu_fusion", options={"dump_graphs": True, "target": "a2"})
        x, w = torch.randn(4, 16, requires_grad=True), torch.randn(16, requires_grad=True)
        compiled(x, w).sum().backward()
    finally:
        log.removeHandler(handler)
    if log.isEnabledFor(logging.INFO):  # TORCH_LOGS set for the test run: matches are logged too
        records = [r for r in records if "joint graph" in r and "the pass" in r]
    assert len(records) == 2, records
    assert records[0].startswith("npu_fusion: joint graph before the pass") and "aten.pow" in records[0]
    assert records[1].startswith("npu_fusion: joint graph after the pass")
    assert "npu_fusion.rms_norm_grad.default" in records[1]
