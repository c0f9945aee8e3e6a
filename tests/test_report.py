"""``npu-fusion report``: every figure it prints comes from the compiled graphs and the
pass's results, for the bundled models, a transformers model, and on the command line."""
import argparse
import collections
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from npu_fusion import cli
from npu_fusion.models import bundled
from npu_fusion.measure.grads import compare_gradients
from npu_fusion.measure.recording import Recorder
from npu_fusion.plugin.options import FusionOptions, forward_ops
from npu_fusion.report import analysis
from npu_fusion.report import command as report
from npu_fusion.report.text import format_text

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROPE, RMS = "rotary_position_embedding_grad", "rms_norm_grad"


def parse(*argv):
    parser = argparse.ArgumentParser()
    report.add_arguments(parser)
    return parser.parse_args(list(argv))


def run_json(capsys, *argv):
    """``report.run`` in this process with ``--json``: (exit status, parsed output, stderr)."""
    status = report.run(parse("--json", *argv))
    out, err = capsys.readouterr()
    return status, json.loads(out), err


@pytest.fixture(scope="module")
def llama_one_layer():
    return report.collect(parse("--layers", "1"))


def test_llama_every_site_fused_and_gradients_close(llama_one_layer):
    r = llama_one_layer
    expected = bundled("llama", 1).expected_sites
    for op, count in expected.items():
        assert r["ops"][op] == {"found": count, "fused": count, "unfused": 0, "expected": count,
                                "modes": {"half": count} if op == ROPE else {"-": count} if count else {}}
    assert r["misses"] == [] and r["pass_errors"] == [] and r["accounting_errors"] == []
    assert r["backward_graphs"] == 1

    # op counts are the graph's: the decomposed backward before, the fused ops after
    before, after = r["op_counts"]["before"], r["op_counts"]["after"]
    for name in ("aten.slice_backward.default", "aten.neg.default", "aten.pow.Tensor_Scalar"):
        assert before.get(name, 0) > 0, name
    assert after.get("aten.neg.default", 0) == 0 and after.get("aten.pow.Tensor_Scalar", 0) == 0
    assert after["npu_fusion.rms_norm_grad.default"] == expected[RMS]
    assert after[f"npu_fusion.{ROPE}.default"] == expected[ROPE]
    assert "npu_fusion.rms_norm_grad.default" not in before
    assert r["op_counts"]["nodes_after"] < r["op_counts"]["nodes_before"]

    # memory traffic is the sum over the pass's sites (of the ops with sites: Llama's MLP has no SwiGLU)
    for op in (op for op, count in expected.items() if count):
        sites = [s for s in r["sites"] if s["op"] == op]
        traffic = r["memory_traffic"][op]
        assert traffic["sites"] == len(sites) == expected[op]
        for key in ("bytes_before", "bytes_after", "bytes_minimum"):
            assert traffic[key] == sum(s[key] for s in sites) > 0
        assert traffic["bytes_minimum"] <= traffic["bytes_after"] < traffic["bytes_before"]

    g = r["gradients"]
    assert g["passed"] and not g["failures"]
    row = g["per_dtype"]["float32"]
    assert row["params"] == len(list(bundled("llama", 1).parameters()))
    assert row["as_close_to_fp64_as_eager"]
    assert row["max_abs_diff_vs_eager"] <= 1e-4
    assert abs(g["loss"]["compiled"] - g["loss"]["eager"]) < 1e-5


def test_text_output_shows_the_tables(llama_one_layer):
    text = format_text(llama_one_layer)
    for heading in ("## Fused ops", "## Left unfused", "## Backward graph ops", "## Modelled memory traffic",
                    "## Parameter gradients"):
        assert heading in text
    assert "rms_norm_grad: all 3 sites fused" in text
    assert f"{ROPE}: all 2 sites fused" in text
    assert "swiglu_grad: no sites in this model" in text  # the bundled Llama's MLP has separate projections
    assert "gradient check: PASSED" in text
    assert "| npu_fusion.rms_norm_grad.default" in text


def share_printed(text: str) -> float:
    """The pass's share of the compile as the text prints it, as a fraction."""
    match = re.search(r"the pass's share of the compile: ([0-9.]+)% of the CPU time", text)
    assert match, text[:600]
    return float(match.group(1)) / 100


def test_the_pass_share_of_the_compile_is_printed(llama_one_layer):
    """The pass's own CPU time over the compiled step's (the recorder's copies left out): a fraction
    of it, in the report's data and in its text, and the pass's CPU time is its results' own."""
    seconds = llama_one_layer["seconds"]
    assert 0 < seconds["pass_share"] < 1, seconds
    assert 0 < seconds["pass_cpu"] < seconds["step_cpu"], seconds
    assert seconds["pass_share"] == pytest.approx(seconds["pass_cpu"] / seconds["step_cpu"])
    assert share_printed(format_text(llama_one_layer)) == pytest.approx(seconds["pass_share"], abs=6e-4)


