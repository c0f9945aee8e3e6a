"""``npu-fusion report``: compile a model with the pass, train one step, and show
what was fused, what was left unfused and why, what it did to the backward graph
and to its modelled memory traffic, and whether the gradients are still right.

Everything reported is read from the graphs and from the pass's own
:class:`~npu_fusion.plugin.pass_manager.FusionResult` s; nothing is assumed. The
step runs on the CPU with the fused ops' reference kernels (as the ``npu_fusion``
backend does off an Ascend host); ``--target`` selects which forms the pass may
emit, so the report shows what a given chip would get.

Exit status: 0 when the gradient check passes, 1 when it fails, 3 when the pass
hit an internal error (it then leaves the graph unchanged), 4 when the report's own
per-op accounting disagrees with the pass's results (:func:`accounting_errors`), 2 for
usage errors.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import dataclasses
import json
import math
import sys
import time
from typing import Any, Callable, Dict, List, Optional

import torch

from ..lowering import FUSED_OPS as LOWERED_OPS
from ..lowering import RMS_NORM_GRAD, ROPE_GRAD
from ..testing.grads import MODEL_FACTOR, grad_error
from .backend import aot_backend, fused_backward, run_keeping_unfused
from .options import TARGETS, FusionOptions
from .pass_manager import FusionResult

FUSED_OPS = tuple(op.name for op in LOWERED_OPS)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

#: the compiled gradient may be this many times further from float64 than eager's is (the tests'
#: criterion, :mod:`npu_fusion.testing.grads`, with its per-dtype floor ``TOLERANCE``)
FP64_FACTOR = MODEL_FACTOR

EXIT_OK, EXIT_GRADIENTS, EXIT_USAGE, EXIT_PASS_ERROR, EXIT_ACCOUNTING = 0, 1, 2, 3, 4


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__.split("\n\n")[0].replace("``", "")
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    model = parser.add_mutually_exclusive_group()
    model.add_argument("--model", choices=("llama", "gptj", "deepseek"), default="llama",
                       help="bundled decoder (RoPE mode 0, 1 or 3 respectively); default llama")
    model.add_argument("--hf", metavar="MODEL_TYPE",
                       help="a transformers architecture (e.g. llama, qwen2, mistral, gptj) with a tiny "
                            "random config; needs transformers, downloads nothing")
    model.add_argument("--framework", metavar="LIBRARY:MODEL", choices=_framework_names(),
                       help="a tiny random model of a training framework's own code: "
                            + ", ".join(_framework_names()) + "; needs that library")
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
                             "hands over no graph)")
    parser.add_argument("--checkpointing", choices=("none", "full", "selective"), default="none",
                        help="activation checkpointing of each block (transformers models: full only, "
                             "through gradient_checkpointing_enable)")
    parser.add_argument("--compiled-autograd", action="store_true",
                        help="compile forward and backward as one step with compiled autograd on")
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


def run(args: argparse.Namespace, sinks=()) -> int:
    """Collect, print, and hand the report to each of ``sinks`` (the ``--html`` page's writer)."""
    try:
        with _framework_workarounds(args):
            report = collect(args)
        for sink in sinks:
            sink(report)
    except UsageError as exc:
        print(f"npu-fusion report: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.json:
        json.dump(_finite(report), sys.stdout, indent=2, allow_nan=False)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(format_text(report))
    sys.stdout.flush()
    for problem in report["accounting_errors"]:
        print(f"npu-fusion report: accounting error: {problem}", file=sys.stderr)
    return exit_status(report)


def exit_status(report: Dict[str, Any]) -> int:
    if report["pass_errors"]:
        return EXIT_PASS_ERROR
    if report["accounting_errors"]:
        return EXIT_ACCOUNTING
    return EXIT_OK if report["gradients"]["passed"] else EXIT_GRADIENTS


def _finite(value):
    """Strict JSON: non-finite floats (a NaN gradient) become strings."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


COMPILERS = ("npu_fusion", "inductor")


class UsageError(Exception):
    pass


def progress(message: str) -> None:
    print(f"[npu-fusion report] {message}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- the model

@dataclasses.dataclass
class Subject:
    """A model and how to run one training step of it."""
    name: str
    model: torch.nn.Module
    loss: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]
    vocab_size: int
    #: fused-op sites one forward contains, when known independently of the pass
    expected: Optional[Dict[str, int]] = None
    #: counts the sites in an eager run instead (HF models): a context manager factory
    counter: Optional[Callable] = None
    #: the counter also tells, during the compiled run, which sites ran outside compiled graphs
    counts_outside: bool = False
    #: a float64 copy of the model (when a deep copy cast with ``.double()`` is not one)
    reference: Optional[Callable[[], torch.nn.Module]] = None
    #: the step's inputs for the float64 copy (floating inputs widened; token ids stay as they are)
    widen: Callable[[Any], Any] = lambda batch: batch


def _bundled_subject(args) -> Subject:
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


def tiny_hf_config(model_type: str, layers: int):
    """A small random config of a transformers architecture, built offline."""
    import inspect

    from transformers import AutoConfig

    try:
        config_class = type(AutoConfig.for_model(model_type))
    except (ValueError, KeyError) as exc:
        raise UsageError(f"transformers does not know the model type {model_type!r}: {exc}") from None
    accepted = set(inspect.signature(config_class.__init__).parameters) | set(getattr(config_class, "attribute_map", {}))
    wanted = dict(_HF_SMALL, num_hidden_layers=layers, **_HF_OVERRIDES.get(model_type, {}))
    return AutoConfig.for_model(model_type, **{k: v for k, v in wanted.items() if k in accepted})


def _framework_names():
    from ..testing.frameworks import FRAMEWORKS

    return tuple(FRAMEWORKS)


def _framework_workarounds(args):
    """What the framework's library needs to run on a CPU at all (``npu_fusion.testing``)."""
    if not getattr(args, "framework", None):
        return contextlib.nullcontext()
    from ..testing.frameworks import FRAMEWORKS

    return FRAMEWORKS[args.framework].workarounds()


def _framework_subject(args) -> Subject:
    from ..testing import frameworks

    framework = frameworks.FRAMEWORKS[args.framework]
    if args.checkpointing != "none":
        raise UsageError("--checkpointing is for the bundled and transformers models")
    try:
        model = frameworks.build(framework, DTYPES[args.dtype], args.layers, args.seed)
    except ImportError as exc:
        raise UsageError(f"--framework {args.framework} needs {framework.library}: {exc}") from None
    return Subject(name=f"{args.framework} (tiny random model of the library's own code)", model=model,
                   loss=lambda m, ids: frameworks.loss(framework, m, ids), vocab_size=frameworks.VOCAB,
                   counter=framework.sites, counts_outside=True,
                   reference=lambda: frameworks.widened(framework, model, args.layers))


def _hf_subject(args) -> Subject:
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
                   model=model, loss=loss, vocab_size=config.vocab_size, counter=_count_hf_sites)


class _count_hf_sites:
    """Count RMSNorm calls (modules named ``*RMSNorm``) and RoPE applications (tensors
    returned by the modeling module's ``apply_rotary_pos_emb*``: Llama's rotates q and k
    in one call, GPT-J's one tensor per call) in an eager run."""

    def __init__(self, model):
        self.model, self.counts = model, dict.fromkeys(FUSED_OPS, 0)
        self.hooks, self.patched = [], []

    def __enter__(self):
        def norm_hook(*_):
            self.counts[RMS_NORM_GRAD.name] += 1

        modules = set()
        for m in self.model.modules():
            if type(m).__name__.lower().endswith("rmsnorm"):
                self.hooks.append(m.register_forward_hook(norm_hook))
            modules.add(sys.modules.get(type(m).__module__))
        for module in modules:
            for name in dir(module) if module is not None else ():
                if name.startswith("apply_rotary_pos_emb") and callable(getattr(module, name)):
                    original = getattr(module, name)

                    def counting(*a, __original=original, **k):
                        out = __original(*a, **k)
                        self.counts[ROPE_GRAD.name] += len(out) if isinstance(out, tuple) else 1
                        return out

                    setattr(module, name, counting)
                    self.patched.append((module, name, original))
        return self.counts

    def __exit__(self, *exc):
        for hook in self.hooks:
            hook.remove()
        for module, name, original in self.patched:
            setattr(module, name, original)


# --------------------------------------------------------------------------- the backend

def _target_name(target) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return str(target)
    return getattr(target, "__name__", str(target))


def op_counts(graph: torch.fx.Graph) -> collections.Counter:
    return collections.Counter(_target_name(n.target) for n in graph.nodes if n.op == "call_function")


class Recorder:
    """A torch.compile backend: the backend's AOTAutograd with the pass, keeping each backward
    graph's op counts from before and after the pass (before: the unfused partition)."""

    def __init__(self, options: FusionOptions):
        self.options = options
        self.before: List[collections.Counter] = []
        self._after: List[Callable[[], torch.fx.Graph]] = []
        self.results: List[FusionResult] = []
        #: per graph through the pass: the counter of its runs (testing.capture.count_graph_runs)
        self.run_keys: List[Optional[int]] = []
        #: per graph through the pass: each node's module path, read before the pass replaces nodes
        self.paths: List[Dict[str, str]] = []
        #: per graph through the pass: what the partition saves without the pass (a joint graph's)
        self.saved_before: List[Optional[Any]] = []

    def __call__(self, gm, example_inputs):
        return aot_backend(self.options, self._around_pass)(gm, example_inputs)

    def _around_pass(self, gm, run):
        from ..testing.capture import count_graph_runs

        progress(f"running the pass on a {run.stage} graph of {len(gm.graph.nodes)} nodes...")
        self.paths.append({n.name: nearest_module_path(n) for n in gm.graph.nodes})
        result, before, saved_before = run_keeping_unfused(gm, run)
        self.results.append(result)
        self.before.append(op_counts(before))
        self.saved_before.append(saved_before)
        self._after.append(fused_backward(gm, run))
        count_graph_runs(gm, run, self.run_keys)

    @property
    def runs(self) -> List[int]:
        """Per graph through the pass: how many times it ran (a graph reused per layer runs once per layer)."""
        from ..testing.capture import GRAPH_RUNS

        return [GRAPH_RUNS[key] if key is not None else 0 for key in self.run_keys]

    @property
    def after(self) -> List[collections.Counter]:
        return [op_counts(after()) for after in self._after]

    def fused_runs(self, op: str) -> int:
        return sum(r.fused(op) * n for r, n in zip(self.results, self.runs))

    def installed(self):
        return contextlib.nullcontext()


class InductorRecorder(Recorder):
    """A torch.compile backend: stock Inductor after ``install_inductor``, the pass inside its
    partition. The pass's results are read from ``HISTORY``; Inductor hands over no graph, so
    there are no op counts."""

    def __call__(self, gm, example_inputs):
        from ..compat import inductor_backend
        from ..testing.capture import count_calls
        from .pass_manager import HISTORY

        mark = HISTORY.mark()
        progress("compiling with Inductor (the pass runs in its partition)...")
        compiled = inductor_backend()(gm, example_inputs)
        new = HISTORY.since(mark)
        self.results.extend(new)
        self.paths.extend({} for _ in new)
        self.saved_before.extend(None for _ in new)
        key, counted = count_calls(compiled)
        self.run_keys.extend(key for _ in new)
        return counted

    @contextlib.contextmanager
    def installed(self):
        """The pass installed, and the compile caches off (a cache hit skips the joint passes)."""
        from ..compat import no_compile_caches
        from .inductor import install_inductor, uninstall_inductor

        install_inductor(**{k: v for k, v in dataclasses.asdict(self.options).items()
                            if k not in ("partitioner", "decompositions")})
        try:
            with no_compile_caches():
                yield
        finally:
            uninstall_inductor()


def module_path(node: torch.fx.Node) -> str:
    """The module whose forward made ``node`` (AOTAutograd copies the forward node's
    ``nn_module_stack`` onto a backward node, as ``fwd_nn_module_stack`` or, recomputed, as
    ``nn_module_stack``), relative to the outermost module of the stack: ``layers.0.attn``; ""
    for none or for the outermost module itself."""
    stack = node.meta.get("fwd_nn_module_stack") or node.meta.get("nn_module_stack")
    if not stack:
        return ""
    paths = [entry[0] for entry in stack.values()]
    root, inner = paths[0], paths[-1]
    return inner[len(root) + 1:] if inner.startswith(root + ".") else ""


def nearest_module_path(node: torch.fx.Node, limit: int = 32) -> str:
    """``node``'s module path, or the nearest one among its inputs (a gradient accumulation, the
    node a miss names, often belongs to no module), looking at ``limit`` nodes at most."""
    queue, seen, index = [node], {node}, 0
    while index < min(len(queue), limit):
        current, index = queue[index], index + 1
        path = module_path(current)
        if path:
            return path
        for source in current.all_input_nodes:
            if source not in seen:
                seen.add(source)
                queue.append(source)
    return ""


def _placed(records: List[Dict[str, Any]], paths: Dict[str, str], nodes) -> List[Dict[str, Any]]:
    """Sites or misses as dicts with the module they came from (the most common among ``nodes(record)``)."""
    placed = []
    for record in records:
        row = dataclasses.asdict(record)
        found = collections.Counter(paths[n] for n in nodes(record) if paths.get(n))
        row["module"] = found.most_common(1)[0][0] if found else ""
        placed.append(row)
    return placed


def _saved_summary(recorder: "Recorder") -> Dict[str, int]:
    """Bytes the forward saves for the backward without and with the pass, over the graphs where
    the pass fused a site on the joint graph (the partitioner then chose the saved set for the
    fused backward; elsewhere it is the one chosen for the unfused backward)."""
    pairs = [(before, r.saved) for r, before in zip(recorder.results, recorder.saved_before)
             if r.sites and before is not None and getattr(r, "saved", None) is not None]
    return {"graphs": len(pairs), "bytes_before": sum(b.bytes for b, _ in pairs),
            "bytes_after": sum(a.bytes for _, a in pairs),
            "tensors_before": sum(len(b.names) for b, _ in pairs), "tensors_after": sum(len(a.names) for _, a in pairs)}


# --------------------------------------------------------------------------- the run

def _param_grads(model) -> Dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _step(subject: Subject, model, ids, fn=None, counting=contextlib.nullcontext()) -> tuple:
    model.zero_grad(set_to_none=True)
    with counting:  # the forward only: checkpointing runs it again in the backward
        loss = (fn or (lambda i: subject.loss(model, i)))(ids)
    loss.backward()
    grads = _param_grads(model)
    model.zero_grad(set_to_none=True)
    return float(loss.detach()), grads


def collect(args: argparse.Namespace) -> Dict[str, Any]:
    """Run the report and return everything it found as plain data (what ``--json`` prints)."""
    if args.layers < 1 or args.batch < 1 or args.seq < 2:
        raise UsageError("--layers and --batch must be at least 1, --seq at least 2")
    if len(args.target) != 1:
        raise UsageError("one --target at a time (several only with --hf-config)")
    compiler = getattr(args, "compiler", "npu_fusion")
    if compiler == "inductor" and args.partitioner is not None:
        raise UsageError("--partitioner is not honoured with --compiler inductor (Inductor partitions with min-cut)")
    partitioner = args.partitioner or ("min_cut" if compiler == "inductor" else "default")
    args = argparse.Namespace(**dict(vars(args), target=args.target[0], dtype=args.dtype or "float32",
                                     partitioner=partitioner, compiler=compiler))
    options = FusionOptions.from_mapping({"target": args.target, "partitioner": partitioner})
    progress("building the model...")
    subject = (_framework_subject(args) if getattr(args, "framework", None)
               else _hf_subject(args) if args.hf else _bundled_subject(args))
    ids = torch.randint(0, subject.vocab_size, (args.batch, args.seq),
                        generator=torch.Generator().manual_seed(args.seed + 1))
    return analyse(subject, ids, options, _settings(args))


def _settings(args: argparse.Namespace) -> Dict[str, Any]:
    return {"model": args.hf or args.model, "source": "transformers" if args.hf else "bundled",
            "layers": args.layers, "dtype": args.dtype, "batch": args.batch, "seq": args.seq,
            "dynamic": args.dynamic, "target": args.target, "partitioner": args.partitioner,
            "compiler": getattr(args, "compiler", "npu_fusion"), "checkpointing": args.checkpointing, "compiled_autograd": args.compiled_autograd,
            "seed": args.seed}


def analyse(subject: Subject, batch, options: FusionOptions, settings: Dict[str, Any]) -> Dict[str, Any]:
    """One training step of ``subject`` on ``batch`` in float64, eagerly, and compiled with the
    pass (``settings["dynamic"]``, ``settings["compiled_autograd"]``): the report as plain data.
    The command line and :func:`npu_fusion.explain` both end here."""
    exact = _float64_step(subject, batch)
    progress("eager step...")
    counting = subject.counter(subject.model) if subject.counter is not None else None
    eager_loss, eager = _step(subject, subject.model, batch, counting=counting or contextlib.nullcontext())
    expected = dict(counting.counts) if counting is not None else subject.expected

    compiler = settings.get("compiler", "npu_fusion")
    recorder = Recorder(options) if compiler == "npu_fusion" else InductorRecorder(options)
    outside = subject.counter(subject.model) if subject.counts_outside else contextlib.nullcontext()
    with recorder.installed():
        seconds, compiled_loss, fused_grads = _measured_compiled_step(settings, subject, recorder, batch, outside)

    progress("comparing gradients...")
    gradients = compare_gradients(fused_grads, eager, exact)
    gradients["loss"] = {"compiled": compiled_loss, "eager": eager_loss}
    report = _assemble(settings, subject, options, recorder, expected, gradients, seconds)
    if subject.counts_outside:
        report["accounting"] = _accounting(counting, outside, recorder)
    return report


def _float64_step(subject: Subject, ids) -> Dict[str, torch.Tensor]:
    """The parameter gradients of an eager step in float64 (the reference)."""
    progress("eager step in float64 (reference)...")
    wide = subject.reference() if subject.reference else copy.deepcopy(subject.model).double()
    _, exact = _step(subject, wide, subject.widen(ids))
    return exact


def _measured_compiled_step(settings, subject: Subject, recorder, ids, outside) -> tuple:
    """The compiled step with the pass, inside ``outside`` (the site counter again: during the
    compiled run it sees only the sites that ran outside compiled graphs): (forward and backward
    seconds, loss, parameter gradients)."""
    model = subject.model
    torch._dynamo.reset()
    step_ids = ids.clone() if isinstance(ids, torch.Tensor) else tuple(_cloned(i) for i in ids)
    if settings["dynamic"]:
        torch._dynamo.mark_dynamic(step_ids, 0)
        torch._dynamo.mark_dynamic(step_ids, 1)
    model.zero_grad(set_to_none=True)
    with outside:
        forward_seconds, backward_seconds, loss = _compiled_step(settings, subject, model, recorder, step_ids)
    fused_grads = _param_grads(model)
    model.zero_grad(set_to_none=True)
    return (forward_seconds, backward_seconds), float(loss.detach()), fused_grads


def _cloned(value):
    """A copy of a step input that the compiled step may mark dynamic without touching the caller's."""
    return value.detach().clone().requires_grad_(value.requires_grad) if isinstance(value, torch.Tensor) else value


def _assemble(settings, subject: Subject, options: FusionOptions, recorder, expected, gradients,
              seconds) -> Dict[str, Any]:
    """The report's plain data from the recorded pass results and the gradient comparison."""
    results = recorder.results
    report = {
        "model": subject.name,
        "settings": dict(settings, resolved_target=options.resolved_target()),
        "backward_graphs": len(results),
        "ops": summarize_sites(results, expected, recorder.runs),
        "misses": [m for r, p in zip(results, recorder.paths) for m in _placed(r.misses, p, lambda m: [m.node])],
        "sites": [s for r, p in zip(results, recorder.paths)
                  for s in _placed(r.sites, p, lambda s: s.replaced_nodes)],
        "op_counts": _op_count_table(recorder),
        "memory_traffic": summarize_bytes(results),
        "saved_activations": _saved_summary(recorder),
        "gradients": gradients,
        "seconds": {"forward_first_call": seconds[0], "backward_first_call": seconds[1],
                    "pass": sum(r.seconds for r in results)},
        "pass_errors": [r.error for r in results if r.error],
    }
    report["accounting_errors"] = accounting_errors(report, recorder)
    if not results:
        report["pass_errors"].append("no backward graph reached the pass (nothing was compiled?)")
    return report


def _compiled_step(settings, subject: Subject, model, recorder, ids):
    """Compile and run one forward and backward: (forward seconds, backward seconds, loss)."""
    if settings["compiled_autograd"]:
        progress("compiling and running forward and backward (compiled autograd)...")
        return _compiled_autograd_step(subject, model, recorder, ids)
    compiled = torch.compile(lambda i: subject.loss(model, i), backend=recorder)
    progress("compiling and running the forward...")
    start = time.perf_counter()
    loss = compiled(ids)
    forward_seconds = time.perf_counter() - start
    progress("backward...")
    start = time.perf_counter()
    loss.backward()
    return forward_seconds, time.perf_counter() - start, loss


def _accounting(counted, outside, recorder) -> Dict[str, Dict[str, Any]]:
    """Per fused op: where each independently counted site ended (fused, a recorded miss, run
    outside every compiled graph, or unexplained), with the outside sites' module paths."""
    from ..testing.sites import account

    return {a.op: {"expected": a.counted, "fused": a.fused, "missed": a.missed, "outside": len(a.outside),
                   "unexplained": a.unexplained, "outside_paths": a.outside}
            for a in account(counted, outside, recorder).values()}


def _compiled_autograd_step(subject: Subject, model, recorder, ids):
    """Forward and backward compiled as one step with compiled autograd on (read when
    ``torch.compile`` wraps the step): (seconds, 0.0, loss), all of it timed as the forward."""
    def train_step(i):
        loss = subject.loss(model, i)
        loss.backward()
        return loss

    with torch._dynamo.config.patch(compiled_autograd=True):
        compiled = torch.compile(train_step, backend=recorder)
        start = time.perf_counter()
        loss = compiled(ids)
    return time.perf_counter() - start, 0.0, loss


def accounting_errors(report: Dict[str, Any], recorder: Recorder) -> List[str]:
    """Where the report's per-op accounting disagrees with the pass's own results: a backward
    graph whose sites the pass recorded but that the step counted as never run (every graph
    compiled for the step runs in it), fused-op nodes the pass added to a graph that are not
    the sites it recorded there, or a table row whose fused and unfused do not add up or
    count fewer fused sites than the pass fused."""
    errors = []
    graphs = zip(recorder.results, recorder.runs, recorder.before, recorder.after)
    for index, (result, runs, before, after) in enumerate(graphs):
        if (result.sites or result.misses) and runs < 1:
            errors.append(f"backward graph {index}: the pass recorded {len(result.sites)} fused and "
                          f"{len(result.misses)} unfused sites, but the step counted {runs} runs of it")
        for op in LOWERED_OPS:  # a compiled-autograd graph inlines backwards fused before it
            added = after.get(str(op.overload), 0) - before.get(str(op.overload), 0)
            if added != result.fused(op.name):
                errors.append(f"backward graph {index}: the pass added {added} {op.name} nodes, but "
                              f"recorded {result.fused(op.name)} {op.name} sites")
    for op, row in report["ops"].items():
        fused_by_pass = sum(r.fused(op) for r in recorder.results)
        if row["found"] != row["fused"] + row["unfused"] or row["fused"] < fused_by_pass:
            errors.append(f"{op}: the table says found {row['found']}, fused {row['fused']}, unfused "
                          f"{row['unfused']}, but the pass fused {fused_by_pass} sites")
    return errors


def summarize_sites(results: List[FusionResult], expected: Optional[Dict[str, int]],
                    runs: Optional[List[int]] = None) -> Dict[str, Dict]:
    """Per op: sites found, fused and left unfused, each counted once per run of its graph."""
    runs = runs if runs is not None else [1] * len(results)
    ops = {}
    names = list(FUSED_OPS) + sorted({s.op for r in results for s in r.sites} - set(FUSED_OPS))
    for op in names:
        fused = sum(r.fused(op) * n for r, n in zip(results, runs))  # a graph reused per layer: per run
        unfused = sum(n for r, n in zip(results, runs) for m in r.misses if m.op == op)
        ops[op] = {"found": fused + unfused, "fused": fused, "unfused": unfused,
                   "expected": expected.get(op) if expected else None,
                   "modes": _modes(results, runs, op)}
    return ops


def _modes(results: List[FusionResult], runs: List[int], op: str) -> Dict[str, int]:
    modes: collections.Counter = collections.Counter()
    for result, n in zip(results, runs):
        for site in (s for s in result.sites if s.op == op):
            modes[site.mode or "-"] += n
    return dict(modes)


def _op_count_table(recorder: Recorder) -> Dict[str, Any]:
    before, after = collections.Counter(), collections.Counter()
    for c in recorder.before:
        before.update(c)
    for c in recorder.after:
        after.update(c)
    return {"before": dict(sorted(before.items())), "after": dict(sorted(after.items())),
            "nodes_before": sum(r.nodes_before for r in recorder.results),
            "nodes_after": sum(r.nodes_after for r in recorder.results)}


def summarize_bytes(results: List[FusionResult]) -> Dict[str, Dict[str, int]]:
    table: Dict[str, Dict[str, int]] = {}
    for r in results:
        for s in r.sites:
            row = table.setdefault(s.op, {"sites": 0, "bytes_before": 0, "bytes_after": 0, "bytes_minimum": 0})
            row["sites"] += 1
            row["bytes_before"] += s.bytes_before
            row["bytes_after"] += s.bytes_after
            row["bytes_minimum"] += s.bytes_minimum
    return table


def compare_gradients(fused: Dict[str, torch.Tensor], eager: Dict[str, torch.Tensor],
                      exact: Dict[str, torch.Tensor]) -> Dict[str, Any]:
    """Per parameter, the tests' float64 criterion (:func:`npu_fusion.testing.grads.grad_error`):
    ``err(compiled) <= 4 * err(eager) + floor``, ``err`` the max abs difference to the float64
    gradient and the floor per dtype; it must hold for every parameter. ``max |compiled - eager|``
    is reported beside it."""
    per_dtype: Dict[str, Dict[str, Any]] = {}
    failures = []
    missing = sorted(set(eager) ^ set(fused))
    for name in sorted(set(eager) & set(fused)):
        g, e = fused[name], eager[name]
        row = per_dtype.setdefault(str(g.dtype).replace("torch.", ""), {
            "params": 0, "max_abs_diff_vs_eager": 0.0, "worst_param": None, "max_err_compiled_vs_fp64": 0.0,
            "max_err_eager_vs_fp64": 0.0, "as_close_to_fp64_as_eager": True})
        failures += _compare_parameter(name, g, e, exact[name], row)
    return {"per_dtype": per_dtype, "failures": failures, "params_without_grad_in_one_run": missing,
            "passed": not failures and not missing and bool(per_dtype)}


def _compare_parameter(name: str, g: torch.Tensor, e: torch.Tensor, x: torch.Tensor,
                       row: Dict[str, Any]) -> List[Dict[str, Any]]:
    """One parameter's gradient into its dtype's ``row``; its failures (none when it passes)."""
    row["params"] += 1
    if g.dtype != e.dtype or g.shape != e.shape:
        row["as_close_to_fp64_as_eager"] = False
        return [{"param": name, "error": f"{g.dtype}{list(g.shape)} vs eager {e.dtype}{list(e.shape)}"}]
    diff = (g.double() - e.double()).abs().max().item() if g.numel() else 0.0
    error = grad_error(g, e, x, factor=FP64_FACTOR)
    if diff >= row["max_abs_diff_vs_eager"]:
        row["max_abs_diff_vs_eager"], row["worst_param"] = diff, name
    row["max_err_compiled_vs_fp64"] = max(row["max_err_compiled_vs_fp64"], error.fused)
    row["max_err_eager_vs_fp64"] = max(row["max_err_eager_vs_fp64"], error.unfused)
    row["as_close_to_fp64_as_eager"] &= error.ok
    failures = []
    if not error.ok:
        failures.append({"param": name, "err_compiled_vs_fp64": error.fused, "err_eager_vs_fp64": error.unfused,
                         "floor": error.floor, "bound": error.bound, "max_abs_diff_vs_eager": diff})
    if not math.isfinite(diff):
        failures.append({"param": name, "error": "non-finite gradient"})
    return failures


# --------------------------------------------------------------------------- text output

def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _table(header: List[str], rows: List[List[Any]]) -> str:
    cells = [header] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in cells]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines) + "\n"


