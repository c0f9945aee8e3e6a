"""The FX pattern matchers: find decomposed backward subgraphs, check the target's
constraints, rewrite them into fused op calls. One module per fused op, each ending in
its :class:`~.rewrite.Rule`; :data:`RULES` is what the pass manager runs, in order.

The method they share: :mod:`.nodes` reads a graph, :mod:`.evaluator` evaluates it
(memoized, seeing through saved tensors), :mod:`.lanes` and :mod:`.algebra` are the two
abstract domains, :mod:`.rewrite` makes each candidate a transaction with one shared
emit, and :mod:`.traffic` is the report's memory-traffic model.

:data:`FORMS` lists the spellings each matcher is tested on; the README's table of
supported forms is rendered from it (``render_forms``) and a test keeps the two equal.
"""
from ..lowering import RMS_NORM, RMS_NORM_GRAD, ROPE_GRAD
from . import rms_norm, rms_norm_forward, rope

#: The rules in the order each round runs them. A site whose dy is another site's dx (a
#: post- or sandwich norm's dy, RoPE's dy under Llama 4's L2 qk-norm, a qk-norm's dy under
#: RoPE) stays pending until that site is a fused op and fuses in the next round, so the
#: order decides only the round in which such a site fuses, never whether it does (the
#: pass manager runs up to ``MAX_ROUNDS``). RMSNorm runs first, as it always has: every
#: figure the project reports was measured in this order.
#: The forward rule runs after the backward ones: it fuses a forward only once its backward is
#: a fused op (the backward rules match the decomposed forward they were written for, statistic
#: and normalized value included), and then hands that op its rstd.
RULES = (rms_norm.RULE, rope.RULE, rms_norm_forward.RULE)