def test_deepseek_on_a2_leaves_rope_unfused_with_the_reason(capsys):
    status, r, err = run_json(capsys, "--model", "deepseek", "--target", "a2", "--layers", "1")
    assert status == 0
    assert r["settings"]["resolved_target"] == "a2"
    assert r["ops"][ROPE]["fused"] == 0
    assert r["ops"][ROPE]["unfused"] == r["ops"][ROPE]["expected"] == 2
    assert r["ops"][RMS]["fused"] == 3
    rope_misses = [m for m in r["misses"] if m["op"] == ROPE]
    assert len(rope_misses) == 2
    for miss in rope_misses:
        assert "950" in miss["reason"] and miss["node"]
    assert r["op_counts"]["after"].get(f"npu_fusion.{ROPE}.default", 0) == 0
    assert "compiling" in err and "backward" in err
    text = format_text(r)
    assert "0 of 2 sites fused" in text
    assert rope_misses[0]["node"] in text and "Ascend 950" in text


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_950_fuses_every_norm_both_ways(capsys, dtype):
    """``npu-fusion report --target 950``: Ascend 950 runs RmsNorm and RmsNormGrad, so every norm of
    the bundled Llama fuses forward and backward, every rotation too, gradients by the float64
    criterion, nothing left unfused."""
    status, r, _ = run_json(capsys, "--target", "950", "--layers", "1", "--dtype", dtype)
    assert status == 0 and r["settings"]["resolved_target"] == "950"
    for op, count in bundled("llama", 1).expected_sites.items():
        assert (r["ops"][op]["fused"], r["ops"][op]["unfused"]) == (count, 0), (op, r["ops"][op])
    for op in forward_ops():  # the forward rules, on by default (SwiGLU's: no site in Llama's MLP)
        assert r["ops"][op]["fused"] == r["ops"][op]["expected"] and r["ops"][op]["unfused"] == 0
        assert r["ops"][op]["expected"] > 0 or op == "swiglu"
    assert r["misses"] == [] and r["pass_errors"] == [] and r["gradients"]["passed"]
    text = format_text(r)
    assert "rms_norm_grad: all 3 sites fused" in text and "rms_norm: all 3 sites fused" in text


def test_bfloat16_dynamic_min_cut(capsys):
    status, r, _ = run_json(capsys, "--dtype", "bfloat16", "--dynamic", "--partitioner", "min_cut",
                            "--layers", "1", "--target", "generic")
    assert status == 0
    assert r["settings"]["dynamic"] and r["settings"]["partitioner"] == "min_cut"
    for op, count in bundled("llama", 1).expected_sites.items():
        assert r["ops"][op]["fused"] == count
    row = r["gradients"]["per_dtype"]["bfloat16"]
    assert row["as_close_to_fp64_as_eager"]


@pytest.mark.parametrize("target", ["a2", "950"])
def test_dynamic_batch_and_sequence_fuse_every_site_on_each_chip(capsys, target):
    """``--dynamic`` marks batch and sequence with ``mark_dynamic``: on A2 RoPE's ``B < 1000`` is kept
    under a guard (the mark forbids only a guard that pins the batch to one value; every RoPE site was a
    recorded miss), and on the 950 RMSNorm fuses over the symbolic leading axes; every site fuses both
    ways with gradients by the float64 criterion."""
    status, r, _ = run_json(capsys, "--dynamic", "--layers", "1", "--target", target)
    assert status == 0 and r["settings"]["dynamic"] and r["misses"] == []
    for op, count in bundled("llama", 1).expected_sites.items():
        assert r["ops"][op]["fused"] == count, (op, r["ops"][op])
    assert r["gradients"]["passed"]


def test_transformers_model_counted_independently(capsys):
    pytest.importorskip("transformers")
    status, r, _ = run_json(capsys, "--hf", "llama", "--layers", "1")
    assert status == 0
    assert r["settings"]["source"] == "transformers"
    # expected counts come from hooks on the eager run, not from the pass
    assert r["ops"][RMS]["expected"] == 3 and r["ops"][ROPE]["expected"] == 2
    assert r["ops"][RMS]["fused"] == 3 and r["ops"][ROPE]["fused"] == 2
    assert r["gradients"]["passed"]


@pytest.mark.parametrize("argv", [("--checkpointing", "full"), ("--checkpointing", "selective"),
                                  ("--compiled-autograd",), ("--hf", "llama", "--checkpointing", "full")],
                         ids=["full", "selective", "compiled-autograd", "transformers-full"])
