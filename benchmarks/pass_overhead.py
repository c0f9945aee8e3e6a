"""How much of torch.compile's time the npu-fusion pass takes, and how the pass's
time grows with the backward graph.

For bundled Llama-style decoders of 1..32 layers (small hidden size, so that the
graph, not the arithmetic, is what grows), one process measures side by side:

* the first forward + backward call of ``torch.compile(backend="npu_fusion")``
  (Dynamo, AOTAutograd, the pass, and running it once);
* the pass's own time on the joint graph (``FusionResult.seconds``, and the
  process's CPU time over the same call, which a busy machine disturbs less);
* the node count of the graph the pass runs on (the joint graph; the backward graph
  through torchair) before and after the pass.

``--inductor`` measures the same through stock Inductor after ``npu_fusion.install_inductor``
(the first call then includes Inductor's code generation and C++ compiles).

It prints a markdown table, then a least-squares fit of pass time against nodes.
Off an Ascend host the backend does no code generation, so the compile time here is
small and the percentage an upper bound of what it is under torchair.

``--torchair`` measures the same ratio compiling the way Ascend users do, through
torchair's real Python backend: ``torchair.get_npu_backend(compiler_config=config)``
with ``npu_fusion.install(config, target=...)`` (target ``a2`` unless ``--target``).
There is no CANN here, so this mode depends on the test harness
``npu_fusion_testing.torchair``: ``harness.load_torchair()``
unpacks torchair from the torch_npu wheel (downloaded once into a cache; needs the
package index the first time) and stubs its four compiled CANN modules
(``npu_fusion_testing.torchair.cann_stub``). The config sets ``debug.run_eagerly``, as the
torchair tests do: torchair converts every FX graph to a GE graph and runs its GE
graph passes, then runs the FX graph eagerly on CPU, so forward and backward run
for real. The "compile time" is then the first forward + backward call of the
torchair-compiled model: Dynamo, AOTAutograd, torchair's FX passes (the npu-fusion
pass among them), its FX -> GE conversion and GE graph construction and passes.
GE's own compile is not part of it: with ``run_eagerly`` torchair never hands the
graph to GE (loading, serialising and compiling it, which the stub would only
record). On an NPU host GE's compile only adds time, so the percentage here is an
upper bound. The pass time is the sum of ``FusionResult.seconds`` over the graphs
of that compilation (the new entries of ``npu_fusion.plugin.pass_manager.HISTORY``);
its CPU time is taken around torchair's whole ``post_grad_custom_pre_pass`` call
(forward graphs included: ``install`` fuses the training forward too, so the per-node column,
over the backward graph's nodes, counts both graphs' work).

Two things differ from the default mode so that torchair can convert the graphs
(torch_npu would provide converters for both on an NPU host):
``aten.silu_backward`` is decomposed, and attention runs on PyTorch's math SDPA
backend, since CPU's fused flash-attention op has no GE converter. Attention is
therefore decomposed into matmul/softmax in the graphs, which have more nodes than
in the default mode (where it stays one op, as ``npu_fusion_attention`` would on an
NPU).

    python -m benchmarks.pass_overhead [--layers 1 2 4 8 16 32] [--repeat 1] [--profile 32]
    python -m benchmarks.pass_overhead --torchair [--target a2] [--layers 1 2 4 8 16 32]
    python -m benchmarks.pass_overhead --forward [--inductor] [--layers 1 8 32]
    python -m benchmarks.pass_overhead --inductor [--layers 1 4] [--profile 4]

With ``--inductor``, ``--profile LAYERS`` prints a cProfile of the pass's call on Inductor's joint
graph alone (SiLU recomposed, the rules, SiLU decomposed again) in that model's first step.

``--widths 16 128`` measures the backend's joint-graph pass at each head dim (4 heads, 2 key/value
heads, hidden 4 x head dim, MLP twice the hidden size; ``--heads``, ``--kv-heads``) and each of
``--layers``: per configuration the pass's CPU time, the joint graph's nodes, CPU time per node and
the share of the first compiled step's CPU time, and per head dim a power fit of the pass's CPU time
against the nodes. With ``--profile LAYERS`` it then prints a cProfile of ``fuse_joint`` alone (the
call the backend makes in the first step) at each head dim.

    python benchmarks/pass_overhead.py --widths 16 128 [--layers 2 8] [--profile 8]

``--against REV`` measures the same rows (``--widths``, default 16, and ``--layers``) at git revision
REV's ``npu_fusion`` and at the working tree's, alternating the two ``--repeat`` times, each run in a
fresh process, and prints the pass's CPU time before -> after (:mod:`benchmarks.before_after`).

    python -m benchmarks.pass_overhead --against b31b828 --widths 16 128 --layers 2 8 --repeat 3

``--net`` measures each size twice in the same process, side by side, on the chosen path (the
backend, ``--inductor`` or ``--torchair``): every rule off, then the default options, and prints
the first step's wall and CPU time with the pass against without it: the pass's own time against
what the fused graph saves the later stages (``--repeat`` pairs, medians).

Every mode but ``--forward`` runs the default options (the forward rules on).

``--forward`` measures each size twice in the same process, side by side: the backward rules
alone, then with the forward rules too (``rms_norm_forward``, ``rope_forward``, ``swiglu_forward``), and prints the ratio of the pass's CPU times.
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import io
import math
import os
import pstats
import statistics
import sys
import time
import warnings

import torch


import npu_fusion  # noqa: F401  (registers the ops)
from npu_fusion.measure.sites import expected_for
from npu_fusion.models import bundled
from npu_fusion.plugin.backend import aot_backend
from npu_fusion.plugin.options import FusionOptions, forward_options
from npu_fusion_testing.generated import publishing, script_command


class GcTimer:
    """Time spent in Python's cyclic garbage collector while active (``gc.callbacks``)."""

    def __init__(self):
        self.seconds, self.full, self._start = 0.0, 0, None

    def _callback(self, phase, info):
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            self.seconds += time.perf_counter() - self._start
            self.full += info.get("generation") == 2
            self._start = None

    def __enter__(self):
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc):
        gc.callbacks.remove(self._callback)


