"""What the pass does to the backward graph of a Llama-7B-shaped decoder layer.

The bundled decoder with Llama-2-7B's sizes (hidden 4096, 32 heads of 128, MLP
11008, vocabulary 32000), one layer by default, batch 1 and sequence 4096 in
bfloat16, is built from fake tensors (``FakeTensorMode``, CPU semantics): nothing is
allocated and nothing computed. torch.compile traces one training step (loss and
backward) through AOTAutograd and the pass runs as one of the three paths does
(``--path``): on the joint graph before the partition (the ``npu_fusion`` backend;
Inductor after ``install_inductor``, with its decompositions and min-cut partitioner,
no code generated), or on the backward graph after it (torchair after ``install``).
Printed as markdown:

* backward graph nodes before and after the pass;
* per fused op: sites, and the modelled memory traffic of the replaced subgraphs
  before and after (``Site.bytes_before`` / ``bytes_after``) against the fused op's
  minimum (``Site.bytes_minimum``: each input read once, each output written once);
* the same traffic model over the whole backward graph, before and after.

The traffic model (``npu_fusion.patterns.traffic.node_traffic``): every non-view
node reads all its tensor inputs and writes its output once; no fusion by a later
compiler is assumed, so "before" is what an op-by-op (eager-like) backend moves.

* the activation bytes the forward saves for the backward, without and with the pass.

With ``--forward`` (the forward rules' options: ``rms_norm_forward``, ``rope_forward``,
``swiglu_forward``; on the torchair path the partitioned training forward is fused after the
backward, as ``install``'s hook does, its saved tensors kept) the forward graph gets the same
two tables: its nodes and whole traffic before and after, and per forward fused op (``rms_norm``,
``rotary_position_embedding``) its sites and their modelled traffic after the pass (the fused
node and the casts next to it) against the fused op's minimum. Compare the saved bytes with a
run without ``--forward`` (the backward fused alone).

``--mlp gate-up`` gives the MLP one ``gate_up`` projection chunked into the gate and the up
(Phi-3's) instead of Llama-2's separate two: one SwiGLU site a layer, whose rows (``swiglu_grad``,
with ``--forward`` ``swiglu``) show the MLP's modelled traffic before and after the fusion
against the fused ops' minimum (docs/benchmarks.md, ``--write-docs graph-effect-swiglu``).

``--compare-partitioners`` traces the ``npu_fusion`` path once per partitioner (default and min-cut)
and prints one table: the bytes saved for the backward without and with the pass, and the modelled
traffic of the backward graph after the pass, min-cut's against default's (the table of
docs/usage.md, written there with ``--write-docs partitioners``).

``--compare-paths`` traces the three paths and prints one table, the paths side by side (the
blocks ``graph-effect-paths`` and, with ``--forward``, ``graph-effect-forward`` of docs/benchmarks.md).

    python -m benchmarks.graph_effect [--layers 1] [--path npu_fusion|torchair|inductor] [--partitioner default]
                                      [--forward]
    python -m benchmarks.graph_effect --compare-partitioners --forward
    python -m benchmarks.graph_effect --layers 32 --compare-paths [--forward]
"""
from __future__ import annotations

import argparse
import collections
import copy
import sys
import time

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import npu_fusion  # noqa: F401  (registers the ops)
from npu_fusion.measure.sites import FORWARD_OPS, KINDS, expected_for
from npu_fusion.models import TinyConfig, TinyDecoder
from npu_fusion.patterns.nodes import is_float_cast
from npu_fusion.patterns.traffic import node_traffic
from npu_fusion.compat import inductor_decompositions
from npu_fusion.plugin.backend import aot_backend
from npu_fusion.plugin.saved_activations import saved_set
from npu_fusion.plugin.options import FusionOptions, forward_ops, forward_options
from npu_fusion.plugin.pass_manager import fuse_forward

from npu_fusion_testing.generated import publishing, script_command

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
LLAMA_7B = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_heads=32, num_kv_heads=32,
                rope="half", eps=1e-5)


def gib(n: float) -> str:
    return f"{n / 2**30:.3f} GiB" if n >= 2**27 else f"{n / 2**20:.1f} MiB"