def test_checkpointing_and_compiled_autograd(capsys, argv):
    if "--hf" in argv:
        pytest.importorskip("transformers")
    status, r, _ = run_json(capsys, "--layers", "1", "--target", "generic", *argv)
    assert status == 0 and not r["pass_errors"]
    # the expected counts are the forward's (a checkpointed forward running again is not counted)
    assert r["ops"][RMS]["expected"] == 3 and r["ops"][ROPE]["expected"] == 2
    assert r["ops"][RMS]["fused"] == 3 and r["ops"][ROPE]["fused"] == 2
    assert not r["misses"] and r["gradients"]["passed"]


def test_unknown_transformers_model_is_a_usage_error(capsys):
    pytest.importorskip("transformers")
    assert report.run(parse("--hf", "no_such_model_type")) == report.EXIT_USAGE
    assert "does not know the model type" in capsys.readouterr().err


def test_gradient_check_detects_a_wrong_gradient():
    torch.manual_seed(0)
    exact = {"w": torch.randn(8, 8, dtype=torch.float64)}
    eager = {"w": exact["w"].float()}
    good = compare_gradients({"w": eager["w"].clone()}, eager, exact)
    assert good["passed"] and good["per_dtype"]["float32"]["max_abs_diff_vs_eager"] == 0.0
    wrong = eager["w"].clone()
    wrong[3, 4] += 0.01
    bad = compare_gradients({"w": wrong}, eager, exact)
    assert not bad["passed"] and bad["failures"][0]["param"] == "w"
    assert not bad["per_dtype"]["float32"]["as_close_to_fp64_as_eager"]
    assert not compare_gradients({}, eager, exact)["passed"]  # a missing gradient fails too


def test_exit_status_follows_the_gradient_check(monkeypatch, capsys, llama_one_layer):
    failed = json.loads(json.dumps(llama_one_layer))
    failed["gradients"]["passed"] = False
    monkeypatch.setattr(report, "collect", lambda args, sources=(): failed)
    assert cli.main(["report"]) == report.EXIT_GRADIENTS
    assert "gradient check: FAILED" in capsys.readouterr().out
    failed["pass_errors"] = ["RuntimeError: boom"]
    assert cli.main(["report", "--json"]) == report.EXIT_PASS_ERROR
    failed["pass_errors"], failed["gradients"]["passed"] = [], True
    failed["accounting_errors"] = ["backward graph 0: the pass recorded 9 fused and 0 unfused sites, but ..."]
    assert cli.main(["report"]) == report.EXIT_ACCOUNTING
    out, err = capsys.readouterr()
    assert "ACCOUNTING ERROR" in out and "accounting error: backward graph 0: the pass recorded 9" in err


def rms_norm_loss(x, w):
    h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    return ((h * w).sum(),)  # a tuple, as Dynamo hands graphs to a backend


def test_accounting_disagrees_while_a_compiled_graph_has_not_run():
    """AOTAutograd partitions (and the pass runs) when the graph is compiled: until the compiled
    function runs, the pass's fused site has run 0 times, which the accounting reports; one run
    (called directly, without Dynamo) is counted by the graph's own code."""
    x, w = torch.randn(2, 5, 32, requires_grad=True), torch.randn(32, requires_grad=True)
    # the backward alone: with the forward rule on, the norm's forward (dgamma left to the program)
    # is one more site, a recorded miss, in the message
    recorder = Recorder(FusionOptions.from_mapping({"target": "generic", "rms_norm_forward": False}))
    compiled = recorder(torch.fx.symbolic_trace(rms_norm_loss), [x, w])
    (result,) = recorder.results
    assert result.fused(RMS) == 1 and recorder.runs == [0]

    def accounting():
        return analysis.accounting_errors({"ops": analysis.summarize_sites(recorder.results, None, recorder.runs)},
                                        recorder)

    graph_error, table_error = accounting()
    assert "backward graph 0: the pass recorded 1 fused and 0 unfused sites, but the step counted 0 runs" in graph_error
    assert table_error == f"{RMS}: the table says found 0, fused 0, unfused 0, but the pass fused 1 sites"
    compiled(x, w)[0].backward()
    assert recorder.runs == [1] and accounting() == []
    torch.testing.assert_close(w.grad, torch.func.grad(lambda *a: rms_norm_loss(*a)[0], argnums=1)(x.detach(), w.detach()))