def _format_accounting(report: Dict[str, Any]) -> str:
    """Where the independently counted sites ended; only where the counter could tell which ran
    outside every compiled graph (``--framework``)."""
    if "accounting" not in report:
        return ""
    rows = [[op, a["expected"], a["fused"], a["missed"], a["outside"], a["unexplained"]]
            for op, a in report["accounting"].items()]
    out = ["\n## Where the counted sites ended\n\n",
           _table(["op", "counted", "fused", "recorded miss", "outside compiled graphs", "unexplained"], rows)]
    out += [f"{op}: ran outside every compiled graph: {path}\n"
            for op, a in report["accounting"].items() for path in a["outside_paths"]]
    return "".join(out)


def format_text(report: Dict[str, Any]) -> str:
    return "".join([_format_header(report), _format_ops(report), _format_accounting(report),
                    _format_misses(report), _format_op_counts(report), _format_traffic(report),
                    _format_saved(report), _format_gradients(report)])


def _format_header(report: Dict[str, Any]) -> str:
    s = report["settings"]
    shapes = "dynamic batch and sequence" if s["dynamic"] else "static shapes"
    size = (f"inputs {', '.join(s['inputs'])}" if "inputs" in s
            else f"{s['layers']} layer(s), {s['dtype']}, batch {s['batch']} x seq {s['seq']}")
    out = [f"npu-fusion report: {report['model']}, {size}, {shapes}\n"
           f"compiler {s.get('compiler', 'npu_fusion')}, target {s['resolved_target']} (asked: {s['target']}), "
           f"partitioner {s['partitioner']}, {report['backward_graphs']} graph(s) through the pass\n"]
    sec = report["seconds"]
    total = sec["forward_first_call"] + sec["backward_first_call"]
    out.append(f"first forward + backward (compile and run) {total:.2f} s; the pass itself "
               f"{sec['pass'] * 1000:.1f} ms ({100 * sec['pass'] / total if total else 0:.1f}%)\n")
    out += [f"PASS ERROR (graph left unchanged): {err}\n" for err in report["pass_errors"]]
    out += [f"ACCOUNTING ERROR (this report contradicts the pass's results): {err}\n"
            for err in report.get("accounting_errors", ())]
    return "".join(out)


