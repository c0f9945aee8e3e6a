"""Where the pass's CPU time goes: each rule's search, rewrites and report of what no form matched.

``python -m benchmarks.rule_costs --widths 128 960 --layers 8`` compiles the bundled Llama of
``benchmarks.pass_overhead`` on the backend (default options) and times, with the process's CPU
clock, every rule's three phases as the pass manager calls them: ``find`` (the search, proofs
included), ``emit`` (the rewrites of the sites found) and ``unexplained`` (the misses no form
matched). What is left of the pass is its own bookkeeping: the rounds, the transactions' rollback
records, the graph's lint and the site judgements. One table a width, medians of ``--repeat``
runs, with each phase's share of the pass and its CPU time per joint-graph node.

The phases are timed by wrapping the rule objects' methods for the run (restored after it); the
pass's own timing (``FusionResult.cpu_seconds``) is read as in ``pass_overhead``.
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections import Counter
from typing import Dict, Iterator, List

from benchmarks.pass_overhead import measure, widths
from npu_fusion.patterns import RULES
from npu_fusion_testing.generated import publishing, script_command

#: the phases of a rule the pass manager calls, in the order a round calls them
PHASES = ("find", "emit", "unexplained")


@contextlib.contextmanager
def timed_phases(clock: Counter) -> Iterator[Counter]:
    """Add each rule phase's CPU time to ``clock[(op name, phase)]`` while the block runs."""
    saved = []
    for rule in RULES:
        for phase in PHASES:
            method = getattr(rule, phase)

            def timed(*args, _method=method, _key=(rule.op.name, phase), **kwargs):
                start = time.process_time()
                try:
                    return _method(*args, **kwargs)
                finally:
                    clock[_key] += time.process_time() - start

            saved.append((rule, phase, rule.__dict__.get(phase)))
            object.__setattr__(rule, phase, timed)
    try:
        yield clock
    finally:
        for rule, phase, before in reversed(saved):
            if before is None:
                object.__delattr__(rule, phase)
            else:
                object.__setattr__(rule, phase, before)


def measure_phases(layers: int, head_dim: int, repeat: int) -> dict:
    """Medians over ``repeat`` first compiled steps: the pass's CPU, each (op, phase)'s, nodes, sites."""
    runs: List[dict] = []
    for _ in range(repeat):
        clock: Counter = Counter()
        with timed_phases(clock):
            row = measure(layers, width=widths(head_dim))
        runs.append({"row": row, "clock": clock})
    keys = sorted({k for r in runs for k in r["clock"]})
    return {
        "head_dim": head_dim, "layers": layers, "nodes": runs[0]["row"]["nodes_before"],
        "sites": runs[0]["row"]["sites"],
        "pass": statistics.median(r["row"]["pass_cpu"] for r in runs),
        "step": statistics.median(r["row"]["first_call_cpu"] for r in runs),
        "phases": {k: statistics.median(r["clock"][k] for r in runs) for k in keys},
    }


def print_phases(result: dict) -> None:
    """One markdown table: each (op, phase) by its CPU time, then the rest of the pass."""
    total, nodes, sites = result["pass"], result["nodes"], result["sites"]
    print(f"\nhead_dim {result['head_dim']}, {result['layers']} layers: {nodes} joint-graph nodes, {sites} sites, "
          f"pass {total * 1e3:.0f} ms CPU ({total / nodes * 1e6:.0f} us per node, "
          f"{total / result['step']:.1%} of the first step's {result['step']:.2f} s)\n")
    print("| rule | phase | CPU | share of the pass | per joint-graph node |")
    print("|---|---|---:|---:|---:|")
    phases: Dict[tuple, float] = result["phases"]
    for (op, phase), seconds in sorted(phases.items(), key=lambda kv: -kv[1]):
        print(f"| `{op}` | {phase} | {seconds * 1e3:.1f} ms | {seconds / total:.1%} | {seconds / nodes * 1e6:.1f} us |")
    rest = total - sum(phases.values())
    print(f"| the rest of the pass | rounds, rollback records, lint, judgements | {rest * 1e3:.1f} ms | "
          f"{rest / total:.1%} | {rest / nodes * 1e6:.1f} us |")
    for phase in PHASES:
        seconds = sum(v for (_, p), v in phases.items() if p == phase)
        print(f"\nevery rule's {phase}: {seconds * 1e3:.0f} ms, {seconds / total:.0%} of the pass", end="")
    print()


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--widths", type=int, nargs="+", default=[128, 960], metavar="HEAD_DIM")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=3, help="runs per width; the tables show the medians")
    parser.add_argument("--write-docs", metavar="NAME", help="also write what this prints into block NAME of its docs/ page")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(1)
    measure(1, width=widths(args.widths[0]))  # warm-up: imports and first-call caches out of the rows
    with publishing(args.write_docs, script_command(__file__, argv), fenced=False):
        print(f"The backend's first compiled step of the bundled Llama, default options, medians of {args.repeat} run(s).")
        for head_dim in args.widths:
            print_phases(measure_phases(args.layers, head_dim, args.repeat))
    return 0


if __name__ == "__main__":
    sys.exit(main())
