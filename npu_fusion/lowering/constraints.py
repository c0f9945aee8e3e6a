"""The SPEC facts of the two operators, stated once: what each accepts on every
chip (the fused ops' input checks, run by the meta kernels, the reference kernels,
the NPU kernels and, before it emits a call, the pass), what each chip accepts
(:func:`rope_target_problem`, :func:`rms_norm_target_problem`: whether the pass may
fuse a site for that chip), and the shapes the GE converters declare supported
(:func:`rope_supported_cases`, :func:`rms_norm_supported_cases`), all read from the
tables below.

The input checks hold on every target (SPEC sections 1 and 2: the union of what
Ascend 950, Atlas A2/A3 and the inference series accept); the per-target limits
are stricter.

Every check raises :class:`FusedOpInputError` whose message names the broken
constraint, so a bad call fails the same way at trace time (fake tensors, static
or symbolic sizes) and at run time (real tensors). A condition on SymInts that
must hold (a size limit) goes through ``torch._check_with``, so dynamic shapes
get a guard or a runtime assertion; a comparison of two shapes refuses what a
guard can decide differs, and passes a data-dependent size that no guard can decide.
"""
from __future__ import annotations

import math
from typing import Callable, Optional, Sequence, Union

import torch
from torch.fx.experimental import symbolic_shapes

from ..compat import guard_or_true as _guard_or_true
from .sizes import provably_less, same_shape, same_size, static_int

#: the chips the pass can target: ``generic`` (any device: every form of every op, as the
#: reference kernels run them), Atlas A2, Atlas A3, Ascend 950PR/950DT, and ``common``: only
#: what all three run (RoPE as on A2/A3, which 950 accepts too; no RmsNormGrad, which 950
#: lacks), the target taken when the chip cannot be told.
TARGETS = ("generic", "a2", "a3", "950", "common")

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

#: RotaryPositionEmbeddingGrad ``mode`` attribute values (SPEC section 1).
ROPE_MODES = {0: "half", 1: "interleave", 2: "quarter", 3: "interleave-half"}

#: The largest last axis D that any target accepts (950: D <= 1024; A2/A3: D < 896).
ROPE_MAX_D = 1024

#: dy layouts: BNSD, BSND, SBND (4 axes) on every target, TND (3 axes) on Ascend 950.
ROPE_DY_RANKS = (3, 4)

#: Atlas A2/A3 (SPEC section 1): modes 0 and 1, D < 896, 4-D dy and cos/sin; per dy layout
#: the cos/sin layouts half mode accepts (interleave mode: the first only); a table with B
#: but not N needs B < S.
ROPE_A2_MODES = (0, 1)
ROPE_A2_MAX_D = 895
ROPE_A2_TABLE_LAYOUTS = {"BNSD": ("11SD", "B1SD", "BNSD"), "BSND": ("1S1D", "BS1D", "BSND"),
                         "SBND": ("S11D", "SB1D", "SBND")}
ROPE_A2_NEEDS_B_LESS_THAN_S = ("B1SD", "BS1D")
#: A2/A3 half mode: B < 1000, N < 1000, and B*N <= 1024 when x is given; interleave: B*N < 1000
ROPE_A2_HALF_MAX_B = ROPE_A2_HALF_MAX_N = 999
ROPE_A2_HALF_MAX_BN_WITH_X = 1024
ROPE_A2_INTERLEAVE_MAX_BN = 999

#: RmsNormGrad tensors are ND with 1 to 8 axes (SPEC section 2).
RMS_NORM_MAX_RANK = 8

#: RmsNormGrad dtype combinations on Atlas A2/A3, a superset of the inference series':
#: (dy/x, gamma) -> dx, dgamma (fp32).
RMS_NORM_DTYPES = {
    (torch.float16, torch.float32),
    (torch.bfloat16, torch.float32),
    (torch.float16, torch.float16),
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.bfloat16),
}

