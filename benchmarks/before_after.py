"""The pass's CPU time at a git revision beside the working tree's, measured by the same benchmark code.

``python -m benchmarks.pass_overhead --against REV [--widths 16 128] [--layers 2 8] [--repeat 3]``
exports REV's ``npu_fusion`` package (``git archive REV npu_fusion``) into a temporary folder and
measures, for every (head dim, layers) row, the first compiled training step of the bundled Llama on
the ``npu_fusion`` backend (``pass_overhead.measure``, default options) once with REV's package and once
with the working tree's, alternating the two (before, after, before, after) ``--repeat`` times, each run
in a fresh process. The measuring code is this tree's on both sides (the same model builder call, the
same backend wrapper, the same ``time.process_time`` clock around the pass); only the package it
imports differs: the worker process gets ``PYTHONPATH`` with the exported tree first and runs from a
folder that holds nothing importable, and it asserts that ``npu_fusion.__file__`` is in the tree it was
given (an editable install elsewhere must not win). A revision whose package lacks what the measurement
calls (``FusionResult.cpu_seconds``, ``npu_fusion.models.bundled``, the ``npu_fusion`` backend) fails the
run with a message that says what is missing.

It prints one table of medians: the pass's CPU time (around the backend's pass call, as in
``--widths``), its CPU time per joint-graph node and its share of the first step's CPU time, before ->
after, and the ratio after / before; both sides must see the same joint graph and fuse the same number
of sites, else the run stops.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
#: what a worker prints before its JSON answer, so that stray output cannot be mistaken for it
ANSWER = "before-after-row: "


def git(*args: str) -> str:
    done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"git {' '.join(args)} failed: {done.stderr.strip()}")
    return done.stdout.strip()


def export_package(rev: str, into: pathlib.Path) -> str:
    """Write ``rev``'s ``npu_fusion`` folder under ``into``; the full commit id."""
    commit = git("rev-parse", "--verify", f"{rev}^{{commit}}")
    into.mkdir(parents=True)
    archive = subprocess.Popen(["git", "archive", commit, "npu_fusion"], cwd=ROOT, stdout=subprocess.PIPE)
    untar = subprocess.run(["tar", "-x", "-C", str(into)], stdin=archive.stdout, capture_output=True)
    archive.stdout.close()
    if archive.wait() or untar.returncode:
        raise SystemExit(f"could not export npu_fusion at {rev}: {untar.stderr.decode().strip()}")
    if not (into / "npu_fusion" / "__init__.py").is_file():
        raise SystemExit(f"{rev} has no npu_fusion package")
    return commit


def working_tree_label() -> str:
    """HEAD's short id, with ``+changes`` when the package differs from it (the run measures the files)."""
    dirty = git("status", "--porcelain", "--", "npu_fusion")
    return git("rev-parse", "--short", "HEAD") + ("+changes" if dirty else "")