class Clocked:
    """The ``npu_fusion`` backend's off-NPU path (AOTAutograd, the pass on the joint
    graph), with the pass call timed on the wall clock and on this process's CPU clock."""

    def __init__(self, options, profiler=None):
        self.options = FusionOptions.from_mapping(options)
        self.profiler = profiler
        self.results, self.wall, self.cpu, self.gc, self.gc_full = [], 0.0, 0.0, 0.0, 0

    def __call__(self, gm, example_inputs):
        return aot_backend(self.options, self._around_pass)(gm, example_inputs)

    def _around_pass(self, bw_gm, run):
        with GcTimer() as gc_time:
            wall, cpu = time.perf_counter(), time.process_time()
            if self.profiler is not None:
                self.profiler.enable()
            try:
                self.results.append(run())
            finally:
                if self.profiler is not None:
                    self.profiler.disable()
            self.wall += time.perf_counter() - wall
            self.cpu += time.process_time() - cpu
        self.gc += gc_time.seconds
        self.gc_full += gc_time.full


def fusion_options(target: str, forward: bool = None, off: bool = False) -> dict:
    """The run's options: the defaults, with the forward rules' switches all ``forward`` unless it is
    None, or with ``off`` every rule's switch off (the compile without the pass's rewrites)."""
    if off:
        from npu_fusion.plugin.options import rule_options  # here: --against's older revisions lack it

        return {"target": target, **dict.fromkeys(rule_options(), False)}
    return {"target": target, **({} if forward is None else dict.fromkeys(forward_options(), forward))}


def expected_sites(model, forward: bool = None, off: bool = False) -> dict:
    """The model's sites by fused op under :func:`fusion_options` (none with every rule ``off``)."""
    return expected_for(FusionOptions.from_mapping(fusion_options("generic", forward, off)), model.expected_sites)


def widths(head_dim: int, heads: int = 4, kv_heads: int = 2) -> dict:
    """The bundled model's width overrides for ``heads`` heads of ``head_dim`` (``kv_heads`` key/value
    heads), the MLP twice the hidden size as in the default (head_dim 16: hidden 64, MLP 128)."""
    hidden = head_dim * heads
    return {"hidden_size": hidden, "num_heads": heads, "num_kv_heads": kv_heads, "intermediate_size": 2 * hidden}


