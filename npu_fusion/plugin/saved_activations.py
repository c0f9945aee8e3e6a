"""What the forward keeps for the backward, once the backward is fused.

The partitioners choose the saved tensors before the pass runs, for the unfused backward. An
HF-style norm upcasts x to float32 inside, and its unfused backward reads that upcast, so the
forward saves ``x.float()``: twice the bytes of x for a bf16 model, alive from forward to
backward. A fused ``rms_norm_grad`` reads x in its own dtype, so after the pass the backward
only narrows the saved upcast back (``x.float().to(bf16)``, exactly x). Where every use of a
saved widening cast is such a narrowing back, the forward saves the cast's source instead
and the backward reads it directly; a saved tensor the fused backward no longer reads at all is
not saved. Both keep every value exact: a widening cast followed by a narrowing back to the
source dtype is the identity.

Only the AOTAutograd partition this plugin runs can do this: the forward and backward graphs
are changed together, before either is compiled (AOTAutograd counts the saved tensors from the
graphs after ``partition_fn``). torchair's ``post_grad_custom_pre_pass`` sees each graph alone,
after the forward is already fixed, so there the saved set stays the partitioner's.
"""
from __future__ import annotations

import dataclasses
from typing import List

import torch.fx as fx

from ..lowering.sizes import same_shape
from ..patterns.nodes import dtype, holds, is_float_cast, shape, val
from ..patterns.traffic import storage_of


@dataclasses.dataclass
class SavedChange:
    """Bytes of the saved tensors before and after (static sizes only; symbolic ones count 0)."""
    narrowed: List[str] = dataclasses.field(default_factory=list)   # saved x instead of x.float()
    dropped: List[str] = dataclasses.field(default_factory=list)    # no longer read by the backward
    bytes_before: int = 0
    bytes_after: int = 0


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


def _saved_pairs(fw_gm: fx.GraphModule, bw_gm: fx.GraphModule):
    """(forward output index, forward node, backward placeholder) of each saved value, paired by
    name (the partitioners name a saved value's placeholder after its forward node; their orders
    differ, saved sizes come first in the backward); no pairs unless every one is found."""
    outputs = list(next(iter(fw_gm.graph.find_nodes(op="output"))).args[0])
    saved = [p for p in bw_gm.graph.find_nodes(op="placeholder") if not p.name.startswith("tangents")]
    first = len(outputs) - len(saved)
    index = {n.name: i for i, n in enumerate(outputs) if i >= first and isinstance(n, fx.Node)}
    if first < 0 or len(index) != len(saved) or any(p.name not in index for p in saved):
        return outputs, []
    return outputs, [(index[p.name], outputs[index[p.name]], p) for p in saved]


def _narrowed_source(fw_node, placeholder):
    """The source x when ``fw_node`` is an exact widening cast of x and the backward only
    narrows it back to x's dtype; else None."""
    if not isinstance(fw_node, fx.Node) or not is_float_cast(fw_node):
        return None
    source = fw_node.args[0]
    wide, narrow = dtype(fw_node), dtype(source)
    if narrow is None or wide == narrow or not holds(wide, narrow) or not same_shape(shape(source), shape(fw_node)):
        return None
    users = list(placeholder.users)
    if not users or not all(is_float_cast(u) and dtype(u) == narrow for u in users):
        return None
    return source


def narrow_saved_activations(fw_gm: fx.GraphModule, bw_gm: fx.GraphModule) -> SavedChange:
    """Save x instead of a widened copy the fused backward only narrows back, and drop saved
    tensors the backward no longer reads; both graphs are changed together."""
    outputs, pairs = _saved_pairs(fw_gm, bw_gm)
    change = SavedChange(bytes_before=saved_bytes(saved_nodes(fw_gm, bw_gm)))
    drop = []
    for index, fw_node, placeholder in pairs:
        if not isinstance(fw_node, fx.Node) or val(fw_node) is None or \
                fw_node.meta.get("saved_tensor_with_no_vc_check"):
            continue  # symints, opaque objects and AOTAutograd's ctx-stashed tensors stay
        if not placeholder.users:
            drop.append((index, placeholder))
            change.dropped.append(placeholder.name)
            continue
        source = _narrowed_source(fw_node, placeholder)
        if source is None:
            continue
        outputs[index] = source
        placeholder.meta["val"] = val(source)
        for user in list(placeholder.users):
            user.replace_all_uses_with(placeholder)
            bw_gm.graph.erase_node(user)
        change.narrowed.append(placeholder.name)
    for index, placeholder in sorted(drop, key=lambda d: d[0], reverse=True):
        del outputs[index]
        bw_gm.graph.erase_node(placeholder)
    if change.narrowed or change.dropped:
        fw_output = next(iter(fw_gm.graph.find_nodes(op="output")))
        fw_output.args = (tuple(outputs),) + tuple(fw_output.args[1:])
        fw_gm.graph.eliminate_dead_code()
        fw_gm.recompile()
        bw_gm.recompile()
    change.bytes_after = saved_bytes(saved_nodes(fw_gm, bw_gm))
    return change
