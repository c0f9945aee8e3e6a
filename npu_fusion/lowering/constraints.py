"""The fused ops' facts (docs/fused-ops.md) under the names the pattern rules and older callers
import. Each fact lives in its op's module (:mod:`.ops.rope_grad`, :mod:`.ops.rms_norm_grad`) and the shared checks in
:mod:`.checks`; this module only re-exports them."""
from .checks import FLOAT_DTYPES, TARGETS, FusedOpInputError, numel  # noqa: F401
from .ops.rms_norm_grad import (RMS_NORM_DTYPES, RMS_NORM_MAX_RANK, RMS_NORM_TARGET_DTYPES,  # noqa: F401
                                check_rms_norm_grad_inputs, rms_norm_split, rms_norm_supported_cases,
                                rms_norm_target_problem)
from .ops.rope_grad import (ROPE_A2_HALF_MAX_B, ROPE_A2_HALF_MAX_BN_WITH_X, ROPE_A2_HALF_MAX_N,  # noqa: F401
                            ROPE_A2_INTERLEAVE_MAX_BN, ROPE_A2_MAX_D, ROPE_A2_MODES, ROPE_A2_NEEDS_B_LESS_THAN_S,
                            ROPE_A2_TABLE_LAYOUTS, ROPE_DY_RANKS, ROPE_MAX_D, ROPE_MODES, check_rope_grad_inputs,
                            rope_divisor, rope_supported_cases, rope_target_problem)
