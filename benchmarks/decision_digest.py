"""What the pass decides on a fixed, deterministic set of programs, as a JSON digest, and every
difference between two digests.

A change that only makes the pass faster must leave every decision as it was: the same sites, the
same misses with the same reasons, the same graph after the pass. Write a digest on the commit
before the change and one after it, then compare them; ``--compare`` prints each difference and
exits 1 if there is any.

Per program, the digest holds each graph the pass ran on (``FusionResult.graph``: ``joint``,
``backward``, ``forward`` or ``inference``) in the order the pass saw them, with

* its sites (every field of ``Site``: op, mode, the outputs it replaced (the first is its anchor),
  inputs, replaced nodes and targets, modelled traffic, note) and, per site, the fused calls of its
  op that read its inputs, printed with their arguments;
* its misses (op, node name, reason), its error if the pass failed, the forward copies and the
  emitted targets;
* the graph after the pass: its Python code (comments dropped: they cite source files and lines,
  which differ between checkouts) and each node's ``meta["val"]`` as text (dtype, shape, stride,
  symbolic sizes printed).

The programs (all with ``target="generic"``, every other option at its default; Dynamo reset before
each, so node and symbol names are the same on every run):

* ``overhead/hd<D>/l<L>``: ``benchmarks.pass_overhead``'s models, the bundled Llama of 1 and 2 layers
  at head dims 16, 128 and 960 (its ``widths``), one training step through the ``npu_fusion``
  backend (the pass on the joint graph);
* ``corpus/<name>``: the FX corpus's graphs (``tests/fx_corpus/``), without Dynamo, through
  ``fuse_joint`` or ``fuse_backward`` as the corpus entry's stage says;
* ``backend/<model>/<static|dynamic>/<train|infer>``: the bundled models (``npu_fusion.models``)
  through the backend, a training step and a forward under ``torch.no_grad()`` (the inference
  graph): each model's both under ``dynamic=False`` (2 layers; Llama's training step is
  ``overhead/hd16/l2``), and under ``dynamic=True`` (1 layer) each model's training step and
  Llama's forward (:data:`DYNAMIC`);
* ``inductor/<model>``: each bundled model's training step with Inductor's decompositions and
  min-cut partitioner, as ``install_inductor``'s hook sees the joint graph, no code generated (as
  ``benchmarks.graph_effect --path inductor`` traces it);
* ``partitioned/<model>``: Llama's and Phi-3's training step with the pass after the default
  partition, where ``install``'s torchair hook runs it, through AOTAutograd alone as
  ``benchmarks.graph_effect --path torchair --forward`` traces it: the backward graph with its
  forward for provenance (``fuse_backward``), then the forward (``fuse_forward``). torchair's own
  backend, which needs the torch_npu wheel, is not run.

    python -m benchmarks.decision_digest --out /tmp/digest.json [--only corpus/ backend/llama]
    python -m benchmarks.decision_digest --compare /tmp/before.json /tmp/after.json
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import re
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.fx as fx

import npu_fusion  # noqa: F401  (registers the ops)
from npu_fusion.compat import inductor_decompositions
from npu_fusion.models import BUNDLED, bundled
from npu_fusion.plugin.backend import aot_backend
from npu_fusion.plugin.options import FusionOptions
from npu_fusion.plugin.pass_manager import FusionResult, fuse_backward, fuse_forward, fuse_joint

#: the options of every program: the defaults, with the target fixed (``auto`` would read the host)
OPTIONS = {"target": "generic"}
#: benchmarks.pass_overhead's sizes: head dims and layers
OVERHEAD_HEAD_DIMS = (16, 128, 960)
OVERHEAD_LAYERS = (1, 2)
#: the programs under ``dynamic=True`` (1 layer: a dynamic compile costs 4 to 5 times a static one):
#: (bundled model, training), every model's training step and Llama's inference graph
DYNAMIC = tuple((model, True) for model in sorted(BUNDLED)) + (("llama", False),)
#: the models whose training step is also fused after the partition, as torchair's hook fuses it
PARTITIONED = ("llama", "phi3")


# --------------------------------------------------------------------------- one graph as text

def value_text(value: Any) -> str:
    """A node's ``meta["val"]`` as text: a tensor's dtype, shape and stride (symbolic sizes printed),
    a sequence item by item, a symbolic or plain number as itself."""
    if isinstance(value, torch.Tensor):
        try:
            stride = ", ".join(map(str, value.stride()))
        except RuntimeError:  # a layout without strides
            stride = "-"
        dtype = str(value.dtype).replace("torch.", "")
        return f"{dtype}[{', '.join(map(str, value.shape))}] stride ({stride})"
    if isinstance(value, (list, tuple)):
        return "(" + ", ".join(value_text(v) for v in value) + ")"
    if value is None or isinstance(value, (bool, int, float, str, torch.SymInt, torch.SymFloat, torch.SymBool)):
        return str(value)
    return type(value).__name__


def code_text(graph: fx.Graph) -> str:
    """The graph's Python code without its comments (source files and lines of the program)."""
    src = graph.python_code(root_module="self").src
    return "\n".join(line for line in src.splitlines() if line.strip() and not line.strip().startswith("#")) + "\n"


