"""The fused ops, one declarative module each, and their list.

The fused ops, one declarative module each (:class:`~..fused_op.FusedOp`); this list is
what the registrar, the pass manager's options and counters, the report, the contract
checks and the conformance tests (``tests/test_op_conformance.py``) read.

Adding an op: its module here, and its line below.
"""
from . import rms_norm, rms_norm_grad, rope, rope_grad, swiglu, swiglu_grad

#: every fused op, by its description
FUSED_OPS = (
    rms_norm_grad.OP,
    rope_grad.OP,
    rms_norm.OP,
    rope.OP,
    swiglu_grad.OP,
    swiglu.OP,
)


def render_schemas() -> str:
    """Every fused op's full schema, one a line, as the README lists them (``tests/test_docs.py``)."""
    return "\n".join(f"torch.ops.npu_fusion.{op.name}{op.schema}" for op in FUSED_OPS)
