#!/usr/bin/env python
"""Coverage of the npu-fusion pass on the model code of training frameworks.

Builds tiny random models of torchtitan, torchtune and Megatron-core (``npu_fusion_testing.frameworks``:
2 layers, random weights, nothing downloaded), counts their RoPE applications and RMSNorm calls in an
eager step independently of the pass, compiles forward and backward with the real pass and prints,
per model and dtype: RoPE and RMSNorm sites fused / counted, sites that ran outside every compiled
graph, sites left unexplained (inside a compiled graph, neither fused nor a recorded miss), whether
every parameter gradient meets the float64 criterion, then every recorded miss with its reason and
every site that ran outside the compiled graphs.

    python -m benchmarks.framework_coverage
    python -m benchmarks.framework_coverage --frameworks torchtune:gemma2,megatron:gpt --dtypes bfloat16
    python -m benchmarks.framework_coverage --forward     # the forward rules too, their sites beside
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import time
import warnings
from typing import Dict, List, Optional

import torch

from npu_fusion.lowering import FUSED_OPS
from npu_fusion.plugin.options import forward_options
from npu_fusion_testing.frameworks import FRAMEWORKS, measure
from npu_fusion_testing.generated import publishing, script_command

LABELS = {op.option: op.label for op in FUSED_OPS}


@dataclasses.dataclass
class Row:
    name: str
    dtype: str
    sites: Dict[str, dict] = dataclasses.field(default_factory=dict)  # kind -> Accounting as a dict
    grads_ok: Optional[bool] = None
    grad_failures: List[str] = dataclasses.field(default_factory=list)
    pass_errors: List[str] = dataclasses.field(default_factory=list)
    graphs: int = 0
    seconds: float = 0.0
    error: str = ""


def run_one(name: str, dtype: str, target: str = "generic", forward: bool = False) -> Row:
    row, start = Row(name, dtype), time.perf_counter()
    switches = dict.fromkeys(forward_options(), True) if forward else {}
    try:
        coverage = measure(FRAMEWORKS[name], getattr(torch, dtype), strict=False, target=target, **switches)
    except ImportError as exc:
        row.error = f"skipped: {exc}"
    except Exception as exc:  # a build or compile failure is a result too
        row.error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ''}"
    else:
        for kind, a in coverage.sites.items():
            row.sites[kind] = dict(dataclasses.asdict(a), unexplained=a.unexplained)
        row.grad_failures, row.grads_ok = coverage.grad_failures, not coverage.grad_failures
        row.pass_errors, row.graphs = coverage.pass_errors, len(coverage.capture.forwards)
    row.seconds = time.perf_counter() - start
    return row


#: the table's site columns: (kind, header), the backward ops' then the forward ops', each in the
#: registry's order (RMSNorm, RoPE, SwiGLU: the zoo table's order too); the forward columns show
#: when their rule ran
COLUMNS = tuple((op.option, op.short_label or op.name)
                for forward in (False, True) for op in FUSED_OPS
                if (op.option in forward_options()) == forward)


def _cell(row: Row, kind: str) -> str:
    a = row.sites.get(kind)
    return f"{a['fused']}/{a['counted']}" if a else "-"


def print_table(rows: List[Row], file=None) -> None:
    file = file or sys.stdout  # looked up at the call: --write-docs redirects it
    columns = [(k, h) for k, h in COLUMNS if any(k in r.sites for r in rows)]
    header = (f"{'framework:model':<32} {'dtype':<9} " + " ".join(f"{h:>{max(5, len(h))}}" for _, h in columns)
              + f" {'outside':>7} {'unexplained':>11} {'missed':>6} {'grads':>5} {'graphs':>6} {'s':>5}")
    print(header, file=file)
    print("-" * len(header), file=file)
    for r in rows:
        if r.error:
            print(f"{r.name:<32} {r.dtype:<9} {r.error}", file=file)
            continue
        total = {key: sum(len(a[key]) if key == "outside" else a[key] for a in r.sites.values())
                 for key in ("outside", "unexplained", "missed")}
        cells = " ".join(f"{_cell(r, k):>{max(5, len(h))}}" for k, h in columns)
        print(f"{r.name:<32} {r.dtype:<9} {cells} {total['outside']:>7} "
              f"{total['unexplained']:>11} {total['missed']:>6} {'ok' if r.grads_ok else 'FAIL':>5} "
              f"{r.graphs:>6} {r.seconds:5.1f}", file=file)


def print_details(rows: List[Row], file=None) -> None:
    """Every recorded miss with its reason, every site outside the compiled graphs, every site left
    unexplained, gradient failures and pass errors."""
    file = file or sys.stdout  # looked up at the call: --write-docs redirects it
    for r in rows:
        lines = []
        for kind, a in r.sites.items():
            lines += [f"{LABELS[kind]} miss: {m}" for m in a["misses"]]
            lines += [f"{LABELS[kind]} ran outside every compiled graph: {p}" for p in a["outside"]]
            if a["unexplained"]:
                lines.append(f"{LABELS[kind]}: {a['unexplained']} site(s) inside compiled graphs neither fused "
                             f"nor recorded as a miss")
        lines += [f"gradient: {g}" for g in r.grad_failures[:5]] + [f"pass error: {e}" for e in r.pass_errors]
        if lines:
            print(f"{r.name} {r.dtype}:", file=file)
            for line in lines:
                print(f"    {line}", file=file)


def print_summary(rows: List[Row], file=None) -> None:
    file = file or sys.stdout  # looked up at the call: --write-docs redirects it
    ran = [r for r in rows if not r.error]
    for kind, label in LABELS.items():
        if not any(kind in r.sites for r in ran):
            continue
        fused = sum(r.sites[kind]["fused"] for r in ran if kind in r.sites)
        counted = sum(r.sites[kind]["counted"] for r in ran if kind in r.sites)
        unexplained = sum(r.sites[kind]["unexplained"] for r in ran if kind in r.sites)
        print(f"{label} sites fused: {fused}/{counted}; unexplained {unexplained}", file=file)
    print(f"gradients within the criterion: {sum(bool(r.grads_ok) for r in ran)}/{len(ran)}; "
          f"failed to build or run: {len(rows) - len(ran)}", file=file)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frameworks", help=f"comma-separated, from: {', '.join(FRAMEWORKS)} (default: all)")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated (default float32,bfloat16)")
    parser.add_argument("--target", default="generic", choices=("generic", "a2", "a3", "950"),
                        help="which chip's forms the pass may emit (default generic: every form)")
    parser.add_argument("--forward", action="store_true",
                        help=f"also fuse the forward (options {' and '.join(forward_options())} on) and count "
                             "its sites: the backward's sites, each a forward site too")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    parser.add_argument("--write-docs", metavar="NAME",
                        help="also write what this prints into block NAME of its docs/ page")
    args = parser.parse_args(argv)
    names = args.frameworks.split(",") if args.frameworks else list(FRAMEWORKS)
    unknown = [n for n in names if n not in FRAMEWORKS]
    if unknown:
        parser.error(f"unknown framework model(s): {', '.join(unknown)}")
    warnings.filterwarnings("ignore")  # deepseek_v3's CPU autocast, torchao's version notice
    logging.getLogger("torch._dynamo").setLevel(logging.ERROR)
    wall = time.perf_counter()
    rows = []
    for name in names:
        for dtype in args.dtypes.split(","):
            rows.append(run_one(name, dtype, args.target, args.forward))
            print(f"[{len(rows)}] {name} {dtype}: {rows[-1].error or 'done'}", file=sys.stderr, flush=True)
    with publishing(args.write_docs, script_command(__file__, argv)):
        print_table(rows)
        print()
        print_details(rows)
        print_summary(rows)
        print(f"wall time {time.perf_counter() - wall:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([dataclasses.asdict(r) for r in rows], f, indent=2)
    return 0 if all(r.grads_ok for r in rows if not r.error) else 1


if __name__ == "__main__":
    sys.exit(main())
