"""What a chip would run of a transformers model at its real sizes, without its weights.

``npu-fusion report --hf-config PATH|MODEL_TYPE [key=value ...]``: what a chip would run of a
transformers model at its real sizes, without its weights or the memory to train it.

The model is built on the meta device (parameters with shapes and dtypes, no storage) from a
``config.json`` or a model type with overrides, at ``--layers`` decoder layers. One training step
is compiled per ``--target`` with the pass: dynamo and AOTAutograd trace it on fake tensors, the
pass rewrites the backward graph and checks each site against the chip's limits at those shapes
(D < 896 and the batch and head limits of Atlas A2/A3, B < S for batch-dependent tables; no empty
x for RmsNorm on Ascend 950), and the step then "runs" on meta tensors, which only propagate shapes.
So the report names, per target, the sites the chip runs and those it refuses with the reason,
with the modelled traffic of each replaced subgraph and the bytes the forward saves for the backward.

An eager step on the meta device counts the sites independently first (module classes named
``*RMSNorm``, functions named ``apply_rotary_pos_emb*``), so every counted site is accounted for.
There is no gradient check: meta tensors carry no values (the tiny configs of ``--hf`` check them).

Two things differ from a real step, both for the meta device's sake:
- the loss is cross entropy written as ``log_softmax`` and ``gather``: compiled ``cross_entropy``
  on meta tensors loses its gradient (torch 2.13: ``nll_loss`` has no autograd kernel for the
  meta device's fake tensors, so the backward graph comes out empty);
- MoE experts run as transformers' ``grouped_mm`` (one grouped matmul over the tokens sorted by
  expert, as training runs them on an accelerator): the eager experts loop selects each expert's
  tokens with ``torch.nonzero``, whose output shape depends on the data (it raises on meta tensors).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from typing import Any, Dict, List

import torch

from ..measure.sites import expected_for
from ..measure.timing import Clock
from ..plugin.options import FusionOptions
from . import analysis, command
from .analysis import progress, recorder_for
from .subjects import DTYPES, Subject, UsageError, conventional_counter, unknown_model_type
from .text import format_accounting, format_ops, format_saved, format_traffic, pass_share_line, table, write_report

EXIT_UNEXPLAINED = 1  # a counted site neither fused nor recorded as a miss
NO_GRADIENTS = {"checked": False, "passed": None, "per_dtype": {}, "failures": [],
                "params_without_grad_in_one_run": [], "loss": None,
                "why": "meta tensors carry no values"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hf-config", metavar="PATH|MODEL_TYPE",
                        help="a transformers config.json (or a model type) at full size, traced on fake tensors "
                             "for each --target: which sites the chip runs and which it refuses; no weights, "
                             "no download; overrides follow as key=value")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides for --hf-config")
    parser.add_argument("--html", metavar="FILE", help="also write the report as one self-contained HTML page")


def load_config(spec: str, overrides: List[str], layers: int):
    """The config of ``spec`` (a JSON file, else a model type) with ``overrides`` and ``layers``."""
    from transformers import AutoConfig

    data: Dict[str, Any] = {}
    if os.path.isfile(spec):
        with open(spec) as f:
            data = json.load(f)
        model_type = data.pop("model_type", None)
        if model_type is None:
            raise UsageError(f"{spec} has no model_type")
    elif spec.endswith(".json") or os.sep in spec:
        raise UsageError(f"--hf-config: no such file {spec!r} (give a config.json's path, or a model type such as "
                         f"'llama')")
    else:
        model_type = spec
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise UsageError(f"override {item!r} is not key=value")
        data[key] = _value(value)
    data["num_hidden_layers"] = layers
    try:
        return AutoConfig.for_model(model_type, **data)
    except (ValueError, KeyError) as exc:
        raise unknown_model_type(model_type) from None


def _value(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


def build_on_meta(config, dtype: torch.dtype) -> torch.nn.Module:
    """The causal LM of ``config`` with meta parameters: shapes and dtypes, no storage."""
    from transformers import AutoModelForCausalLM

    if any(getattr(config, k, None) for k in ("n_routed_experts", "num_experts", "num_local_experts")):
        config._experts_implementation = "grouped_mm"  # module docstring
    with torch.device("meta"):
        try:
            model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
        except ValueError as exc:
            raise UsageError(f"{config.model_type} has no causal-LM model: {exc}") from None
    return model.to(dtype).eval()


def meta_loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy as log_softmax and gather (module docstring), with a full attention
    mask: without one, transformers looks for packed sequences, with ``.item()`` in an eager step."""
    mask = torch.ones_like(ids)
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, :-1].float()
    return -logits.log_softmax(-1).gather(-1, ids[:, 1:, None]).mean()


