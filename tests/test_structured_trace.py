"""The pass in PyTorch's structured trace: with ``TORCH_TRACE=<dir>`` its decisions and the
backward graph before and after it are artifacts of the backward's compile, where ``tlparse``
shows them beside AOTAutograd's. Read from the raw trace files of a fresh process (the trace
is set up when torch is imported)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from test_logging import run_script

pytestmark = pytest.mark.smoke


def read_trace(directory: Path) -> list:
    """Every structured-trace entry of the run: (metadata dict, payload text)."""
    entries = []
    for path in sorted(directory.glob("*.log")):
        for line in path.read_text().splitlines():
            if line.startswith("\t") and entries:  # payload lines follow their entry, tab-indented
                meta, payload = entries[-1]
                entries[-1] = (meta, payload + line[1:] + "\n")
            elif "] {" in line:
                entries.append((json.loads(line[line.index("] {") + 2:]), ""))
    return entries


def artifacts(entries, name) -> list:
    return [(meta, payload) for meta, payload in entries if meta.get("artifact", {}).get("name") == name]


def compile_id(meta) -> tuple:
    return meta.get("frame_id"), meta.get("frame_compile_id"), meta.get("attempt")


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    directory = tmp_path_factory.mktemp("torch_trace")
    run_script(TORCH_TRACE=str(directory))
    return read_trace(directory)


def test_decisions_list_sites_and_misses_with_reasons(trace):
    (meta, payload), = artifacts(trace, "npu_fusion_decisions")
    assert meta["artifact"]["encoding"] == "json"
    decisions = json.loads(payload)
    assert decisions["target"] == "a2"
    # each norm fused both ways (the forward rules are on by default), the rotations refused by A2
    assert sorted(site["op"] for site in decisions["sites"]) == ["rms_norm"] * 3 + ["rms_norm_grad"] * 3
    assert all(site["inputs"].keys() == ({"dy", "x", "rstd", "gamma"} if site["op"] == "rms_norm_grad"
                                         else {"x", "gamma"}) for site in decisions["sites"])
    misses = decisions["misses"]
    assert sorted(miss["op"] for miss in misses) == ["rotary_position_embedding"] * 2 + [
        "rotary_position_embedding_grad"] * 2
    assert all("950" in miss["reason"] and miss["node"] for miss in misses)
    assert decisions["nodes_after"] < decisions["nodes_before"] and decisions["error"] is None


def test_graphs_before_and_after_the_pass(trace):
    (_, before), = artifacts(trace, "npu_fusion_backward_before")
    (_, after), = artifacts(trace, "npu_fusion_backward_after")
    assert "aten.pow.Tensor_Scalar" in before and "npu_fusion.rms_norm_grad" not in before
    assert after.count("torch.ops.npu_fusion.rms_norm_grad.default(") == 3
    assert "def forward(self" in before and "def forward(self" in after


def test_artifacts_belong_to_the_backward_compile(trace):
    """Same compile id as AOTAutograd's backward graph: tlparse puts them on that compile's page."""
    (backward_meta, _), = [(m, p) for m, p in trace if "aot_backward_graph" in m]
    ours = [meta for name in ("npu_fusion_backward_before", "npu_fusion_backward_after", "npu_fusion_decisions")
            for meta, _ in artifacts(trace, name)]
    assert len(ours) == 3
    assert {compile_id(meta) for meta in ours} == {compile_id(backward_meta)}
    assert compile_id(backward_meta)[0] is not None