#: the targets RmsNormGrad runs on (SPEC section 2 "Products": not Ascend 950), each with
#: the dtype combinations it accepts
RMS_NORM_TARGET_DTYPES = {"generic": RMS_NORM_DTYPES, "a2": RMS_NORM_DTYPES, "a3": RMS_NORM_DTYPES}

Message = Union[str, Callable[[], str]]


class FusedOpInputError(ValueError):
    """An input violates a fused operator's documented constraint."""


# -- symbolic-size helpers -------------------------------------------------------

def _require(condition, message: Message) -> None:
    """Raise FusedOpInputError(message) unless ``condition``; messages may be lazy."""
    lazy = message if callable(message) else (lambda: message)
    if isinstance(condition, torch.SymBool):
        torch._check_with(FusedOpInputError, condition, lazy)
    elif not condition:
        raise FusedOpInputError(lazy())


def _shown(sizes) -> list:
    """Sizes for a message: a symbolic size as its value in this trace, where it has one."""
    return [s.node.hint if isinstance(s, torch.SymInt) and s.node.hint is not None else s for s in sizes]


def _same_shape(a: Sequence, b: Sequence) -> bool:
    return len(a) == len(b) and all(_guard_or_true(x == y) for x, y in zip(a, b))


def _broadcasts_to(small: Sequence, big: Sequence) -> bool:
    """``small`` broadcasts to ``big`` and broadcasting gives ``big`` (not a larger shape)."""
    if len(small) > len(big):
        return False
    lead = len(big) - len(small)
    return all(_guard_or_true(s == 1) or _guard_or_true(s == b) for s, b in zip(small, big[lead:]))


def _require_one_device(op: str, named) -> None:
    devices = {t.device for _, t in named if t is not None}
    _require(len(devices) <= 1, lambda: f"{op}: all tensor arguments must be on the same device, got "
             + ", ".join(f"{name} on {t.device}" for name, t in named if t is not None))


def _require_dtype_like(op: str, reference: str, ref, named) -> None:
    for name, t in named:
        if t is not None:
            _require(t.dtype == ref.dtype, lambda: f"{op}: {name} dtype {t.dtype} must equal {reference} "
                     f"dtype {ref.dtype}")


def _require_float(op: str, name: str, t) -> None:
    _require(t.dtype in FLOAT_DTYPES,
             lambda: f"{op}: {name} dtype must be float16, bfloat16 or float32, got {t.dtype}")


# -- RotaryPositionEmbeddingGrad ------------------------------------------------

def rope_divisor(mode: int) -> int:
    """The last axis is split into 4 chunks in quarter mode, into halves or pairs otherwise."""
    return 4 if mode == 2 else 2


def _rope_mode(op: str, mode):
    if isinstance(mode, torch.SymInt):  # an attribute: the kernel is chosen by it, so specialise
        mode = symbolic_shapes.guard_int(mode)
    _require(type(mode) is int and mode in ROPE_MODES,
             lambda: f"{op}: mode must be an int, one of {sorted(ROPE_MODES)} "
             f"({', '.join(f'{k}={v}' for k, v in ROPE_MODES.items())}), got {mode!r}")
    return mode


def _require_rope_ranks(op: str, dy, cos) -> None:
    _require(dy.dim() in ROPE_DY_RANKS,
             lambda: f"{op}: dy must have 3 or 4 dimensions (layouts BNSD, BSND, SBND, TND), got {dy.dim()}")
    _require(1 <= cos.dim() <= dy.dim(),
             lambda: f"{op}: cos/sin must have between 1 and dy.dim()={dy.dim()} dimensions, got {cos.dim()}")


def _require_rope_last_axis(op: str, dy, cos, mode: int) -> None:
    d, (shown_d,) = dy.shape[-1], _shown(dy.shape[-1:])
    _require(_guard_or_true(cos.shape[-1] == d), lambda: f"{op}: cos/sin last dimension "
             f"{_shown(cos.shape[-1:])[0]} must equal dy last dimension D={shown_d}")
    _require(d <= ROPE_MAX_D, lambda: f"{op}: the last dimension D={shown_d} must be <= {ROPE_MAX_D}")
    div = rope_divisor(mode)
    _require(d % div == 0, lambda: f"{op}: the last dimension D={shown_d} must be divisible by {div} "
             f"in {ROPE_MODES[mode]} mode")