def _is_fused_call(node: fx.Node) -> bool:
    return node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) \
        and node.target.namespace == "npu_fusion"


def _op_name(node: fx.Node) -> str:
    return node.target._opname  # npu_fusion.rms_norm_grad.default -> rms_norm_grad


def _made(node: fx.Node) -> int:
    """Where ``node`` stands among the calls of its target in the order they were made: FX names them
    ``<op>_default``, ``<op>_default_1``, ... as they are created."""
    suffix = re.fullmatch(r".*_default_(\d+)", node.name)
    return int(suffix.group(1)) if suffix else 0


def _sites_text(sites, fused: List[fx.Node]) -> List[Dict[str, Any]]:
    """Every field of each site, and its fused call printed (``fused``). Each site makes one call of
    its op and the pass records the sites in the order it makes them, so where an op has as many
    calls as sites they pair in that order; otherwise a site lists the calls of its op that read
    one of its inputs."""
    rows = []
    by_op: Dict[str, List[fx.Node]] = {}
    for node in fused:
        by_op.setdefault(_op_name(node), []).append(node)
    for calls in by_op.values():
        calls.sort(key=_made)
    seen: Dict[str, int] = {}
    for site in sites:
        row = dataclasses.asdict(site)
        calls = by_op.get(site.op, [])
        if len(calls) == sum(s.op == site.op for s in sites):
            row["fused"] = [calls[seen.get(site.op, 0)].format_node()]
        else:
            inputs = set(site.inputs.values())
            row["fused"] = [n.format_node() for n in calls if inputs & {a.name for a in n.all_input_nodes}]
        seen[site.op] = seen.get(site.op, 0) + 1
        rows.append(row)
    return rows


def graph_digest(graph: fx.Graph, result: FusionResult) -> Dict[str, Any]:
    """What the pass decided on one graph, and the graph after it (see the module doc)."""
    fused = [n for n in graph.nodes if _is_fused_call(n)]
    return {
        "graph": result.graph, "target": result.target, "error": result.error,
        "nodes_before": result.nodes_before, "nodes_after": result.nodes_after,
        "sites": _sites_text(result.sites, fused),
        "misses": [{"op": m.op, "node": m.node, "reason": m.reason} for m in result.misses],
        "copies": list(result.copies), "emitted": dict(result.emitted),
        "code": code_text(graph),
        "values": {n.name: value_text(n.meta.get("val")) for n in graph.nodes},
    }


# --------------------------------------------------------------------------- the programs