def _format_ops(report: Dict[str, Any]) -> str:
    out = ["\n## Fused ops\n\n"]
    rows = []
    for op, r in report["ops"].items():
        modes = ", ".join(f"{m}: {n}" if m != "-" else str(n) for m, n in r["modes"].items()) or "-"
        rows.append([op, r["expected"] if r["expected"] is not None else "?", r["found"], r["fused"],
                     r["unfused"], modes])
    out.append(_table(["op", "expected", "found", "fused", "unfused", "modes fused"], rows))
    for op, r in report["ops"].items():
        if r["expected"] is not None and r["fused"] == r["expected"]:
            out.append(f"{op}: all {r['expected']} sites fused\n")
        elif r["expected"] is not None:
            out.append(f"{op}: {r['fused']} of {r['expected']} sites fused\n")
    return "".join(out)


def _format_misses(report: Dict[str, Any]) -> str:
    if not report["misses"]:
        return "\n## Left unfused\n\nnothing: no near miss was recorded\n"
    return "\n## Left unfused\n\n" + _table(["op", "node", "reason"],
                                              [[m["op"], m["node"], m["reason"]] for m in report["misses"]])


def _format_op_counts(report: Dict[str, Any]) -> str:
    counts = report["op_counts"]
    names = sorted(set(counts["before"]) | set(counts["after"]))
    rows = [[n, counts["before"].get(n, 0), counts["after"].get(n, 0)] for n in names
            if counts["before"].get(n, 0) != counts["after"].get(n, 0)]
    rows.sort(key=lambda r: (-(r[1] - r[2]), r[0]))
    rows.append(["all nodes (placeholders and output too)", counts["nodes_before"], counts["nodes_after"]])
    return ("\n## Backward graph ops, before and after the pass (changed ones)\n\n"
            + _table(["op", "before", "after"], rows))


