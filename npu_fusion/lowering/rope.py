"""RoPE's backward under the module name the pattern rules import (``from ..lowering.rope import
OP``); the op is declared in :mod:`.ops.rope_grad`."""
from .ops.rope_grad import OP, reference_kernel, rope_grad_dx, rope_grad_tables  # noqa: F401
