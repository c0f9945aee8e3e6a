"""Check npu-fusion's NPU-side contracts against every torch_npu release line and print a table.

For each line, ``npu_fusion_testing.torchair.npu_contracts`` runs in its own process (one
torchair per process): the eager kernels against stand-in ``torch.ops.npu`` ops
made from that wheel's schemas, and the GE nodes our converters build against
that wheel's generated ``REG_OP`` definitions. The nodes are built by the line's
own torchair; where that torchair does not import with the installed torch, by
the torchair matching it, and the table says so. Wheels are downloaded once into
the cache of ``npu_fusion_testing.torchair.harness`` (``~/.cache/npu_fusion``). Every fused op
of ``npu_fusion.lowering.FUSED_OPS`` (of the checkout the checks run in) is checked, from its own
declaration.

    python -m scripts.check_npu_contracts            # every line below
    python -m scripts.check_npu_contracts 2.13.0     # some lines
    python -m scripts.check_npu_contracts --write-docs contracts   # and into docs/compatibility.md
Exit status 1 when any check found a problem.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

from npu_fusion_testing.generated import pop_write_docs, publishing, script_command

#: the newest release of each torch_npu line 2.6 to 2.14 on the package index (checked 2026-11-30;
#: 2.9 has two: 2.9.0.post9 and 2.9.1).
LINES = ("2.6.0.post5", "2.7.1.post11", "2.8.0.post5", "2.9.0.post9", "2.9.1", "2.10.0.post7",
         "2.11.0.post3", "2.12.0.post3", "2.13.0", "2.14.0")
CHECK = "npu_fusion_testing.torchair.npu_contracts"


def run_line(line: str, torchair_version: str) -> dict:
    env = dict(os.environ, NPU_FUSION_TORCH_NPU_VERSION=torchair_version)
    # from the repository root, where the harness (npu_fusion_testing) lives: it is not installed
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-m", CHECK, line], env=env, capture_output=True, text=True, timeout=1800,
                          cwd=root)
    if done.returncode != 0:
        tail = "\n".join(done.stderr.strip().splitlines()[-5:])
        return {"line": line, "error": f"exit {done.returncode}: {tail}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def check_line(line: str, default_torchair: str) -> dict:
    report = run_line(line, line)
    if "torchair_error" in report and line != default_torchair:
        fallback = run_line(line, default_torchair)
        fallback["own_torchair_error"] = report["torchair_error"]
        report = fallback
    return report


def _modes_cell(eager: dict) -> str:
    """The rotary modes that reached torch_npu eagerly, and what its kernels accept (per op where
    they differ)."""
    used = {op: values for op, values in eager["values_on_npu"].items()}
    accepted = {op: values.get("mode", []) for op, values in eager["eager_values"].items() if values}
    cells = {f"{', '.join(used.get(op, []))} (accepts: {', '.join(accepted[op])})" for op in accepted}
    if len(cells) == 1:
        return cells.pop()
    return "; ".join(f"{op}: {', '.join(used.get(op, []))} (accepts: {', '.join(accepted[op])})"
                     for op in sorted(accepted))


def row(report: dict) -> list:
    if "error" in report:
        return [report["line"], "error", "", "", "", report["error"].splitlines()[-1][:80]]
    eager = report["eager"]
    calls = eager["calls"]
    ops = report["ops"]  # {fused op: [its torch_npu op, its GE op]}, as the checked code declares them
    bound = sum(1 for npu_op, _ in ops.values() if calls.get(npu_op))
    eager_cell = f"{bound}/{len(ops)} ops, {sum(calls.values())} calls, {len(report['eager_problems'])} problems"
    if "ge" not in report:
        return [report["line"], eager_cell, _modes_cell(eager), "not run", "", report.get("torchair_error", "")[:80]]
    nodes = report["ge"]["nodes_checked"]
    ge_cell = (" + ".join(str(nodes.get(ge_op, 0)) for _, ge_op in ops.values())
               + f" nodes, {len(report['ge_problems'])} problems")
    built = report["torchair"] + (" (its own does not import)" if "own_torchair_error" in report else "")
    builders = " / ".join(report["builders"].values())
    return [report["line"], eager_cell, _modes_cell(eager), ge_cell, built, builders]


def print_table(reports) -> None:
    builders = next((r["builders"] for r in reports if "builders" in r), {})
    ge_ops = next((" + ".join(ge for _, ge in r["ops"].values()) for r in reports if "ops" in r), "")
    header = ["torch_npu", "eager kernels bound", "rotary modes on torch_npu eagerly",
              f"GE definitions matched ({ge_ops})", "GE nodes built by torchair",
              "builders: " + " / ".join(builders)]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for report in reports:
        print("| " + " | ".join(row(report)) + " |")
    for report in reports:
        problems = report.get("eager_problems", []) + report.get("ge_problems", [])
        for problem in problems[:10]:
            print(f"{report['line']}: {problem}")
        if "own_torchair_error" in report:
            print(f"{report['line']}: its torchair does not import with torch {torch.__version__}: "
                  f"{report['own_torchair_error'][:200]}")


def main(argv) -> int:
    write_docs, lines = pop_write_docs(argv)
    lines = lines or LINES
    default_torchair = torch.__version__.split("+")[0]
    reports = []
    for line in lines:
        print(f"checking torch_npu {line} ...", file=sys.stderr, flush=True)
        reports.append(check_line(line, default_torchair))
    with publishing(write_docs, script_command(__file__, argv), fenced=False):
        print_table(reports)
    failed = [r for r in reports if "error" in r or r.get("eager_problems") or r.get("ge_problems") or "ge" not in r]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
