"""A small corpus of captured AOTAutograd graphs, so that a rule change is checked in seconds,
without Dynamo (``tests/test_fx_corpus.py``).

Each entry is one program of :data:`PROGRAMS` compiled once through the backend's AOTAutograd
with the pass held back: its joint graph (or, for ``stage="backward"``, the backward graph after
the default partition, with that partition's forward), written as plain data (nodes in order:
name, op, target by qualified name, arguments, the partitioner's tags) with the example inputs
the compile saw. Loading rebuilds the graph node for node and propagates fake values through it.

Regenerate after changing a program or moving to another torch (the test checks both)::

    python tests/fx_corpus.py
"""
from __future__ import annotations

import hashlib
import inspect
import operator
import pathlib
import sys
from typing import Any, Callable, Dict, List, NamedTuple

import torch
import torch.fx as fx

CORPUS = pathlib.Path(__file__).resolve().parent / "fx_corpus"
#: node meta the pass reads besides fake values (partitioning, activation checkpointing)
KEPT_META = ("partitioner_tag", "recompute")


# --------------------------------------------------------------------------- the programs

def _hf_model(model_type: str, dtype=torch.bfloat16, **overrides):
    def build():
        from transformers import AutoModelForCausalLM

        from npu_fusion.report.subjects import tiny_hf_config

        torch.manual_seed(0)
        config = tiny_hf_config(model_type, 1)
        for key, value in overrides.items():
            setattr(config, key, value)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").to(dtype)
        ids = torch.randint(0, config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))
        return lambda: model(input_ids=ids, labels=ids).loss
    return build


def _near_miss_norm():
    """An RMSNorm whose mean runs over the wrong axis: no site, and nothing may fuse."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, 8, 64, generator=gen, requires_grad=True)
    w = torch.randn(64, generator=gen, requires_grad=True)

    def step():
        xf = x.float()
        return (w * (xf * torch.rsqrt(xf.pow(2).mean(-2, keepdim=True) + 1e-6))).sum()
    return step


class Program(NamedTuple):
    build: Callable[[], Callable[[], torch.Tensor]]  # returns the step (a scalar loss)
    stage: str  # "joint" or "backward"
    #: sites per fused op, counted from the program's structure (not from the pass)
    sites: Dict[str, int]


#: name -> program. A 1-layer model has three RMSNorms (input, post-attention, final) and
#: RoPE on q and k; Qwen3 adds its q and k norms.
PROGRAMS = {
    "llama_bf16_joint": Program(_hf_model("llama"), "joint", {"rms_norm_grad": 3, "rotary_position_embedding_grad": 2}),
    "llama_fp32_backward": Program(_hf_model("llama", torch.float32), "backward",
                                   {"rms_norm_grad": 3, "rotary_position_embedding_grad": 2}),
    "gemma_bf16_joint": Program(_hf_model("gemma"), "joint", {"rms_norm_grad": 3, "rotary_position_embedding_grad": 2}),
    "qwen3_bf16_joint": Program(_hf_model("qwen3"), "joint", {"rms_norm_grad": 5, "rotary_position_embedding_grad": 2}),
    "gptj_fp32_joint": Program(_hf_model("gptj", torch.float32), "joint", {"rms_norm_grad": 0, "rotary_position_embedding_grad": 2}),
    "near_miss_norm_axis": Program(_near_miss_norm, "joint", {"rms_norm_grad": 0, "rotary_position_embedding_grad": 0}),
}


def programs_digest() -> str:
    """What the corpus was generated from: this module's program code and the torch release."""
    source = inspect.getsource(sys.modules[__name__])
    programs = source[source.index("def _hf_model("):source.index("def programs_digest")]
    return hashlib.sha256(f"{torch.__version__}\n{programs}".encode()).hexdigest()[:16]


# --------------------------------------------------------------------------- graphs as data

