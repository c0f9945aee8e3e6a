"""Single-path RoPE's backward as the fused op ``npu_fusion::rotary_position_embedding_grad``.

``npu_fusion::rotary_position_embedding_grad``: the backward of single-path RoPE
(docs/fused-ops.md#rotary_position_embedding_grad; GE ``RotaryPositionEmbeddingGrad``, torch_npu
``npu_rotary_mul_backward``).

Math. The forward is ``y = x * cos + rotate(x) * sin`` with cos/sin broadcast to
x's shape; ``rotate`` depends on the mode:

* mode 0, half (HF/NeoX ``rotate_half``): ``rotate(x) = cat(-x2, x1)``, halves.
* mode 1, interleave (GPT-J): pairs ``(x[2j], x[2j+1]) -> (-x[2j+1], x[2j])``.
* mode 2, quarter: ``rotate_half`` applied to each half: ``cat(-x2, x1, -x4, x3)``, quarters.
* mode 3, interleave-half (DeepSeek-V3): x is first de-interleaved,
  ``xd = cat(x[::2], x[1::2])``, then ``y = xd * cos + rotate_half(xd) * sin``.

The backward is the transpose of that linear map in x, and two reductions::

    dx   = rotate^T(dy * sin) + dy * cos        (mode 3: re-interleaved)
    dcos = sum(dy * xd, dims)                   (xd = x except in mode 3)
    dsin = sum(dy * rotate_half(xd), dims)

where ``dims`` are the axes along which cos/sin were broadcast to dy, so dcos
and dsin have cos's shape.

When ``x`` is None, dcos and dsin are not computed (as in aclnn, where the
optional x being null means they are not written): the op returns empty
one-dimensional tensors of shape ``[0]`` in dy's dtype for them. The meta
kernel, the reference kernel and the (hand-written) GE converter all follow that.

The facts of RoPE (the modes, each chip's limits) are stated here once; the
forward op (:mod:`.rope`) reads them too.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.fx.experimental import symbolic_shapes

from ..checks import (FLOAT_DTYPES, broadcasts_to, case_shape, require, require_dtype_like, require_float,
                      require_one_device, same_shape, shown, size_equal)
from ..fused_op import CountedSite, FusedOp, GeAttr, GeInput, GeIr, NpuBinding
from ..sizes import decided_under_guards, limit_problem, same_shape as provably_same_shape, same_size, static_int

#: RotaryPositionEmbeddingGrad ``mode`` attribute values.
ROPE_MODES = {0: "half", 1: "interleave", 2: "quarter", 3: "interleave-half"}
#: RoPE mode -> the ``rotary_mode`` string torch_npu's eager kernels accept for it (every line
#: 2.6 to 2.14: "should be half or interleave"; modes 2 and 3 run in graph mode only).
TORCH_NPU_ROTARY_MODES = {0: "half", 1: "interleave"}

#: The largest last axis D that any target accepts (950: D <= 1024; A2/A3: D < 896).
ROPE_MAX_D = 1024
#: dy layouts: BNSD, BSND, SBND (4 axes) on every target, TND (3 axes) on Ascend 950.
ROPE_DY_RANKS = (3, 4)
#: Atlas A2/A3: modes 0 and 1, D < 896, 4-D dy and cos/sin; per dy layout the cos/sin layouts
#: half mode accepts (interleave mode: the first only); a table with B but not N needs B < S.
ROPE_A2_MODES = (0, 1)
ROPE_A2_MAX_D = 895
ROPE_A2_TABLE_LAYOUTS = {"BNSD": ("11SD", "B1SD", "BNSD"), "BSND": ("1S1D", "BS1D", "BSND"),
                         "SBND": ("S11D", "SB1D", "SBND")}
ROPE_A2_NEEDS_B_LESS_THAN_S = ("B1SD", "BS1D")
#: A2/A3 half mode: B < 1000, N < 1000, and B*N <= 1024 when x is given; interleave: B*N < 1000
ROPE_A2_HALF_MAX_B = ROPE_A2_HALF_MAX_N = 999
ROPE_A2_HALF_MAX_BN_WITH_X = 1024
ROPE_A2_INTERLEAVE_MAX_BN = 999
ROPE_KINDS = "DT_FLOAT16, DT_FLOAT, DT_BFLOAT16"


# -- input checks (every target) ---------------------------------------------------

def rope_divisor(mode: int) -> int:
    """The last axis is split into 4 chunks in quarter mode, into halves or pairs otherwise."""
    return 4 if mode == 2 else 2


def rope_mode(op: str, mode):
    if isinstance(mode, torch.SymInt):  # an attribute: the kernel is chosen by it, so specialise
        mode = symbolic_shapes.guard_int(mode)
    require(type(mode) is int and mode in ROPE_MODES,
            lambda: f"{op}: mode must be an int, one of {sorted(ROPE_MODES)} "
            f"({', '.join(f'{k}={v}' for k, v in ROPE_MODES.items())}), got {mode!r}")
    return mode


def check_rope_tables(op: str, lead: str, t, cos, sin, mode: int) -> None:
    """What RoPE asks of its rotated tensor ``t`` (named ``lead``: dy or x) and cos/sin."""
    require(t.dim() in ROPE_DY_RANKS, lambda: f"{op}: {lead} must have 3 or 4 dimensions (layouts BNSD, "
            f"BSND, SBND, TND), got {t.dim()}")
    require(1 <= cos.dim() <= t.dim(), lambda: f"{op}: cos/sin must have between 1 and {lead}.dim()={t.dim()} "
            f"dimensions, got {cos.dim()}")
    d, (shown_d,) = t.shape[-1], shown(t.shape[-1:])
    require(size_equal(cos.shape[-1], d), lambda: f"{op}: cos/sin last dimension "
            f"{shown(cos.shape[-1:])[0]} must equal {lead} last dimension D={shown_d}")
    require(d <= ROPE_MAX_D, lambda: f"{op}: the last dimension D={shown_d} must be <= {ROPE_MAX_D}")
    div = rope_divisor(mode)
    require(d % div == 0, lambda: f"{op}: the last dimension D={shown_d} must be divisible by {div} "
            f"in {ROPE_MODES[mode]} mode")
    require(same_shape(cos.shape, sin.shape), lambda: f"{op}: cos and sin must have the same shape, got "
            f"{shown(cos.shape)} and {shown(sin.shape)}")
    require(broadcasts_to(cos.shape, t.shape), lambda: f"{op}: cos/sin shape {shown(cos.shape)} must "
            f"broadcast to {lead} shape {shown(t.shape)} without enlarging it")
    if t.dim() == 3:
        require(cos.dim() == 3 and size_equal(cos.shape[0], t.shape[0]),
                lambda: f"{op}: with TND {lead} {shown(t.shape)}, cos/sin must be T1D or TND, "
                f"got {shown(cos.shape)}")


def check_rope_grad_inputs(op: str, dy, cos, sin, x: Optional[torch.Tensor], mode: int) -> None:
    """The op's constraints that hold on every target; ``op`` names the op in messages."""
    mode = rope_mode(op, mode)
    require_one_device(op, (("dy", dy), ("cos", cos), ("sin", sin), ("x", x)))
    require_float(op, "dy", dy)
    require_dtype_like(op, "dy", dy, (("cos", cos), ("sin", sin), ("x", x)))
    check_rope_tables(op, "dy", dy, cos, sin, mode)
    if x is not None:
        require(same_shape(x.shape, dy.shape),
                lambda: f"{op}: x shape {shown(x.shape)} must equal dy shape {shown(dy.shape)}")