def _saved(n: int) -> str:
    return f"{gib(n)} ({n:,} bytes)"


def fused_traffic(graph) -> dict:
    """Per fused op, the modelled traffic around each fused node in a final graph (backward or forward):
    the node itself and the casts right before and after it (what the pass added, as the
    partition left them: on the joint graph a cast of a saved upcast back to x's dtype is gone)."""
    out = collections.Counter()
    for node in graph.nodes:
        name = getattr(node.target, "__name__", "")
        if node.op != "call_function" or not str(node.target).startswith("npu_fusion."):
            continue
        casts = [a for a in node.all_input_nodes if is_float_cast(a)]
        casts += [c for g in node.users for c in g.users if is_float_cast(c)]
        out[name.split(".")[0]] += node_traffic(node) + sum(node_traffic(c) for c in casts)
    return out


PATHS = {
    # path: (where the pass runs, partitioner, decompositions)
    "npu_fusion": ("joint", None, "none"),     # the backend: the joint graph, --partitioner
    "torchair": ("backward", "default", "none"),  # install(): after torchair's default partition
    "inductor": ("joint", "min_cut", "inductor"),  # install_inductor(): Inductor's table and min-cut
}


def _parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="bfloat16")
    parser.add_argument("--rope", choices=("half", "interleave", "interleave_half"), default="half")
    parser.add_argument("--mlp", choices=("separate", "gate-up"), default="separate",
                        help="the MLP's projections: separate gate and up (Llama-2's: no SwiGLU site) or one "
                             "gate_up projection chunked in two (Phi-3's: one SwiGLU site a layer)")
    parser.add_argument("--target", choices=("generic", "a2", "a3", "950"), default="generic")
    parser.add_argument("--partitioner", choices=("default", "min_cut"), default="default",
                        help="the npu_fusion path's partitioner (torchair's is default, Inductor's min-cut)")
    parser.add_argument("--path", choices=tuple(PATHS), default="npu_fusion",
                        help="npu_fusion: the backend, pass on the joint graph; torchair: the pass after "
                             "the partition (npu_fusion.install); inductor: the joint graph with Inductor's "
                             "decompositions and min-cut partitioner (npu_fusion.install_inductor; no codegen)")
    parser.add_argument("--forward", action="store_true",
                        help=f"fuse the forward too ({', '.join(forward_options())}; joint-graph paths only)")
    parser.add_argument("--compare-partitioners", action="store_true",
                        help="trace the npu_fusion path under each partitioner and print their saved bytes "
                             "and backward traffic side by side (instead of --partitioner's tables)")
    parser.add_argument("--compare-paths", action="store_true",
                        help="trace every path and print one table, the paths side by side (with --forward "
                             "the forward graph's rows too) instead of --path's tables")
    parser.add_argument("--write-docs", metavar="NAME",
                        help="also write what this prints into block NAME of its docs/ page")
    args = parser.parse_args(argv)
    if args.compare_partitioners and args.path != "npu_fusion":
        parser.error("--compare-partitioners compares the npu_fusion path's partitioners")
    return args


def _build(args):
    config = TinyConfig(**dict(LLAMA_7B, num_layers=args.layers, rope=args.rope, mlp=args.mlp.replace("-", "_")))
    fake_mode = FakeTensorMode()
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(DTYPES[args.dtype])  # .to(dtype) cannot swap fake parameters
    try:
        with fake_mode:  # CPU tensors with shapes and dtypes only: nothing allocated, nothing computed
            model = TinyDecoder(config)
            ids = torch.zeros(args.batch, args.seq, dtype=torch.long)
    finally:
        torch.set_default_dtype(default_dtype)
    assert all(p.dtype == DTYPES[args.dtype] for p in model.parameters())
    return config, fake_mode, model, ids


