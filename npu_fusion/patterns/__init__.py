"""The FX pattern matchers: find decomposed backward subgraphs, check the target's
constraints, rewrite them into fused op calls. One module per fused op family.

:data:`FORMS` lists the spellings each matcher is tested on; the README's table of
supported forms is rendered from it (``render_forms``) and a test keeps the two equal.
"""

FORMS = [
    # (fused op, form, where it comes from)
    ("rotary_position_embedding_grad", "mode 0 half: `rotate_half`", "HF `apply_rotary_pos_emb` (Llama, Qwen2/3, Mistral, Gemma, ...)"),
    ("rotary_position_embedding_grad", "mode 1 interleave: strided slices + stack + flatten", "GPT-J `rotate_every_two`, Cohere"),
    ("rotary_position_embedding_grad", "mode 1 interleave: complex `view_as_complex(x) * freqs_cis`", "Llama 4, DeepSeek-V2"),
    ("rotary_position_embedding_grad", "mode 2 quarter: four chunks", "targets `950`, `generic`"),
    ("rotary_position_embedding_grad", "mode 3 interleave-half: de-interleave then `rotate_half`", "DeepSeek-V3 (`view`/`transpose` or even/odd slices)"),
    ("rotary_position_embedding_grad", "partial rotary (`rotary_dim < head_dim`)", "GPT-NeoX `rotary_pct`, GPT-J `rotary_dim`, `partial_rotary_factor`"),
    ("rotary_position_embedding_grad", "half-width or complex tables rebuilt to full width", "`x1*cos - x2*sin` spellings, `freqs_cis`"),
    ("rotary_position_embedding_grad", "layouts BNSD, BSND, SBND, TND; cos/sin 11SD, B1SD, BNSD, 1S1D, BS1D, BSND, S11D, SB1D, T1D, TND, [S, D]", "`unsqueeze_dim=1/2`, packed sequences"),
    ("rotary_position_embedding_grad", "cos/sin requiring grad: x passed, dcos/dsin wired", "learned or scaled tables; q and k sharing them"),
    ("rotary_position_embedding_grad", "output scaled by a constant before use", "`q * scale`, SDPA's math path"),
    ("rotary_position_embedding_grad", "a dy that is itself computed: output used elementwise, scaled per position", "`q_rot . k_rot`, `q.square()`, Llama 4's L2 qk-norm, Ministral 3's q scaling"),
    ("rotary_position_embedding_grad", "a table negated as a whole (`cat(x2, -x1)`: mode 0 with sin negated)", "nanochat"),
    ("rotary_position_embedding_grad", "mode 1 interleave: `stack` of `x[..., 0]`/`x[..., 1]` products with a `[S, D/2, 2]` cache (`select_backward`)", "torchtune `RotaryPositionalEmbeddings`, `Llama3ScaledRoPE`"),
    ("rotary_position_embedding_grad", "`[S, B, H, D]` with tables computed from `freqs` in the graph, half or interleaved (`stack((-x2, x1), -1)`)", "Megatron-core `_apply_rotary_pos_emb_bshd`"),
    ("rotary_position_embedding_grad", "one rotated head expanded over the heads, or GQA's k expanded after RoPE (dy a sum over the copies)", "torchtitan DeepSeek-V3 MLA `k_pe`, torchtune GQA, DeepSeek-V2"),
    ("rotary_position_embedding_grad", "one table saved several times (copies of one forward expression are one value)", "torchtune's `cache[..., 0]` in two products"),
    ("rotary_position_embedding_grad", "complex tables broadcast head-first (`freqs_cis[None, None, :T]` on `[B, H, T, D]`), under either partitioner", "torchtitan `ComplexRoPE`"),
    ("rotary_position_embedding_grad", "inside training graphs: activation checkpointing (full, selective), compiled autograd, DDP, FSDP2", "torchtitan, transformers' `gradient_checkpointing_enable`"),
    ("rms_norm_grad", "fp32 statistics, `weight * x.to(dtype)`", "HF `LlamaRMSNorm` and its copies"),
    ("rms_norm_grad", "`torch.nn.RMSNorm`, `F.rms_norm`, with or without weight", "PyTorch"),
    ("rms_norm_grad", "`x * (1 + weight)` in fp32", "Gemma"),
    ("rms_norm_grad", "normalized input cast to the weight's dtype", "T5"),
    ("rms_norm_grad", "per-head norms on 4-D tensors; gamma over several trailing axes", "Qwen3 q/k norms"),
    ("rms_norm_grad", "dx summed into the residual gradient (no cast in between)", "fp32 models"),
    ("rms_norm_grad", "rstd saved by the partitioner or recomputed in the backward", "default and min-cut partitioners"),
    ("rms_norm_grad", "output scaled by a constant before use", "MiniCPM3's logits scaling"),
    ("rms_norm_grad", "gated norms: `norm(x) * gate` (dy = grad * gate)", "Qwen3-Next, Qwen3.5, Kimi `o_norm`"),
    ("rms_norm_grad", "post- and sandwich norms: dy is another norm's dx, x another norm's output", "Gemma 2/3, OLMo 2/3, GLM-4, EXAONE 4, nanochat"),
    ("rms_norm_grad", "x a computed value (`norm(relu(g)**2 * up)`)", "BitNet"),
    ("rms_norm_grad", "float32 statistics with a bf16 weight (gamma widened exactly, dgamma narrowed back)", "torchtitan Qwen3 qk-norms in bf16"),
    ("rms_norm_grad", "symbolic hidden size (`dynamic=True` with the size from an input)", "dynamic shapes"),
    ("rms_norm_grad", "inside training graphs: activation checkpointing (full, selective), compiled autograd, DDP, FSDP2", "torchtitan, transformers' `gradient_checkpointing_enable`"),
]


def render_forms() -> str:
    lines = ["| fused op | form | seen in |", "|---|---|---|"]
    lines += [f"| `{op}` | {form} | {where} |" for op, form, where in FORMS]
    return "\n".join(lines)