# -- what each target accepts -------------------------------------------------------

@decided_under_guards
def rope_target_problem(target: str, mode: int, dy_shape, cos_shape, with_x: bool, compute_dtype) -> Optional[str]:
    """Why ``target`` cannot run RoPE (forward or backward) on these shapes, or None; ``with_x``:
    the backward computes dcos/dsin (A2/A3 then need B*N <= 1024 in half mode).

    A limit on symbolic sizes is proved, or kept under a guard where one can be installed
    (:func:`~npu_fusion.lowering.sizes.limit_problem`)."""
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
            if not provably_same_shape(tuple(cos_shape[:3]), _table_lead(dy_layout, table, dy_shape)):
                continue
            if table in ROPE_A2_NEEDS_B_LESS_THAN_S and (why := limit_problem(b, s)):
                problem = f"A2/A3 need B < S for {table} cos/sin with {dy_layout} dy (B={b}, S={s}: {why})"
                continue
            return _rope_a2_size_problem(mode, dy_layout, b, n, with_x)
    return problem or (
        "A2/A3 support cos/sin shapes " + ", ".join("/".join(t) for t in ROPE_A2_TABLE_LAYOUTS.values())
        + " (half) or " + "/".join(t[0] for t in ROPE_A2_TABLE_LAYOUTS.values())
        + f" (interleave); got dy {list(dy_shape)}, cos {list(cos_shape)}")


