"""One training step of a :class:`~.subjects.Subject`, measured.

One training step of a :class:`~.subjects.Subject`, measured: in float64 eagerly (the
reference), eagerly (the baseline, while an independent counter counts the sites), and compiled
with the pass through the recording backend (:mod:`npu_fusion.measure.recording`), with the
counter active again to see the sites that ran outside every compiled graph. With
``settings["train"]`` False, one inference step instead (:func:`analyse_inference`): the same
three runs of the forward under ``torch.no_grad()``, the outputs compared instead of gradients. :func:`analyse`
returns the report as plain data; the command line (:mod:`.command`), :func:`npu_fusion.explain`
and the full-size analysis (:mod:`.fullsize`) all build on it.

Everything reported is read from the graphs and from the pass's own
:class:`~npu_fusion.plugin.pass_manager.FusionResult` s; nothing is assumed. Each site counts once
per run of its graph (:mod:`npu_fusion.measure.runs`).
"""
from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import sys
import time
from typing import Any, Dict, List, Optional

import torch

from ..compat import compiled_autograd_enabled, mark_dynamic
from ..lowering import FUSED_OPS as LOWERED_OPS
from ..measure.grads import compare_gradients
from ..measure.recording import InductorRecorder, Recorder, TorchairRecorder, op_counts
from ..measure.sites import FORWARD_OPS, account, expected_for, floating_tensors
from ..plugin.options import FusionOptions
from ..plugin.pass_manager import FusionResult
from .subjects import Subject

FUSED_OPS = tuple(op.name for op in LOWERED_OPS)


def progress(message: str) -> None:
    print(f"[npu-fusion report] {message}", file=sys.stderr, flush=True)


def recorder_for(options: FusionOptions, compiler: str = "npu_fusion") -> Recorder:
    """The recording backend of the report: the pass's graphs with their module paths, each
    announced on stderr."""
    if compiler == "inductor":
        return InductorRecorder(options, on_graph=_announce_inductor)
    if compiler == "torchair":
        return TorchairRecorder(options, on_graph=_announce_torchair)
    return Recorder(options, module_paths=True, on_graph=_announce)


def _announce(gm, run) -> None:
    progress(f"running the pass on a {run.stage} graph of {len(gm.graph.nodes)} nodes...")


def _announce_inductor(_gm, _run) -> None:
    progress("compiling with Inductor (the pass runs in its partition)...")


def _announce_torchair(_gm, _run) -> None:
    progress("compiling with torchair (the pass runs on each forward and backward graph after the partition)...")


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
    """Bytes the forward saves for the backward, without and with the pass.

    Bytes the forward saves for the backward without and with the pass, over the graphs where
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


def analyse(subject: Subject, batch, options: FusionOptions, settings: Dict[str, Any]) -> Dict[str, Any]:
    """One training step of ``subject`` on ``batch`` in float64, eagerly, and compiled with the
    pass (``settings["dynamic"]``, ``settings["compiled_autograd"]``): the report as plain data.
    The command line and :func:`npu_fusion.explain` both end here."""
    if not settings.get("train", True):
        return analyse_inference(subject, batch, options, settings)
    exact = _float64_step(subject, batch)
    progress("eager step...")
    counting = subject.counter(subject.model) if subject.counter is not None else None
    eager_loss, eager = _step(subject, subject.model, batch, counting=counting or contextlib.nullcontext())
    expected = expected_for(options, dict(counting.counts) if counting is not None else subject.expected)

    compiler = settings.get("compiler", "npu_fusion")
    recorder = recorder_for(options, compiler)
    outside = subject.counter(subject.model) if subject.counts_outside else contextlib.nullcontext()
    with recorder.installed():
        seconds, compiled_loss, fused_grads = _measured_compiled_step(settings, subject, recorder, batch, outside)

    progress("comparing gradients...")
    gradients = compare_gradients(fused_grads, eager, exact)
    gradients["loss"] = {"compiled": compiled_loss, "eager": eager_loss}
    report = assemble(settings, subject, options, recorder, expected, gradients, seconds)
    if subject.counts_outside:
        report["accounting"] = accounting(counting, outside, recorder)
    return report


def analyse_inference(subject: Subject, batch, options: FusionOptions, settings: Dict[str, Any]) -> Dict[str, Any]:
    """One inference step of ``subject`` on ``batch`` (its forward under ``torch.no_grad()``: an
    inference graph, the forward rules): in float64, eagerly while the counter counts each call as
    a forward site, and compiled with the pass. The outputs (:attr:`~.subjects.Subject.outputs`)
    are compared by the float64 criterion in the report's ``gradients`` section, one row per output
    tensor; only the forward ops are expected."""
    progress("eager forward in float64 (reference)...")
    wide = subject.reference() if subject.reference else copy.deepcopy(subject.model).double()
    with torch.no_grad():
        exact = _outputs(subject, wide, subject.widen(batch))
    progress("eager forward...")
    counting = subject.counter(subject.model) if subject.counter is not None else None
    with torch.no_grad(), counting or contextlib.nullcontext():
        eager = _outputs(subject, subject.model, batch)
    expected = expected_for(options, dict(counting.counts) if counting is not None else subject.expected)
    expected = {op: n for op, n in expected.items() if op in FORWARD_OPS} if expected is not None else None

    recorder = recorder_for(options, settings.get("compiler", "npu_fusion"))
    outside = subject.counter(subject.model) if subject.counts_outside else contextlib.nullcontext()
    with recorder.installed():
        torch.compiler.reset()
        step = batch.clone() if isinstance(batch, torch.Tensor) else tuple(_cloned(i) for i in batch)
        if settings["dynamic"]:
            mark_dynamic(step, 0)
            mark_dynamic(step, 1)
        compiled = torch.compile(lambda i: _outputs(subject, subject.model, i), backend=recorder)
        progress("compiling and running the forward (no_grad)...")
        with torch.no_grad(), outside:
            start = time.perf_counter()
            got = compiled(step)
            seconds = time.perf_counter() - start

    progress("comparing outputs...")
    gradients = compare_gradients(got, eager, exact)
    gradients["loss"] = None
    report = assemble(settings, subject, options, recorder, expected, gradients, (seconds, 0.0))
    if subject.counts_outside:
        report["accounting"] = accounting(counting, outside, recorder, inference=True)
    return report


def _outputs(subject: Subject, model, batch) -> Dict[str, torch.Tensor]:
    """The floating tensors an inference step compares, by name (``output``, or ``output[i]``)."""
    value = subject.outputs(model, batch) if subject.outputs is not None else subject.loss(model, batch)
    tensors = floating_tensors(value)
    return {"output" if len(tensors) == 1 else f"output[{i}]": t for i, t in enumerate(tensors)}


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
    torch.compiler.reset()
    step_ids = ids.clone() if isinstance(ids, torch.Tensor) else tuple(_cloned(i) for i in ids)
    if settings["dynamic"]:
        mark_dynamic(step_ids, 0)
        mark_dynamic(step_ids, 1)
    model.zero_grad(set_to_none=True)
    with outside:
        forward_seconds, backward_seconds, loss = _compiled_step(settings, subject, model, recorder, step_ids)
    fused_grads = _param_grads(model)
    model.zero_grad(set_to_none=True)
    return (forward_seconds, backward_seconds), float(loss.detach()), fused_grads


def _cloned(value):
    """A copy of a step input that the compiled step may mark dynamic without touching the caller's."""
    return value.detach().clone().requires_grad_(value.requires_grad) if isinstance(value, torch.Tensor) else value


