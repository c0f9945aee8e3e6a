"""The model-zoo sweep: every causal LM of the installed transformers that uses RoPE, RMSNorm or SwiGLU, measured.

Each is built from a tiny random config and compiled with the real pass. The kinds of site
(:data:`COUNTED_KINDS`) are the backward rules' site probes.

For each model: the sites counted independently of the pass in an eager step
(:func:`count_sites`), where they ended after the pass (fused, with a recorded miss, left
unfused by module), the gradient criterion (:func:`~npu_fusion.measure.grads.grad_failures`)
and what is left of the decomposed RoPE/RMSNorm backward (:func:`site_leftovers`).
``benchmarks/zoo_coverage.py`` is its command line and ``tests/test_zoo.py`` its test.

Needs transformers (the test extra).
"""
from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import functools
import importlib
import inspect
import os
import re
import sys
import time
import traceback
from typing import Any, Dict, List, Optional

import torch

from .capture import Capture, decomposed_leftovers
from npu_fusion.measure.grads import grad_failures
from npu_fusion.measure.sites import KINDS, PROBES, ROPE_OP, GatedProducts, grad_tensors
from npu_fusion.patterns import RULES, RmsNormGradRule, RopeGradRule, SwigluGradRule
from npu_fusion.plugin.options import forward_options

#: the tiny sizes; an attribute is set only when the config has it (directly or via attribute_map)
SHRINK = {
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 128, "max_position_embeddings": 64,
    # MoE and MLA sizes, so that those models stay tiny too
    "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64, "intermediate_size_mlp": 128,
    "ffn_hidden_size": 128, "n_inner": 128,
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
    "moe_topk": 2, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
    "q_lora_rank": 32, "kv_lora_rank": 32, "qk_rope_head_dim": 16, "qk_nope_head_dim": 16,
    "v_head_dim": 16, "qk_head_dim": 32,
    # linear-attention / state-space sizes of hybrid models
    "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_num_key_heads": 2,
    "linear_num_value_heads": 4, "mamba_d_ssm": 64, "mamba_n_heads": 4, "mamba_d_head": 16,
    "mamba_d_state": 16, "mamba_chunk_size": 16, "mamba_head_dim": 16, "mamba_num_heads": 4,
    "ssm_state_size": 16, "state_size": 16, "chunk_size": 16, "linear_num_heads": 4, "linear_head_dim": 16,
    "n_groups": 1, "mamba_n_groups": 1, "mamba_ngroups": 1, "time_step_rank": 8,
    "num_experts_per_token": 2, "num_layers_per_stack": 1, "H_cycles": 1, "L_cycles": 1,
}
#: (heads, head size) pairs of Mamba-2 style mixers: heads * head size must be the inner width
MAMBA_HEADS = [("mamba_n_heads", "mamba_d_head"), ("mamba_num_heads", "mamba_head_dim"),
               ("n_mamba_heads", "mamba_headdim")]
#: a shrunk model above this many parameters kept some large size under a name SHRINK does not know
MAX_PARAMS = 5_000_000
#: sizes whose None means "derive it from the others", so they are set even when None
SET_WHEN_NONE = {"num_hidden_layers", "head_dim", "num_key_value_heads", "intermediate_size", "n_inner"}
#: token-id attributes that must index the tiny vocabulary
TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id", "sep_token_id", "decoder_start_token_id")

#: module-level functions that apply RoPE to q/k (DeepSeek's ``apply_rotary_pos_emb_interleave``,
#: Llama 4's ``apply_rotary_emb``, ...); vision and multi-dimensional variants are not text RoPE
#: (the RoPE rule's site probe)
ROPE_FUNCTION = re.compile(RopeGradRule.site_probe.functions)
NOT_TEXT_ROPE = re.compile(RopeGradRule.site_probe.excluded)
ROPE_CLASS = re.compile(RopeGradRule.site_probe.module_classes)
#: the kinds the zoo counts on its own (the backward rules' site probes: ``rope``, ``rms_norm``,
#: ``swiglu``), in rule order, and the fused backward op each one's sites become
COUNTED_KINDS = tuple(kind for kind, probe in PROBES.items() if not probe.same_sites_as)
BACKWARD_OP = {kind: KINDS[kind] for kind in COUNTED_KINDS}
#: the forward op whose sites are each counted kind's (each rotation, norm call and gated product
#: is a forward site and a backward site)
FORWARD_OP = {probe.same_sites_as: KINDS[kind] for kind, probe in PROBES.items() if probe.same_sites_as}
#: the table's and summary's name of each kind
LABEL = {rule.site_probe.kind: rule.op.short_label for rule in RULES
         if rule.site_probe is not None and rule.site_probe.kind in COUNTED_KINDS}
#: the forward rules' switches, on (``--forward``)
FORWARD_OPTIONS = dict.fromkeys(forward_options(), True)
#: the SwiGLU rule's site probe: modules whose forward's source calls one gate_up projection (a
#: dense MLP) or indexes one (MoE experts: one projection per expert)
GATED_MLP_SOURCE = re.compile(SwigluGradRule.site_probe.source)
#: the activation modules a gated MLP calls on the gate half: each call is one site
GATE_ACTIVATION = re.compile(SwigluGradRule.ops[0].counted_site.gate_activation)


