"""A caller's in-place update between forward and backward, legal in eager: the programs every
compile path must keep legal once the pass fuses them. A fused op may read a tensor the caller
holds (a graph input, a returned tensor, a view of either) where the unfused backward read a copy
of it (an HF-style norm's float32 upcast); the caller's update then must not reach the backward.
:data:`UPDATED_PROGRAMS` holds them, norms and rotations, each with the update and the dtypes
where eager allows it; :func:`assert_updated_as_eager` checks a compiled one."""
import dataclasses
import re
from typing import Callable, Dict, Tuple

import torch


def hf_rms_norm(x, w, eps=1e-6):
    """An HF-style RMSNorm: float32 statistics, the normalized value cast back to x's dtype."""
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def grads_after_updating_the_input(fn, dtype=torch.bfloat16):
    """The gradients of the leaf and the weight when the caller adds 1 in place to ``fn``'s input
    after the forward and before the backward."""
    gen = torch.Generator().manual_seed(3)
    leaf = torch.randn(2, 4, 16, generator=gen).to(dtype).requires_grad_()
    w = torch.randn(16, generator=gen).to(dtype).requires_grad_()
    h = leaf * 1
    out = fn(h, w)
    h.add_(1.0)
    out.double().sum().backward()
    return leaf.grad, w.grad


# -- programs whose caller updates a tensor it holds, legal in eager --------------------------

def residual_norm(x, r, w, eps=1e-6):
    """A pre-norm block's residual add and its HF-style norm, the sum returned (the next block's
    residual): the caller holds ``h``, which the norm's fused backward reads."""
    h = x + r
    return hf_rms_norm(h, w, eps), h


def residual_norm_view(x, r, w, eps=1e-6):
    """:func:`residual_norm` returning a view of the sum (its first half along the last axis)."""
    y, h = residual_norm(x, r, w, eps)
    return y, h[..., : h.shape[-1] // 2]


def split_residual_norm(x, r, w, eps=1e-6):
    """:func:`residual_norm` of the first half of the sum (a ``split``'s view of it), the whole
    sum returned: the fused backward reads a view of the tensor the caller holds."""
    h = x + r
    return hf_rms_norm(h.chunk(2, -1)[0], w, eps), h


def stacked_norms(x, w1, w2, eps=1e-6):
    """Two HF-style norms, the first one's output normalized again and returned: the second
    norm's fused backward reads the first fused forward op's output, which the caller holds."""
    y1 = hf_rms_norm(x, w1, eps)
    return hf_rms_norm(y1, w2, eps), y1


def frozen_input_norm(x, w, eps=1e-6):
    """A norm whose input takes no gradient (frozen embeddings, norm-only tuning), the input
    returned as a view: its fused backward (dgamma only) reads x, the unfused read the
    normalized value."""
    return hf_rms_norm(x, w, eps), x.view(-1, x.shape[-1])


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), -1)


def rope_q_k(q, k, cos, sin):
    """HF's ``apply_rotary_pos_emb`` on q and k [B, H, S, D] with the tables [1, 1, S, D]."""
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def rope_returning_tables(q, k, inv_freq):
    """HF's rotary embedding and its application: the tables [1, 1, S, D] computed in float32 from
    the positions and returned, q and k rotated with them cast to q's dtype (a copy the unfused
    backward reads; the fused op may read the float32 table the caller holds)."""
    positions = torch.arange(q.shape[-2], dtype=torch.float32)
    freqs = positions[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), -1)
    cos, sin = emb.cos()[None, None], emb.sin()[None, None]
    return (*rope_q_k(q, k, cos.to(q.dtype), sin.to(q.dtype)), cos, sin)


def rope_returning_q_k(q, k, cos, sin):
    """:func:`rope_q_k` returning q and k too (views of the caller's inputs)."""
    return (*rope_q_k(q, k, cos, sin), q.transpose(1, 2), k.view(-1))


