"""Attacks on the ``[S, 1, D]`` table view read as a leaf in the RoPE backward.

A BNSD rotation reads the ``[S, D]`` tables themselves, a BSND one a view that inserts a size-1 axis
(``cos[:, None]``, ``unsqueeze(1)``, ``view(S, 1, D)``). Programs near that reading: the rows paired
with the heads or the batch (``S == N``, ``S == B``), tables that take a gradient, tables computed
before the view (scaled, flipped, strided or offset rows, half width, interleaved, from q itself),
partial rotary, bf16 tables beside float32 q, a TND k, checkpointing, forward rules off, Inductor.
Each is one training step whose outputs and gradients pass the float64 criterion against eager, with
every rotation fused both ways and no miss. Under ``dynamic=True`` the spellings other than
``cos[:, None]`` were a backward miss (the product refused for a symbolic heads' axis, not for its
broadcast), and tables computed from q crashed the lanes (an expand to a symbolic size)."""
import pytest
import torch

from test_inductor import installed  # noqa: F401  (the fixture: the pass in Inductor, compile caches off)
from test_forward_fusion import calls
from test_rope_permuted import compiled_step, inductor_step, rotate

ROPE, ROPE_GRAD = "rotary_position_embedding", "rotary_position_embedding_grad"
B, S, N, D = 2, 6, 4, 16
H = D // 2


def _rot_interleaved(x, cos, sin):
    return x * cos + torch.stack((-x[..., 1::2], x[..., 0::2]), -1).flatten(-2) * sin


def _partial(x, cos, sin):
    return torch.cat((rotate(x[..., :H], cos, sin), x[..., H:]), -1)


def _shared(view, q_tables=lambda t: t):
    """q rotated as BNSD with the tables (as ``q_tables`` makes them), k as BSND with ``view`` of them."""
    def program(q, k, cos, sin):
        qr = rotate(q.transpose(1, 2), q_tables(cos), q_tables(sin))
        return qr * 3, qr, rotate(k, view(cos), view(sin))
    return program


def _half(t):
    return torch.cat((t, t), -1)


def partial_rotary(q, k, cos, sin):
    """The view sliced after it: ``cos[:, None, :D/2]``, q's tables ``cos[:, :D/2]``."""
    return _partial(q.transpose(1, 2), cos[:, :H], sin[:, :H]) * 3, _partial(k, cos[:, None, :H], sin[:, None, :H])


def half_tables_viewed_then_cat(q, k, cos, sin):
    return (rotate(q.transpose(1, 2), _half(cos), _half(sin)) * 3,
            rotate(k, _half(cos[:, None]), _half(sin[:, None])))


def interleaved(q, k, cos, sin):
    c, s = cos.repeat_interleave(2, -1), sin.repeat_interleave(2, -1)
    return _rot_interleaved(q.transpose(1, 2), c, s) * 3, _rot_interleaved(k, c[:, None], s[:, None])


def rows_meet_the_batch(q, k, cos, sin):
    """``cos.view(S, 1, 1, D)`` on a ``[S, S, N, D]`` k (B == S): table rows meet the batch."""
    qr = rotate(q.transpose(1, 2), cos, sin)
    return qr * 3, rotate(k, cos.view(S, 1, 1, D), sin.view(S, 1, 1, D))


def tnd_k(q, k, cos, sin):
    return rotate(q.transpose(0, 1), cos, sin) * 3, rotate(k, cos[:, None], sin[:, None])


def checkpointed(q, k, cos, sin):
    return torch.utils.checkpoint.checkpoint(_shared(lambda t: t[:, None]), q, k, cos, sin, use_reentrant=False)


def tables_from_q(q, k, cos, sin):
    """The tables a value of q (its mean over the batch and the heads): they take q's gradient."""
    angles = q.mean((0, 2)) + cos
    return _shared(lambda t: t[:, None])(q, k, angles.cos(), angles.sin())


#: name: (program, q and k shape, table shape, table dtype (None: q's), tables take a gradient)
PROGRAMS = {
    "rows_meet_the_heads": (_shared(lambda t: t[None]), (B, S, S, D), (S, D), None, False),
    "rows_meet_the_batch": (rows_meet_the_batch, (S, S, N, D), (S, D), None, False),
    "unsqueeze_tables_take_grad": (_shared(lambda t: t.unsqueeze(1)), (B, S, N, D), (S, D), None, True),
    "scaled_then_viewed": (_shared(lambda t: (t * 2)[:, None]), (B, S, N, D), (S, D), None, False),
    "flipped_then_viewed": (_shared(lambda t: t.flip(0)[:, None]), (B, S, N, D), (S, D), None, True),
    "strided_rows": (_shared(lambda t: t[::2][:, None], lambda t: t[::2]), (B, S, N, D), (2 * S, D), None, False),
    "rows_offset": (_shared(lambda t: t[1:S + 1][:, None], lambda t: t[:S]), (B, S, N, D), (2 * S, D), None, False),
    "partial_rotary": (partial_rotary, (B, S, N, D), (S, D), None, False),
    "half_tables_viewed_then_cat": (half_tables_viewed_then_cat, (B, S, N, D), (S, H), None, False),
    "interleaved": (interleaved, (B, S, N, D), (S, H), None, False),
    "bf16_tables_float32_qk": (_shared(lambda t: t.view(S, 1, D)), (B, S, N, D), (S, D), torch.bfloat16, False),
    "tnd_k": (tnd_k, (S, N, D), (S, D), None, False),
    "checkpointed": (checkpointed, (B, S, N, D), (S, D), None, True),
}


