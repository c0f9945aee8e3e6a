"""The decision digest (``benchmarks/decision_digest.py``): two runs of the pass on the same programs
write the same digest, and comparing two digests finds every changed decision.

A few programs only (a near miss and a backward graph of the FX corpus, a dynamic-shape inference
graph through the backend): the whole set is the benchmark's to run, before and after a change."""
import copy
import io
import json

import pytest

from benchmarks import decision_digest

SUBSET = ("corpus/near_miss_norm_axis", "corpus/llama_fp32_backward", "backend/llama/dynamic/infer")


@pytest.fixture(scope="module")
def two_runs():
    return decision_digest.digest(SUBSET), decision_digest.digest(SUBSET)


def test_two_runs_of_the_pass_write_the_same_digest(two_runs):
    first, second = two_runs
    assert sorted(first["programs"]) == sorted(SUBSET)
    assert not [name for name, p in first["programs"].items() if "error" in p], first["programs"]
    assert first["programs"] == second["programs"]
    graphs = [g for p in first["programs"].values() for g in p["graphs"]]
    assert {g["graph"] for g in graphs} == {"joint", "backward", "inference"}
    assert all(site["fused"] for g in graphs for site in g["sites"])  # each site names its fused call
    assert any(g["misses"] for g in graphs) and any(g["sites"] for g in graphs)
    dynamic = first["programs"]["backend/llama/dynamic/infer"]["graphs"][0]
    assert any("s" in text.split("[")[1] for text in dynamic["values"].values() if "[" in text)  # symbolic sizes


def _written(tmp_path, name, made):
    path = tmp_path / name
    path.write_text(json.dumps(made))
    return str(path)


def test_compare_prints_each_changed_decision(two_runs, tmp_path):
    first, _ = two_runs
    changed = copy.deepcopy(first)
    near_miss = changed["programs"]["corpus/near_miss_norm_axis"]["graphs"][0]
    near_miss["misses"][0]["reason"] += " (changed)"
    backward = changed["programs"]["corpus/llama_fp32_backward"]["graphs"][0]
    backward["sites"].pop()
    backward["code"] = backward["code"].replace("torch.ops.aten.", "torch.ops.aten_", 1)
    a, b = _written(tmp_path, "a.json", first), _written(tmp_path, "b.json", changed)

    printed = io.StringIO()
    assert decision_digest.compare(a, a, printed) == 0
    assert printed.getvalue().startswith("0 difference(s)")

    printed = io.StringIO()
    assert decision_digest.compare(a, b, printed) == 1
    text = printed.getvalue()
    assert "/corpus/near_miss_norm_axis/graphs[0]/misses[0]/reason" in text
    assert "/corpus/llama_fp32_backward/graphs[0]/sites: 5 -> 4 items" in text
    assert "+" in text and "torch.ops.aten_" in text  # the code's changed line, as a diff
    assert text.rstrip().splitlines()[-1].startswith("3 difference(s)")