def _rope_a2_size_problem(mode: int, dy_layout: str, b, n, with_x: bool) -> Optional[str]:
    if mode == 0:
        limits = [("B", b, ROPE_A2_HALF_MAX_B + 1), ("N", n, ROPE_A2_HALF_MAX_N + 1)]
        limits += [("B*N", b * n, ROPE_A2_HALF_MAX_BN_WITH_X + 1)] if with_x else []
    else:
        limits = [("B*N", b * n, ROPE_A2_INTERLEAVE_MAX_BN + 1)]
    broken = [f"{name}={size}: {why}" for name, size, bound in limits if (why := limit_problem(size, bound))]
    if not broken:
        return None
    if mode == 0:
        return (f"A2/A3 half mode needs B < {ROPE_A2_HALF_MAX_B + 1}, N < {ROPE_A2_HALF_MAX_N + 1} and "
                f"(with x) B*N <= {ROPE_A2_HALF_MAX_BN_WITH_X} ({dy_layout}, B={b}, N={n}; {'; '.join(broken)})")
    return (f"A2/A3 interleave mode needs B*N < {ROPE_A2_INTERLEAVE_MAX_BN + 1} ({dy_layout}, B={b}, N={n}; "
            f"{'; '.join(broken)})")


def _target_problem(target, dy, cos, sin, x=None, mode=0):
    return rope_target_problem(target, mode, tuple(dy.shape), tuple(cos.shape), x is not None, dy.dtype)


# -- kernels --------------------------------------------------------------------------

def _halves(t, parts):
    return t.chunk(parts, dim=-1)


def _evens_odds(t):
    return t[..., ::2], t[..., 1::2]


def _interleave(a, b):
    return torch.stack((a, b), dim=-1).flatten(-2)


def rope_grad_dx(dy, cos, sin, mode: int):
    """The op's dx, in dy's (already widened) dtype, broadcasting cos/sin."""
    cos, sin = cos.expand_as(dy), sin.expand_as(dy)
    if mode == 2:
        y, c, s = _halves(dy, 4), _halves(cos, 4), _halves(sin, 4)
        return torch.cat((c[0] * y[0] + s[1] * y[1], c[1] * y[1] - s[0] * y[0],
                          c[2] * y[2] + s[3] * y[3], c[3] * y[3] - s[2] * y[2]), dim=-1)
    split = _evens_odds if mode == 1 else (lambda t: _halves(t, 2))
    (y1, y2), (c1, c2), (s1, s2) = split(dy), split(cos), split(sin)
    first, second = c1 * y1 + s2 * y2, c2 * y2 - s1 * y1
    if mode == 0:
        return torch.cat((first, second), dim=-1)
    return _interleave(first, second)  # modes 1 and 3


def rope_grad_tables(dy, x, mode: int):
    """The per-element factors of dcos and dsin before the broadcast reduction:
    ``(dy * xd, dy * rotate_half(xd))`` with xd as in the module docstring."""
    if mode == 2:
        x1, x2, x3, x4 = _halves(x, 4)
        return dy * x, dy * torch.cat((-x2, x1, -x4, x3), dim=-1)
    if mode == 1:
        x1, x2 = _evens_odds(x)
        return dy * x, dy * _interleave(-x2, x1)
    if mode == 3:
        x1, x2 = _evens_odds(x)
        return dy * torch.cat((x1, x2), dim=-1), dy * torch.cat((-x2, x1), dim=-1)
    x1, x2 = _halves(x, 2)
    return dy * x, dy * torch.cat((-x2, x1), dim=-1)


def reference_kernel(dy, cos, sin, x=None, mode=0):
    """Reference kernel: any device, computes in float32 and casts back to dy's dtype."""
    OP.check_inputs(dy, cos, sin, x, mode)
    dyf, cosf, sinf = dy.float(), cos.float(), sin.float()
    dx = rope_grad_dx(dyf, cosf, sinf, mode).to(dy.dtype).contiguous()  # as the meta kernel says, whatever dy's layout
    if x is None:
        return dx, dy.new_empty((0,)), dy.new_empty((0,))
    dcos, dsin = rope_grad_tables(dyf, x.float(), mode)
    return (dx, dcos.sum_to_size(cos.shape).to(dy.dtype).contiguous(),
            dsin.sum_to_size(cos.shape).to(dy.dtype).contiguous())


def meta_kernel(dy, cos, sin, x=None, mode=0):
    OP.check_inputs(dy, cos, sin, x, mode)
    dx = dy.new_empty(dy.shape)
    if x is None:
        return dx, dy.new_empty((0,)), dy.new_empty((0,))
    return dx, cos.new_empty(cos.shape), cos.new_empty(cos.shape)


# -- the unfused program: autograd of the plain forward ----------------------------------