def collect(args: argparse.Namespace) -> Dict[str, Any]:
    """Everything ``--hf-config`` found, per target, as plain data (what ``--json`` prints)."""
    if args.layers < 1 or args.batch < 1 or args.seq < 2:
        raise UsageError("--layers and --batch must be at least 1, --seq at least 2")
    if args.hf or getattr(args, "framework", None) or args.dynamic or args.compiled_autograd \
            or args.checkpointing != "none":
        raise UsageError("--hf-config takes --layers, --batch, --seq, --dtype, --target and --partitioner only")
    if getattr(args, "compiler", "npu_fusion") != "npu_fusion":
        raise UsageError("--hf-config runs the npu_fusion backend only (no --compiler)")
    args.partitioner = args.partitioner or "default"
    started = time.perf_counter()
    config = load_config(args.hf_config, args.overrides, args.layers)
    dtype_name = args.dtype or str(getattr(config, "dtype", None) or "bfloat16").replace("torch.", "")
    progress(f"building {config.model_type} on the meta device ({args.layers} layers, {dtype_name})...")
    model = build_on_meta(config, DTYPES[dtype_name])
    ids = torch.zeros(args.batch, args.seq, dtype=torch.long, device="meta")
    progress("counting the sites in an eager step on meta tensors...")
    with conventional_counter(model) as counted:
        meta_loss(model, ids).backward()
    model.zero_grad(set_to_none=True)
    targets = {}
    for target in args.target:
        settings = {"model": config.model_type, "source": "hf-config", "config": args.hf_config,
                    "overrides": list(args.overrides), "layers": args.layers, "dtype": dtype_name,
                    "batch": args.batch, "seq": args.seq, "dynamic": False, "target": target,
                    "partitioner": args.partitioner, "checkpointing": "none", "compiled_autograd": False,
                    "seed": None, "forward": command.forward_fused(args),
                    "backward_only": bool(getattr(args, "backward_only", False))}
        targets[target] = _one_target(model, ids, settings, counted)
    return {"model": f"{config.model_type} ({os.path.basename(args.hf_config)}, meta device)",
            "config": _shape_summary(config), "targets": targets,
            "seconds": time.perf_counter() - started,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def _one_target(model, ids, settings: Dict[str, Any], counted) -> Dict[str, Any]:
    """The pass on one compiled step for ``settings["target"]``: the report's data, per site."""
    options = FusionOptions.from_mapping(dict({"target": settings["target"], "partitioner": settings["partitioner"]},
                                              **command.forward_switches(argparse.Namespace(**settings))))
    progress(f"target {options.resolved_target()}: compiling forward and backward on fake tensors...")
    torch.compiler.reset()
    recorder = recorder_for(options)
    outside = conventional_counter(model)
    with outside, Clock() as step:
        loss = torch.compile(lambda i: meta_loss(model, i), backend=recorder)(ids)
        loss.backward()
    model.zero_grad(set_to_none=True)
    subject = Subject(name=settings["model"], model=model, loss=meta_loss, vocab_size=0)
    expected = expected_for(options, counted.counts)
    report = analysis.assemble(settings, subject, options, recorder, expected, NO_GRADIENTS, (step.wall, 0.0),
                               step.cpu)
    report["accounting"] = analysis.accounting(counted, outside, recorder)
    return report


_SHAPE_KEYS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
               "vocab_size", "qk_rope_head_dim", "kv_lora_rank", "q_lora_rank", "n_routed_experts",
               "num_experts_per_tok", "moe_intermediate_size", "first_k_dense_replace", "rope_interleave")


def _shape_summary(config) -> Dict[str, Any]:
    return {k: getattr(config, k) for k in _SHAPE_KEYS if getattr(config, k, None) is not None}


def status(report: Dict[str, Any]) -> int:
    """0, or 3 for an internal error of the pass, or 1 for a counted site left unexplained."""
    targets = report["targets"].values()
    if any(t["pass_errors"] for t in targets):
        return command.EXIT_PASS_ERROR
    if any(a["unexplained"] for t in targets for a in t["accounting"].values()):
        return EXIT_UNEXPLAINED
    return command.EXIT_OK


def run(args: argparse.Namespace, sinks=()) -> int:
    try:
        report = collect(args)
        for sink in sinks:
            sink(report)
    except UsageError as exc:
        print(f"npu-fusion report: {exc}", file=sys.stderr)
        return command.EXIT_USAGE
    write_report(report, args.json, format_text)
    return status(report)


def format_text(report: Dict[str, Any]) -> str:
    config = ", ".join(f"{k} {v}" for k, v in report["config"].items())
    out = [f"npu-fusion report --hf-config: {report['model']}\n{config}\n",
           f"{report['seconds']:.1f} s, peak resident memory {report['peak_rss_bytes'] / 2**20:.0f} MiB "
           "(no weights: the meta device)\n"]
    for target, r in report["targets"].items():
        s = r["settings"]
        out.append(f"\n# Target {r['settings']['resolved_target']}: {s['layers']} layer(s), {s['dtype']}, "
                   f"batch {s['batch']} x seq {s['seq']}\n")
        out.append(f"{pass_share_line(r['seconds'])}\n")
        out += [f"PASS ERROR (graph left unchanged): {err}\n" for err in r["pass_errors"]]
        out.append(format_sites(r))
        out += [format_ops(r), format_accounting(r), format_traffic(r), format_saved(r)]
    return "".join(out)


def format_sites(report: Dict[str, Any]) -> str:
    """Each site where it is in the model: what the chip runs, and what it refuses and why."""
    rows = [[s["module"] or "?", s["op"], "runs" + (f" ({s['mode']})" if s["mode"] else ""), ""]
            for s in report["sites"]]
    rows += [[m["module"] or "?", m["op"], "REFUSED", m["reason"]] for m in report["misses"]]
    rows.sort(key=lambda r: _module_order(r[0]))
    return "\n## Sites\n\n" + table(["module", "op", "on this chip", "reason"], rows)


def _module_order(path: str):
    return [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in path.split(".")]
