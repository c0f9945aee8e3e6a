#!/usr/bin/env python
"""``npu-fusion report --hf-config`` on the shipped full-size configs: time, memory and what each chip runs.

Runs ``python -m npu_fusion report --hf-config examples/configs/NAME.json --layers 2 --seq 4096
--target a2,950 --json`` once per shipped config (DeepSeek-V3 with ``first_k_dense_replace=1`` so
that its second layer is a MoE layer), each in a process of its own, and prints one markdown row
per config: the command's wall time, the report's own time after the imports (building the model
on the meta device, counting its sites and tracing a step per target), the process's peak resident
memory, the sites counted, and per target the counted sites that run fused and those refused, for
the backward ops and the forward ops, and on the first target the pass's CPU time, per graph node and
as a share of the step's CPU time. It is the table of docs/report.md (``--write-docs fullsize``);
with ``--layers 32`` and ``80`` on Llama-3-70B, the depth rows of docs/benchmarks.md
(``--write-docs pass-overhead-fullsize``).

    python -m benchmarks.fullsize_report
    python -m benchmarks.fullsize_report --configs llama-3-70b --seq 1024
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List

from npu_fusion.lowering import FUSED_OPS, RMS_NORM_GRAD
from npu_fusion.plugin.options import forward_ops
from npu_fusion_testing.generated import ROOT, publishing, script_command

EXAMPLES = ROOT / "examples" / "configs"
#: config file stem: (its name in the table, its overrides)
CONFIGS = {
    "llama-3-70b": ("Llama-3-70B", []),
    "qwen3-32b": ("Qwen3-32B (q/k norms too)", []),
    "deepseek-v3": ("DeepSeek-V3 (MLA, 256 experts)", ["first_k_dense_replace=1"]),
}
TARGETS = ("a2", "950")
#: the fused ops by direction: each counted site is a backward site, and a forward one while the
#: forward rules are on (their default)
FORWARD_NAMES = forward_ops()
BACKWARD_NAMES = tuple(op.name for op in FUSED_OPS if op.name not in FORWARD_NAMES)
LABELS = {op.name: op.label for op in FUSED_OPS}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated config names of examples/configs")
    parser.add_argument("--layers", type=int, nargs="+", default=[2], help="decoder layers (several: a row each)")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--json", metavar="PATH", help="also write the reports as JSON")
    parser.add_argument("--write-docs", metavar="NAME",
                        help="also write what this prints into block NAME of its docs/ page")
    return parser.parse_args(argv)


def run_one(name: str, layers: int, args: argparse.Namespace) -> Dict[str, Any]:
    """The report's JSON for one config, with the command's wall time and the process's peak memory."""
    command = [sys.executable, "-m", "npu_fusion", "report", "--hf-config", str(EXAMPLES / f"{name}.json"),
               *CONFIGS[name][1], "--layers", str(layers), "--seq", str(args.seq),
               "--target", ",".join(TARGETS), "--json"]
    with tempfile.TemporaryFile("w+") as out:
        start = time.perf_counter()
        process = subprocess.Popen(command, stdout=out, cwd=ROOT)
        _, status, usage = os.wait4(process.pid, 0)
        wall = time.perf_counter() - start
        process.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        text = out.read()
    if process.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} exited with {process.returncode}")
    report = json.loads(text)
    report["wall_seconds"], report["peak_rss_process"] = wall, usage.ru_maxrss * 1024  # Linux: KiB
    return report


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def _counted(target: Dict[str, Any], ops: List[str]) -> Dict[str, int]:
    rows = [target["accounting"][op] for op in ops if op in target["accounting"]]
    return {key: sum(r[key] for r in rows) for key in ("expected", "fused", "missed", "outside", "unexplained")}


def _sites(target: Dict[str, Any]) -> str:
    """The counted sites by kind (the backward ops' counts: one per RMSNorm call, one per rotation)."""
    return ", ".join(f"{target['accounting'][op]['expected']} {LABELS[op]}" for op in BACKWARD_NAMES
                     if target["accounting"].get(op, {}).get("expected"))