def _encode(value: Any) -> Any:
    if isinstance(value, fx.Node):
        return {"node": value.name}
    if isinstance(value, (list, tuple)):
        return {"tuple" if isinstance(value, tuple) else "list": [_encode(v) for v in value]}
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, (torch.device, torch.memory_format, torch.layout)):
        return {type(value).__name__: str(value).removeprefix("torch.")}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"cannot write {type(value).__name__} {value!r} into the corpus")


def _decode(value: Any, nodes: Dict[str, fx.Node]) -> Any:
    if not isinstance(value, dict):
        return value
    (kind, payload), = value.items()
    if kind == "node":
        return nodes[payload]
    if kind in ("list", "tuple"):
        items = [_decode(v, nodes) for v in payload]
        return items if kind == "list" else tuple(items)
    if kind == "device":
        return torch.device(payload)
    return getattr(torch, payload)  # dtype, memory_format, layout


def _target_name(target) -> str:
    if target is operator.getitem:
        return "operator.getitem"
    if isinstance(target, torch._ops.OpOverload):
        return str(target)
    raise TypeError(f"cannot write the call target {target!r} into the corpus")


def _resolve(name: str):
    if name == "operator.getitem":
        return operator.getitem
    namespace, op, overload = name.split(".")
    return getattr(getattr(getattr(torch.ops, namespace), op), overload)


def _meta(node: fx.Node) -> Dict[str, Any]:
    kept = {k: node.meta[k] for k in KEPT_META if k in node.meta}
    if "recompute" in kept:
        kept["recompute"] = kept["recompute"].name
    return kept


def graph_as_data(graph: fx.Graph) -> List[Dict[str, Any]]:
    return [{"name": n.name, "op": n.op,
             "target": n.target if n.op in ("placeholder", "output", "get_attr") else _target_name(n.target),
             "args": _encode(n.args), "kwargs": {k: _encode(v) for k, v in n.kwargs.items()}, "meta": _meta(n)}
            for n in graph.nodes]


def graph_from_data(rows: List[Dict[str, Any]]) -> fx.Graph:
    from torch.utils.checkpoint import CheckpointPolicy

    graph, nodes = fx.Graph(), {}
    for row in rows:
        args = _decode(row["args"], nodes)
        kwargs = {k: _decode(v, nodes) for k, v in row["kwargs"].items()}
        if row["op"] == "placeholder":
            node = graph.placeholder(row["target"])
        elif row["op"] == "output":
            node = graph.output(args[0])
        elif row["op"] == "get_attr":
            node = graph.get_attr(row["target"])
        else:
            node = graph.call_function(_resolve(row["target"]), tuple(args), kwargs)
        node.name = row["name"]
        node.meta.update(row["meta"])
        if "recompute" in node.meta:
            node.meta["recompute"] = CheckpointPolicy[node.meta["recompute"]]
        nodes[row["name"]] = node
    return graph


class Entry(NamedTuple):
    name: str
    stage: str
    sites: Dict[str, int]
    gm: fx.GraphModule
    inputs: List[torch.Tensor]
    forward: fx.Graph  # the partition's forward of a backward entry (else None)


def _holding(constants: Dict[str, torch.Tensor]) -> torch.nn.Module:
    root = torch.nn.Module()
    for attribute, constant in constants.items():
        setattr(root, attribute, constant)
    return root