def test_a_graph_reused_per_layer_counts_each_run():
    """One compiled graph run three times in a step (Dynamo reuses it for each 'layer'): its
    site ran three times, counted by the graph's own code; gradients against eager and float64."""
    from npu_fusion_testing.capture import Capture
    from npu_fusion.measure.grads import MODEL_FACTOR, assert_close_as_unfused, float64_grads, run_grads

    capture = Capture(target="generic")
    torch._dynamo.reset()
    layer = torch.compile(lambda h, w: h + h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * w,
                          backend=capture)
    x, w = torch.randn(2, 5, 32, requires_grad=True), torch.randn(32, requires_grad=True)

    def step(compiled):
        def run(x):
            h = x
            for _ in range(3):
                h = compiled(h, w)
            return h.square().sum()
        return run

    got, grad_outputs = run_grads(step(layer), [x], [w])
    eager_layer = lambda h, w: h + h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * w  # noqa: E731
    eager, _ = run_grads(step(eager_layer), [x], [w], grad_outputs)
    exact = float64_grads(step(eager_layer), [x], [w], grad_outputs)
    for g, e, x64 in zip(got, eager, exact):
        assert_close_as_unfused(g, e, x64, factor=MODEL_FACTOR)
    assert len(capture.results) == 1 and capture.fused(RMS) == 1
    assert capture.runs == [3] and capture.fused_runs(RMS) == 3


def test_command_line_json():
    env = {k: v for k, v in os.environ.items() if k not in ("TORCH_LOGS", "NPU_FUSION_DUMP_GRAPHS")}
    proc = subprocess.run([sys.executable, "-m", "npu_fusion", "report", "--json", "--layers", "1"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout)  # stdout is only the JSON: progress is on stderr
    assert "[npu-fusion report] compiling" in proc.stderr
    backward = bundled("llama", 1).expected_sites
    # the forward rules are on by default: each site fuses forward too
    expected = dict(backward, rms_norm=backward["rms_norm_grad"],
                    rotary_position_embedding=backward["rotary_position_embedding_grad"])
    assert {op: r["ops"][op]["fused"] for op in expected} == expected
    assert r["gradients"]["passed"]
    counted = collections.Counter(s["op"] for s in r["sites"])
    assert dict(counted) == {op: n for op, n in expected.items() if n}  # Llama's MLP: no SwiGLU site


def test_report_through_inductor(capsys):
    """``--compiler inductor``: stock Inductor after install_inductor, every site of a 1-layer
    bf16 Llama fused in its joint graph, gradients by the float64 criterion; the install is undone."""
    from npu_fusion.compat import inductor_config

    before = inductor_config().joint_custom_pre_pass
    status, r, _ = run_json(capsys, "--compiler", "inductor", "--layers", "1", "--dtype", "bfloat16",
                            "--seq", "8", "--target", "generic")
    assert status == 0 and r["gradients"]["passed"], r["gradients"]
    assert r["settings"]["compiler"] == "inductor" and r["settings"]["partitioner"] == "min_cut"
    assert r["ops"][RMS]["fused"] == 3 and r["ops"][ROPE]["fused"] == 2, r["ops"]
    assert not r["misses"] and not r["pass_errors"]
    assert inductor_config().joint_custom_pre_pass is before
    assert report.run(parse("--compiler", "inductor", "--partitioner", "default")) == report.EXIT_USAGE


def test_settings_say_whether_the_forward_is_fused():
    """The report's settings say whether the forward was fused from the options in force (their
    defaults included): --forward turns the forward rules on, --backward-only off."""
    from npu_fusion.plugin.options import FusionOptions, forward_options
    from npu_fusion.report import command

    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    assert forward_options(), "no rule fuses the forward"
    default = bool(getattr(FusionOptions(), forward_options()[0]))
    for argv, fused in (([], default), (["--forward"], True), (["--backward-only"], False)):
        args = parser.parse_args(argv)
        options = FusionOptions.from_mapping(command.forward_switches(args))
        assert command.forward_fused(args) is fused
        defaults = [getattr(FusionOptions(), option) for option in forward_options()]  # each rule's default
        expected = defaults if not argv else [fused] * len(forward_options())
        assert [getattr(options, option) for option in forward_options()] == expected


def test_bundled_phi3_fuses_its_swiglu_and_the_switches_turn_its_forward_off(capsys):
    """``--model phi3`` (Llama's decoder with one gate_up projection): its SwiGLU site fuses
    backward and forward by default, gradients by the float64 criterion; ``--backward-only`` leaves
    the forward product to the program and still fuses the backward."""
    for argv, forward in (([], 1), (["--backward-only"], 0)):
        status, r, _ = run_json(capsys, "--model", "phi3", "--layers", "1", "--target", "generic", *argv)
        assert status == 0 and r["gradients"]["passed"], r["gradients"]
        assert (r["ops"]["swiglu_grad"]["fused"], r["ops"]["swiglu_grad"]["expected"]) == (1, 1), r["ops"]
        assert r["ops"]["swiglu_grad"]["unfused"] == 0
        assert r["ops"].get("swiglu", {}).get("fused", 0) == forward, r["ops"].get("swiglu")
        assert not r["misses"] and not r["pass_errors"]
