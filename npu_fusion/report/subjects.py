"""What the report runs a training step of, and how it counts sites independently.

What the report runs a training step of (:class:`Subject`): the bundled decoders, a tiny random
transformers model, or the user's own module or function (:func:`npu_fusion.explain`); and the
independent site counter of the transformers naming convention (:func:`conventional_counter`).

A :class:`SubjectSource` adds models to the command line from outside the package: the
repository's harness adds ``--framework`` (the training frameworks' own model code) this way.
"""
from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
import sys
from typing import Any, Callable, ContextManager, Dict, Optional, Sequence

import torch

from ..measure.sites import COUNTED_SITES, SiteCounter

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class UsageError(Exception):
    pass


@dataclasses.dataclass
class Subject:
    """A model and how to run one training step of it."""
    name: str
    model: torch.nn.Module
    loss: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]
    vocab_size: int
    #: fused-op sites one forward contains, when known independently of the pass
    expected: Optional[Dict[str, int]] = None
    #: counts the sites in an eager run instead: a :class:`SiteCounter` factory
    counter: Optional[Callable] = None
    #: the counter also tells, during the compiled run, which sites ran outside compiled graphs
    counts_outside: bool = False
    #: a float64 copy of the model (when a deep copy cast with ``.double()`` is not one)
    reference: Optional[Callable[[], torch.nn.Module]] = None
    #: the step's inputs for the float64 copy (floating inputs widened; token ids stay as they are)
    widen: Callable[[Any], Any] = lambda batch: batch
    #: what an inference step compares, ``outputs(model, batch)`` (its floating tensors); None: the loss
    outputs: Optional[Callable[[torch.nn.Module, Any], Any]] = None


class SubjectSource:
    """Models the command line can build besides the bundled and the transformers ones: its
    options join the mutually exclusive model options."""

    def add_arguments(self, models: argparse._MutuallyExclusiveGroup) -> None:
        raise NotImplementedError

    def chosen(self, args: argparse.Namespace) -> bool:
        """Whether ``args`` asks for one of this source's models."""
        raise NotImplementedError

    def subject(self, args: argparse.Namespace) -> Subject:
        raise NotImplementedError

    def workarounds(self, args: argparse.Namespace) -> ContextManager:
        """What the model's library needs around building and running it."""
        raise NotImplementedError


def bundled_subject(args) -> Subject:
    from ..models import bundled

    model = bundled(args.model, num_layers=args.layers, dtype=DTYPES[args.dtype], seed=args.seed,
                    checkpoint=args.checkpointing)
    return Subject(name=f"{args.model} (bundled)", model=model, loss=lambda m, ids: m.loss(ids),
                   vocab_size=model.config.vocab_size, expected=dict(model.expected_sites))


#: per-architecture settings on top of :data:`_HF_SMALL` (a tiny config must stay consistent)
_HF_OVERRIDES = {
    "gptj": {"rotary_dim": 16, "n_inner": 128},
    "deepseek_v3": {"num_key_value_heads": 4, "kv_lora_rank": 32, "q_lora_rank": 32, "qk_rope_head_dim": 16, "qk_nope_head_dim": 16,
                    "v_head_dim": 16, "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2,
                    "moe_intermediate_size": 32, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1},
}
_HF_SMALL = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 256,
             "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}


def unknown_model_type(model_type: str) -> UsageError:
    """The error for a model type transformers does not know, naming the known ones spelled closest."""
    import difflib

    from transformers import CONFIG_MAPPING

    close = difflib.get_close_matches(model_type, list(CONFIG_MAPPING.keys()), n=5)
    return UsageError(f"transformers does not know the model type {model_type!r}"
                      + (f"; the closest it knows: {', '.join(close)}" if close else ""))


def tiny_hf_config(model_type: str, layers: int):
    """A small random config of a transformers architecture, built offline."""
    from transformers import AutoConfig

    try:
        config_class = type(AutoConfig.for_model(model_type))
    except (ValueError, KeyError) as exc:
        raise unknown_model_type(model_type) from None
    accepted = set(inspect.signature(config_class.__init__).parameters) | set(getattr(config_class, "attribute_map", {}))
    wanted = dict(_HF_SMALL, num_hidden_layers=layers, **_HF_OVERRIDES.get(model_type, {}))
    return AutoConfig.for_model(model_type, **{k: v for k, v in wanted.items() if k in accepted})