def _require_rope_tables(op: str, dy, cos, sin) -> None:
    _require(_same_shape(cos.shape, sin.shape),
             lambda: f"{op}: cos and sin must have the same shape, got {_shown(cos.shape)} and "
             f"{_shown(sin.shape)}")
    _require(_broadcasts_to(cos.shape, dy.shape),
             lambda: f"{op}: cos/sin shape {_shown(cos.shape)} must broadcast to dy shape {_shown(dy.shape)} "
             f"without enlarging it")
    if dy.dim() == 3:
        _require(cos.dim() == 3 and _guard_or_true(cos.shape[0] == dy.shape[0]),
                 lambda: f"{op}: with TND dy {_shown(dy.shape)}, cos/sin must be T1D or TND, "
                 f"got {_shown(cos.shape)}")


def check_rope_grad_inputs(op: str, dy, cos, sin, x: Optional[torch.Tensor], mode: int) -> None:
    """SPEC section 1's constraints that hold on every target; ``op`` names the op in messages."""
    mode = _rope_mode(op, mode)
    _require_one_device(op, (("dy", dy), ("cos", cos), ("sin", sin), ("x", x)))
    _require_float(op, "dy", dy)
    _require_dtype_like(op, "dy", dy, (("cos", cos), ("sin", sin), ("x", x)))
    _require_rope_ranks(op, dy, cos)
    _require_rope_last_axis(op, dy, cos, mode)
    _require_rope_tables(op, dy, cos, sin)
    if x is not None:
        _require(_same_shape(x.shape, dy.shape),
                 lambda: f"{op}: x shape {_shown(x.shape)} must equal dy shape {_shown(dy.shape)}")


# -- RmsNormGrad ----------------------------------------------------------------

def rms_norm_split(x, gamma) -> int:
    """n such that gamma.shape == x.shape[n:]."""
    return x.dim() - gamma.dim()


def _require_rms_norm_dtypes(op: str, dy, x, rstd, gamma) -> None:
    _require_float(op, "dy", dy)
    _require_dtype_like(op, "dy", dy, (("x", x),))
    _require(rstd.dtype == torch.float32, lambda: f"{op}: rstd dtype must be float32, got {rstd.dtype}")
    _require((dy.dtype, gamma.dtype) in RMS_NORM_DTYPES,
             lambda: f"{op}: unsupported dtype combination dy/x={dy.dtype}, gamma={gamma.dtype}; supported "
             f"(dy, gamma): {sorted((str(a), str(b)) for a, b in RMS_NORM_DTYPES)}")


def _require_rms_norm_shapes(op: str, dy, x, rstd, gamma) -> None:
    _require(1 <= x.dim() <= RMS_NORM_MAX_RANK,
             lambda: f"{op}: x must have 1 to {RMS_NORM_MAX_RANK} dimensions, got {x.dim()}")
    _require(_same_shape(dy.shape, x.shape),
             lambda: f"{op}: dy shape {_shown(dy.shape)} must equal x shape {_shown(x.shape)}")
    n = rms_norm_split(x, gamma)
    _require(0 <= n < x.dim() and _same_shape(gamma.shape, x.shape[n:]),
             lambda: f"{op}: gamma shape {_shown(gamma.shape)} must equal x.shape[n:] for some "
             f"0 <= n < x.dim(); x shape is {_shown(x.shape)}")
    lead = list(x.shape[:n])
    keepdim = lead + [1] * (x.dim() - n)
    _require(_same_shape(rstd.shape, lead) or _same_shape(rstd.shape, keepdim),
             lambda: f"{op}: rstd shape {_shown(rstd.shape)} must equal x.shape[:{n}] = {_shown(lead)} "
             f"or its keep-dim form {_shown(keepdim)} (n = x.dim() - gamma.dim())")
    # The original document gives rstd 1 to 8 axes, so for n = 0 only the keep-dim form.
    _require(rstd.dim() >= 1,
             lambda: f"{op}: rstd must have 1 to {RMS_NORM_MAX_RANK} dimensions, got 0 (use the keep-dim "
             f"shape {_shown(keepdim)})")