def _runs_refuses(target: Dict[str, Any]) -> str:
    backward, forward = _counted(target, list(BACKWARD_NAMES)), _counted(target, list(FORWARD_NAMES))
    cell = f"{backward['fused']} / {backward['missed']}"
    if forward["expected"]:
        cell += f"; forward {forward['fused']} / {forward['missed']}"
    refused = sorted({m["reason"] for m in target["misses"]})
    return cell + (f" ({'; '.join(refused)})" if refused else "")


def _pass_cost(seconds: Dict[str, Any]) -> str:
    """The pass's CPU time on one target, with its graphs' nodes, its time per node and its share of the step."""
    nodes, share = seconds.get("pass_nodes"), seconds.get("pass_share")
    if not nodes or share is None:
        return f"{seconds['pass_cpu'] * 1e3:.0f} ms"
    return (f"{seconds['pass_cpu'] * 1e3:.0f} ms ({nodes} nodes, {seconds['pass_cpu'] * 1e6 / nodes:.0f} us, "
            f"{100 * share:.1f}%)")


def print_table(reports: Dict[str, Dict[str, Any]], args: argparse.Namespace) -> None:
    layers = args.layers[0] if len(args.layers) == 1 else "L"
    print(f"`npu-fusion report --hf-config examples/configs/NAME.json --layers {layers} --seq {args.seq} "
          f"--target {','.join(TARGETS)}` (batch 2, bfloat16), one process per config:\n")
    print("| config | wall time (whole command) | of it, after the imports (build, count, trace both targets) | "
          "peak resident memory | sites | " + " | ".join(f"{t} runs / refuses" for t in TARGETS) + " | "
          f"{TARGETS[-1]}: modelled traffic of the replaced RMSNorm backwards, before -> after (minimum) | "
          f"{TARGETS[-1]}: saved for the backward, without -> with the pass | "
          f"{TARGETS[0]}: the pass's CPU time (graph nodes, per node, share of the step's CPU time) |")
    print("|---|---|---|---|---|" + "---|" * len(TARGETS) + "---|---|---|")
    for (name, layers), r in reports.items():
        targets = [r["targets"][t] for t in TARGETS]
        traffic, saved = targets[-1]["memory_traffic"].get(RMS_NORM_GRAD.name), targets[-1]["saved_activations"]
        traffic_cell = (f"{_gib(traffic['bytes_before'])} -> {_gib(traffic['bytes_after'])} "
                        f"({_gib(traffic['bytes_minimum'])})" if traffic else "-")
        label = CONFIGS[name][0] + (f", {layers} layers" if len(args.layers) > 1 else "")
        print(f"| {label} | {r['wall_seconds']:.0f} s | {r['seconds']:.0f} s | "
              f"{r['peak_rss_process'] / 2**20:.0f} MiB | {_sites(targets[0])} | "
              + " | ".join(_runs_refuses(t) for t in targets)
              + f" | {traffic_cell} | {_gib(saved['bytes_before'])} -> {_gib(saved['bytes_after'])} | "
              f"{_pass_cost(targets[0]['seconds'])} |")
    unexplained = sum(a["unexplained"] for r in reports.values() for t in TARGETS
                      for a in r["targets"][t]["accounting"].values())
    print(f"\ncounted sites left unexplained on any target: {unexplained}")


def main(argv=None) -> int:
    args = parse_args(argv)
    names = [n.strip() for n in args.configs.split(",")]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        raise SystemExit(f"unknown configs {unknown}: one of {list(CONFIGS)}")
    reports = {}
    for name in names:
        for layers in args.layers:
            print(f"{name}, {layers} layers...", file=sys.stderr, flush=True)
            reports[name, layers] = run_one(name, layers, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({f"{name}, {layers} layers": r for (name, layers), r in reports.items()}, f, indent=1)
    with publishing(args.write_docs, script_command(__file__, argv), fenced=False):
        print_table(reports, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
