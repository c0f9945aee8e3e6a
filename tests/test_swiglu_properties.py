"""Property tests of SwiGLU (options ``swiglu``, ``swiglu_forward``): random programs around one
``silu(gate) * up`` of the halves of one projection, spelled with ``chunk``, ``split``,
``split_with_sizes`` or slices, either factor first, in float32, bfloat16 or float16, computed in
the halves' dtype or upcast to float32 and cast back, with near misses (the halves swapped, a split
that does not halve, halves along another axis, a constant inside the product), compiled by the
``npu_fusion`` backend (``strict``) under either partitioner and the ``none`` or ``core``
decompositions. Each example must hold:

(a) no false rewrite: the output and every gradient within the float64 criterion, in eager's
    dtypes and shapes (``test_swiglu.check``);
(b) a near miss is never fused;
(c) each direction of the site ends fused or as exactly one recorded miss: an exact program is
    fused both ways, a near miss is one miss each way.

The ``ci`` profile runs a tenth of its examples here (15); the long profile is where the evidence is.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

from test_swiglu import BACKWARD, FORWARD, H, _fused, _inputs, _misses, check

EXAMPLES = settings(max_examples=max(1, settings().max_examples // (10 if settings().derandomize else 1)))
SPELLINGS = ("chunk", "split", "split_with_sizes", "slices")
NEAR_MISSES = (None, None, None, "swapped", "not_halving", "other_axis", "scaled")


def halves(h, spelling: str, near_miss):
    """The gate and the up of ``h`` (its last axis 2H wide), as ``spelling`` cuts them."""
    if near_miss == "not_halving":
        return h[..., :H - 1], h[..., H + 1:]
    if near_miss == "other_axis":  # h is [2H, 3, 2H]: the halves of axis 0
        return h.chunk(2, dim=0)
    if spelling == "chunk":
        return h.chunk(2, dim=-1)
    if spelling == "split":
        return torch.split(h, H, dim=-1)
    if spelling == "split_with_sizes":
        return torch.split(h, [H, H], dim=-1)
    return h[..., :H], h[..., H:]


def program(spelling: str, up_first: bool, upcast: bool, near_miss):
    """``silu(gate) * up`` of the halves of ``x @ w``, spelled as drawn."""
    def fn(x, w):
        gate, up = halves(x @ w, spelling, near_miss)
        if near_miss == "swapped":
            gate, up = up, gate
        if upcast:
            gate, up = gate.float(), up.float()
        if near_miss == "scaled":
            up = 2 * up
        y = up * F.silu(gate) if up_first else F.silu(gate) * up
        return y.to(x.dtype) if upcast else y
    return fn


@st.composite
def swiglu_programs(draw):
    near_miss = draw(st.sampled_from(NEAR_MISSES))
    return dict(spelling=draw(st.sampled_from(SPELLINGS)), up_first=draw(st.booleans()),
                upcast=draw(st.booleans()), near_miss=near_miss,
                dtype=draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16])),
                partitioner=draw(st.sampled_from(["default", "min_cut"])),
                decompositions=draw(st.sampled_from(["none", "core"])), seed=draw(st.integers(0, 3)))


@EXAMPLES
@given(swiglu_programs())
def test_swiglu_program_is_fused_or_one_miss_each_way_and_stays_right(drawn):
    near_miss = drawn["near_miss"]
    fn = program(drawn["spelling"], drawn["up_first"], drawn["upcast"], near_miss)
    lead = (2 * H, 3) if near_miss == "other_axis" else (2, 3)
    capture = check(fn, _inputs(drawn["dtype"], lead=lead, seed=drawn["seed"]), partitioner=drawn["partitioner"],
                    decompositions=drawn["decompositions"])  # (a)
    for op in (FORWARD, BACKWARD):
        fused, misses = _fused(capture, op), _misses(capture, op)
        if near_miss is not None:
            assert fused == 0, (drawn, op)  # (b)
        assert fused + len(misses) == 1, (drawn, op, misses)  # (c)
        assert fused == int(near_miss is None), (drawn, op, misses)