def check_rms_norm_grad_inputs(op: str, dy, x, rstd, gamma) -> None:
    """SPEC section 2's constraints that hold on every target; ``op`` names the op in messages."""
    _require_one_device(op, (("dy", dy), ("x", x), ("rstd", rstd), ("gamma", gamma)))
    _require_rms_norm_dtypes(op, dy, x, rstd, gamma)
    _require_rms_norm_shapes(op, dy, x, rstd, gamma)


def numel(shape) -> int:
    return math.prod(shape)


# -- what each target accepts: whether the pass may fuse a site for it ----------

def rope_target_problem(target: str, mode: int, dy_shape, cos_shape, with_x: bool, compute_dtype) -> Optional[str]:
    """Why ``target`` cannot run RotaryPositionEmbeddingGrad on these shapes, or None."""
    if compute_dtype not in FLOAT_DTYPES:
        return f"dtype {compute_dtype} is not float16, bfloat16 or float32"
    d = static_int(dy_shape[-1])
    if target == "generic":
        return None
    if target == "950":
        return _rope_950_problem(d, dy_shape, cos_shape)
    # a2, a3 and common: A2/A3's limits, all within what Ascend 950 accepts
    if mode not in ROPE_A2_MODES:
        return f"mode {mode} ({ROPE_MODES[mode]}) runs only on Ascend 950"
    if d > ROPE_A2_MAX_D:
        return f"A2/A3 need D < {ROPE_A2_MAX_D + 1}, got {d}"
    if len(dy_shape) != 4 or len(cos_shape) != 4:
        return "A2/A3 need 4-D dy and cos/sin (layouts BNSD, BSND, SBND)"
    return _rope_a2_layout_problem(mode, dy_shape, cos_shape, with_x)


def _rope_950_problem(d, dy_shape, cos_shape) -> Optional[str]:
    if d > ROPE_MAX_D:
        return f"Ascend 950 needs D <= {ROPE_MAX_D}, got {d}"
    if len(dy_shape) not in ROPE_DY_RANKS:
        return f"Ascend 950 supports dy layouts BNSD, BSND, SBND and TND, got rank {len(dy_shape)}"
    if len(dy_shape) == 3 and not (len(cos_shape) == 3 and same_size(cos_shape[0], dy_shape[0])
                                   and (static_int(cos_shape[1]) == 1 or same_size(cos_shape[1], dy_shape[1]))):
        return "Ascend 950 with TND dy supports cos/sin T1D and TND only"
    return None


def _table_lead(dy_layout: str, table_layout: str, dy_shape) -> tuple:
    """The leading three sizes a cos/sin of ``table_layout`` has beside a dy of ``dy_layout``."""
    return tuple(1 if axis == "1" else dy_shape[dy_layout.index(axis)] for axis in table_layout[:3])


def _rope_a2_layout_problem(mode: int, dy_shape, cos_shape, with_x: bool) -> Optional[str]:
    problem = None
    for dy_layout, tables in ROPE_A2_TABLE_LAYOUTS.items():
        b, n, s = (dy_shape[dy_layout.index(axis)] for axis in "BNS")
        for table in (tables[:1] if mode == 1 else tables):
            if not same_shape(tuple(cos_shape[:3]), _table_lead(dy_layout, table, dy_shape)):
                continue
            if table in ROPE_A2_NEEDS_B_LESS_THAN_S and not provably_less(b, s):
                problem = f"A2/A3 need B < S for {table} cos/sin with {dy_layout} dy (B={b}, S={s}; not provable)"
                continue
            return _rope_a2_size_problem(mode, dy_layout, b, n, with_x)
    return problem or (
        "A2/A3 support cos/sin shapes " + ", ".join("/".join(t) for t in ROPE_A2_TABLE_LAYOUTS.values())
        + " (half) or " + "/".join(t[0] for t in ROPE_A2_TABLE_LAYOUTS.values())
        + f" (interleave); got dy {list(dy_shape)}, cos {list(cos_shape)}")


