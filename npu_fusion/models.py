"""Small bundled decoder models in plain PyTorch, written the way Hugging Face
transformers writes them, for the report and the benchmarks (no downloads).

``rope`` selects how the attention rotates q and k:

* ``"half"``: Llama's ``rotate_half`` (RotaryPositionEmbeddingGrad mode 0);
* ``"interleave"``: GPT-J's ``rotate_every_two`` with repeat-interleaved tables (mode 1);
* ``"interleave_half"``: DeepSeek-V3's de-interleave then ``rotate_half`` (mode 3).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn


@dataclasses.dataclass
class TinyConfig:
    vocab_size: int = 128
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    rope: str = "half"
    rope_theta: float = 10000.0
    eps: float = 1e-6
    #: activation checkpointing of each block: "none", "full" (recompute the whole block in the
    #: backward) or "selective" (save the matmul outputs, recompute the rest)
    checkpoint: str = "none"
    #: the MLP's projections: "separate" (Llama's gate and up) or "gate_up" (Phi-3's one projection
    #: chunked into the gate and the up: a SwiGLU site)
    mlp: str = "separate"

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


class RMSNorm(nn.Module):
    """HF LlamaRMSNorm: statistics in fp32, the weight applied in the input's dtype."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def rotate_every_two(x):
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def apply_rope(q, k, cos, sin, style: str):
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    if style == "interleave":
        return q * cos + rotate_every_two(q) * sin, k * cos + rotate_every_two(k) * sin
    if style == "interleave_half":
        def deinterleave(t):
            b, h, s, d = t.shape
            return t.view(b, h, s, d // 2, 2).transpose(4, 3).reshape(b, h, s, d)
        q, k = deinterleave(q), deinterleave(k)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


class Rotary(nn.Module):
    def __init__(self, config: TinyConfig):
        super().__init__()
        d = config.head_dim
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.style = config.rope

    def forward(self, x, position_ids):
        freqs = position_ids[..., None].float() * self.inv_freq
        if self.style == "interleave":
            emb = torch.repeat_interleave(freqs, 2, dim=-1)
        else:
            emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: TinyConfig):
        super().__init__()
        self.config = config
        h, d = config.hidden_size, config.head_dim
        self.q_proj = nn.Linear(h, config.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, config.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, config.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(config.num_heads * d, h, bias=False)

    def forward(self, x, cos, sin):
        c = self.config
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, c.num_heads, c.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, c.num_kv_heads, c.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, c.num_kv_heads, c.head_dim).transpose(1, 2)
        q, k = apply_rope(q, k, cos, sin, c.rope)
        groups = c.num_heads // c.num_kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class Block(nn.Module):
    def __init__(self, config: TinyConfig):
        super().__init__()
        self.input_norm = RMSNorm(config.hidden_size, config.eps)
        self.attn = Attention(config)
        self.post_norm = RMSNorm(config.hidden_size, config.eps)
        if config.mlp == "gate_up":
            self.gate_up = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        else:
            self.gate = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
            self.up = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.input_norm(x), cos, sin)
        h = self.post_norm(x)
        gate, up = self.gate_up(h).chunk(2, -1) if hasattr(self, "gate_up") else (self.gate(h), self.up(h))
        return x + self.down(F.silu(gate) * up)


class TinyDecoder(nn.Module):
    """Embedding, ``num_layers`` pre-norm blocks, final norm and LM head."""

    def __init__(self, config: TinyConfig):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary = Rotary(config)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        positions = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0).expand(ids.shape[0], -1)
        cos, sin = self.rotary(x, positions)
        for layer in self.layers:
            x = self._run(layer, x, cos, sin)
        return self.lm_head(self.norm(x))

    def _run(self, layer, x, cos, sin):
        if self.config.checkpoint == "none":
            return layer(x, cos, sin)
        from torch.utils.checkpoint import checkpoint

        kwargs = {}
        if self.config.checkpoint == "selective":
            kwargs["context_fn"] = _save_matmuls
        return checkpoint(layer, x, cos, sin, use_reentrant=False, **kwargs)

    def loss(self, ids):
        logits = self(ids)
        return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())

    @property
    def expected_sites(self):
        """RMSNorm calls, RoPE applications and SwiGLU products of one forward, by construction."""
        from .lowering import RMS_NORM_GRAD, ROPE_GRAD
        from .lowering.ops.swiglu_grad import OP as SWIGLU_GRAD

        layers = self.config.num_layers
        return {RMS_NORM_GRAD.name: 2 * layers + 1, ROPE_GRAD.name: 2 * layers,
                SWIGLU_GRAD.name: layers if self.config.mlp == "gate_up" else 0}


def _save_matmuls():
    """Selective activation checkpointing: keep matmul outputs, recompute everything else."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    def policy(_ctx, op, *_args, **_kwargs):
        return CheckpointPolicy.MUST_SAVE if op in (torch.ops.aten.mm.default, torch.ops.aten.bmm.default) \
            else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


CHECKPOINTING = ("none", "full", "selective")

BUNDLED = {
    "llama": TinyConfig(rope="half"),
    "gptj": TinyConfig(rope="interleave"),
    "deepseek": TinyConfig(rope="interleave_half"),
    "phi3": TinyConfig(rope="half", mlp="gate_up"),  # Llama's, with Phi-3's one gate_up projection
}


def bundled(name: str, num_layers: int = 2, dtype=torch.float32, seed: int = 0, **overrides) -> TinyDecoder:
    if name not in BUNDLED:
        raise ValueError(f"unknown bundled model {name!r}; choose from {sorted(BUNDLED)}")
    if overrides.get("checkpoint", "none") not in CHECKPOINTING:
        raise ValueError(f"unknown checkpointing {overrides['checkpoint']!r}; choose from {CHECKPOINTING}")
    config = dataclasses.replace(BUNDLED[name], num_layers=num_layers, **overrides)
    torch.manual_seed(seed)
    model = TinyDecoder(config)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, RMSNorm):
                module.weight.normal_(1.0, 0.1)
    return model.to(dtype)