def assemble(settings, subject: Subject, options: FusionOptions, recorder, expected, gradients,
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


def accounting(counted, outside, recorder, inference: bool = False) -> Dict[str, Dict[str, Any]]:
    """Per fused op: where each independently counted site ended (fused, a recorded miss, run
    outside every compiled graph, or unexplained), with the outside sites' module paths (an
    ``inference`` step: the forward ops only)."""
    return {a.op: {"expected": a.counted, "fused": a.fused, "missed": a.missed, "outside": len(a.outside),
                   "unexplained": a.unexplained, "outside_paths": a.outside}
            for a in account(counted, outside, recorder, inference).values()}


def _compiled_autograd_step(subject: Subject, model, recorder, ids):
    """Forward and backward compiled as one step with compiled autograd on (read when
    ``torch.compile`` wraps the step): (seconds, 0.0, loss), all of it timed as the forward."""
    def train_step(i):
        loss = subject.loss(model, i)
        loss.backward()
        return loss

    with compiled_autograd_enabled():
        compiled = torch.compile(train_step, backend=recorder)
        start = time.perf_counter()
        loss = compiled(ids)
    return time.perf_counter() - start, 0.0, loss


def accounting_errors(report: Dict[str, Any], recorder: Recorder) -> List[str]:
    """Where the report's per-op accounting disagrees with the pass's own results.

    Where the report's per-op accounting disagrees with the pass's own results: a backward
    graph whose sites the pass recorded but that the step counted as never run (every graph
    compiled for the step runs in it), fused-op nodes the pass added to a graph that are not
    the sites it recorded there, or a table row whose fused and unfused do not add up or
    count fewer fused sites than the pass fused."""
    errors = []
    graphs = zip(recorder.results, recorder.runs, *_op_counts(recorder))
    for index, (result, runs, before, after) in enumerate(graphs):
        if (result.sites or result.misses) and runs < 1:
            errors.append(f"backward graph {index}: the pass recorded {len(result.sites)} fused and "
                          f"{len(result.misses)} unfused sites, but the step counted {runs} runs of it")
        # a compiled-autograd graph inlines backwards fused before it; a forward op's nodes are in
        # the partition's forward graph, which the recorder does not keep (the independent count
        # checks those)
        for op in (op for op in LOWERED_OPS if op.name not in FORWARD_OPS):
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


def _op_counts(recorder: Recorder) -> tuple:
    """Per graph through the pass, its backward's op counts before and after the pass (the report
    names ops with their namespace: ``aten.mul.Tensor``)."""
    return ([op_counts(g, qualified=True) for g in recorder.before],
            [op_counts(g, qualified=True) for g in recorder.after])


def _op_count_table(recorder: Recorder) -> Dict[str, Any]:
    before, after = collections.Counter(), collections.Counter()
    before_counts, after_counts = _op_counts(recorder)
    for c in before_counts:
        before.update(c)
    for c in after_counts:
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