def hf_subject(args) -> Subject:
    try:
        import transformers
        from transformers import AutoModelForCausalLM
    except ImportError:
        raise UsageError("--hf needs transformers (pip install transformers)") from None
    config = tiny_hf_config(args.hf, args.layers)
    torch.manual_seed(args.seed)
    try:
        # eager attention and experts: plain PyTorch the pass can see, and a float64 reference
        # (grouped_mm has no float64 kernel)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", experts_implementation="eager")
    except TypeError:
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    except ValueError as exc:
        raise UsageError(f"{args.hf} has no causal-LM model in transformers {transformers.__version__}: {exc}") from None
    # eval(): no dropout, so that eager and compiled see the same function (autograd is unaffected)
    model = model.to(DTYPES[args.dtype]).eval()
    if args.checkpointing == "selective":
        raise UsageError("--checkpointing selective is for the bundled models; transformers models take full")
    if args.checkpointing == "full":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()  # transformers checkpoints only in training mode; the tiny configs have no dropout

    def loss(m, ids):
        return m(input_ids=ids, labels=ids, use_cache=False).loss

    return Subject(name=f"{args.hf} (transformers {transformers.__version__}, {type(model).__name__})",
                   model=model, loss=loss, vocab_size=config.vocab_size, counter=conventional_counter,
                   outputs=lambda m, ids: m(input_ids=ids, use_cache=False).logits)


class FunctionModule(torch.nn.Module):
    """A plain function as a module whose parameters are the inputs that take gradients."""

    def __init__(self, fn: Callable, inputs: Sequence[Any]):
        super().__init__()
        self.fn = fn
        wanted = [i for i, a in enumerate(inputs) if isinstance(a, torch.Tensor) and a.requires_grad]
        self.positions = wanted or [i for i, a in enumerate(inputs)
                                    if isinstance(a, torch.Tensor) and a.is_floating_point()]
        for i in self.positions:
            self.register_parameter(f"input{i}", torch.nn.Parameter(inputs[i].detach().clone()))

    def forward(self, *others):
        rest = iter(others)
        count = len(self.positions) + len(others)
        return self.fn(*(getattr(self, f"input{i}") if i in self.positions else next(rest) for i in range(count)))


def gate_activations(model: torch.nn.Module, site) -> tuple:
    """The gate activations of ``model``: its modules whose class name matches :attr:`~npu_fusion.lowering.CountedSite.gate_activation`."""
    return tuple(m for m in model.modules() if re.search(site.gate_activation, type(m).__name__))


def conventional_counter(model: torch.nn.Module) -> SiteCounter:
    """A site counter for the transformers naming convention each counted op declares.

    A site counter for the transformers naming convention each counted op declares
    (:class:`~npu_fusion.lowering.CountedSite`): calls of module classes named ``*RMSNorm``,
    calls of a SiLU module that compute SwiGLU's value (the SiLU of the first half of a tensor
    times its second half: :class:`~npu_fusion.measure.sites.GatedProducts`), and
    tensors returned by functions named ``apply_rotary_pos_emb*`` in the modules that define the
    model's classes (Llama's rotates q and k in one call, GPT-J's one tensor per call). A plain
    function (:class:`FunctionModule`) is counted through the attribute that holds it, itself such
    a function or not."""
    modules = {sys.modules.get(type(m).__module__) for m in model.modules()}
    if isinstance(model, FunctionModule):
        modules.add(sys.modules.get(getattr(model.fn, "__module__", None)))
    classes, functions, gated = {}, {}, {}
    for kind, site in COUNTED_SITES.items():
        if site.class_suffix:
            classes[kind] = tuple({type(m) for m in model.modules()
                                   if type(m).__name__.lower().endswith(site.class_suffix)})
        if site.gate_activation:
            gated[kind] = gate_activations(model, site)
        if site.function_prefix:
            functions[kind] = [(module, attr) for module in modules if module is not None for attr in dir(module)
                               if attr.startswith(site.function_prefix) and callable(getattr(module, attr))]
            if isinstance(model, FunctionModule) and getattr(model.fn, "__name__", "").startswith(site.function_prefix):
                functions[kind].append((model, "fn"))
    return SiteCounter(model, modules=classes, functions=functions, gated=gated)