# -- discovery and tiny configs -------------------------------------------------------------

@dataclasses.dataclass
class Entry:
    model_type: str
    class_name: str
    module: Any = None            # the modeling module of the model class
    config: Any = None
    rope_functions: List[str] = dataclasses.field(default_factory=list)
    norm_classes: List[str] = dataclasses.field(default_factory=list)
    uses_rope: bool = False
    gated_mlp_classes: List[str] = dataclasses.field(default_factory=list)
    skip: Optional[str] = None


def causal_lm_types() -> Dict[str, str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return dict(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _has(config, name) -> bool:
    return name in getattr(config, "attribute_map", {}) or hasattr(config, name)


def _pick_layers(config, n: int) -> Optional[List[int]]:
    """Which of the original layers to keep: the first of each distinct layer type first."""
    types = getattr(config, "layer_types", None)
    if not isinstance(types, (list, tuple)) or len(types) <= n:
        return None
    picked = []
    for i, t in enumerate(types):
        if t not in [types[j] for j in picked]:
            picked.append(i)
    for i in range(len(types)):
        if len(picked) >= n:
            break
        if i not in picked:
            picked.append(i)
    return sorted(picked)


def shrink(config, layers: int = 2):
    """Shrink ``config`` in place to the tiny sizes; per-layer lists keep the chosen layers."""
    original_layers = getattr(config, "num_hidden_layers", None) if _has(config, "num_hidden_layers") else None
    keep = _pick_layers(config, layers)
    n_layers = len(keep) if keep is not None else layers
    sizes = dict(SHRINK, num_hidden_layers=n_layers)
    old_head_dim = None
    if _has(config, "hidden_size") and _has(config, "num_attention_heads"):
        try:
            old_head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        except Exception:
            old_head_dim = None
    _set_sizes(config, sizes)
    if _has(config, "kv_lora_rank") and _has(config, "num_key_value_heads"):
        config.num_key_value_heads = config.num_attention_heads  # MLA: every head has its own k and v
    _fit_mamba_heads(config)
    if _has(config, "rotary_dim") and isinstance(getattr(config, "rotary_dim", None), int) and old_head_dim:
        # GPT-J style partial rotary: keep the original fraction of the head
        frac = config.rotary_dim / old_head_dim
        config.rotary_dim = max(2, int(round(16 * frac / 2)) * 2)
    if original_layers and isinstance(original_layers, int):
        _keep_layers(config, original_layers, n_layers, keep)
    _tiny_ids_no_cache_no_dropout(config)
    config._attn_implementation = "eager"
    # MoE experts as indexed batched matmuls: grouped_mm has no float64 kernel, and the eager
    # experts loop is data-dependent (graph breaks)
    config._experts_implementation = "batched_mm"
    return config


def _set_sizes(config, sizes) -> None:
    """The tiny sizes the config has (None often means "off" and stays, unless SET_WHEN_NONE)."""
    for name, value in sizes.items():
        if not _has(config, name):
            continue
        try:
            current = getattr(config, name, None)
        except Exception:
            continue
        if name == "num_experts_per_tok" and current is None and any(
                isinstance(getattr(config, e, None), int) for e in ("n_routed_experts", "num_experts", "num_local_experts")):
            current = value  # DeepSeek-V2's default: experts but no top-k
        elif current is None and name not in SET_WHEN_NONE:
            continue  # None often means "off" (q_lora_rank=None: no q LoRA; num_experts=None: dense)
        if name == "num_key_value_heads" and isinstance(current, int) and current == 1:
            continue  # keep multi-query attention
        if name == "num_experts_per_tok" and isinstance(current, int) and current < value:
            continue
        try:
            setattr(config, name, value)
        except (AttributeError, NotImplementedError):
            pass  # a derived property (Falcon's head_dim): it follows the sizes it derives from


def _fit_mamba_heads(config) -> None:
    """Mamba-2 style mixers: heads of size 16 that fill the inner width."""
    hidden = getattr(config, "hidden_size", None) if _has(config, "hidden_size") else None
    expand = getattr(config, "mamba_expand", None) or getattr(config, "expand", None)
    if isinstance(hidden, int) and isinstance(expand, (int, float)):
        inner = getattr(config, "mamba_d_ssm", None) or int(expand * hidden)
        pairs = MAMBA_HEADS + ([("num_heads", "head_dim")] if config.model_type.startswith("mamba") else [])
        for heads, size in pairs:
            if hasattr(config, heads) and hasattr(config, size):
                setattr(config, size, 16)
                setattr(config, heads, inner // 16)


def _keep_layers(config, original_layers: int, n_layers: int, keep) -> None:
    """Per-layer lists of the config keep the chosen layers (or the first ``n_layers``)."""
    for name, value in list(vars(config).items()):
        if isinstance(value, (list, tuple)) and len(value) == original_layers and original_layers > n_layers:
            chosen = keep if keep is not None else list(range(n_layers))
            setattr(config, name, type(value)(value[i] for i in chosen))


def _tiny_ids_no_cache_no_dropout(config) -> None:
    """Token ids inside the tiny vocabulary, no cache, no dropout (compiled and eager runs must agree)."""
    vocab = getattr(config, "vocab_size", 128) or 128
    for name in TOKEN_IDS:
        value = getattr(config, name, None)
        if isinstance(value, int) and value >= vocab:
            setattr(config, name, vocab - 1)
        elif isinstance(value, (list, tuple)):
            setattr(config, name, [min(v, vocab - 1) for v in value])
    for name in ("use_cache",):
        if hasattr(config, name):
            setattr(config, name, False)
    for name, value in list(vars(config).items()):  # no dropout: compiled and eager runs must agree
        if ("dropout" in name or name.endswith("_pdrop")) and isinstance(value, float):
            setattr(config, name, 0.0)


def rope_function_names(module) -> List[str]:
    return sorted(n for n, f in vars(module).items()
                  if inspect.isfunction(f) and ROPE_FUNCTION.search(n) and not NOT_TEXT_ROPE.search(n))


#: (the RMSNorm rule's site probe: the source of a norm that is RMSNorm without the name)
_RMS_SOURCE = re.compile(RmsNormGradRule.site_probe.source)
_CENTERED = re.compile(RmsNormGradRule.site_probe.excluded)


def norm_class_names(module) -> List[str]:
    """Modules whose class name contains ``RMSNorm``, and other norms that are RMSNorm without the
    name (Llama 4's weightless ``Llama4TextL2Norm``: ``x * rsqrt(x.pow(2).mean(-1) + eps)``)."""
    names = []
    for n, c in vars(module).items():
        if not (inspect.isclass(c) and issubclass(c, torch.nn.Module)):
            continue
        if re.search(RmsNormGradRule.site_probe.module_classes, n):
            names.append(n)
            continue
        if "Norm" not in n or c.__module__ != module.__name__:
            continue
        try:
            source = inspect.getsource(c)
        except (OSError, TypeError):
            continue
        if _RMS_SOURCE.search(source) and not _CENTERED.search(source):
            names.append(n)
    return sorted(names)


def gated_mlp_class_names(module) -> List[str]:
    """Modules of ``module`` whose forward calls or indexes one ``gate_up_proj`` (the SwiGLU rule's
    site probe): Phi-3's and GLM-4's MLPs, the MoE experts of Mixtral, Qwen3-MoE, DeepSeek-V3."""
    names = []
    for n, c in vars(module).items():
        if not (inspect.isclass(c) and issubclass(c, torch.nn.Module)) or c.__module__ != module.__name__:
            continue
        try:
            source = inspect.getsource(c.forward)
        except (OSError, TypeError):
            continue
        if GATED_MLP_SOURCE.search(source):
            names.append(n)
    return sorted(names)


def discover(model_types: Optional[List[str]] = None, layers: int = 2) -> List[Entry]:
    """The causal-LM entries, tiny-configured; those that cannot be built carry a skip reason."""
    import transformers

    mapping = causal_lm_types()
    wanted = model_types or list(mapping)
    entries, seen = [], {}
    for mt in wanted:
        if mt not in mapping:
            entries.append(Entry(mt, "?", skip="not a causal-LM model type of this transformers"))
            continue
        entry = Entry(mt, mapping[mt])
        entries.append(entry)
        if not entry.class_name.endswith(("ForCausalLM", "LMHeadModel", "WithLMHead", "Decoder")):
            entry.skip = f"{entry.class_name} is not a text-only causal LM"
            continue
        try:
            cls = getattr(transformers, entry.class_name)
            entry.module = importlib.import_module(cls.__module__)
        except Exception as exc:
            entry.skip = f"model class unavailable: {type(exc).__name__}: {str(exc)[:120]}"
            continue
        _configure(entry, cls, layers)
        if entry.skip:
            continue
        key = (entry.class_name, type(entry.config).__name__)
        if key in seen:
            first = seen[key]
            if mt.endswith("_text") and not first.model_type.endswith("_text"):
                first, entry = entry, first  # name the text model by its own type (llama4_text)
            entry.skip = f"same model class and config as {first.model_type}"
            seen[key] = first
            continue
        seen[key] = entry
    return entries


def _configure(entry: Entry, cls, layers: int) -> None:
    """The entry's tiny config, its RoPE functions and RMSNorm classes, or its skip reason."""
    entry.config = _tiny_config(entry, cls, layers)
    if entry.skip:
        return
    entry.rope_functions = rope_function_names(entry.module)
    own_norms = norm_class_names(entry.module)
    # torch.nn.RMSNorm too, wherever a model uses it (DiffLlama's per-head groupnorm)
    entry.norm_classes = own_norms + ([] if "RMSNorm" in own_norms else ["RMSNorm"])
    entry.uses_rope = bool(entry.rope_functions) or any(
        inspect.isclass(c) and ROPE_CLASS.search(n) for n, c in vars(entry.module).items())
    entry.gated_mlp_classes = gated_mlp_class_names(entry.module)
    if not entry.uses_rope and not own_norms and not entry.gated_mlp_classes:
        entry.skip = "uses neither RoPE nor RMSNorm nor a gate_up projection"
        return
    try:
        with torch.device("meta"):
            params = sum(p.numel() for p in cls(copy.deepcopy(entry.config)).parameters())
    except Exception as exc:
        entry.skip = f"build: {type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
        return
    if params > MAX_PARAMS:
        entry.skip = f"still {params / 1e6:.0f}M parameters after shrinking (sizes not found by name)"


def _tiny_config(entry: Entry, cls, layers: int):
    """The model type's default config (its text config where the class wants that), shrunk;
    None with ``entry.skip`` set when it is composite or cannot be made."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.for_model(entry.model_type)
        expected = getattr(cls, "config_class", None)
        if expected is not None and not isinstance(config, expected):
            text = config.get_text_config() if hasattr(config, "get_text_config") else None
            if text is not None and isinstance(text, expected):
                config = text
        if getattr(config, "sub_configs", None) and any(
                getattr(config, k, None) is not None for k in config.sub_configs if k != "text_config"):
            entry.skip = "composite (multimodal) config; its text model is swept under its own type"
            return None
        return shrink(config, layers)
    except Exception as exc:
        entry.skip = f"config: {type(exc).__name__}: {str(exc)[:160]}"
        return None


def build(entry: Entry, dtype=torch.float32, seed: int = 0):
    import transformers

    cls = getattr(transformers, entry.class_name)
    torch.manual_seed(seed)
    model = cls(copy.deepcopy(entry.config))
    with torch.no_grad():  # norms initialised to ones (or zeros for 1+w) make dgamma degenerate
        for name, module in model.named_modules():
            if type(module).__name__ in entry.norm_classes:
                for p in module.parameters(recurse=False):
                    p.add_(torch.randn_like(p) * 0.1)
    return model.to(dtype).eval()


# -- independent site counts --------------------------------------------------------------

@contextlib.contextmanager
def count_sites(model, entry: Entry):
    """Count RMSNorm calls, RoPE applications and SwiGLU products of an eager forward and backward.

    Independently of the pass: forward hooks on the norm modules and on the gate activations
    of the gated MLPs (:data:`GATED_MLP_SOURCE`), and a wrapper around the apply-rotary functions,
    put a gradient hook on each output; a site counts when its output receives a gradient (so a
    RoPE whose result only feeds a top-k index, as in DeepSeek-V4's indexer, does not: it has no
    backward to fuse).

    Yields ``{kind: n for kind in COUNTED_KINDS, "where": Counter, "forward": {...}}``; ``where``
    counts the sites by ``(kind, module path)``: the norm module, the module whose forward called
    the apply function (the attention), or the gated MLP whose activation ran, so unfused sites
    can be named; ``forward`` counts the calls of the forward whether or not a gradient reached
    them.

    Not :class:`~npu_fusion.measure.sites.SiteCounter`, whose counts would differ here: this one
    finds the norm classes by name or source in any model, counts only the innermost of nested
    norm modules, skips norms that return only the statistic, counts an apply function that calls
    another once, names the caller from a module stack rather than frames, hooks each output
    itself rather than a view's base, and also counts forward calls that get no gradient.
    """
    counts = {**dict.fromkeys(COUNTED_KINDS, 0), "where": collections.Counter(),
              "forward": dict.fromkeys(COUNTED_KINDS, 0)}
    stack = []  # module paths of the forwards running now
    names = {m: n for n, m in model.named_modules()}
    watch = functools.partial(_watch_output, counts)
    hooks = _norm_hooks(model, entry, counts, watch, names) + _gate_hooks(model, entry, watch, names)
    hooks += [m.register_forward_pre_hook(functools.partial(_push, stack, names)) for m in model.modules()]
    hooks += [m.register_forward_hook(functools.partial(_pop, stack), always_call=True) for m in model.modules()]
    originals = {}
    depth = [0]
    for name in entry.rope_functions:
        originals[name] = getattr(entry.module, name)
        setattr(entry.module, name, _counting_rope(originals[name], watch, depth, stack))
    try:
        yield counts
    finally:
        for name, fn in originals.items():
            setattr(entry.module, name, fn)
        for h in hooks:
            h.remove()


def _watch_output(counts, kind, where, out) -> None:
    """Count the output's tensors that require grad, and each site when a gradient reaches it."""
    tensors = grad_tensors(out)
    counts["forward"][kind] += len(tensors)

    def reached(_grad):
        counts[kind] += 1
        counts["where"][(kind, where)] += 1

    for t in tensors:
        t.register_hook(reached)


def _norm_hooks(model, entry: Entry, counts, watch, names) -> list:
    """Forward hooks on the innermost norm modules: a norm module that wraps another
    (AXK2GatedRMSNorm: norm, then a sigmoid gate) is not a site of its own."""
    def on_norm(module, inputs, output):
        x = inputs[0] if inputs and isinstance(inputs[0], torch.Tensor) else None
        if (isinstance(output, torch.Tensor) and x is not None and output.dim() and x.dim()
                and output.shape[-1] == 1 != x.shape[-1]):
            # returns the statistic rsqrt(mean(x^2) + eps), not a normalized tensor (HY-V4's
            # UnweightedRMSNorm in its hyper-connections): no RmsNormGrad there
            counts["statistic_only"] = counts.get("statistic_only", 0) + 1
            return
        watch("rms_norm", names.get(module, "?"), output)

    def is_norm(m):
        return type(m).__name__ in entry.norm_classes

    return [m.register_forward_hook(on_norm) for m in model.modules()
            if is_norm(m) and not any(is_norm(c) for c in m.modules() if c is not m)]


def _gate_hooks(model, entry: Entry, watch, names) -> list:
    """Hooks that find each SwiGLU product of the gate activations (SiLU) by value: each call whose
    input is the first half of a tensor and whose output is multiplied by its second half is one
    site of the module that holds the activation (:class:`~npu_fusion.measure.sites.GatedProducts`;
    a dense MLP calls it once, MoE experts once per expert that got tokens)."""
    activations = [m for m in model.modules() if GATE_ACTIVATION.search(type(m).__name__)]
    return GatedProducts(model, activations, lambda parent, out: watch("swiglu", names.get(parent, "?"), out)).hooks()


def _push(stack, names, module, *_):
    stack.append(names.get(module, "?"))


def _pop(stack, *_):
    stack.pop()


def _counting_rope(fn, watch, depth, stack):
    """``fn`` (an apply-rotary function) watching its output, attributed to the module whose
    forward called it; an apply function calling another is one application."""
    @functools.wraps(fn)
    def counting(*args, **kwargs):
        depth[0] += 1
        try:
            out = fn(*args, **kwargs)
        finally:
            depth[0] -= 1
        if depth[0] == 0:
            watch("rope", stack[-1] if stack else "?", out)
        return out
    return counting


def _module_path(dynamo_path: str) -> str:
    """``L['args'][0].model.layers[0].self_attn`` -> ``model.layers.0.self_attn``."""
    path = re.sub(r"^L(\[[^\]]+\])+\.?", "", dynamo_path)  # L['self'] or L['args'][0]
    path = re.sub(r"\._modules\['([^']+)'\]", r".\1", path)
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    return path.strip(".")


def _innermost_module(node) -> Optional[tuple]:
    stack = node.meta.get("fwd_nn_module_stack") or node.meta.get("nn_module_stack") or {}
    if not stack:
        return None
    path, cls = list(stack.values())[-1][:2]
    return _module_path(path), getattr(cls, "__name__", str(cls))


def fused_where(capture, entry: Entry) -> collections.Counter:
    """The fused sites by ``(kind, module path)``, read off the forward module stacks of the nodes
    each site replaced (in the backward graph before the pass), once per run of their graph."""
    where = collections.Counter()
    # a graph dynamo reuses for several layers (after graph breaks) holds a site once and runs it
    # once per layer: count each site per run, as the eager counter does
    for before, result, runs in zip(capture.before, capture.results, capture.runs):
        by_name = {n.name: n for n in before.nodes}
        for site in (s for s in result.sites if s.op in KIND_OF_BACKWARD_OP):  # backward sites
            kind = KIND_OF_BACKWARD_OP[site.op]
            found = [_innermost_module(by_name[n]) for n in site.replaced_nodes if n in by_name]
            found = [f for f in found if f is not None]
            if kind == "rms_norm":
                found = [f for f in found if f[1] in entry.norm_classes] or found
            if kind == "swiglu":  # the MLP, not its activation
                found = [f for f in found if f[1] in entry.gated_mlp_classes] or found
            paths = collections.Counter(f[0] for f in found)
            where[(kind, paths.most_common(1)[0][0] if paths else "?")] += runs
    return where


KIND_OF_BACKWARD_OP = {op: kind for kind, op in BACKWARD_OP.items()}


def missed_runs(capture, op: str) -> int:
    """Recorded misses of ``op``, each once per run of its graph (as sites are counted)."""
    return sum(runs for result, runs in zip(capture.results, capture.runs) for m in result.misses if m.op == op)


def miss_lines(capture) -> List[str]:
    """The pass's Miss records as ``op at node [module of the node]: reason``."""
    lines = []
    for before, result in zip(capture.before, capture.results):
        by_name = {n.name: n for n in before.nodes}
        for m in result.misses:
            where = _innermost_module(by_name[m.node]) if m.node in by_name else None
            lines.append(f"{m.op} at {m.node}" + (f" [{where[0]}]" if where else "") + f": {m.reason}")
    return lines


def unfused_where(counted: collections.Counter, fused: collections.Counter) -> List[str]:
    """Counted sites with no fused op, as ``kind path-pattern [xN]`` (layer indices as ``*``)."""
    left = collections.Counter(counted)
    for (kind, path), n in fused.items():
        for _ in range(n):
            if left[(kind, path)] > 0:
                left[(kind, path)] -= 1
                continue
            # after a graph break dynamo compiles a submodule: its paths are relative to it
            match = [k for k, c in left.items() if c > 0 and k[0] == kind
                     and (k[1].endswith("." + path) or path == "?")]  # "?": no module stack
            if match:
                left[match[0]] -= 1
    left = +left
    grouped = collections.Counter()
    for (kind, path), n in left.items():
        grouped[(kind, re.sub(r"\.\d+\.", ".*.", path))] += n
    return [f"{kind} {path}" + (f" x{n}" if n > 1 else "") for (kind, path), n in sorted(grouped.items())]


# -- leftovers attributed to the sites ----------------------------------------------------

ROPE_HELPERS = re.compile(r"rotate|rotary|rope", re.I)


def _frames(node) -> List[str]:
    """Function names of the forward stack trace a backward node was derived from."""
    return re.findall(r", in (\w+)\n", node.meta.get("stack_trace") or "")


def origin(node, entry: Entry) -> Optional[str]:
    """``"rope"``, ``"rms_norm"`` or ``"other"`` for a backward node, from the forward code it
    came from (stack trace and module stack that AOTAutograd keeps); None when unknown."""
    frames = _frames(node)
    modules = node.meta.get("fwd_nn_module_stack") or node.meta.get("nn_module_stack") or {}
    classes = [getattr(v[1], "__name__", str(v[1])) for v in modules.values()] if modules else []
    if classes and classes[-1] in entry.norm_classes:
        return "rms_norm"
    if any(f in entry.rope_functions or ROPE_HELPERS.search(f) for f in frames):
        return "rope"
    if frames or classes:
        return "other"
    return None


def _fused_rope_widths(graph) -> set:
    widths = set()
    for n in graph.nodes:
        if n.op == "call_function" and getattr(n.target, "__name__", "").startswith(ROPE_OP):
            val = n.meta.get("val")
            if isinstance(val, (tuple, list)) and isinstance(val[0], torch.Tensor):
                widths.add(int(val[0].shape[-1]))
    return widths


def _is_partial_rotary_split(node, widths) -> bool:
    """``slice_backward`` of partial rotary's split ``x[..., :w]`` / ``x[..., w:]`` (or the trailing
    ``x[..., -w:]``) around a fused RoPE op of width ``w``: it puts dx of the rotated part (or dy of
    the pass-through part) back into the full head. It is no part of the fused op (whose D is the
    rotated width)."""
    if getattr(node.target, "__name__", "").split(".")[0] != "slice_backward":
        return False
    _grad, sizes, dim, start, end, step = node.args[:6]
    full = sizes[-1] if isinstance(sizes[-1], int) else None
    if step != 1 or full is None or dim % len(sizes) != len(sizes) - 1:
        return False
    start, end = (v + full if v < 0 else v for v in (start, end))
    end = min(end, full)
    width = end - start
    # the rotated part or the pass-through part, leading (GPT-NeoX) or trailing (DeepSeek-V4)
    return 0 < width < full and (start == 0 or end == full) and (width in widths or full - width in widths)


def site_leftovers(graph, entry: Entry) -> Dict[str, List[str]]:
    """:func:`~npu_fusion_testing.capture.decomposed_leftovers` of ``graph``, by origin: what is left of a RoPE
    or RMSNorm backward (``rope``/``rms_norm``), of unknown origin (``unknown``), of other code
    (``other``: GELU-tanh's pow, GPT-J's partial-rotary split in the attention), and partial
    rotary's split inside the apply function (GPT-NeoX) around a fused op (``partial_rotary``)."""
    by_name = {n.name: n for n in graph.nodes}
    widths = _fused_rope_widths(graph)
    out: Dict[str, List[str]] = {"rope": [], "rms_norm": [], "unknown": [], "other": [], "partial_rotary": []}
    for name in decomposed_leftovers(graph):
        node = by_name[name]
        kind = origin(node, entry) or "unknown"
        if kind in ("rope", "unknown") and _is_partial_rotary_split(node, widths):
            kind = "partial_rotary"
        out[kind].append(name)
    return out


# -- one model ----------------------------------------------------------------------------

def causal_lm_loss(model, ids):
    out = model(input_ids=ids, labels=ids)
    return out.loss


def param_grads(model, ids, run=None):
    model.zero_grad(set_to_none=True)
    causal_lm_loss(run if run is not None else model, ids).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _describe(exc) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200] if text else ''}"


def compiled_grads(model, ids, dynamic=False, **options):
    """Parameter gradients of the compiled model, and the Capture that saw its backward graphs."""
    torch._dynamo.reset()
    capture = Capture(strict=False, **options)  # an internal error of the pass is recorded, not raised
    compiled = torch.compile(model, backend=capture)
    if dynamic:
        torch._dynamo.mark_dynamic(ids, 0)
        torch._dynamo.mark_dynamic(ids, 1)
    return param_grads(model, ids, run=compiled), capture


@dataclasses.dataclass
class Outcome:
    model_type: str
    class_name: str
    status: str = "ok"          # ok | skipped | error
    reason: str = ""
    #: by kind (:data:`COUNTED_KINDS`): the counted sites, and of them those the backward op replaced
    present: Dict[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(COUNTED_KINDS, 0))
    fused: Dict[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(COUNTED_KINDS, 0))
    grads_ok: Optional[bool] = None
    grad_failures: List[str] = dataclasses.field(default_factory=list)
    misses: List[str] = dataclasses.field(default_factory=list)
    unfused: List[str] = dataclasses.field(default_factory=list)   # counted sites left unfused, by module
    pass_errors: List[str] = dataclasses.field(default_factory=list)
    leftovers: int = 0          # decomposed RoPE/RMSNorm nodes left (or of unknown origin; SwiGLU's are not told)
    leftovers_other: int = 0    # decomposed_leftovers of other code (GELU-tanh's pow, ...)
    backward_graphs: int = 0
    forward: bool = False       # the forward rules ran too (the forward_* fields are theirs)
    #: by kind: the forward op's fused sites and recorded misses
    forward_fused: Dict[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(COUNTED_KINDS, 0))
    forward_missed: Dict[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(COUNTED_KINDS, 0))
    variant: str = "default"    # the AOTAutograd variant the model was compiled with
    notes: List[str] = dataclasses.field(default_factory=list)
    seconds: float = 0.0

    def forward_silent(self, kind: str) -> int:
        """Counted forward sites of ``kind`` (one of :data:`COUNTED_KINDS`) neither fused nor
        recorded as a miss (negative when the pass accounted for more than were counted)."""
        return self.present[kind] - self.forward_fused[kind] - self.forward_missed[kind]

    def fully_fused(self, kind: str) -> bool:
        return self.fused[kind] == self.present[kind]


def _count_forward(out: Outcome, capture) -> None:
    """The forward ops' fused sites and recorded misses, each once per run of its graph."""
    for kind, op in FORWARD_OP.items():
        out.forward_fused[kind], out.forward_missed[kind] = capture.fused_runs(op), missed_runs(capture, op)


def _compiled_or_with_core_decompositions(out: Outcome, model, ids, dynamic, switches):
    """The compiled gradients and the capture; where torch.compile fails on the model without the
    pass too (not the pass's doing), again with core ATen decompositions, which often get through."""
    try:
        return compiled_grads(model, ids, dynamic, **switches)
    except Exception as exc:
        first = _describe(exc)
        try:
            compiled_grads(model, ids, dynamic, **dict.fromkeys(COUNTED_KINDS, False), **{
                option: False for option in forward_options()})
        except Exception:
            out.variant = "decompositions=core"
            out.notes.append(f"default compile fails without the pass too ({first})")
            return compiled_grads(model, ids, dynamic, decompositions="core", **switches)
        raise RuntimeError(f"fails only with the pass: {first}") from exc


def run_model(entry: Entry, dtype=torch.float32, batch=2, seq=12, dynamic=False, seed=0,
              keep_capture=False, forward=False):
    """Sweep one entry; returns (Outcome, capture or None). ``forward``: the forward rules too."""
    out = Outcome(entry.model_type, entry.class_name, forward=forward)
    switches = FORWARD_OPTIONS if forward else {}
    if entry.skip:
        out.status, out.reason = "skipped", entry.skip
        return out, None
    start = time.perf_counter()
    capture = None
    try:
        model = build(entry, dtype, seed)
        ids = torch.randint(0, entry.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1))
        with count_sites(model, entry) as counts:
            eager = param_grads(model, ids)
        out.present = {kind: counts[kind] for kind in COUNTED_KINDS}
        if counts.get("statistic_only"):
            out.notes.append(f"{counts['statistic_only']} *RMSNorm call(s) return only rsqrt(mean(x^2)+eps) "
                             f"(not counted: no RmsNormGrad form)")
        for kind in COUNTED_KINDS:
            idle = counts["forward"][kind] - counts[kind]
            if idle:
                out.notes.append(f"{idle} {LABEL[kind]} output(s) get no gradient (no backward site; not counted)")
        exact = param_grads(copy.deepcopy(model).double(), ids)

        fused, capture = _compiled_or_with_core_decompositions(out, model, ids, dynamic, switches)
        out.fused = {kind: capture.fused_runs(op) for kind, op in BACKWARD_OP.items()}
        _count_forward(out, capture)
        out.backward_graphs = len(capture.after)
        out.grad_failures = grad_failures(fused, eager, exact)
        out.grads_ok = not out.grad_failures
        out.misses = miss_lines(capture)
        out.unfused = unfused_where(counts["where"], fused_where(capture, entry))
        out.pass_errors = [r.error for r in capture.results if r.error]
        for g in capture.after:
            left = site_leftovers(g, entry)
            out.leftovers += len(left["rope"]) + len(left["rms_norm"]) + len(left["unknown"])
            out.leftovers_other += len(left["other"]) + len(left["partial_rotary"])
    except Exception as exc:
        out.status = "error"
        out.reason = _describe(exc)
        if os.environ.get("ZOO_TRACEBACK"):
            traceback.print_exc()
    finally:
        torch._dynamo.reset()
    out.seconds = time.perf_counter() - start
    return out, (capture if keep_capture else None)


