"""What the forward keeps for the backward: the saved tensors of a partition, and their bytes.

The ``npu_fusion`` backend fuses the joint graph before the partition (:mod:`.joint`), so the
partitioner chooses the saved set for the fused backward: an HF-style norm's fused op reads x in
its own dtype, and the float32 upcast the unfused backward read is no longer saved. This module
only measures that set (the backend records it on each result, the benchmarks and tests read it).
Through torchair's post-partition hook the saved set stays the one chosen for the unfused backward.
"""
from __future__ import annotations

import dataclasses
from typing import List, Optional, Tuple

import torch
import torch.fx as fx

from ..patterns.nodes import val
from ..patterns.traffic import storage_of


@dataclasses.dataclass
class SavedSet:
    """The forward's outputs saved for the backward: their names and activation bytes (static
    sizes only; symbolic ones count 0)."""
    names: List[str] = dataclasses.field(default_factory=list)
    bytes: int = 0
    #: (dtype, shape) of each saved tensor, in the order of ``names`` (None for a non-tensor)
    kinds: List[Optional[Tuple[torch.dtype, tuple]]] = dataclasses.field(default_factory=list)

    def count(self, dtype: torch.dtype, shape) -> int:
        """How many saved tensors have this dtype and shape."""
        return sum(1 for k in self.kinds if k is not None and k[0] == dtype and tuple(k[1]) == tuple(shape))


def saved_bytes(nodes) -> int:
    """Activation bytes the saved tensors keep alive: each storage once (a saved view keeps
    its whole base), graph inputs (parameters, the batch) and their views not at all."""
    total = 0
    for node in dict.fromkeys(storage_of(n) for n in nodes):
        if not isinstance(node, fx.Node) or node.op == "placeholder":
            continue
        v = val(node)
        numel = v.numel() if v is not None else None
        if isinstance(numel, int):  # a symbolic size is not modelled (int() would specialize it)
            total += numel * v.element_size()
    return total


def saved_nodes(fw_gm: fx.GraphModule, bw_gm: fx.GraphModule) -> list:
    """The forward's outputs saved for the backward: its last outputs, one per backward
    placeholder before the tangents."""
    outputs = list(next(iter(fw_gm.graph.find_nodes(op="output"))).args[0])
    saved = [p for p in bw_gm.graph.find_nodes(op="placeholder") if not p.name.startswith("tangents")]
    return outputs[len(outputs) - len(saved):] if len(saved) <= len(outputs) else []


def saved_set(fw_gm: fx.GraphModule, bw_gm: fx.GraphModule) -> SavedSet:
    nodes = [n for n in saved_nodes(fw_gm, bw_gm) if isinstance(n, fx.Node)]
    kinds = [(val(n).dtype, tuple(val(n).shape)) if val(n) is not None else None for n in nodes]
    return SavedSet(names=[n.name for n in nodes], bytes=saved_bytes(nodes), kinds=kinds)