FORMS = [
    # (fused op, form, where it comes from)
    (ROPE_GRAD.name, "mode 0 half: `rotate_half`", "HF `apply_rotary_pos_emb` (Llama, Qwen2/3, Mistral, Gemma, ...)"),
    (ROPE_GRAD.name, "mode 1 interleave: strided slices + stack + flatten", "GPT-J `rotate_every_two`, Cohere"),
    (ROPE_GRAD.name, "mode 1 interleave: complex `view_as_complex(x) * freqs_cis`", "Llama 4, DeepSeek-V2"),
    (ROPE_GRAD.name, "mode 2 quarter: four chunks", "targets `950`, `generic`"),
    (ROPE_GRAD.name, "mode 3 interleave-half: de-interleave then `rotate_half`", "DeepSeek-V3 (`view`/`transpose` or even/odd slices)"),
    (ROPE_GRAD.name, "partial rotary (`rotary_dim < head_dim`)", "GPT-NeoX `rotary_pct`, GPT-J `rotary_dim`, `partial_rotary_factor`"),
    (ROPE_GRAD.name, "half-width or complex tables rebuilt to full width", "`x1*cos - x2*sin` spellings, `freqs_cis`"),
    (ROPE_GRAD.name, "layouts BNSD, BSND, SBND, TND; cos/sin 11SD, B1SD, BNSD, 1S1D, BS1D, BSND, S11D, SB1D, T1D, TND, [S, D]", "`unsqueeze_dim=1/2`, packed sequences"),
    (ROPE_GRAD.name, "cos/sin requiring grad: x passed, dcos/dsin wired", "learned or scaled tables; q and k sharing them"),
    (ROPE_GRAD.name, "output scaled by a constant before use", "`q * scale`, SDPA's math path"),
    (ROPE_GRAD.name, "a dy that is itself computed: output used elementwise, scaled per position, also when the rotation's backward reads it in pieces (halves, pair lanes)", "`q_rot . k_rot`, `q.square()`, Llama 4's L2 qk-norm, Ministral 3's q scaling, torchtune RoPE then `exp`"),
    (ROPE_GRAD.name, "a table negated as a whole (`cat(x2, -x1)`: mode 0 with sin negated)", "nanochat"),
    (ROPE_GRAD.name, "mode 1 interleave: `stack` of `x[..., 0]`/`x[..., 1]` products with a `[S, D/2, 2]` cache (`select_backward`)", "torchtune `RotaryPositionalEmbeddings`, `Llama3ScaledRoPE`"),
    (ROPE_GRAD.name, "`[S, B, H, D]` with tables computed from `freqs` in the graph, half or interleaved (`stack((-x2, x1), -1)`)", "Megatron-core `_apply_rotary_pos_emb_bshd`"),
    (ROPE_GRAD.name, "one rotated head expanded over the heads, or GQA's k expanded after RoPE (dy a sum over the copies)", "torchtitan DeepSeek-V3 MLA `k_pe`, torchtune GQA, DeepSeek-V2"),
    (ROPE_GRAD.name, "one table saved several times (copies of one forward expression are one value)", "torchtune's `cache[..., 0]` in two products"),
    (ROPE_GRAD.name, "complex tables broadcast head-first (`freqs_cis[None, None, :T]` on `[B, H, T, D]`), under either partitioner", "torchtitan `ComplexRoPE`"),
    (ROPE_GRAD.name, "autocast: a bf16 or fp16 x with float32 tables, GQA's k expanded while float32 (each term rounded to dk's dtype)", "Hugging Face Trainer `bf16=True`, `torch.autocast` training"),
    (ROPE_GRAD.name, "inside training graphs: activation checkpointing (full, selective), compiled autograd, DDP, FSDP2", "torchtitan, transformers' `gradient_checkpointing_enable`"),
    (RMS_NORM_GRAD.name, "fp32 statistics, `weight * x.to(dtype)`", "HF `LlamaRMSNorm` and its copies"),
    (RMS_NORM_GRAD.name, "`torch.nn.RMSNorm`, `F.rms_norm`, with or without weight", "PyTorch"),
    (RMS_NORM_GRAD.name, "`x * (1 + weight)` in fp32", "Gemma"),
    (RMS_NORM_GRAD.name, "normalized input cast to the weight's dtype", "T5"),
    (RMS_NORM_GRAD.name, "per-head norms on 4-D tensors; gamma over several trailing axes", "Qwen3 q/k norms"),
    (RMS_NORM_GRAD.name, "dx summed into the residual gradient (no cast in between)", "fp32 models"),
    (RMS_NORM_GRAD.name, "rstd saved by the partitioner or recomputed in the backward", "default and min-cut partitioners"),
    (RMS_NORM_GRAD.name, "output scaled by a constant before use", "MiniCPM3's logits scaling"),
    (RMS_NORM_GRAD.name, "gated norms: `norm(x) * gate` (dy = grad * gate)", "Qwen3-Next, Qwen3.5, Kimi `o_norm`"),
    (RMS_NORM_GRAD.name, "post- and sandwich norms: dy is another norm's dx (or the sum of several), x another norm's output", "Gemma 2/3, OLMo 2/3, GLM-4, EXAONE 4, nanochat, HRM"),
    (RMS_NORM_GRAD.name, "x a computed value (`norm(relu(g)**2 * up)`)", "BitNet"),
    (RMS_NORM_GRAD.name, "float32 statistics with a bf16 weight (gamma widened exactly, dgamma narrowed back)", "torchtitan Qwen3 qk-norms in bf16"),
    (RMS_NORM_GRAD.name, "autocast with fp32 weights; a bf16 input's normalized value rounded to bf16 before an fp32 weight (dx fused, dgamma left to the program)", "Trainer `bf16=True`; Qwen3 q/k norms under autocast"),
    (RMS_NORM_GRAD.name, "symbolic hidden size (`dynamic=True` with the size from an input)", "dynamic shapes"),
    (RMS_NORM_GRAD.name, "inside training graphs: activation checkpointing (full, selective), compiled autograd, DDP, FSDP2", "torchtitan, transformers' `gradient_checkpointing_enable`"),
    (RMS_NORM_GRAD.name, "`aten._fused_rms_norm_backward` kept whole (the outputs its `output_mask` asks for; with or without weight)", "`F.rms_norm` on a device with its own RMSNorm kernel (CUDA, XPU; none on torch_npu yet)"),
    (RMS_NORM.name, "forward on the joint graph, paired with its fused backward (which reads its rstd): HF with its casts, `nn.RMSNorm`/`F.rms_norm`, Gemma `1 + weight`, T5, per-head, gated, post and sandwich norms, no weight (option `rms_norm_forward`, off by default)", "the same models as `rms_norm_grad`")
]


def render_forms() -> str:
    lines = ["| fused op | form | seen in |", "|---|---|---|"]
    lines += [f"| `{op}` | {form} | {where} |" for op, form, where in FORMS]
    return "\n".join(lines)
