"""Tiny random models of the training frameworks Ascend users build on, measured with the pass.

Each :class:`Framework` builds one library's own model code (torchtitan, torchtune, Megatron-core;
2 layers, head_dim 16 where the library lets us choose, random weights, nothing downloaded), runs it
forward and gives the causal-LM loss, and counts its RoPE, RMSNorm and SwiGLU sites independently
of the pass (:class:`~npu_fusion.measure.sites.SiteCounter` on the library's own norm and RoPE
classes, apply-RoPE function or gated linear unit's activation; torchtitan's and torchtune's MLPs
have separate gate and up projections: no SwiGLU site). :func:`measure` runs one training step eagerly (counting), in float64 (the
reference), and compiled with the real pass (:class:`~npu_fusion_testing.capture.Capture`), and
returns where every counted site ended and whether the gradients meet the criterion.

What a library needs to run on a CPU at all is in :mod:`.cpu_workarounds`, applied here only.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib
from typing import Callable, ContextManager, Dict, List

import torch
import torch.nn.functional as F

from .capture import Capture
from .cpu_workarounds import cpu_workarounds_megatron, cpu_workarounds_torchtitan
from npu_fusion.measure.grads import grad_failures
from npu_fusion.lowering import RMS_NORM_GRAD, ROPE_GRAD
from npu_fusion.lowering.ops.swiglu_grad import OP as SWIGLU_GRAD
from npu_fusion.measure.sites import Accounting, SiteCounter, account

#: the counter's kinds of the sites the frameworks' norm and RoPE classes and functions run
NORM, ROPE, SWIGLU = RMS_NORM_GRAD.option, ROPE_GRAD.option, SWIGLU_GRAD.option

VOCAB = 128  # token ids are drawn below this; every model's vocabulary is at least this large


@dataclasses.dataclass(frozen=True)
class Framework:
    name: str                                                  # "library:model"
    library: str                                               # the import name of the library
    build: Callable[[int], torch.nn.Module]                    # layers -> float32 model
    forward: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]   # (model, ids) -> [B, S, V] logits
    sites: Callable[[torch.nn.Module], SiteCounter]            # a fresh counter for a model
    workarounds: Callable[[], ContextManager] = contextlib.nullcontext  # around building and running


# -- torchtitan ---------------------------------------------------------------------------

def _torchtitan_build(model_name: str) -> Callable[[int], torch.nn.Module]:
    def build(layers: int) -> torch.nn.Module:
        package = importlib.import_module(f"torchtitan.models.{model_name}")
        config = package.model_registry("debugmodel", attn_backend="flex").model
        config.layers = config.layers[:layers]
        model = cpu_workarounds_torchtitan(config).build()
        model.init_states()
        return model
    return build


def _torchtitan_sites(model) -> SiteCounter:
    from torchtitan.models.common import RMSNorm, RoPE

    return SiteCounter(model, modules={NORM: (RMSNorm,), ROPE: (RoPE,)})  # RoPE returns (q, k)


def _torchtitan(model_name: str) -> Framework:
    return Framework(f"torchtitan:{model_name}", "torchtitan", _torchtitan_build(model_name),
                     lambda model, ids: model(ids), _torchtitan_sites)


# -- torchtune ----------------------------------------------------------------------------

def _torchtune_build(model_name: str) -> Callable[[int], torch.nn.Module]:
    def build(layers: int) -> torch.nn.Module:
        builder = getattr(importlib.import_module(f"torchtune.models.{model_name}"), model_name)
        sizes = dict(vocab_size=VOCAB, num_layers=layers, num_heads=4, num_kv_heads=2, embed_dim=64,
                     max_seq_len=64, intermediate_dim=128)
        if model_name.startswith("gemma"):
            sizes["head_dim"] = 16
        if model_name == "gemma2":
            sizes["sliding_window_size"] = 8
        return builder(**sizes)
    return build


def _torchtune_sites(model) -> SiteCounter:
    from torchtune.models.gemma.rms_norm import GemmaRMSNorm
    from torchtune.models.llama3_1._position_embeddings import Llama3ScaledRoPE
    from torchtune.modules import RMSNorm, RotaryPositionalEmbeddings

    return SiteCounter(model, modules={NORM: (RMSNorm, GemmaRMSNorm),
                                       ROPE: (RotaryPositionalEmbeddings, Llama3ScaledRoPE)})


def _torchtune(model_name: str) -> Framework:
    return Framework(f"torchtune:{model_name}", "torchtune", _torchtune_build(model_name),
                     lambda model, ids: model(ids), _torchtune_sites)


# -- Megatron-core ------------------------------------------------------------------------

def _megatron_build(interleaved: bool, qk_norm: bool) -> Callable[[int], torch.nn.Module]:
    """GPTModel with the local layer spec (plain PyTorch modules, no TransformerEngine), no
    dropout (its default is 0.1) and no fused kernels; call inside :func:`cpu_workarounds_megatron`."""
    def build(layers: int) -> torch.nn.Module:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.models.gpt.gpt_model import GPTModel
        from megatron.core.transformer.transformer_config import TransformerConfig

        config = TransformerConfig(
            num_layers=layers, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128,
            hidden_dropout=0.0, attention_dropout=0.0, normalization="RMSNorm", use_cpu_initialization=True,
            gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
            rotary_interleaved=interleaved, qk_layernorm=qk_norm, params_dtype=torch.float32,
            apply_rope_fusion=False, masked_softmax_fusion=False, bias_activation_fusion=False,
            bias_dropout_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False)
        spec = get_gpt_layer_local_spec(qk_layernorm=qk_norm, normalization="RMSNorm")
        return GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=64, position_embedding_type="rope")
    return build


def _megatron_forward(model, ids):
    """Explicit positions and causal mask: Megatron's default mask is made on CUDA."""
    seq = ids.shape[1]
    positions = torch.arange(seq).unsqueeze(0).expand(ids.shape[0], -1)
    mask = torch.triu(torch.ones(seq, seq), diagonal=1).bool()[None, None]
    return model(ids, positions, mask)