def _format_traffic(report: Dict[str, Any]) -> str:
    rows = []
    for op, b in report["memory_traffic"].items():
        ratio = b["bytes_after"] / b["bytes_before"] if b["bytes_before"] else float("nan")
        rows.append([op, b["sites"], _bytes(b["bytes_before"]), _bytes(b["bytes_after"]),
                     _bytes(b["bytes_minimum"]), f"{ratio:.2f}"])
    return ("\n## Modelled memory traffic of the replaced subgraphs\n\n"
            "(each non-view node reads its inputs and writes its output; minimum: the fused op "
            "reads each input once and writes each output once)\n\n"
            + (_table(["op", "sites", "before", "after", "fused-op minimum", "after / before"], rows)
               if rows else "no site was fused\n"))


def _format_saved(report: Dict[str, Any]) -> str:
    saved = report.get("saved_activations")
    if not saved or not saved["graphs"]:
        return "\n## Saved for the backward\n\nunchanged: no site was fused\n"
    return (f"\n## Saved for the backward\n\n{_bytes(saved['bytes_before'])} in {saved['tensors_before']} tensors "
            f"without the pass, {_bytes(saved['bytes_after'])} in {saved['tensors_after']} with it (the partitioner "
            f"chose them for the fused backward), in the graphs where a site fused\n")


def _format_gradients(report: Dict[str, Any]) -> str:
    g = report["gradients"]
    out = ["\n## Parameter gradients: compiled with the pass vs eager, both vs float64\n\n"]
    rows = [[dt, r["params"], f"{r['max_abs_diff_vs_eager']:.3g}", f"{r['max_err_compiled_vs_fp64']:.3g}",
             f"{r['max_err_eager_vs_fp64']:.3g}", "yes" if r["as_close_to_fp64_as_eager"] else "NO"]
            for dt, r in g["per_dtype"].items()]
    out.append(_table(["dtype", "params", "max abs diff compiled vs eager", "max err compiled vs fp64",
                       "max err eager vs fp64", f"compiled <= {FP64_FACTOR:g} x eager + floor"], rows))
    out.append(f"loss: compiled {g['loss']['compiled']:.6g}, eager {g['loss']['eager']:.6g}\n")
    out += [f"gradient check failed for {f['param']}: {f}\n" for f in g["failures"]]
    if g["params_without_grad_in_one_run"]:
        out.append(f"parameters with a gradient in only one run: {g['params_without_grad_in_one_run']}\n")
    out.append(f"\ngradient check: {'PASSED' if g['passed'] else 'FAILED'}\n")
    return "".join(out)
