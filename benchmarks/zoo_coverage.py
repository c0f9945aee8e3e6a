#!/usr/bin/env python
"""Model-zoo coverage of the npu-fusion pass on real transformers model code.

Sweeps the causal-LM models of the installed transformers that use RoPE,
RMSNorm or a gate_up projection (SwiGLU), each built from a tiny random config (``AutoConfig.for_model`` shrunk;
no downloads, no weights). For each model it

1. counts, in an eager forward and backward and independently of the pass, the
   RMSNorm calls (forward hooks on modules whose class name contains ``RMSNorm``, or
   whose source is RMSNorm's, like Llama 4's ``L2Norm``) and the RoPE applications
   (a wrapper around the modeling module's apply-rotary functions: one per rotated
   tensor returned) and the SwiGLU products (forward hooks on the SiLU of modules whose
   forward calls or indexes one ``gate_up_proj``: Phi-3's MLP, the MoE experts); a site
   counts when its output receives a gradient; the kinds are the rules' site probes;
2. compiles the model with ``npu_fusion_testing.capture.Capture``, which runs the
   real pass (``fuse_backward(bw_gm, options, forward=fw_graph)``), and runs forward
   and backward of the causal-LM loss (if torch.compile fails on the model without
   the pass too, it retries with core ATen decompositions and says so);
3. compares every parameter gradient against eager in the same dtype and against
   float64, with the tests' criterion (``npu_fusion.measure.grads.grad_failures``, factor 4);

and prints a table per model (RMSNorm, RoPE and SwiGLU sites fused/counted, the gradient
verdict, decomposed RoPE/RMSNorm nodes left), then per model the counted sites left
unfused (by module), the pass's ``FusionResult.misses`` reasons (with the module of
the node) and notes; then the overall coverage and the wall time.

    python -m benchmarks.zoo_coverage                       # every RoPE/RMSNorm/SwiGLU model
    python -m benchmarks.zoo_coverage --models llama,gptj   # some
    python -m benchmarks.zoo_coverage --dtype bfloat16 --json out.json --limit 20
    python -m benchmarks.zoo_coverage --forward             # the forward rules too, their columns beside

The sweep itself is :mod:`npu_fusion_testing.zoo`; this is its command line.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import torch

from npu_fusion_testing.generated import publishing, script_command
from npu_fusion_testing.zoo import COUNTED_KINDS, FORWARD_OP, LABEL, discover, print_details, print_table, run_model, summary


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", help="comma-separated model types (default: every RoPE/RMSNorm/SwiGLU causal LM)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--limit", type=int, help="run at most this many (buildable) models")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--dynamic", action="store_true", help="mark batch and sequence of input_ids dynamic")
    parser.add_argument("--forward", action="store_true",
                        help="also fuse the forward (the forward rules' options on): each counted site is a "
                             "forward site too, shown in the fw columns")
    parser.add_argument("--show-skipped", action="store_true")
    parser.add_argument("--write-docs", metavar="NAME",
                        help="also write what this prints into block NAME of its docs/ page")
    return parser.parse_args(argv)


def quiet_libraries() -> None:
    """Only errors from Dynamo and transformers, no warnings: the sweep prints its own table."""
    import logging
    import warnings

    logging.getLogger("torch._dynamo").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    import transformers  # after the filter: its import warns too

    transformers.logging.set_verbosity_error()


def sweep(args: argparse.Namespace) -> list:
    """Every discovered model run (or skipped), with a progress line per model on stderr."""
    models = [m.strip() for m in args.models.split(",")] if args.models else None
    entries = discover(models, layers=args.layers)
    dtype = getattr(torch, args.dtype)
    outcomes, ran = [], 0
    for entry in entries:
        if not entry.skip and args.limit is not None and ran >= args.limit:
            entry.skip = "--limit reached"
        outcome, _ = run_model(entry, dtype=dtype, dynamic=args.dynamic, forward=args.forward)
        outcomes.append(outcome)
        if outcome.status != "skipped":
            ran += 1
            print(f"[{ran}] {outcome.model_type}: {outcome.status} "
                  + " ".join(f"{kind} {outcome.fused[kind]}/{outcome.present[kind]}" for kind in COUNTED_KINDS)
                  + ("".join(f" forward {kind} {outcome.forward_fused[kind]} (missed {outcome.forward_missed[kind]})"
                             for kind in FORWARD_OP) if args.forward else "")
                  + f" grads {'ok' if outcome.grads_ok else 'FAIL'}"
                  + f" ({outcome.seconds:.1f}s) {outcome.reason}", file=sys.stderr, flush=True)
    return outcomes


def print_summary(s) -> None:
    print(f"\nmodels: {s['models_ran']} ran, {s['models_error']} failed to build/run, "
          f"{s['models_skipped']} skipped (no RoPE/RMSNorm/SwiGLU, composite, duplicate or unbuildable)")
    width = max(len(label) for label in LABEL.values()) + len(" forward")
    for kind in COUNTED_KINDS:
        fused, counted = s[f"{kind}_sites"]
        models = s[f"{kind}_models_fully_fused"]
        print(f"{LABEL[kind] + ' sites fused:':<{width + 13}} {fused}/{counted} ({100.0 * fused / max(1, counted):.1f}%),"
              f" models fully fused {models[0]}/{models[1]}")
    if "forward_silent" in s:
        for kind in FORWARD_OP:
            fused, counted = s[f"{kind}_forward_sites"]
            print(f"{LABEL[kind] + ' forward sites fused:':<{width + 13}} {fused}/{counted} "
                  f"({100.0 * fused / max(1, counted):.1f}%), recorded misses {s[f'{kind}_forward_missed']}")
        print(f"forward sites neither fused nor recorded (silent): {s['forward_silent']}; models with every "
              f"forward site fused {s['models_forward_fully_fused'][0]}/{s['models_forward_fully_fused'][1]}")
    print(f"models with every site fused: {s['models_fully_fused'][0]}/{s['models_fully_fused'][1]}; "
          f"gradients match eager (float64 criterion): {s['grads_ok'][0]}/{s['grads_ok'][1]}")


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(max(1, min(torch.get_num_threads(), os.cpu_count() or 1)))
    quiet_libraries()
    import transformers

    with publishing(args.write_docs, script_command(__file__, argv)):
        return report(args, transformers)


def report(args, transformers) -> int:
    wall = time.perf_counter()
    outcomes = sweep(args)
    wall = time.perf_counter() - wall

    print(f"\nnpu-fusion zoo coverage: transformers {transformers.__version__}, torch {torch.__version__}, "
          f"dtype {args.dtype}, {args.layers} layers{', dynamic shapes' if args.dynamic else ''}\n")
    print_table(outcomes)
    print(f"\n({'/'.join(LABEL.values())}: fused/counted sites; grads: every parameter gradient as close to float64 as "
          "eager's; left: decomposed RoPE/RMSNorm nodes left after the pass; bw: backward graphs; "
          "unrecognized: no matcher reported the site, missed: a matcher gave a Miss reason)\n")
    print_details(outcomes)
    skipped = [o for o in outcomes if o.status == "skipped"]
    if args.show_skipped and skipped:
        print("\nskipped:")
        for o in skipped:
            print(f"  {o.model_type:<26} {o.reason}")
    s = summary(outcomes)
    print_summary(s)
    print(f"wall time {wall:.0f}s on {torch.get_num_threads()} threads")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"transformers": transformers.__version__, "torch": torch.__version__, "dtype": args.dtype,
                       "layers": args.layers, "dynamic": args.dynamic, "wall_seconds": wall, "summary": s,
                       "models": [dataclasses.asdict(o) for o in outcomes]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