def load(name: str) -> Entry:
    """A corpus entry with fake values on every node (a fresh copy: the pass rewrites in place)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    data = torch.load(CORPUS / f"{name}.pt", weights_only=True)
    gm = fx.GraphModule(_holding(data["constants"]), graph_from_data(data["graph"]))
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    FakeTensorProp(gm, mode).propagate(*[mode.from_tensor(t) for t in data["inputs"]])  # shapes as captured
    forward, inputs = None, data["inputs"]
    if data["forward"]:
        forward = fx.GraphModule(_holding(data["forward_constants"]), graph_from_data(data["forward"]))
        inputs = _backward_inputs(forward, data["forward_inputs"], gm.graph, inputs)
        FakeTensorProp(forward, mode).propagate(*[mode.from_tensor(t) for t in data["forward_inputs"]])
        forward = forward.graph
    program = PROGRAMS[name]
    return Entry(name, program.stage, program.sites, gm, inputs, forward)


def _backward_inputs(forward: fx.GraphModule, forward_inputs, backward: fx.Graph, random_inputs):
    """A backward graph's inputs as the program makes them: the saved tensors from running its
    forward (the pass relies on what they are), the incoming gradients random."""
    with torch.no_grad():
        values = forward(*forward_inputs)
    outputs = next(iter(forward.graph.find_nodes(op="output"))).args[0]
    saved = {node.name: value for node, value in zip(outputs, values) if isinstance(node, fx.Node)}
    placeholders = backward.find_nodes(op="placeholder")
    return [saved.get(p.name, given) for p, given in zip(placeholders, random_inputs)]


def digest_of_corpus() -> str:
    return (CORPUS / "DIGEST").read_text().strip()


# --------------------------------------------------------------------------- capture

def _capture(program: Program) -> Dict[str, Any]:
    from npu_fusion.plugin.backend import aot_backend
    from npu_fusion.patterns import RULES
    from npu_fusion.plugin.options import FusionOptions

    kept = {}

    def around_pass(gm, run):
        kept.setdefault("graph", graph_as_data(gm.graph))
        kept.setdefault("constants", {n.target: getattr(gm, n.target) for n in gm.graph.find_nodes(op="get_attr")})
        kept.setdefault("forward", graph_as_data(run.forward) if run.forward is not None else None)
        kept.setdefault("forward_constants", {} if run.forward is None else {
            n.target: getattr(run.forward.owning_module, n.target) for n in run.forward.find_nodes(op="get_attr")})
        kept.setdefault("forward_inputs", [] if run.forward is None else [
            p.meta["val"] for p in run.forward.find_nodes(op="placeholder")])
        kept.setdefault("inputs", [p.meta["val"] for p in gm.graph.find_nodes(op="placeholder")])
        run()  # with every fusion off: the graph stays as captured

    options = FusionOptions(target="generic", **{rule.option: False for rule in RULES})
    step = program.build()
    torch._dynamo.reset()
    torch.compile(step, backend=aot_backend(options, around_pass, stage=program.stage), fullgraph=False)()
    return kept


def _real_inputs(fakes: List[torch.Tensor]) -> List[torch.Tensor]:
    """Inputs of the captured shapes: integers in [0, 8) (ids, positions); floats normal, with a
    standard deviation of 1/sqrt(last size) for a tensor of two or more axes (a weight as a
    default init draws it, an activation of that scale). Unscaled, a bf16 Llama's attention
    logits reach a few hundred, where a bf16 ulp is 1 to 2 and the softmax turns any
    difference in rounding into a gradient error as large as the gradient: the float64
    criterion then compares two meaningless results."""
    gen = torch.Generator().manual_seed(0)
    made = []
    for fake in fakes:
        if fake.dtype.is_floating_point:
            scale = fake.shape[-1] ** -0.5 if fake.dim() >= 2 and fake.shape[-1] > 0 else 1.0
            made.append((torch.randn(fake.shape, generator=gen) * scale).to(fake.dtype))
        elif fake.dtype == torch.bool:
            made.append(torch.ones(fake.shape, dtype=torch.bool))
        else:
            made.append(torch.randint(0, 8, fake.shape, generator=gen).to(fake.dtype))
    return made


def regenerate() -> None:
    CORPUS.mkdir(exist_ok=True)
    for name, program in PROGRAMS.items():
        kept = _capture(program)
        data = {"graph": kept["graph"], "forward": kept["forward"], "forward_inputs": _real_inputs(kept["forward_inputs"]),
                "constants": kept["constants"], "forward_constants": kept["forward_constants"],
                "inputs": _real_inputs(kept["inputs"])}
        torch.save(data, CORPUS / f"{name}.pt")
        print(f"{name}: {len(data['graph'])} nodes")
    (CORPUS / "DIGEST").write_text(programs_digest() + "\n")


if __name__ == "__main__":
    regenerate()