def _compiled(make_model: Callable[[], torch.nn.Module], options: Dict[str, Any], dynamic: bool = False,
              train: bool = True, decompositions: Optional[dict] = None, stage: str = "joint"):
    """A program: ``make_model()`` compiled through the backend with an ``around_pass`` that digests each
    graph the pass rewrites; a training step (the loss: the pass runs on the joint graph at the
    partition) or, with ``train`` false, a forward under ``torch.no_grad()`` (the inference graph).
    With ``stage="backward"`` the pass runs after the default partition, where ``install``'s torchair
    hook runs it: on the backward graph with its forward for provenance, then ``fuse_forward`` on the
    partitioned forward (as ``benchmarks.graph_effect --path torchair --forward`` traces it)."""
    fusion_options = FusionOptions.from_mapping(options)

    def run() -> List[Dict[str, Any]]:
        graphs = []

        def around_pass(gm, run_pass):
            result = run_pass()
            graphs.append(graph_digest(gm.graph, result))
            if run_pass.stage == "backward":
                run_pass.after_partition.append(
                    lambda fw_gm, bw_gm: graphs.append(graph_digest(fw_gm.graph, fuse_forward(fw_gm, fusion_options))))

        model = make_model()
        ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
        backend = aot_backend(fusion_options, around_pass, stage=stage, decompositions=decompositions)
        if train:
            torch.compile(lambda i: model.loss(i), backend=backend, dynamic=dynamic)(ids)
        else:
            with torch.no_grad():
                torch.compile(lambda i: model(i), backend=backend, dynamic=dynamic)(ids)
        return graphs
    return run


def _corpus_program(name: str):
    """A program of the FX corpus: its captured graph through the pass, without Dynamo."""
    def run() -> List[Dict[str, Any]]:
        from tests import fx_corpus

        entry = fx_corpus.load(name)
        if entry.stage == "joint":
            result = fuse_joint(entry.gm, OPTIONS)
        else:
            result = fuse_backward(entry.gm, OPTIONS, forward=entry.forward)
        return [graph_digest(entry.gm.graph, result)]
    return run


def _corpus_names() -> List[str]:
    from tests import fx_corpus

    return sorted(fx_corpus.PROGRAMS)


def programs() -> Dict[str, Callable[[], List[Dict[str, Any]]]]:
    """Every program of the digest, by name, in the order they run."""
    from benchmarks.pass_overhead import widths

    out = {}
    for head_dim in OVERHEAD_HEAD_DIMS:
        for layers in OVERHEAD_LAYERS:
            out[f"overhead/hd{head_dim}/l{layers}"] = _compiled(
                lambda layers=layers, head_dim=head_dim: bundled("llama", num_layers=layers, **widths(head_dim)),
                OPTIONS)
    for name in _corpus_names():
        out[f"corpus/{name}"] = _corpus_program(name)
    for model in sorted(BUNDLED):
        for train in (True, False):
            if not (model == "llama" and train):  # overhead/hd16/l2 is that program
                out[f"backend/{model}/static/{'train' if train else 'infer'}"] = \
                    _compiled(lambda model=model: bundled(model), OPTIONS, False, train)
    for model, train in DYNAMIC:
        out[f"backend/{model}/dynamic/{'train' if train else 'infer'}"] = _compiled(
            lambda model=model: bundled(model, num_layers=1), OPTIONS, True, train)
    inductor = dict(OPTIONS, partitioner="min_cut")
    for model in sorted(BUNDLED):
        out[f"inductor/{model}"] = _compiled(lambda model=model: bundled(model), inductor,
                                             decompositions=inductor_decompositions())
    for model in PARTITIONED:
        out[f"partitioned/{model}"] = _compiled(lambda model=model: bundled(model), dict(OPTIONS, partitioner="default"),
                                                stage="backward")
    return out


def digest(only: Sequence[str] = (), progress: bool = False) -> Dict[str, Any]:
    """The digest of every program whose name starts with one of ``only`` (all when empty)."""
    start = time.process_time()
    wall = time.perf_counter()
    out = {}
    for name, run in programs().items():
        if only and not any(name.startswith(prefix) for prefix in only):
            continue
        torch._dynamo.reset()  # names of nodes and symbols start afresh
        began = time.process_time()
        try:
            out[name] = {"graphs": run()}
        except Exception as exc:  # a program that fails is one difference, not the end of the digest
            out[name] = {"error": f"{type(exc).__name__}: {exc}"}
        if progress:
            print(f"{name}: {len(out[name].get('graphs', []))} graph(s), {time.process_time() - began:.1f} s CPU",
                  file=sys.stderr, flush=True)
    torch._dynamo.reset()
    return {"meta": {"torch": torch.__version__, "cpu_seconds": round(time.process_time() - start, 1),
                     "wall_seconds": round(time.perf_counter() - wall, 1), **counts(out)},
            "programs": out}


