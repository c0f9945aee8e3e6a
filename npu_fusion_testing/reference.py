"""Independent float64 references for the fused ops' tests: the forwards of docs/fused-ops.md
written plainly (no code shared with the ops), differentiated by autograd."""
import torch


def rotate(x, mode):
    """The forward rotation of each RoPE mode (docs/fused-ops.md), without sharing code with the op."""
    d = x.shape[-1]
    if mode == 0:
        return torch.cat((-x[..., d // 2:], x[..., : d // 2]), dim=-1)
    if mode == 1:
        return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).reshape(x.shape)
    if mode == 2:
        q = d // 4
        a, b, c, e = x[..., :q], x[..., q:2 * q], x[..., 2 * q:3 * q], x[..., 3 * q:]
        return torch.cat((-b, a, -e, c), dim=-1)
    raise ValueError(mode)


def rope_forward(x, cos, sin, mode):
    if mode == 3:  # DeepSeek-V3: de-interleave, then rotate_half; output in halves
        xd = torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
        return xd * cos + rotate(xd, 0) * sin
    return x * cos + rotate(x, mode) * sin


def rope_grads(dy, cos, sin, x, mode, dtype=torch.float64):
    """(dx, dcos, dsin) by autograd of the forward, computed in ``dtype``."""
    x = x.detach().to(dtype).requires_grad_()
    cos = cos.detach().to(dtype).requires_grad_()
    sin = sin.detach().to(dtype).requires_grad_()
    y = rope_forward(x, cos, sin, mode)
    return torch.autograd.grad(y, (x, cos, sin), dy.to(dtype))


def rms_norm_forward(x, gamma, eps, n):
    dims = tuple(range(n, x.dim()))
    rstd = torch.rsqrt(x.pow(2).mean(dims, keepdim=True) + eps)
    return x * rstd * gamma, rstd


def rms_norm_grads(dy, x, gamma, eps, n, dtype=torch.float64):
    x = x.detach().to(dtype).requires_grad_()
    gamma = gamma.detach().to(dtype).requires_grad_()
    y, _ = rms_norm_forward(x, gamma, eps, n)
    return torch.autograd.grad(y, (x, gamma), dy.to(dtype))