# -- report -------------------------------------------------------------------------------

def _frac(fused, present):
    return f"{fused}/{present}" if present else ("-" if not fused else f"{fused}/0!")


def unfused_note(o: Outcome) -> str:
    """The table's short note; :func:`print_details` has the full story."""
    notes = []
    explained = {m.split(" at ")[0] for m in o.misses}
    notes += [f"{o.present[kind] - o.fused[kind]} {LABEL[kind]} "
              + ("missed" if BACKWARD_OP[kind] in explained else "unrecognized")
              for kind in COUNTED_KINDS if o.fused[kind] < o.present[kind]]
    if any(o.fused[kind] > o.present[kind] for kind in COUNTED_KINDS):
        notes.append("more fused than counted")
    if o.forward:
        silent = [(o.forward_silent(kind), LABEL[kind]) for kind in FORWARD_OP if o.forward_silent(kind)]
        notes += [f"{n} {label} forward " + ("unrecognized" if n > 0 else "more than counted") for n, label in silent]
    if o.misses:
        notes.append(f"{len(o.misses)} Miss")
    if o.pass_errors:
        notes.append("pass error")
    if o.variant != "default":
        notes.append(o.variant)
    if o.backward_graphs > 1:
        notes.append("graph breaks")
    return ", ".join(notes)