def _inputs(name, dtype=torch.float32):
    _, qk, table, table_dtype, grad = PROGRAMS[name]
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(*qk, generator=gen).to(dtype).requires_grad_() for _ in range(2))
    angles = torch.randn(*table, generator=gen)
    cos, sin = (t.to(table_dtype or dtype).requires_grad_(grad) for t in (angles.cos(), angles.sin()))
    return [q, k, cos, sin]


@pytest.mark.parametrize("program", PROGRAMS)
def test_near_programs_fuse_both_rotations_exactly(program):
    result, after = compiled_step(PROGRAMS[program][0], _inputs(program), False)
    assert not result.misses, result.misses
    assert result.fused(ROPE) == result.fused(ROPE_GRAD) == 2, result.sites
    assert len(calls(after, ROPE_GRAD)) == 2


#: the spellings of the [S, 1, D] view other than ``cos[:, None]`` (tests/test_rope_permuted.py)
SPELLINGS = {"unsqueeze": lambda t: t.unsqueeze(1), "view": lambda t: t.view(S, 1, D),
             "reshape": lambda t: t.reshape(-1, 1, D), "unsqueeze_-2": lambda t: t.unsqueeze(-2)}


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_every_spelling_fuses_under_dynamic_shapes(spelling):
    """Under ``dynamic=True`` the heads' axis is symbolic: the BSND product was refused for its
    "inner sizes", not its broadcast, and the backward a miss (1 of 2 fused) before."""
    result, after = compiled_step(_shared(SPELLINGS[spelling]), _inputs("unsqueeze_tables_take_grad"), True)
    assert not result.misses, result.misses
    assert result.fused(ROPE) == result.fused(ROPE_GRAD) == len(calls(after, ROPE_GRAD)) == 2, result.sites


def test_forward_rules_off_the_backward_fuses_alone():
    result, after = compiled_step(_shared(SPELLINGS["unsqueeze"]), _inputs("unsqueeze_tables_take_grad"), True, False)
    assert not result.misses and result.fused(ROPE) == 0, (result.sites, result.misses)
    assert result.fused(ROPE_GRAD) == len(calls(after, ROPE_GRAD)) == 2, result.sites


def test_tables_from_q_under_dynamic_shapes_no_crash():
    """Tables computed from q: the mean's gradient is an expand to a symbolic size among the tracked
    axes, which crashed the lanes (a TypeError, raised under strict). Both rotations fuse; the table
    gradient's chain through ``cos``'s backward is a recorded miss, a gradient times a table."""
    result, _ = compiled_step(tables_from_q, _inputs("scaled_then_viewed"), True)
    assert result.fused(ROPE) == result.fused(ROPE_GRAD) == 2, (result.sites, result.misses)
    assert [m.op for m in result.misses] == [ROPE_GRAD], result.misses


@pytest.mark.parametrize("program", ["interleaved", "unsqueeze_tables_take_grad"])
def test_through_inductor_dynamic(installed, program):  # noqa: F811
    assert inductor_step(PROGRAMS[program][0], _inputs(program), True) == {ROPE: 2, ROPE_GRAD: 2}


def sign_flipped(q, k, cos, sin):
    qr = rotate(q.transpose(1, 2), cos, sin)
    return qr * 3, k * cos.unsqueeze(1) + torch.cat((k[..., H:], k[..., :H]), -1) * sin.unsqueeze(1)


def split_off_the_middle(q, k, cos, sin):
    qr = rotate(q.transpose(1, 2), cos, sin)
    return qr * 3, k * cos.unsqueeze(1) + torch.cat((-k[..., 6:], k[..., :6]), -1) * sin.unsqueeze(1)


@pytest.mark.parametrize("program", [sign_flipped, split_off_the_middle], ids=lambda f: f.__name__)
def test_near_misses_under_dynamic_shapes_name_the_difference(program):
    """k's rotation, no RoPE, stays unfused under ``dynamic=True``, and its backward miss says the
    formula differs (read through the ``unsqueeze(1)`` leaf; it said "inner sizes" before)."""
    result, after = compiled_step(program, _inputs("scaled_then_viewed"), True)
    assert result.fused(ROPE) == result.fused(ROPE_GRAD) == len(calls(after, ROPE_GRAD)) == 1, result.sites
    [backward] = [m for m in result.misses if m.op == ROPE_GRAD]
    assert "no mode's formula" in backward.reason, backward