def run_worker(package_root: pathlib.Path, cwd: pathlib.Path, job: dict) -> dict:
    """One measurement in a fresh process importing ``npu_fusion`` from ``package_root``."""
    roots = [str(package_root)] + ([] if package_root == ROOT else [str(ROOT)])  # benchmarks and harness: ours
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(roots + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    done = subprocess.run([sys.executable, "-m", "benchmarks.before_after", json.dumps(job)], cwd=cwd, env=env,
                          capture_output=True, text=True)
    answers = [line[len(ANSWER):] for line in done.stdout.splitlines() if line.startswith(ANSWER)]
    if done.returncode or len(answers) != 1:
        raise SystemExit(f"the measurement with npu_fusion from {package_root} failed (exit {done.returncode}):\n"
                         f"{done.stderr[-4000:]}")
    return json.loads(answers[0])


def check_package(expected: str) -> None:
    """Stop unless ``npu_fusion`` comes from ``expected`` and has what the measurement calls."""
    import dataclasses

    import torch

    import npu_fusion

    found = pathlib.Path(npu_fusion.__file__).resolve().parent
    if found != pathlib.Path(expected).resolve() / "npu_fusion":  # not an assert: -O must not skip it
        raise SystemExit(f"npu_fusion imported from {found}, not from {expected}: PYTHONPATH did not win")
    missing = []
    try:
        from npu_fusion.plugin.pass_manager import FusionResult

        if "cpu_seconds" not in {f.name for f in dataclasses.fields(FusionResult)}:
            missing.append("FusionResult.cpu_seconds")
    except ImportError as e:
        missing.append(f"npu_fusion.plugin.pass_manager.FusionResult ({e})")
    try:
        from npu_fusion.models import bundled  # noqa: F401
    except ImportError as e:
        missing.append(f"npu_fusion.models.bundled ({e})")
    if "npu_fusion" not in torch._dynamo.list_backends():
        missing.append("the npu_fusion backend")
    if missing:
        raise SystemExit(f"npu_fusion at {expected} lacks what the measurement calls: {', '.join(missing)}")


def worker(job: dict) -> dict:
    """The child's side: check the package, warm up at one layer, measure the row's first step."""
    check_package(job["package_root"])
    import torch

    try:
        from benchmarks import pass_overhead
    except ImportError as e:
        raise SystemExit(f"the benchmark cannot import what it needs from npu_fusion at "
                         f"{job['package_root']}: {e}")
    if pathlib.Path(pass_overhead.__file__).resolve().parent != ROOT / "benchmarks":
        raise SystemExit(f"the benchmark imported from {pass_overhead.__file__}, not from {ROOT}")
    torch.set_num_threads(job["threads"])
    width = pass_overhead.widths(job["head_dim"], job["heads"], job["kv_heads"])
    pass_overhead.measure(1, target=job["target"], width=width)  # imports and first-use costs: not the row's
    row = pass_overhead.measure(job["layers"], target=job["target"], width=width)
    return row


def compare(args: argparse.Namespace) -> list:
    """``(before, after)`` median rows per (head dim, layers), the two sides alternating per repeat."""
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="npu-fusion-against-"))
    try:
        before_root = tmp / "before"
        args.against_commit = export_package(args.against, before_root)
        args.after_label = working_tree_label()
        cwd = tmp / "run"  # nothing importable here: the worker's first import root is PYTHONPATH's
        cwd.mkdir()
        sides = (before_root, ROOT)
        pairs = []
        for head_dim in args.widths or [16]:
            for layers in args.layers:
                start = time.perf_counter()
                job = {"layers": layers, "head_dim": head_dim, "heads": args.heads, "kv_heads": args.kv_heads,
                       "target": args.target or "generic", "threads": args.threads}
                runs = [[], []]
                for _ in range(args.repeat):
                    for i, root in enumerate(sides):
                        runs[i].append(run_worker(root, cwd, {**job, "package_root": str(root)}))
                pairs.append(tuple(median_row(side) for side in runs))
                before, after = pairs[-1]
                print(f"head_dim {head_dim}, {layers} layers: pass CPU {before['pass_cpu'] * 1e3:.0f} -> "
                      f"{after['pass_cpu'] * 1e3:.0f} ms ({time.perf_counter() - start:.0f} s for "
                      f"{args.repeat} pair(s))", file=sys.stderr, flush=True)
        return pairs
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def median_row(runs: list) -> dict:
    """The first run's row with the medians of the times; every run must have seen the same graph."""
    graphs = {(r["nodes_before"], r["nodes_after"], r["sites"]) for r in runs}
    if len(graphs) != 1:
        raise SystemExit(f"runs of one side disagree on (nodes before, after, sites): {sorted(graphs)}")
    row = dict(runs[0])
    for key in ("first_call_cpu", "pass_cpu", "fuse_joint_cpu"):
        row[key] = statistics.median(r[key] for r in runs)
    return row


def print_against(pairs, args: argparse.Namespace) -> None:
    """The before -> after table (``--against``)."""
    for before, after in pairs:
        if (before["nodes_before"], before["sites"]) != (after["nodes_before"], after["sites"]):
            raise SystemExit(f"{before['layers']} layers, head_dim {before['head_dim']}: the two sides saw "
                             f"{before['nodes_before']} and {after['nodes_before']} joint nodes and fused "
                             f"{before['sites']} and {after['sites']} sites: not the same measurement")
    print(f"Before: `npu_fusion` at {args.against_commit[:10]}; after: the working tree at {args.after_label}. "
          f"Medians of {args.repeat} run(s) a side, alternating, each in a fresh process.\n")
    print("| layers | head_dim (hidden) | joint nodes (after the pass) | sites fused | pass CPU, before -> after | "
          "of which fuse_joint | pass CPU per node | pass / first step, CPU | ratio after / before |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for b, a in pairs:
        nodes = b["nodes_before"]
        after_nodes = str(b["nodes_after"]) if a["nodes_after"] == b["nodes_after"] \
            else f"{b['nodes_after']} -> {a['nodes_after']}"
        print(f"| {b['layers']} | {b['head_dim']} ({b['hidden']}) | {nodes} ({after_nodes}) | {b['sites']} | "
              f"{b['pass_cpu'] * 1e3:.0f} -> {a['pass_cpu'] * 1e3:.0f} ms | "
              f"{b['fuse_joint_cpu'] * 1e3:.0f} -> {a['fuse_joint_cpu'] * 1e3:.0f} ms | "
              f"{1e6 * b['pass_cpu'] / nodes:.0f} -> {1e6 * a['pass_cpu'] / nodes:.0f} us | "
              f"{100 * b['pass_cpu'] / b['first_call_cpu']:.1f}% -> {100 * a['pass_cpu'] / a['first_call_cpu']:.1f}% | "
              f"{a['pass_cpu'] / b['pass_cpu']:.2f}x |")


if __name__ == "__main__":
    answer = worker(json.loads(sys.argv[1]))
    print(ANSWER + json.dumps(answer), flush=True)