def _columns(forward: bool) -> List[tuple]:
    """The table's site columns: ``(header, kind, forward)`` per counted kind, then per forward kind."""
    columns = [(LABEL[kind], kind, False) for kind in COUNTED_KINDS]
    return columns + ([(f"{LABEL[kind]} fw", kind, True) for kind in FORWARD_OP] if forward else [])


def _cells(o: Outcome, columns: List[tuple], blank: bool = False) -> str:
    """fused/counted per column (the forward op's fused sites in a forward column)."""
    return "".join(f" {'' if blank else _frac((o.forward_fused if fw else o.fused)[kind], o.present[kind]):>{max(7, len(h))}}"
                   for h, kind, fw in columns)


def print_table(outcomes: List[Outcome], file=None):
    file = file or sys.stdout  # looked up at the call: --write-docs redirects it
    rows = [o for o in outcomes if o.status != "skipped"]
    columns = _columns(any(o.forward for o in rows))
    header = (f"{'model':<20}" + "".join(f" {h:>{max(7, len(h))}}" for h, _, _ in columns)
              + f" {'grads':>5} {'left':>4} {'bw':>3} {'s':>5}  notes")
    print(header, file=file)
    print("-" * max(100, len(header) + 10), file=file)
    for o in rows:
        if o.status == "error":
            print(f"{o.model_type:<20}{_cells(o, columns, True)} {'':>5} {'':>4} {'':>3} "
                  f"{o.seconds:5.1f}  ERROR {o.reason[:120]}", file=file)
            continue
        grads = "ok" if o.grads_ok else "FAIL"
        print(f"{o.model_type:<20}{_cells(o, columns)} {grads:>5} {o.leftovers:>4} "
              f"{o.backward_graphs:>3} {o.seconds:5.1f}  {unfused_note(o)}", file=file)