def _keeping_unfused(gm, run) -> dict:
    """Run the pass; the graphs and saved set of the program without it: on a joint graph the
    partition of a copy taken before the pass, else a copy of the backward graph (and the forward
    graph given for provenance, which the pass leaves as it is; the saved set is then unchanged)."""
    if run.stage == "joint" and run.split is not None:
        unfused = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))  # its attributes shared, not copied
        result = run()
        fw_gm, bw_gm = run.split(unfused)
        return dict(result=result, before=bw_gm.graph, forward_before=fw_gm.graph,
                    unfused_saved=saved_set(fw_gm, bw_gm))
    before = copy.deepcopy(gm.graph)
    return dict(result=run(), before=before, forward_before=run.forward, unfused_saved=None)


def _options(args) -> FusionOptions:
    partitioner = PATHS[args.path][1]
    return FusionOptions.from_mapping({"target": args.target, "partitioner": partitioner or args.partitioner,
                                       **dict.fromkeys(forward_options(), args.forward)})


def _backend(args, captured):
    stage, _, decompositions = PATHS[args.path]
    options = _options(args)

    def around_pass(gm, run):
        captured.update(_keeping_unfused(gm, run))
        joint = run.stage == "joint" and run.split is not None
        # after the compile: the partition of the fused joint graph, or the rewritten backward
        captured["after"] = (lambda: run.partitioned[1].graph) if joint else (lambda: gm.graph)
        captured["forward_after"] = (lambda: run.partitioned[0].graph) if joint else (lambda: run.forward)
        captured["forward_result"] = captured["result"]  # the joint graph's pass fuses both
        if not joint and args.forward:  # torchair's hook: the partitioned forward, after the backward
            run.after_partition.append(lambda fw_gm, bw_gm: _fuse_partitioned_forward(fw_gm, options, captured))

    table = inductor_decompositions() if decompositions == "inductor" else None
    return aot_backend(options, around_pass, stage=stage, decompositions=table)


def _fuse_partitioned_forward(fw_gm, options, captured) -> None:
    """The forward rules on the partitioned training forward, as ``install``'s hook runs them
    (``fuse_forward``: what it saves for the backward kept), the graph before kept."""
    captured["forward_before"] = copy.deepcopy(fw_gm.graph)
    captured["forward_result"] = fuse_forward(fw_gm, options)
    captured["forward_after"] = lambda: fw_gm.graph


def _trace(args):
    """One training step traced on fake tensors with the pass: (config, what the backend captured,
    the sites it holds by construction, seconds)."""
    config, fake_mode, model, ids = _build(args)
    # the sites of one forward by construction, a forward op's those of its backward
    expected = expected_for(_options(args), model.expected_sites)
    captured = {}
    print(f"tracing {args.layers} layer(s) on fake tensors...", file=sys.stderr)
    torch._dynamo.reset()
    start = time.perf_counter()
    with fake_mode:  # the compiled step, forward and backward, runs on fake tensors too
        step = torch.compile(lambda i: model.loss(i), backend=_backend(args, captured), fullgraph=True)
        step(ids).backward()
    traced = time.perf_counter() - start
    assert not captured["result"].error, captured["result"].error
    return config, captured, expected, traced


def main(argv=None) -> int:
    args = _parse(argv)
    if args.compare_paths:
        runs = {path: _trace(argparse.Namespace(**dict(vars(args), path=path))) for path in PATHS}
        with publishing(args.write_docs, script_command(__file__, argv), fenced=False):
            return _print_paths(args, runs)
    if args.compare_partitioners:
        runs = {p: _trace(argparse.Namespace(**dict(vars(args), partitioner=p))) for p in ("default", "min_cut")}
        with publishing(args.write_docs, script_command(__file__, argv), fenced=False):
            return _print_partitioners(args, runs)
    config, captured, expected, traced = _trace(args)
    with publishing(args.write_docs, script_command(__file__, argv), fenced=False):
        return _print_effect(args, config, captured, expected, traced)