def measure(layers: int, dtype=torch.float32, seq: int = 16, batch: int = 2, target: str = "generic",
            forward: bool = None, width: dict = None, profiler=None, off: bool = False) -> dict:
    """The first compiled step of a bundled Llama on the backend, with the pass timed (and, given a
    ``cProfile.Profile``, profiled: only the ``fuse_joint`` call runs under it)."""
    model = bundled("llama", num_layers=layers, dtype=dtype, **(width or {}))
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    gc.collect()
    backend = Clocked(fusion_options(target, forward, off), profiler)
    step = torch.compile(lambda i: model.loss(i), backend=backend)
    wall, cpu = time.perf_counter(), time.process_time()
    step(ids).backward()
    first, first_cpu = time.perf_counter() - wall, time.process_time() - cpu
    start = time.perf_counter()
    step(ids).backward()  # compiled already: what running alone costs
    second = time.perf_counter() - start
    assert len(backend.results) == 1, f"expected one backward graph, got {len(backend.results)}"
    r = backend.results[0]
    assert not r.error, r.error
    expected = expected_sites(model, forward, off)
    assert {op: r.fused(op) for op in expected} == expected, ({op: r.fused(op) for op in expected}, expected)
    return {"layers": layers, "first_call": first, "first_call_cpu": first_cpu, "second_call": second,
            "pass": r.seconds, "pass_cpu": backend.cpu, "fuse_joint_cpu": r.cpu_seconds, "pass_gc": backend.gc,
            "gc_full": backend.gc_full, "objects": len(gc.get_objects()), "nodes_before": r.nodes_before,
            "nodes_after": r.nodes_after, "sites": len(r.sites), "head_dim": model.config.head_dim,
            "hidden": model.config.hidden_size}


def measure_inductor(layers: int, target: str = "generic", dtype=torch.float32, seq: int = 16,
                     batch: int = 2, forward: bool = None, off: bool = False, profiler=None) -> dict:
    """``measure`` through stock Inductor with ``npu_fusion.install_inductor``: the first call is
    Dynamo, AOTAutograd, Inductor's joint passes (the npu-fusion pass among them), its partition,
    code generation and C++ compilation of both graphs. The pass's CPU time is taken around its
    own call (the ``CustomGraphPass``: recomposing SiLU, the rules, decomposing again), the pass
    time from ``FusionResult.seconds``; given a ``cProfile.Profile``, only that call runs under it."""
    from npu_fusion.compat import no_compile_caches
    from npu_fusion.plugin import pass_manager
    from npu_fusion.plugin.inductor import uninstall_inductor

    model = bundled("llama", num_layers=layers, dtype=dtype)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    gc.collect()
    installed = npu_fusion.install_inductor(**fusion_options(target, forward, off))
    clock = {"cpu": 0.0, "gc": 0.0, "gc_full": 0}
    real_call = type(installed).__call__

    def timed(self, graph):
        with GcTimer() as gc_time:
            cpu = time.process_time()
            if profiler is not None:
                profiler.enable()
            try:
                real_call(self, graph)
            finally:
                if profiler is not None:
                    profiler.disable()
            clock["cpu"] += time.process_time() - cpu
        clock["gc"] += gc_time.seconds
        clock["gc_full"] += gc_time.full

    type(installed).__call__ = timed
    try:
        with no_compile_caches():  # a cache hit would skip the joint passes, the pass among them
            step = torch.compile(lambda i: model.loss(i))  # backend="inductor"
            history = pass_manager.HISTORY.mark()
            wall, cpu = time.perf_counter(), time.process_time()
            step(ids).backward()
            first, first_cpu = time.perf_counter() - wall, time.process_time() - cpu
            start = time.perf_counter()
            step(ids).backward()
            second = time.perf_counter() - start
    finally:
        type(installed).__call__ = real_call
        uninstall_inductor()
    (r,) = [r for r in pass_manager.HISTORY.since(history) if r.graph == "joint"]
    assert not r.error, r.error
    expected = expected_sites(model, forward, off)
    assert {op: r.fused(op) for op in expected} == expected, ({op: r.fused(op) for op in expected}, expected)
    return {"layers": layers, "first_call": first, "first_call_cpu": first_cpu, "second_call": second,
            "pass": r.seconds, "pass_cpu": clock["cpu"], "pass_gc": clock["gc"], "gc_full": clock["gc_full"],
            "objects": len(gc.get_objects()), "nodes_before": r.nodes_before,
            "nodes_after": r.nodes_after, "sites": len(r.sites)}


def load_torchair():
    """torchair from the torch_npu wheel with CANN stubbed, through the test harness."""
    from npu_fusion_testing.torchair import harness

    torchair = harness.load_torchair()
    from npu_fusion.lowering import ge_converters

    if not ge_converters.register():
        raise RuntimeError("npu_fusion's GE converters did not register with torchair")
    return torchair