def _megatron_sites(model) -> SiteCounter:
    import megatron.core.transformer.attention as attention

    # the local spec's RMSNorm is torch.nn.RMSNorm; RoPE is a function the attention calls by name;
    # with gated linear units the MLP calls the config's activation on fc1's first half (a site)
    gated = [(model.config, "activation_func")] if model.config.gated_linear_unit else []
    return SiteCounter(model, modules={NORM: (torch.nn.RMSNorm,)},
                       functions={ROPE: [(attention, "apply_rotary_pos_emb")], SWIGLU: gated})


def _megatron(name: str, interleaved: bool, qk_norm: bool) -> Framework:
    return Framework(f"megatron:{name}", "megatron.core", _megatron_build(interleaved, qk_norm),
                     _megatron_forward, _megatron_sites, cpu_workarounds_megatron)


FRAMEWORKS: Dict[str, Framework] = {f.name: f for f in [
    _torchtitan("llama3"), _torchtitan("qwen3"), _torchtitan("deepseek_v3"),
    _torchtune("llama3"), _torchtune("llama3_1"), _torchtune("gemma"), _torchtune("gemma2"),
    _megatron("gpt", interleaved=False, qk_norm=False),
    _megatron("gpt-interleaved-qknorm", interleaved=True, qk_norm=True),
]}


# -- building and measuring ---------------------------------------------------------------

def _tensors(model) -> Dict[str, torch.Tensor]:
    named = dict(model.named_parameters(remove_duplicate=False))
    named.update(model.named_buffers(remove_duplicate=False))
    return named


def build(framework: Framework, dtype=torch.float32, layers: int = 2, seed: int = 0) -> torch.nn.Module:
    """The model in ``dtype``: floating-point parameters and buffers only. Never ``model.to(dtype)``:
    it would turn torchtitan's complex64 RoPE table into its real part."""
    torch.manual_seed(seed)
    model = framework.build(layers)
    counter = framework.sites(model)
    with torch.no_grad():
        # a counted module's own parameters (a norm's gamma) start at ones (or zeros): their
        # gradient would be degenerate
        for module in model.modules():
            if isinstance(module, counter.module_types()):
                for p in module.parameters(recurse=False):
                    p.add_(torch.randn_like(p) * 0.1)
        for t in _tensors(model).values():
            if t.is_floating_point():
                t.data = t.data.to(dtype)
    return model


def widened(framework: Framework, model, layers: int = 2) -> torch.nn.Module:
    """A float64 copy of ``model`` (complex tables in complex128), built again rather than deep-copied
    (Megatron's modules hold process groups) and given every parameter and buffer of ``model``."""
    torch.manual_seed(0)
    wide = framework.build(layers)
    source = _tensors(model)
    for name, t in _tensors(wide).items():
        dtype = torch.complex128 if t.is_complex() else torch.float64 if t.is_floating_point() else t.dtype
        t.data = source[name].detach().to(dtype)
    return wide


def loss(framework: Framework, run, ids) -> torch.Tensor:
    logits = framework.forward(run, ids)
    return F.cross_entropy(logits.float().flatten(0, 1), ids.flatten())


def param_grads(framework: Framework, model, ids, run=None) -> Dict[str, torch.Tensor]:
    """One forward and backward of ``run`` (the model itself, or its compiled form)."""
    model.zero_grad(set_to_none=True)
    loss(framework, model if run is None else run, ids).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


@dataclasses.dataclass
class Coverage:
    """One framework model compiled with the pass: where each counted site ended, the gradient
    check, and the capture with every backward graph before and after the pass."""
    name: str
    dtype: torch.dtype
    sites: Dict[str, Accounting]     # by kind: "rope", "rms_norm", "swiglu" (and the forward kinds)
    grad_failures: List[str]
    capture: Capture

    @property
    def pass_errors(self) -> List[str]:
        return [r.error for r in self.capture.results if r.error]


def measure(framework: Framework, dtype=torch.float32, batch: int = 2, seq: int = 12, layers: int = 2,
            **capture_options) -> Coverage:
    """Count the sites in an eager step, compute the float64 reference, then compile with the pass
    (``capture_options``: :class:`Capture`'s) and count what ran outside the compiled graphs."""
    ids = torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(1))
    with framework.workarounds():
        model = build(framework, dtype, layers)
        with framework.sites(model) as counted:
            eager = param_grads(framework, model, ids)
        exact = param_grads(framework, widened(framework, model, layers), ids)
        torch._dynamo.reset()
        capture = Capture(**capture_options)
        try:
            with framework.sites(model) as outside:
                fused = param_grads(framework, model, ids, run=torch.compile(model, backend=capture))
        finally:
            torch._dynamo.reset()
    return Coverage(framework.name, dtype, account(counted, outside, capture),
                    grad_failures(fused, eager, exact), capture)