def _print_partitioners(args, runs) -> int:
    """The partitioners side by side: saved bytes without and with the pass, backward traffic after it."""
    config = runs["default"][0]
    print(f"Llama-7B-shaped decoder: {args.layers} layer(s), hidden {config.hidden_size}, {config.num_heads} heads "
          f"x {config.head_dim}, MLP {config.intermediate_size}, batch {args.batch} x seq {args.seq}, {args.dtype}, "
          f"target {args.target}, the npu_fusion backend, forward fusion {'on' if args.forward else 'off'}\n")
    rows = {}
    for partitioner, (_, captured, _, _) in runs.items():
        result = captured["result"]
        rows[partitioner] = (captured["unfused_saved"].bytes, result.saved.bytes,
                             sum(node_traffic(n) for n in captured["after"]().nodes), len(result.sites))
    base = rows["default"]

    def against(value, reference):
        return "" if value == reference else f" ({100 * (value - reference) / reference:+.1f}%)"

    print("| partitioner | sites fused | saved for the backward without the pass | with the pass | "
          "modelled traffic of the backward graph after the pass |")
    print("|---|---:|---:|---:|---:|")
    for partitioner, (unfused, saved, traffic, sites) in rows.items():
        print(f"| {partitioner} | {sites} | {gib(unfused)} | {gib(saved)}{against(saved, base[1])} | "
              f"{gib(traffic)}{against(traffic, base[2])} |")
    saved_less, traffic_more = base[1] - rows["min_cut"][1], rows["min_cut"][2] - base[2]
    print(f"\nmin_cut saves {saved_less / 2**20:.0f} MiB less than default for the backward, with "
          f"{traffic_more / 2**20:+.0f} MiB of backward traffic ({args.layers} layer(s))")
    return 0


def _graph_row(before, after) -> tuple:
    """Nodes and modelled traffic of a graph before and after the pass, as two cells."""
    b, a = (sum(node_traffic(n) for n in g.nodes) for g in (before, after))
    return (f"{len(before.nodes)} -> {len(after.nodes)}",
            f"{b / 2**30:.1f} -> {a / 2**30:.1f} GiB, {100 * (a - b) / b:+.1f}%")


def _op_row(result, after, op, expected) -> str:
    """One fused op's cell: sites fused / expected, traffic before -> after / the fused-op minimum."""
    sites = [s for s in result.sites if s.op == op]
    minimum = sum(s.bytes_minimum for s in sites)
    after_bytes = fused_traffic(after).get(op, 0)
    ratio = f", {after_bytes / minimum:.2f}x" if minimum else ""
    return (f"{len(sites)}/{expected.get(op, 0)}, {gib(sum(s.bytes_before for s in sites))} -> "
            f"{gib(after_bytes)} / {gib(minimum)}{ratio}")


def _print_paths(args, runs) -> int:
    """Every path side by side: backward (and with ``--forward`` forward) nodes, traffic and sites, and the saved set."""
    config = next(iter(runs.values()))[0]
    print(f"Llama-7B-shaped decoder: {args.layers} layer(s), hidden {config.hidden_size}, {config.num_heads} heads "
          f"x {config.head_dim}, MLP {config.intermediate_size} ({args.mlp} projections), batch {args.batch} x seq "
          f"{args.seq}, {args.dtype}, target {args.target}, forward fusion {'on' if args.forward else 'off'}\n")
    heads = {"npu_fusion": "joint, default", "torchair": "after the partition", "inductor": "joint, min-cut"}
    print("| | " + " | ".join(f"`{path}` ({heads[path]})" for path in runs) + " |")
    print("|---|" + "---:|" * len(runs))
    rows = collections.defaultdict(list)
    graphs = [("backward", "result", "before", "after", [op for op in KINDS.values() if op not in FORWARD_OPS])]
    if args.forward:
        graphs.append(("forward", "forward_result", "forward_before", "forward_after", list(forward_ops())))
    for _, captured, expected, _ in runs.values():
        for kind, result_key, before_key, after_key, ops in graphs:
            after = captured[after_key]()
            nodes, traffic = _graph_row(captured[before_key], after)
            rows[f"{kind} nodes before -> after"].append(nodes)
            rows[f"modelled traffic, whole {kind} graph"].append(traffic)
            for op in ops:
                if expected.get(op, 0) or any(s.op == op for s in captured[result_key].sites):
                    rows[f"`{op}`: sites, traffic before -> after / fused-op minimum"].append(
                        _op_row(captured[result_key], after, op, expected))
        result, unfused = captured["result"], captured["unfused_saved"]
        rows["saved for the backward: without -> with the pass"].append(
            f"{gib(unfused.bytes)} -> {gib(result.saved.bytes)}" if unfused else f"{gib(result.saved.bytes)}, unchanged")
        rows["float32 `[B, S, H]` tensors saved, with the pass"].append(
            str(result.saved.count(torch.float32, (args.batch, args.seq, config.hidden_size))))
    for label, cells in rows.items():
        print(f"| {label} | " + " | ".join(cells) + " |")
    return 0