class HookClock:
    """Wraps torchair's ``post_grad_custom_pre_pass`` (the one ``npu_fusion.install`` set):
    wall and CPU time of every call, and the collector's pauses inside them."""

    def __init__(self, hook):
        self.hook = hook
        self.wall, self.cpu, self.gc, self.gc_full, self.calls = 0.0, 0.0, 0.0, 0, 0

    def __call__(self, gm, example_inputs=None, config=None):
        with GcTimer() as gc_time:
            wall, cpu = time.perf_counter(), time.process_time()
            try:
                self.hook(gm, example_inputs, config)
            finally:
                self.wall += time.perf_counter() - wall
                self.cpu += time.process_time() - cpu
                self.calls += 1
        self.gc += gc_time.seconds
        self.gc_full += gc_time.full


@contextlib.contextmanager
def torchair_probes(stats: dict):
    """Time torchair's per-graph compile (``_NpuFxCompiler._gen_compiled_gm``: its FX passes,
    the npu-fusion pass among them, FX -> GE conversion and GE graph passes) and count the
    ops of every GE graph it builds. Patches the two torchair methods while active."""
    from torchair._ge_concrete_graph.fx2ge_converter import GeConcreteGraph
    from torchair.npu_fx_compiler import _NpuFxCompiler

    gen, optimize = _NpuFxCompiler._gen_compiled_gm, GeConcreteGraph.optimize_graph_without_runtime

    def timed_gen(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return gen(self, *args, **kwargs)
        finally:
            stats["torchair_graph_compile"] = stats.get("torchair_graph_compile", 0.0) + time.perf_counter() - start

    def counted_optimize(self, *args, **kwargs):
        out = optimize(self, *args, **kwargs)
        stats.setdefault("ge_ops", []).append(len(self.graph.op))
        return out

    _NpuFxCompiler._gen_compiled_gm, GeConcreteGraph.optimize_graph_without_runtime = timed_gen, counted_optimize
    try:
        yield stats
    finally:
        _NpuFxCompiler._gen_compiled_gm, GeConcreteGraph.optimize_graph_without_runtime = gen, optimize


def measure_torchair(torchair, layers: int, target: str = "a2", dtype=torch.float32, seq: int = 16,
                     batch: int = 2, forward: bool = None, off: bool = False) -> dict:
    """``measure`` through ``torchair.get_npu_backend`` with ``npu_fusion.install`` (see the module doc)."""
    from torch._decomp import get_decompositions
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from npu_fusion.plugin import pass_manager

    model = bundled("llama", num_layers=layers, dtype=dtype)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    gc.collect()
    config = torchair.CompilerConfig()
    config.debug.run_eagerly = True  # build the GE graph, then run the FX graph on CPU
    npu_fusion.install(config, **fusion_options(target, forward, off))
    clock = HookClock(config.post_grad_custom_pre_pass.value)
    config.post_grad_custom_pre_pass = clock
    backend = torchair.get_npu_backend(compiler_config=config,
                                       custom_decompositions=get_decompositions([torch.ops.aten.silu_backward]))
    # get_npu_backend put a "once" filter for every UserWarning first in line; with
    # debug.run_eagerly AOTAutograd warns about the unboxed FX graph it gets back.
    warnings.filterwarnings("ignore", message="Your compiler for AOTAutograd", category=UserWarning)
    step = torch.compile(lambda i: model.loss(i), backend=backend)
    history = pass_manager.HISTORY.mark()
    stats = {}
    with sdpa_kernel(SDPBackend.MATH), torchair_probes(stats):
        wall, cpu = time.perf_counter(), time.process_time()
        step(ids).backward()
        first, first_cpu = time.perf_counter() - wall, time.process_time() - cpu
        start = time.perf_counter()
        step(ids).backward()  # compiled already: what running alone costs (here, eagerly on CPU)
        second = time.perf_counter() - start
    results = pass_manager.HISTORY.since(history)
    assert [x.graph for x in results] == ["forward", "backward"], f"expected one forward and one backward graph, " \
                                                                  f"got {[x.graph for x in results]}"
    assert clock.calls == 2, f"expected the pass hook on one forward and one backward graph, got {clock.calls} calls"
    assert len(stats.get("ge_ops", ())) == 2, f"expected two GE graphs, torchair built {stats.get('ge_ops')}"
    r = results[1]
    assert not any(x.error for x in results), [x.error for x in results]
    expected = expected_sites(model, forward, off)
    fused = {op: sum(x.fused(op) for x in results) for op in expected}  # a forward op's sites: the forward graph's
    assert fused == expected, (fused, expected)
    return {"layers": layers, "first_call": first, "first_call_cpu": first_cpu, "second_call": second,
            "pass": sum(x.seconds for x in results), "pass_cpu": clock.cpu, "pass_gc": clock.gc,
            "gc_full": clock.gc_full, "torchair_graph_compile": stats["torchair_graph_compile"],
            "ge_ops": stats["ge_ops"], "objects": len(gc.get_objects()), "nodes_before": r.nodes_before,
            "nodes_after": r.nodes_after, "sites": sum(len(x.sites) for x in results)}


def fit(xs, ys):
    """Least squares y = a + b x, and R^2."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    a = my - b * mx
    ss_res = sum((y - a - b * x) ** 2 for x, y in zip(xs, ys))
    ss_tot = sum((y - my) ** 2 for y in ys)
    return a, b, 1 - ss_res / ss_tot if ss_tot else 1.0


def profile_pass(layers: int, top: int = 25) -> str:
    """cProfile of the pass alone on the backward graph of a ``layers``-layer model."""
    import copy

    from npu_fusion.plugin.pass_manager import fuse_backward
    from npu_fusion_testing.capture import Capture

    model = bundled("llama", num_layers=layers)
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    capture = Capture(fuse=False)  # the backward graph as the partitioner made it: profiled below
    torch.compile(lambda i: model.loss(i), backend=capture)(ids).backward()
    gm, forward = copy.deepcopy(capture.backwards[0]), capture.partition_forwards[0]
    gc.collect()
    gc.disable()  # collector pauses would land on whichever function allocates: measured above
    try:
        profiler = cProfile.Profile()
        profiler.enable()
        result = fuse_backward(gm, {"target": "generic"}, forward=forward)
        profiler.disable()
    finally:
        gc.enable()
    out = io.StringIO()
    out.write(f"pass on {result.nodes_before} nodes: {result.seconds * 1e3:.0f} ms (under cProfile, GC off)\n")
    pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats(top)
    out.write("\n")
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def _profiled(run, sort_first: str, top: int):
    """``run(profiler)``'s row and the profile's two listings (``sort_first``, then the other of tottime and
    cumulative), with GC off under the profiler: its pauses would land on whichever function allocates."""
    profiler = cProfile.Profile()
    gc.collect()
    gc.disable()
    try:
        row = run(profiler)
    finally:
        gc.enable()
    out = io.StringIO()
    for order in (sort_first, "cumulative" if sort_first == "tottime" else "tottime"):
        pstats.Stats(profiler, stream=out).sort_stats(order).print_stats(top)
    return row, out.getvalue()


def profile_joint(layers: int, width: dict, target: str = "generic", top: int = 25) -> str:
    """cProfile of ``fuse_joint`` alone, in the backend's first compiled step of a ``layers``-layer model
    of the given widths (GC off under the profiler)."""
    row, listings = _profiled(lambda p: measure(layers, target=target, width=width, profiler=p), "tottime", top)
    return (f"fuse_joint on {row['nodes_before']} nodes, {layers} layers, head_dim {row['head_dim']}, hidden "
            f"{row['hidden']}: {row['pass_cpu'] * 1e3:.0f} ms CPU (under cProfile, GC off)\n{listings}")


def profile_inductor(layers: int, target: str = "generic", top: int = 30) -> str:
    """cProfile of the pass's call on Inductor's joint graph (``install_inductor``'s ``CustomGraphPass``) in
    the first compiled step of a ``layers``-layer model (GC off under the profiler, as :func:`profile_joint`)."""
    row, listings = _profiled(lambda p: measure_inductor(layers, target=target, profiler=p), "cumulative", top)
    return (f"Inductor's joint-graph pass on {row['nodes_before']} nodes, {layers} layers: "
            f"{row['pass_cpu'] * 1e3:.0f} ms CPU (under cProfile, GC off)\n{listings}")


def measure_widths(args: argparse.Namespace) -> list:
    """One row per (head_dim, layers) on the backend: ``--repeat`` runs each, medians of the times."""
    target = args.target or "generic"
    rows = []
    for head_dim in args.widths:
        width = widths(head_dim, args.heads, args.kv_heads)
        for layers in args.layers:
            runs = [measure(layers, target=target, width=width) for _ in range(args.repeat)]
            row = dict(runs[0])
            for key in ("first_call", "first_call_cpu", "pass", "pass_cpu", "pass_gc"):
                row[key] = statistics.median(r[key] for r in runs)
            rows.append(row)
            print(f"head_dim {head_dim}, {layers} layers: pass {row['pass_cpu'] * 1e3:.0f} ms CPU",
                  file=sys.stderr, flush=True)
    return rows


def print_widths_table(rows) -> None:
    """Per configuration: the pass's CPU time, the joint graph's nodes, CPU time per node and the share."""
    print("| head_dim (hidden) | layers | joint nodes before -> after | sites fused | first step CPU | "
          "pass CPU | pass CPU per node | pass / first step, CPU |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['head_dim']} ({r['hidden']}) | {r['layers']} | {r['nodes_before']} -> {r['nodes_after']} | "
              f"{r['sites']} | {r['first_call_cpu']:.2f} s | {r['pass_cpu'] * 1e3:.0f} ms | "
              f"{1e6 * r['pass_cpu'] / r['nodes_before']:.0f} us | "
              f"{100 * r['pass_cpu'] / r['first_call_cpu']:.1f}% |")
    for head_dim in dict.fromkeys(r["head_dim"] for r in rows):
        same = [r for r in rows if r["head_dim"] == head_dim]
        if len(same) >= 2:
            _, b, r2 = fit([math.log(r["nodes_before"]) for r in same], [math.log(r["pass_cpu"]) for r in same])
            print(f"\nhead_dim {head_dim}: power fit pass CPU time ~ nodes^{b:.2f} (R^2 = {r2:.4f}; 1.00 = linear)")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--repeat", type=int, default=1, help="runs per size; the table shows the medians")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument("--profile", type=int, default=0, metavar="LAYERS",
                        help="also print a cProfile of the pass on a model of this many layers (with --inductor: "
                             "the pass's call on Inductor's joint graph)")
    parser.add_argument("--torchair", action="store_true",
                        help="compile through torchair.get_npu_backend with npu_fusion.install (torchair "
                             "from the torch_npu wheel, CANN stubbed, via tests/torchair; see the module doc)")
    parser.add_argument("--inductor", action="store_true",
                        help="compile with stock Inductor after npu_fusion.install_inductor (the pass on the joint "
                             "graph; the first call includes Inductor's code generation and C++ compiles)")
    parser.add_argument("--target", default=None,
                        help="npu-fusion target (default: generic, or a2 with --torchair)")
    parser.add_argument("--forward", action="store_true",
                        help="each size twice, side by side: the backward rules alone, then the forward rules too")
    parser.add_argument("--net", action="store_true",
                        help="each size twice, side by side, on the chosen path: every rule off, then the "
                             "default options; the first step's time with the pass against without it")
    parser.add_argument("--widths", type=int, nargs="+", metavar="HEAD_DIM",
                        help="measure these head dims (hidden = heads x head_dim, MLP twice that) at each of "
                             "--layers on the backend, and with --profile profile the pass at each of them")
    parser.add_argument("--heads", type=int, default=4, help="attention heads with --widths (default 4)")
    parser.add_argument("--kv-heads", type=int, default=2, help="key/value heads with --widths (default 2)")
    parser.add_argument("--against", metavar="REV",
                        help="each --widths (default 16) x --layers row at git revision REV's npu_fusion and at the "
                             "working tree's, alternating, each run in a fresh process: the pass's CPU time before "
                             "-> after (benchmarks/before_after.py)")
    parser.add_argument("--write-docs", metavar="NAME",
                        help="also write what this prints into block NAME of its docs/ page")
    args = parser.parse_args(argv)
    if args.widths and (args.forward or args.net or args.torchair or args.inductor):
        parser.error("--widths measures the npu_fusion backend's joint graph alone")
    if args.against and (args.forward or args.net or args.torchair or args.inductor or args.profile):
        parser.error("--against measures the npu_fusion backend's joint graph alone, without --profile")
    return args


def chosen_path(args: argparse.Namespace):
    """``(run, description)``: one measurement per model size on the path the options chose."""
    if args.torchair:
        torchair = load_torchair()
        target = args.target or "a2"
        return (lambda layers, forward=None, off=False: measure_torchair(torchair, layers, target=target,
                                                                         forward=forward, off=off),
                f"torchair {os.path.dirname(torchair.__file__)}, target {target}")
    target = args.target or "generic"
    if args.inductor:
        return (lambda layers, forward=None, off=False: measure_inductor(layers, target=target, forward=forward,
                                                                         off=off),
                f"stock Inductor with install_inductor, target {target}")
    return (lambda layers, forward=None, off=False: measure(layers, target=target, forward=forward, off=off),
            f"aot_autograd CPU backend, target {target}")


def measure_sizes(run, args: argparse.Namespace, forward: bool = None) -> list:
    """One row per model size: the medians of ``--repeat`` runs."""
    rows = []
    keys = ["first_call", "first_call_cpu", "second_call", "pass", "pass_cpu", "pass_gc"]
    if args.torchair:
        keys.append("torchair_graph_compile")
    for layers in args.layers:
        start = time.perf_counter()
        runs = [run(layers) if forward is None else run(layers, forward=forward) for _ in range(args.repeat)]
        row = dict(runs[0])
        for key in keys:
            row[key] = statistics.median(r[key] for r in runs)
        rows.append(row)
        print(f"{layers} layers: first call {row['first_call']:.2f} s, pass {row['pass'] * 1e3:.0f} ms "
              f"({time.perf_counter() - start:.0f} s for {args.repeat} run(s))", file=sys.stderr, flush=True)
    return rows


def print_torchair_table(rows) -> None:
    print("| layers | backward nodes before -> after | sites fused | GE ops fw + bw | "
          "first fwd+bw call: wall (CPU) | of which torchair graph compile fw + bw | second call | "
          "pass: wall (CPU) | of which GC (full collections) | pass / first call: wall (CPU time) | "
          "pass CPU time per node |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        fw_ops, bw_ops = r["ge_ops"]
        print(f"| {r['layers']} | {r['nodes_before']} -> {r['nodes_after']} | {r['sites']} | "
              f"{fw_ops} + {bw_ops} | {r['first_call']:.2f} s ({r['first_call_cpu']:.2f} s) | "
              f"{r['torchair_graph_compile']:.2f} s | {r['second_call'] * 1e3:.0f} ms | "
              f"{r['pass'] * 1e3:.0f} ms ({r['pass_cpu'] * 1e3:.0f} ms) | "
              f"{r['pass_gc'] * 1e3:.0f} ms ({r['gc_full']}) | "
              f"{100 * r['pass'] / r['first_call']:.1f}% ({100 * r['pass_cpu'] / r['first_call_cpu']:.1f}%) | "
              f"{1e6 * r['pass_cpu'] / r['nodes_before']:.0f} us |")


def print_table(rows) -> None:
    print("| layers | nodes the pass sees, before -> after | sites fused | first fwd+bw call: wall (CPU) | "
          "second call | pass: wall (CPU) | of which GC (full collections) | pass / first call, CPU time | "
          "pass CPU time per node |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['layers']} | {r['nodes_before']} -> {r['nodes_after']} | {r['sites']} | "
              f"{r['first_call']:.2f} s ({r['first_call_cpu']:.2f} s) | {r['second_call'] * 1e3:.0f} ms | "
              f"{r['pass'] * 1e3:.0f} ms ({r['pass_cpu'] * 1e3:.0f} ms) | "
              f"{r['pass_gc'] * 1e3:.0f} ms ({r['gc_full']}) | "
              f"{100 * r['pass_cpu'] / r['first_call_cpu']:.1f}% | "
              f"{1e6 * r['pass_cpu'] / r['nodes_before']:.0f} us |")


def print_fits(rows) -> None:
    """How the pass's CPU time grows with the graph: a linear and a power fit over the sizes."""
    xs = [r["nodes_before"] for r in rows]
    ys = [r["pass_cpu"] for r in rows]
    a, b, r2 = fit(xs, ys)
    print(f"\nlinear fit: pass CPU time ~= {a * 1e3:.1f} ms + {b * 1e6:.0f} us x nodes (R^2 = {r2:.4f})")
    la, lb, lr2 = fit([math.log(x) for x in xs], [math.log(y) for y in ys])
    print(f"power fit: pass CPU time ~ nodes^{lb:.2f} (R^2 = {lr2:.4f}; 1.00 = linear)")
    small, large = rows[0], rows[-1]
    growth = (large["pass_cpu"] / small["pass_cpu"]) / (large["nodes_before"] / small["nodes_before"])
    print(f"from {small['nodes_before']} to {large['nodes_before']} nodes the CPU time per node changes "
          f"x{growth:.2f} (1.00 = linear)")


def print_forward_comparison(alone, both) -> None:
    """The backward rules alone beside the forward rules too, per size (``--forward``)."""
    print("| layers | nodes before | sites fused: backward alone / forward too | pass CPU time: backward alone "
          "-> forward too | ratio | first fwd+bw call CPU time: alone -> too | pass / first call, forward too |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for a, b in zip(alone, both):
        print(f"| {a['layers']} | {a['nodes_before']} | {a['sites']} / {b['sites']} | "
              f"{a['pass_cpu'] * 1e3:.0f} -> {b['pass_cpu'] * 1e3:.0f} ms | {b['pass_cpu'] / a['pass_cpu']:.2f}x | "
              f"{a['first_call_cpu']:.2f} -> {b['first_call_cpu']:.2f} s | "
              f"{100 * b['pass_cpu'] / b['first_call_cpu']:.1f}% |")


def measure_net(run, args: argparse.Namespace) -> list:
    """Per size, ``--repeat`` pairs of first steps, every rule off then the defaults, one after the
    other (a busy machine disturbs both alike): ``(off, on)`` rows of medians."""
    pairs = []
    for layers in args.layers:
        runs = [(run(layers, off=True), run(layers)) for _ in range(args.repeat)]
        median = []
        for side in zip(*runs):
            row = dict(side[0])
            for key in ("first_call", "first_call_cpu", "pass", "pass_cpu"):
                row[key] = statistics.median(r[key] for r in side)
            median.append(row)
        pairs.append(tuple(median))
        off, on = median
        print(f"{layers} layers: first step CPU {off['first_call_cpu']:.2f} s without, {on['first_call_cpu']:.2f} s "
              f"with the pass", file=sys.stderr, flush=True)
    return pairs


def print_net(pairs) -> None:
    """The first step with every rule off beside the defaults, per size (``--net``)."""
    print("| layers | nodes before | sites fused | first step, every rule off: wall (CPU) | with the pass: wall (CPU) "
          "| net change: wall (CPU) | pass CPU | pass / first step, CPU |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for off, on in pairs:
        print(f"| {on['layers']} | {on['nodes_before']} | {on['sites']} | "
              f"{off['first_call']:.2f} s ({off['first_call_cpu']:.2f} s) | "
              f"{on['first_call']:.2f} s ({on['first_call_cpu']:.2f} s) | "
              f"{100 * (on['first_call'] / off['first_call'] - 1):+.1f}% "
              f"({100 * (on['first_call_cpu'] / off['first_call_cpu'] - 1):+.1f}%) | "
              f"{on['pass_cpu'] * 1e3:.0f} ms | {100 * on['pass_cpu'] / on['first_call_cpu']:.1f}% |")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.against:  # every measurement in a child process, none here
        from benchmarks import before_after

        with publishing(args.write_docs, script_command(__file__, argv), fenced=False):
            before_after.print_against(before_after.compare(args), args)
        return 0
    torch.set_num_threads(args.threads)
    run, mode = chosen_path(args)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s); {mode}; warming up...", file=sys.stderr)
    run(1)
    with publishing(args.write_docs, script_command(__file__, argv), fenced=False):
        return measure_and_print(run, args)


def measure_and_print(run, args) -> int:
    if args.widths:
        print_widths_table(measure_widths(args))
        if args.profile:
            for head_dim in args.widths:
                text = profile_joint(args.profile, widths(head_dim, args.heads, args.kv_heads), args.target or "generic")
                print(f"\n```\n{text}```")
        return 0
    if args.net:
        print_net(measure_net(run, args))
        return 0
    if args.forward:  # each size alone and too, one after the other, so a busy machine disturbs both alike
        pairs = [(measure_sizes(run, sized, False)[0], measure_sizes(run, sized, True)[0])
                 for sized in (argparse.Namespace(**{**vars(args), "layers": [n]}) for n in args.layers)]
        print_forward_comparison(*zip(*pairs))
        return 0
    rows = measure_sizes(run, args)
    (print_torchair_table if args.torchair else print_table)(rows)
    if len(rows) >= 2:
        print_fits(rows)
    if args.profile:
        text = profile_inductor(args.profile, args.target or "generic") if args.inductor else profile_pass(args.profile)
        print(f"\n```\n{text}```")
    return 0


if __name__ == "__main__":
    sys.exit(main())