def rope_rotation_read_back(q, k, cos, sin):
    """:func:`rope_q_k` on q and k [B, S, H, D] seen as [B, H, S, D] (the fused op runs on them as
    they lie and its output is permuted back), the rotated q squared (its backward reads it) and
    returned, and views of the tables returned: eager refuses an update of either."""
    qr, kr = rope_q_k(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    return qr * qr + kr, qr, cos[0], sin.view(-1)


def rope_transposed_returned(q, k, cos, sin):
    """:func:`rope_q_k` on q and k [B, S, H, D] seen as [B, H, S, D], both rotations returned (their
    backward reads neither: the caller may update them in place)."""
    return rope_q_k(q.transpose(1, 2), k.transpose(1, 2), cos, sin)


def run_with_update(fn, inputs, update, rounding=None, differentiated=1):
    """``fn(*inputs)``, then ``update(inputs, outputs)`` under ``no_grad`` (the caller's in-place
    update), then the backward of the first ``differentiated`` outputs with fixed random gradients,
    rounded to ``rounding`` (default: each output's dtype; a float64 run passes the dtype it
    stands for). ``inputs`` are copied first (the update may write them). Returns the outputs as
    they were before the update and the gradients of the inputs that take one, in order."""
    inputs = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
    outputs = fn(*inputs)
    before = [o.detach().clone() for o in outputs]
    with torch.no_grad():
        update(inputs, outputs)
    gen = torch.Generator().manual_seed(5)
    seeds = outputs[:differentiated]
    grads = [torch.randn(o.shape, generator=gen).to(rounding or o.dtype).to(o.dtype) for o in seeds]
    torch.autograd.backward(seeds, grads)
    return before, [t.grad for t in inputs if t.requires_grad]


@dataclasses.dataclass(frozen=True)
class UpdatedProgram:
    """A program whose caller updates a tensor it holds in place between forward and backward:
    legal in eager in the dtypes ``legal`` (elsewhere the unfused program saved that tensor)."""
    name: str
    fn: Callable
    #: the inputs' shapes, and which take a gradient
    shapes: Tuple[tuple, ...]
    takes_grad: Tuple[bool, ...]
    #: ``update(inputs, outputs)``: the caller's in-place update
    update: Callable
    legal: Tuple[torch.dtype, ...]
    #: the fused ops of one compile with every rule on
    fused: Dict[str, int]
    #: how many of the first outputs the backward starts from
    differentiated: int = 1

    def inputs(self, dtype):
        gen = torch.Generator().manual_seed(0)
        return [torch.randn(shape, generator=gen).to(dtype).requires_grad_(grad)
                for shape, grad in zip(self.shapes, self.takes_grad)]

    def run(self, fn, dtype):
        """:func:`run_with_update` of ``fn`` (this program compiled, or itself) on the inputs in ``dtype``."""
        return run_with_update(fn, self.inputs(dtype), self.update, differentiated=self.differentiated)

    def reference(self, dtype):
        """:func:`run_with_update` of the program in float64 on the inputs drawn in ``dtype``,
        without the update: where the program is legal, the update changes no gradient (they are
        those of the values the forward read), and in float64 the program may save what it
        updates (a cast to float64 is no copy)."""
        wide = [t.detach().double().requires_grad_(t.requires_grad) for t in self.inputs(dtype)]
        return run_with_update(self.fn, wide, lambda inputs, outputs: None, rounding=dtype,
                               differentiated=self.differentiated)

    def __repr__(self) -> str:
        return self.name


def refused(run) -> bool:
    """Whether ``run()`` raises autograd's error for a saved tensor updated in place (else it runs).

    Eager's refusals: a saved tensor "modified by an inplace operation", a view of a split whose base
    was "modified inplace". A compiled function's output refused as a view of a multi-output function
    is no refusal eager makes: it is raised."""
    try:
        run()
    except RuntimeError as error:
        if re.search("modified (by an )?inplace", str(error)) is None or "CompiledFunction is a view" in str(error):
            raise
        return True
    return False


def assert_refused_as_unfused(compiled, unfused, program: "UpdatedProgram", dtype) -> None:
    """Where eager refuses ``program``'s update, ``compiled`` (the pass on) refuses it where
    ``unfused`` (the same compile with every rule off) does, and runs where it runs (a compiled
    program may save an alias without eager's version counter: its gradients are then no claim,
    the update being illegal; the fused op may read other saved values than the unfused backward)."""
    assert refused(lambda: program.run(program.fn, dtype))
    assert refused(lambda: program.run(compiled, dtype)) == refused(lambda: program.run(unfused, dtype))


def assert_updated_as_eager(compiled, program: UpdatedProgram, dtype, factor=4.0) -> None:
    """``compiled`` runs ``program`` with the caller's update without raising, and its outputs (as
    the forward returned them) and gradients keep eager's dtypes and shapes and pass the float64
    criterion against eager's."""
    from npu_fusion.measure.grads import assert_close_as_unfused

    got, eager, exact = program.run(compiled, dtype), program.run(program.fn, dtype), program.reference(dtype)
    for kind, g_all, e_all, x_all in zip(("output", "gradient"), got, eager, exact):
        assert len(g_all) == len(e_all), (kind, len(g_all), len(e_all))
        for i, (g, e, x) in enumerate(zip(g_all, e_all, x_all)):
            if e is None:  # an input no differentiated output depends on
                assert g is None, (kind, i)
                continue
            assert g.dtype == e.dtype and g.shape == e.shape, (kind, i, g.dtype, g.shape, e.dtype, e.shape)
            assert_close_as_unfused(g, e, x, factor=factor)


B, S, H, D = 2, 6, 2, 16
HALF, FULL = (torch.bfloat16, torch.float16), (torch.bfloat16, torch.float16, torch.float32)
NORM = {"rms_norm_grad": 1, "rms_norm": 1}
ROPE = {"rotary_position_embedding_grad": 2, "rotary_position_embedding": 2}
#: the frozen input's norm: its forward is not fused (its backward, dgamma only, is)
DGAMMA = {"rms_norm_grad": 1, "rms_norm": 0}
_RESIDUAL = ((B, S, D), (B, S, D), (D,))
_ROPE = ((B, H, S, D), (B, H, S, D), (1, 1, S, D), (1, 1, S, D))
_ROPE_BSHD = ((B, S, H, D), (B, S, H, D), (1, 1, S, D), (1, 1, S, D))

#: the programs (the unfused float32 program saves the returned sum, the input, the float32 tables;
#: the rotation read back and the tables are saved in every dtype)
UPDATED_PROGRAMS = (
    UpdatedProgram("returned_residual", residual_norm, _RESIDUAL, (True, True, True),
                   lambda i, o: o[1].mul_(2.0), HALF, NORM),
    UpdatedProgram("returned_residual_view", residual_norm_view, _RESIDUAL, (True, True, True),
                   lambda i, o: o[1].mul_(2.0), HALF, NORM),
    UpdatedProgram("returned_split_residual", split_residual_norm, ((B, S, 2 * D), (B, S, 2 * D), (D,)),
                   (True, True, True), lambda i, o: o[1].mul_(2.0), HALF, NORM),
    UpdatedProgram("stacked_norms_returned_between", stacked_norms, ((B, S, D), (D,), (D,)), (True, True, True),
                   lambda i, o: o[1].mul_(2.0), HALF, {"rms_norm_grad": 2, "rms_norm": 2}),
    UpdatedProgram("returned_norm_output", residual_norm, _RESIDUAL, (True, True, True),
                   lambda i, o: o[0].mul_(2.0), FULL, NORM),
    UpdatedProgram("residual_input", residual_norm, _RESIDUAL, (True, True, True),
                   lambda i, o: i[0].add_(1.0), FULL, NORM),
    UpdatedProgram("norm_input", lambda x, w: (hf_rms_norm(x, w),), ((B, S, D), (D,)), (True, True),
                   lambda i, o: i[0].add_(1.0), HALF, NORM),
    UpdatedProgram("frozen_norm_input_returned", frozen_input_norm, ((B, S, D), (D,)), (False, True),
                   lambda i, o: o[1].add_(1.0), FULL, DGAMMA),
    UpdatedProgram("frozen_norm_input", frozen_input_norm, ((B, S, D), (D,)), (False, True),
                   lambda i, o: i[0].add_(1.0), FULL, DGAMMA),
    UpdatedProgram("rope_inputs", rope_returning_q_k, _ROPE, (True, True, False, False),
                   lambda i, o: (i[0].add_(1.0), i[1].add_(1.0)), FULL, ROPE, 2),
    UpdatedProgram("rope_returned_q_k", rope_returning_q_k, _ROPE, (True, True, False, False),
                   lambda i, o: (o[2].add_(1.0), o[3].add_(1.0)), FULL, ROPE, 2),
    UpdatedProgram("rope_returned_output", rope_returning_q_k, _ROPE, (True, True, False, False),
                   lambda i, o: o[1].mul_(2.0), FULL, ROPE, 2),
    UpdatedProgram("rope_transposed_rotation_returned", rope_transposed_returned, _ROPE_BSHD,
                   (True, True, False, False), lambda i, o: (o[0].mul_(2.0), o[1].mul_(2.0)), FULL, ROPE, 2),
    UpdatedProgram("rope_rotation_read_back", rope_rotation_read_back, _ROPE_BSHD, (True, True, False, False),
                   lambda i, o: o[1].mul_(2.0), (), ROPE),
    UpdatedProgram("rope_table_view_returned", rope_rotation_read_back, _ROPE_BSHD, (True, True, False, False),
                   lambda i, o: o[2].mul_(2.0), (), ROPE),
    UpdatedProgram("rope_returned_tables", rope_returning_tables, ((B, H, S, D), (B, H, S, D), (D // 2,)),
                   (True, True, False), lambda i, o: (o[2].mul_(2.0), o[3].mul_(2.0)), HALF, ROPE, 2),
)
