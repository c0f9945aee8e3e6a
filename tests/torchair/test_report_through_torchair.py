"""``npu-fusion report --compiler torchair``: torchair's own backend after ``npu_fusion.install``
(the wheel's torchair, CANN stubbed; off an NPU it builds the GE graphs and runs the FX graphs
eagerly), the pass after torchair's partition."""
import argparse
import json

from npu_fusion.report import command as report

RMS, ROPE = "rms_norm_grad", "rotary_position_embedding_grad"


def parse(*argv):
    parser = argparse.ArgumentParser()
    report.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_report_through_torchair(torchair, capsys):
    """Every site of a 1-layer fp32 Llama fused on torchair's backward graph, each counted once
    per run of its graph, and the gradients by the float64 criterion."""
    status = report.run(parse("--json", "--compiler", "torchair", "--layers", "1", "--dtype", "float32",
                              "--seq", "8", "--target", "a2"))
    r = json.loads(capsys.readouterr().out)
    assert status == report.EXIT_OK and r["gradients"]["passed"], r["gradients"]
    assert r["settings"]["compiler"] == "torchair" and r["settings"]["partitioner"] == "default"
    assert r["ops"][RMS]["fused"] == 3 and r["ops"][ROPE]["fused"] == 2, r["ops"]
    assert not r["misses"] and not r["pass_errors"] and not r["accounting_errors"]
    assert report.run(parse("--compiler", "torchair", "--partitioner", "min_cut")) == report.EXIT_USAGE