def print_details(outcomes: List[Outcome], file=None):
    """Per model with something to say: unfused sites by module, the pass's Miss reasons
    (node: reason), gradient failures, pass errors and compile notes."""
    file = file or sys.stdout  # looked up at the call: --write-docs redirects it
    for o in outcomes:
        if o.status != "ok":
            continue
        lines = []
        lines += [f"unfused  {u}" for u in o.unfused]
        lines += [f"Miss     {m}" for m in o.misses]
        lines += [f"grad     {g}" for g in o.grad_failures[:5]]
        lines += [f"error    {e}" for e in o.pass_errors]
        lines += [f"note     {n}" for n in o.notes]
        if lines:
            print(f"{o.model_type} ({o.class_name}):", file=file)
            for line in lines:
                print(f"    {line}", file=file)


def summary(outcomes: List[Outcome]) -> Dict[str, Any]:
    """Totals of a sweep: per counted kind ``<kind>_sites`` (fused, counted) and
    ``<kind>_models_fully_fused`` (models, models with a site of the kind), and over all kinds."""
    ran = [o for o in outcomes if o.status == "ok"]
    out: Dict[str, Any] = {
        "models_ran": len(ran),
        "models_error": sum(o.status == "error" for o in outcomes),
        "models_skipped": sum(o.status == "skipped" for o in outcomes),
    }
    for kind in COUNTED_KINDS:
        having = [o for o in ran if o.present[kind]]
        out[f"{kind}_sites"] = [sum(min(o.fused[kind], o.present[kind]) for o in ran), sum(o.present[kind] for o in ran)]
        out[f"{kind}_models_fully_fused"] = [sum(o.fully_fused(kind) for o in having), len(having)]
    out["models_fully_fused"] = [sum(all(o.fully_fused(kind) for kind in COUNTED_KINDS) for o in ran), len(ran)]
    out["grads_ok"] = [sum(bool(o.grads_ok) for o in ran), len(ran)]
    out.update(_forward_summary(ran))
    return out


def _forward_summary(ran: List[Outcome]) -> Dict[str, Any]:
    """The forward sites (the backward's counted sites) fused, recorded as misses and silent."""
    ran = [o for o in ran if o.forward]
    if not ran:
        return {}
    out: Dict[str, Any] = {}
    for kind in FORWARD_OP:
        out[f"{kind}_forward_sites"] = [sum(min(o.forward_fused[kind], o.present[kind]) for o in ran),
                                        sum(o.present[kind] for o in ran)]
        out[f"{kind}_forward_missed"] = sum(o.forward_missed[kind] for o in ran)
    out["forward_silent"] = sum(max(0, o.forward_silent(k)) for o in ran for k in FORWARD_OP)
    out["models_forward_fully_fused"] = [sum(all(o.forward_fused[k] == o.present[k] for k in FORWARD_OP)
                                             for o in ran), len(ran)]
    return out
