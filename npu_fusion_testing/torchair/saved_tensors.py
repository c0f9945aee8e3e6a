"""Which backward GE graph input is which forward GE graph output, by edges, not by names.

The chain from a backward op's input back to the forward op that made it:

1. in the backward GE graph, the op's input is fed by a ``Data`` node of index ``k``; torchair
   makes the ``k``-th placeholder of the backward FX graph it compiles that ``Data`` node;
2. AOTAutograd's partition: the backward FX graph's first placeholders are the tensors the
   forward saves, which are the forward FX graph's outputs after its user outputs, in order
   (placeholder ``k`` is forward output ``n_user + k``);
3. torchair's forward GE graph outputs (``NetOutput``'s inputs) are the forward FX graph's outputs
   less those that alias a graph input (rebuilt on the host) and less repeats, in order
   (:func:`ge_output_positions`);
4. in the forward GE graph, that ``NetOutput`` input is fed by the forward op's output.

:class:`FxRecorder` (a torchair ``post_grad_custom_pre_pass``) keeps the FX graphs torchair's
compiler is given. Each step checks what it relies on (dtypes and shapes agree along the chain).
"""
from __future__ import annotations

import operator
from typing import Dict, List, Tuple

import torch
import torch.fx as fx


class FxRecorder:
    """A torchair ``post_grad_custom_pre_pass`` keeping every FX graph torchair's compiler gets."""

    def __init__(self):
        self.graphs: List[fx.GraphModule] = []

    def __call__(self, gm, example_inputs=None, config=None):
        self.graphs.append(gm)

    def forward_and_backward(self) -> Tuple[fx.GraphModule, fx.GraphModule]:
        assert len(self.graphs) == 2, f"expected a forward and a backward FX graph, got {len(self.graphs)}"
        return self.graphs[0], self.graphs[1]


def _val(node):
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def placeholders(gm: fx.GraphModule) -> List[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def fx_outputs(gm: fx.GraphModule) -> list:
    return list(gm.graph.output_node().args[0])


def ge_output_positions(forward: fx.GraphModule) -> Dict[int, int]:
    """``{FX output index: NetOutput input position}`` of the tensors torchair's GE graph outputs."""
    inputs = [v for v in map(_val, placeholders(forward)) if isinstance(v, torch.Tensor)]
    kept, positions = [], {}
    for index, node in enumerate(fx_outputs(forward)):
        value = _val(node)
        if not isinstance(value, torch.Tensor) or any(torch._C._is_alias_of(x, value) for x in inputs):
            continue
        if node not in kept:
            kept.append(node)
        positions[index] = kept.index(node)
    return positions


def _same_kind(ge_graph, ge_dtype: torch.dtype, value: torch.Tensor, where: str) -> None:
    assert ge_dtype == value.dtype, f"{where}: GE {ge_dtype} vs FX {value.dtype} ({ge_graph.name})"


def forward_output_feeding(backward_ge, op, which, forward_ge, forward_fx, backward_fx, n_user: int):
    """(forward FX node, forward GE op, its output index) that backward GE ``op``'s input ``which``
    is: the chain of the module docstring, each link checked."""
    data, _ = backward_ge.producer(op, which)
    k = backward_ge.data_index(data)
    bw_inputs = placeholders(backward_fx)
    assert len(backward_ge.of_type("Data")) == len(bw_inputs), "a backward Data node per FX placeholder"
    _same_kind(backward_ge, backward_ge.output_dtype(data), _val(bw_inputs[k]), f"Data {k}")
    outputs = fx_outputs(forward_fx)
    saved = outputs[n_user:]
    assert len(saved) <= len(bw_inputs), (len(saved), len(bw_inputs))
    for s, p in zip(saved, bw_inputs):  # the partition's contract, checked where it matters
        assert (_val(s).dtype, tuple(_val(s).shape)) == (_val(p).dtype, tuple(_val(p).shape)), (s, p)
    assert k < len(saved), f"backward input {k} is no saved tensor (a tangent?)"
    fx_node = outputs[n_user + k]
    positions = ge_output_positions(forward_fx)
    net = forward_ge.net_outputs()
    assert len(net) == len(set(positions.values())), (len(net), positions)
    producer, index = net[positions[n_user + k]]
    _same_kind(forward_ge, forward_ge.output_dtype(producer, index), _val(fx_node), "saved output")
    return fx_node, producer, index


def is_output_of(node, target, index: int) -> bool:
    """Whether FX ``node`` is output ``index`` of a ``target`` node (``getitem(target(...), index)``)."""
    return (node.op == "call_function" and node.target is operator.getitem and node.args[1] == index
            and node.args[0].target == target)
