"""The ``npu-fusion report`` command: compile a model with the pass, train one step, show what fused.

``npu-fusion report``: compile a model with the pass, train one step, and show
what was fused, what was left unfused and why, what it did to the backward graph
and to its modelled memory traffic, and whether the gradients are still right.

Everything reported is read from the graphs and from the pass's own
:class:`~npu_fusion.plugin.pass_manager.FusionResult` s; nothing is assumed. The
step runs on the CPU with the fused ops' reference kernels (as the ``npu_fusion``
backend does off an Ascend host); ``--target`` selects which forms the pass may
emit, so the report shows what a given chip would get.

Exit status: 0 when the gradient check passes, 1 when it fails, 3 when the pass
hit an internal error (it then leaves the graph unchanged), 4 when the report's own
per-op accounting disagrees with the pass's results (:func:`~.analysis.accounting_errors`),
2 for usage errors.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import sys
from typing import Any, Dict, Sequence

import torch

from ..models import BUNDLED
from ..plugin.options import TARGETS, FusionOptions, forward_ops, forward_options
from .analysis import analyse, progress
from .subjects import DTYPES, SubjectSource, UsageError, bundled_subject, hf_subject
from .text import write_report

EXIT_OK, EXIT_GRADIENTS, EXIT_USAGE, EXIT_PASS_ERROR, EXIT_ACCOUNTING = 0, 1, 2, 3, 4
COMPILERS = ("npu_fusion", "inductor", "torchair")


def forward_switches(args) -> dict:
    """The forward rules' options: off with ``--backward-only``, on with ``--forward``, else their
    defaults."""
    if getattr(args, "backward_only", False):
        return dict.fromkeys(forward_options(), False)
    return dict.fromkeys(forward_options(), True) if getattr(args, "forward", False) else {}


def forward_fused(args) -> bool:
    """Whether the run fuses the forward (what the report's settings say): the options'
    values, the defaults included."""
    options = FusionOptions.from_mapping(forward_switches(args))
    return any(getattr(options, option) for option in forward_options())


def add_arguments(parser: argparse.ArgumentParser, sources: Sequence[SubjectSource] = ()) -> None:
    """The report's options; ``sources`` add models of their own (the harness's ``--framework``)."""
    parser.description = __doc__.split("\n\n")[0].replace("``", "")
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    model = parser.add_mutually_exclusive_group()
    model.add_argument("--model", choices=tuple(BUNDLED), default="llama",
                       help="bundled decoder (llama, gptj, deepseek: RoPE mode 0, 1 or 3; phi3: llama with one "
                            "gate_up projection, a SwiGLU site a layer); default llama")
    model.add_argument("--hf", metavar="MODEL_TYPE",
                       help="a transformers architecture (e.g. llama, qwen2, mistral, gptj) with a tiny "
                            "random config; needs transformers, downloads nothing")
    for source in sources:
        source.add_arguments(model)
    parser.add_argument("--layers", type=int, default=2, help="decoder layers (default 2)")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default=None,
                        help="parameter dtype (default float32; --hf-config: the config's dtype, "
                             "else bfloat16)")
    parser.add_argument("--batch", type=int, default=2, help="batch size (default 2)")
    parser.add_argument("--seq", type=int, default=16, help="sequence length (default 16)")
    parser.add_argument("--dynamic", action="store_true", help="mark batch and sequence dynamic")
    parser.add_argument("--target", type=_targets, default=("auto",), metavar="{" + ",".join(("auto",) + TARGETS) + "}",
                        help="which chip's forms the pass may emit (auto: detect, generic off an NPU host); "
                             "--hf-config takes several, comma-separated")
    parser.add_argument("--partitioner", choices=("default", "min_cut"), default=None,
                        help="AOTAutograd partitioner of the npu_fusion backend (default: default)")
    parser.add_argument("--compiler", choices=COMPILERS, default="npu_fusion",
                        help="npu_fusion: the backend (the pass on the joint graph); inductor: stock Inductor "
                             "after npu_fusion.install_inductor (its min-cut partitioner; no op counts, Inductor "
                             "hands over no graph); torchair: torchair's own backend after npu_fusion.install "
                             "(the pass after its default partition; needs torch_npu's torchair)")
    parser.add_argument("--checkpointing", choices=("none", "full", "selective"), default="none",
                        help="activation checkpointing of each block (transformers models: full only, "
                             "through gradient_checkpointing_enable)")
    parser.add_argument("--compiled-autograd", action="store_true",
                        help="compile forward and backward as one step with compiled autograd on")
    parser.add_argument("--forward", action="store_true",
                        help=f"fuse the forward too (options {' and '.join(forward_options())}, on by default): "
                             "each counted site is then a forward site as well, in the rows of "
                             f"{' and '.join(forward_ops())}")
    parser.add_argument("--backward-only", action="store_true",
                        help=f"turn the forward rules off ({', '.join(f'{o}=False' for o in forward_options())})")
    parser.add_argument("--inference", action="store_true",
                        help="report an inference step instead of a training step: one forward under no_grad "
                             "(an inference graph: the forward rules), its logits checked against float64")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true",
                        help="print everything as one JSON object on stdout (progress stays on stderr)")
    parser.epilog = ("exit status: 0 gradients meet the criterion, 1 gradient check failed, "
                     "3 the pass hit an internal error, 4 the report's accounting disagrees with the "
                     "pass's results, 2 usage error")


def _targets(text: str) -> tuple:
    chosen = tuple(t.strip() for t in text.split(","))
    unknown = [t for t in chosen if t not in ("auto",) + TARGETS]
    if unknown or not chosen:
        raise argparse.ArgumentTypeError(f"unknown target(s) {unknown}: choose from {('auto',) + TARGETS}")
    return chosen


def run(args: argparse.Namespace, sinks=(), sources: Sequence[SubjectSource] = ()) -> int:
    """Collect, print, and hand the report to each of ``sinks`` (the ``--html`` page's writer)."""
    try:
        source = _chosen_source(args, sources)
        with source.workarounds(args) if source is not None else contextlib.nullcontext():
            report = collect(args, sources)
        for sink in sinks:
            sink(report)
    except UsageError as exc:
        print(f"npu-fusion report: {exc}", file=sys.stderr)
        return EXIT_USAGE
    write_report(report, args.json)
    for problem in report["accounting_errors"]:
        print(f"npu-fusion report: accounting error: {problem}", file=sys.stderr)
    return exit_status(report)


def exit_status(report: Dict[str, Any]) -> int:
    if report["pass_errors"]:
        return EXIT_PASS_ERROR
    if report["accounting_errors"]:
        return EXIT_ACCOUNTING
    return EXIT_OK if report["gradients"]["passed"] else EXIT_GRADIENTS


def _chosen_source(args: argparse.Namespace, sources: Sequence[SubjectSource]):
    return next((s for s in sources if s.chosen(args)), None)


def collect(args: argparse.Namespace, sources: Sequence[SubjectSource] = ()) -> Dict[str, Any]:
    """Run the report and return everything it found as plain data (what ``--json`` prints)."""
    if args.layers < 1 or args.batch < 1 or args.seq < 2:
        raise UsageError("--layers and --batch must be at least 1, --seq at least 2")
    if getattr(args, "inference", False) and (args.compiled_autograd or args.checkpointing != "none"):
        raise UsageError("--inference runs no backward: --compiled-autograd and --checkpointing do not apply")
    if len(args.target) != 1:
        raise UsageError("one --target at a time (several only with --hf-config)")
    compiler = getattr(args, "compiler", "npu_fusion")
    if compiler != "npu_fusion" and args.partitioner is not None:
        raise UsageError(f"--partitioner is not honoured with --compiler {compiler} "
                         f"({'Inductor partitions with min-cut' if compiler == 'inductor' else 'torchair partitions with default'})")
    if compiler == "torchair" and "torchair" not in sys.modules and importlib.util.find_spec("torchair") is None:
        raise UsageError("--compiler torchair needs torchair (it comes with torch_npu, on an Ascend host)")
    partitioner = args.partitioner or ("min_cut" if compiler == "inductor" else "default")
    args = argparse.Namespace(**dict(vars(args), target=args.target[0], dtype=args.dtype or "float32",
                                     partitioner=partitioner, compiler=compiler))
    options = FusionOptions.from_mapping(dict({"target": args.target, "partitioner": partitioner},
                                              **forward_switches(args)))
    progress("building the model...")
    source = _chosen_source(args, sources)
    subject = (source.subject(args) if source is not None
               else hf_subject(args) if args.hf else bundled_subject(args))
    ids = torch.randint(0, subject.vocab_size, (args.batch, args.seq),
                        generator=torch.Generator().manual_seed(args.seed + 1))
    return analyse(subject, ids, options, _settings(args))


def _settings(args: argparse.Namespace) -> Dict[str, Any]:
    return {"model": args.hf or args.model, "source": "transformers" if args.hf else "bundled",
            "layers": args.layers, "dtype": args.dtype, "batch": args.batch, "seq": args.seq,
            "dynamic": args.dynamic, "target": args.target, "partitioner": args.partitioner,
            "compiler": getattr(args, "compiler", "npu_fusion"), "checkpointing": args.checkpointing, "compiled_autograd": args.compiled_autograd,
            "seed": args.seed, "forward": forward_fused(args), "train": not getattr(args, "inference", False)}