def _print_effect(args, config, captured, expected, traced) -> int:
    result = captured["result"]
    partitioner = PATHS[args.path][1] or args.partitioner
    print(f"Llama-7B-shaped decoder: {args.layers} layer(s), hidden {config.hidden_size}, "
          f"{config.num_heads} heads x {config.head_dim}, MLP {config.intermediate_size} ({args.mlp} projections), "
          f"vocab {config.vocab_size}, "
          f"batch {args.batch} x seq {args.seq}, {args.dtype}, target {args.target}, path {args.path} "
          f"(pass on the {result.graph} graph), partitioner {partitioner}, "
          f"forward fusion {'on' if args.forward else 'off'}\n")
    print(f"traced and compiled in {traced:.1f} s; the pass took {result.seconds * 1e3:.0f} ms\n")
    backward_ops = tuple(op for op in KINDS.values() if op not in FORWARD_OPS)
    graphs = [("backward", result, captured["before"], captured["after"](), backward_ops)]
    if args.forward:
        graphs.append(("forward", captured["forward_result"], captured["forward_before"], captured["forward_after"](),
                       forward_ops()))
    for kind, graph_result, before, after, ops in graphs:
        _print_graph_table(kind, before, after)
        _print_sites_table(graph_result, after, ops, expected)
    unfused = captured["unfused_saved"]
    print(f"\nsaved for the backward (activations: graph inputs and their views not counted): "
          f"{_saved(unfused.bytes) if unfused else 'the same'} without the pass, {_saved(result.saved.bytes)} with it; "
          f"float32 [B, S, H] tensors saved: "
          f"{result.saved.count(torch.float32, (args.batch, args.seq, config.hidden_size))}")
    forward_misses = captured["forward_result"].misses if captured["forward_result"] is not result else []
    for miss in [*result.misses, *forward_misses]:
        print(f"\nunfused: {miss.op} at {miss.node}: {miss.reason}")
    return 0


def _print_graph_table(kind, before, after) -> None:
    print(f"\n| | {kind} graph nodes | modelled traffic of the whole {kind} graph |")
    print("|---|---:|---:|")
    whole_before = sum(node_traffic(n) for n in before.nodes)
    whole_after = sum(node_traffic(n) for n in after.nodes)
    print(f"| before the pass | {len(before.nodes)} | {gib(whole_before)} |")
    print(f"| after the pass | {len(after.nodes)} | {gib(whole_after)} |")
    print(f"| change | {len(after.nodes) - len(before.nodes):+d} | "
          f"{100 * (whole_after - whole_before) / whole_before:+.1f}% |\n")


def _print_sites_table(result, after, ops, expected) -> None:
    """Per fused op of ``ops``: its sites, and their modelled traffic in the final graph ``after``."""
    by_op = collections.defaultdict(list)
    for site in result.sites:
        by_op[site.op].append(site)
    final = fused_traffic(after)
    print("| fused op | sites (expected) | replaced nodes | traffic before | after | fused-op minimum | "
          "after / minimum | saved |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for op in ops:
        sites = by_op.get(op, [])
        b = sum(s.bytes_before for s in sites)
        a = final.get(op, 0)
        m = sum(s.bytes_minimum for s in sites)
        nodes = sum(len(s.replaced_nodes) for s in sites)
        ratio = f"{a / m:.2f}" if m else "-"
        print(f"| {op} | {len(sites)} ({expected.get(op, 0)}) | {nodes} | {gib(b)} | {gib(a)} | {gib(m)} | {ratio} | "
              f"{gib(b - a)} |")


if __name__ == "__main__":
    sys.exit(main())
