"""Turns each :class:`~.fused_op.FusedOp` declaration into a registered op: what each op's
module once did by hand.

* :func:`define`: ``torch.ops.npu_fusion.<name>`` from the declared schema, its reference
  kernel as the implementation on every device, its meta kernel as the fake kernel;
* :func:`register_backends`: the NPU eager kernel (:mod:`.npu`, from the op's
  :class:`~.fused_op.NpuBinding`) when torch_npu imports, and the GE converter
  (:mod:`.ge_converters`, from its :class:`~.fused_op.GeIr`, with its declared
  supported cases) when torchair imports. Both return False and change nothing
  without them.
"""
from __future__ import annotations

from typing import Dict, Iterable, Tuple

import torch

from .fused_op import FusedOp

#: the ``torch.library`` custom op of each defined fused op, by name
CUSTOM_OPS: Dict[str, object] = {}


def define(op: FusedOp):
    """Define ``torch.ops.npu_fusion.<op.name>`` (once per process) and return its custom op."""
    if op.name not in CUSTOM_OPS:
        custom = torch.library.custom_op(f"npu_fusion::{op.name}", op.reference, mutates_args=(),
                                         schema=op.schema)
        custom.register_fake(op.meta)
        CUSTOM_OPS[op.name] = custom
    return CUSTOM_OPS[op.name]


def define_all(ops: Iterable[FusedOp]) -> None:
    for op in ops:
        define(op)


def register_backends(ops: Tuple[FusedOp, ...]) -> Tuple[bool, bool]:
    """``(NPU kernels registered, GE converters registered)``."""
    from . import ge_converters, npu

    return npu.register(ops, CUSTOM_OPS), ge_converters.register(ops)