def rotate_unfused(x, mode: int):
    """The forward rotation of each mode as a model writes it (index slices, no shared code)."""
    d = x.shape[-1]
    if mode == 1:
        return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).reshape(x.shape)
    if mode == 2:
        q = d // 4
        return torch.cat((-x[..., q:2 * q], x[..., :q], -x[..., 3 * q:], x[..., 2 * q:3 * q]), dim=-1)
    return torch.cat((-x[..., d // 2:], x[..., :d // 2]), dim=-1)


def rope_unfused(x, cos, sin, mode: int):
    """``y = x*cos + rotate(x)*sin`` in the inputs' dtype (mode 3 de-interleaves x first)."""
    if mode == 3:
        x = torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
        mode = 0
    return x * cos + rotate_unfused(x, mode) * sin


def unfused(dy, cos, sin, x=None, mode=0):
    """The backward autograd computes for :func:`rope_unfused`, in the inputs' dtype."""
    with torch.enable_grad():
        given = x if x is not None else torch.zeros_like(dy)
        leaves = [t.detach().requires_grad_() for t in (given, cos, sin)]
        dx, dcos, dsin = torch.autograd.grad(rope_unfused(*leaves, mode), leaves, dy)
    if x is None:
        return dx, dy.new_empty((0,)), dy.new_empty((0,))
    return dx, dcos, dsin


# -- declared cases ---------------------------------------------------------------

def rope_supported_cases():
    """``(dtype, dy shape, cos/sin shape, with x, mode)``, each valid on some target and
    accepted by the input checks: every mode and dtype with BSND dy and 1S1D tables, every
    A2/A3 table layout of every dy layout (half mode), and without x."""
    cases = [(dt, case_shape("BSND"), case_shape("1S1D"), True, mode)
             for mode in ROPE_MODES for dt in FLOAT_DTYPES]
    cases += [(torch.float32, case_shape(dy), case_shape(table), True, 0)
              for dy, tables in ROPE_A2_TABLE_LAYOUTS.items() for table in tables]
    cases += [(dt, case_shape("BSND"), case_shape("1S1D"), False, 0) for dt in FLOAT_DTYPES]
    return cases


def cases():
    """The declared cases as arguments ``(dy, cos, sin, x, mode)``."""
    generator = torch.Generator().manual_seed(0)
    for dt, dy, cos, with_x, mode in rope_supported_cases():
        def t(shape):
            return torch.randn(shape, generator=generator).to(dt)
        yield t(dy), t(cos), t(cos), (t(dy) if with_x else None), mode


# -- the hand converter: no x, no dcos/dsin ------------------------------------------

def convert_without_x(build, arguments, meta_outputs):
    """GE leaves dcos/dsin unwritten without x; the op returns ``[0]``-shaped tensors (Fill)."""
    from ...compat import torchair_converter_api

    ge = torchair_converter_api().ge
    outputs = build(arguments)
    if arguments["x"] is not None:
        return outputs
    dy = arguments["dy"]
    empty = [ge.Fill([0], ge.Cast(0.0, dst_type=dy.dtype)) for _ in range(2)]
    return (outputs[0], *empty)


OP = FusedOp(
    name="rotary_position_embedding_grad", ge_op="RotaryPositionEmbeddingGrad", label="RoPE", option="rope",
    spec_section="docs/fused-ops.md#rotary_position_embedding_grad", outputs=("dx", "dcos", "dsin"),
    checks=check_rope_grad_inputs,
    # ``SymInt mode``: stated, not inferred (torch 2.6 cannot resolve postponed annotations)
    schema="(Tensor dy, Tensor cos, Tensor sin, Tensor? x=None, SymInt mode=0) -> (Tensor, Tensor, Tensor)",
    reference=reference_kernel, meta=meta_kernel, unfused=unfused, target_problem=_target_problem, cases=cases,
    npu=NpuBinding(op="npu_rotary_mul_backward", positional=("dy", "x", "cos", "sin"),
                   keywords=(("rotary_mode", "mode"),), values={"mode": TORCH_NPU_ROTARY_MODES}),
    ge=GeIr(op="RotaryPositionEmbeddingGrad",
            inputs=(GeInput("dy", ROPE_KINDS), GeInput("cos", ROPE_KINDS), GeInput("sin", ROPE_KINDS),
                    GeInput("x", ROPE_KINDS, optional=True)),
            attrs=(GeAttr("mode", "Int", 0, "mode"),),
            outputs=(("dx", ROPE_KINDS), ("dcos", ROPE_KINDS), ("dsin", ROPE_KINDS))),
    ge_converter=convert_without_x,
    # the tables are functions of the positions only: min-cut may recompute them rather than save
    short_label="RoPE", recomputable=("cos", "sin"),
    # Llama's apply_rotary_pos_emb rotates q and k in one call, GPT-J's one tensor per call; a RoPE
    # module is often one instance every layer calls, so its sites are its caller's
    counted_site=CountedSite(function_prefix="apply_rotary_pos_emb", path_of_caller=True),
)