def counts(programs_digest: Dict[str, Any]) -> Dict[str, int]:
    """How many programs, graphs, sites, misses and failed programs a digest's programs hold."""
    graphs = [g for p in programs_digest.values() for g in p.get("graphs", ())]
    return {"programs": len(programs_digest), "graphs": len(graphs), "sites": sum(len(g["sites"]) for g in graphs),
            "misses": sum(len(g["misses"]) for g in graphs),
            "failed_programs": sum("error" in p for p in programs_digest.values()),
            "pass_errors": sum(g["error"] is not None for g in graphs)}


# --------------------------------------------------------------------------- two digests

def differences(a: Any, b: Any, path: str = "") -> List[str]:
    """Every difference between two digests' values at ``path``, one entry each (code as a unified diff)."""
    if type(a) is not type(b):
        return [f"{path}: {json.dumps(a)} -> {json.dumps(b)}"]
    if isinstance(a, dict):
        out = []
        for key in list(a) + [k for k in b if k not in a]:
            if key not in b:
                out.append(f"{path}/{key}: only in A: {json.dumps(a[key])[:2000]}")
            elif key not in a:
                out.append(f"{path}/{key}: only in B: {json.dumps(b[key])[:2000]}")
            else:
                out.extend(differences(a[key], b[key], f"{path}/{key}"))
        return out
    if isinstance(a, list):
        if a == b:
            return []
        if len(a) == len(b):
            return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{path}[{i}]")]
        texts_a, texts_b = [json.dumps(x, sort_keys=True) for x in a], [json.dumps(y, sort_keys=True) for y in b]
        lines = [f"{path}: {len(a)} -> {len(b)} items"]
        lines += [f"  only in A: {t}" for t in texts_a if t not in texts_b]
        lines += [f"  only in B: {t}" for t in texts_b if t not in texts_a]
        return ["\n".join(lines)]
    if a == b:
        return []
    if isinstance(a, str) and ("\n" in a or "\n" in b):
        diff = difflib.unified_diff(a.splitlines(), b.splitlines(), "A", "B", lineterm="", n=1)
        return [f"{path}:\n" + "\n".join(diff)]
    return [f"{path}: {json.dumps(a)} -> {json.dumps(b)}"]


def compare(path_a: str, path_b: str, out=None) -> int:
    """Print every difference between the programs of two digests; 1 if there is any, else 0."""
    out = out if out is not None else sys.stdout
    with open(path_a) as fa, open(path_b) as fb:
        a, b = json.load(fa), json.load(fb)
    found = differences(a["programs"], b["programs"], "")
    for line in found:
        print(line, file=out)
    summary = ", ".join(f"{k} {a['meta'].get(k)} / {b['meta'].get(k)}" for k in ("programs", "graphs", "sites", "misses"))
    print(f"{len(found)} difference(s) between {path_a} and {path_b} (A / B: {summary})", file=out)
    return 1 if found else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="decision-digest.json", help="where to write the digest (JSON)")
    parser.add_argument("--only", nargs="+", default=(), metavar="PREFIX",
                        help="only the programs whose names start with one of these (corpus/, backend/llama)")
    parser.add_argument("--list", action="store_true", help="print the programs' names and stop")
    parser.add_argument("--compare", nargs=2, metavar=("A", "B"), help="print every difference between two digests")
    args = parser.parse_args(argv)
    if args.compare:
        return compare(*args.compare)
    if args.list:
        print("\n".join(programs()))
        return 0
    torch.set_num_threads(1)
    made = digest(args.only, progress=True)
    with open(args.out, "w") as f:
        json.dump(made, f, indent=1)
        f.write("\n")
    meta = made["meta"]
    print(f"{args.out}: {meta['programs']} programs, {meta['graphs']} graphs, {meta['sites']} sites, "
          f"{meta['misses']} misses, {meta['failed_programs']} failed programs, {meta['pass_errors']} pass errors; "
          f"{meta['cpu_seconds']} s CPU, {meta['wall_seconds']} s wall", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
