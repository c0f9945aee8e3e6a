"""A caller's in-place update between forward and backward, legal in eager: the program every
compile path must keep legal once the pass fuses its RMSNorm (the fused op reads x, which the
caller holds, where the unfused backward read the forward's float32 upcast, a copy)."""
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
