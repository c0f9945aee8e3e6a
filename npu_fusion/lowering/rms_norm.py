"""RMSNorm's backward under the module name the pattern rules import (``from ..lowering.rms_norm
import OP``); the op is declared in :mod:`.ops.rms_norm_grad`."""
from .ops.rms_norm_grad import OP, reference_kernel  # noqa: F401