def _rope_a2_size_problem(mode: int, dy_layout: str, b, n, with_x: bool) -> Optional[str]:
    if mode == 0 and not (provably_less(b, ROPE_A2_HALF_MAX_B + 1) and provably_less(n, ROPE_A2_HALF_MAX_N + 1)
                          and (not with_x or provably_less(b * n, ROPE_A2_HALF_MAX_BN_WITH_X + 1))):
        return (f"A2/A3 half mode needs B < {ROPE_A2_HALF_MAX_B + 1}, N < {ROPE_A2_HALF_MAX_N + 1} and "
                f"(with x) B*N <= {ROPE_A2_HALF_MAX_BN_WITH_X} ({dy_layout}, B={b}, N={n})")
    if mode == 1 and not provably_less(b * n, ROPE_A2_INTERLEAVE_MAX_BN + 1):
        return f"A2/A3 interleave mode needs B*N < {ROPE_A2_INTERLEAVE_MAX_BN + 1} ({dy_layout}, B={b}, N={n})"
    return None


def rms_norm_target_problem(target: str, compute: torch.dtype, gamma_dtype: torch.dtype) -> Optional[str]:
    """Why ``target`` cannot run RmsNormGrad with these dtypes, or None."""
    dtypes = RMS_NORM_TARGET_DTYPES.get(target)
    if target == "common":
        return "RmsNormGrad does not run on every known chip (not on Ascend 950); target 'common' emits none"
    if dtypes is None:
        return f"RmsNormGrad is not documented for Ascend {target} (SPEC section 2 products)"
    if (compute, gamma_dtype) not in dtypes:
        return f"dtype combination dy/x={compute}, gamma={gamma_dtype} is not in SPEC's table"
    return None


# -- the shapes the GE converters declare supported -----------------------------

#: B, N, S and D of the declared cases
_CASE_SIZES = {"B": 2, "N": 4, "S": 16, "D": 64}


def _case_shape(layout: str) -> tuple:
    return tuple(1 if axis == "1" else _CASE_SIZES[axis] for axis in layout)


def rope_supported_cases():
    """``(dtype, dy shape, cos/sin shape, with x, mode)``, each valid on some target and
    accepted by the input checks: every mode and dtype with BSND dy and 1S1D tables, every
    A2/A3 table layout of every dy layout (half mode), and without x."""
    cases = [(dt, _case_shape("BSND"), _case_shape("1S1D"), True, mode)
             for mode in ROPE_MODES for dt in FLOAT_DTYPES]
    cases += [(torch.float32, _case_shape(dy), _case_shape(table), True, 0)
              for dy, tables in ROPE_A2_TABLE_LAYOUTS.items() for table in tables]
    cases += [(dt, _case_shape("BSND"), _case_shape("1S1D"), False, 0) for dt in FLOAT_DTYPES]
    return cases


def rms_norm_supported_cases():
    """``(dy/x dtype, gamma dtype, x shape, rstd shape, gamma shape)``: every dtype combination
    with keep-dim rstd, then plain rstd, then normalizing over the last two axes."""
    x = (4, 16, 64)
    combinations = sorted(RMS_NORM_DTYPES, key=str)
    cases = [(dy, gamma, x, (4, 16, 1), (64,)) for dy, gamma in combinations]
    cases += [(dy, gamma, x, (4, 16), (64,)) for dy, gamma in combinations]
    cases.append((torch.float32, torch.float32, x, (4, 1, 1), (16, 64)))
    return cases
