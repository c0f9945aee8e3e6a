"""The traffic model the report and the benchmarks read: every node that is not a view
reads its inputs and writes its output once. A fused site's bytes before, after and
at the fused op's minimum (each input read once, each output written once) come from
here, and so does which saved tensors share a storage."""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..compat import size_hint
from .nodes import VIEWS, aten

#: ops that move no data: the views, a reshape (of contiguous data, as backward graphs'
#: are), the splits into views and picking one output of several
NO_TRAFFIC = VIEWS | {aten.reshape.default, aten.unbind.int, aten.split.Tensor, aten.split_with_sizes.default,
                      operator.getitem}


def tensor_bytes(value) -> int:
    """Bytes of a tensor (or a tuple of them), symbolic sizes at their example values."""
    if isinstance(value, (tuple, list)):
        return sum(tensor_bytes(v) for v in value)
    if not isinstance(value, torch.Tensor):
        return 0
    numel = value.numel()
    if type(numel) is int:
        return numel * value.element_size()
    numel = 1
    for size in value.shape:
        hint = size_hint(size) if isinstance(size, torch.SymInt) else None
        numel *= int(hint) if hint is not None else int(size)
    return numel * value.element_size()

def node_traffic(node: fx.Node) -> int:
    if node.op != "call_function" or node.target in NO_TRAFFIC:
        return 0
    reads = sum(tensor_bytes(a.meta.get("val")) for a in node.all_input_nodes)
    return reads + tensor_bytes(node.meta.get("val"))


def storage_of(node):
    """The node whose storage ``node``'s value lives in: through views to their base."""
    while isinstance(node, fx.Node) and node.op == "call_function" and node.target in VIEWS:
        node = node.args[0]
    return node
