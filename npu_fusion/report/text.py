"""The report as text, one table per section.

The report as text: one table per section (fused ops, where the counted sites ended, what was
left unfused and why, backward ops before and after, modelled traffic, saved activations, the
gradient check), as ``npu-fusion report`` and ``str(npu_fusion.explain(...))`` print it."""
from __future__ import annotations

import json
import math
import sys
from typing import Any, Dict, List

from ..measure.grads import MODEL_FACTOR as FP64_FACTOR


def finite(value):
    """Strict JSON: non-finite floats (a NaN gradient) become strings."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def table(header: List[str], rows: List[List[Any]]) -> str:
    cells = [header] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in cells]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines) + "\n"


def pass_share_line(seconds: Dict[str, Any]) -> str:
    """The pass's share of the compile, in words: its CPU time over the compiled step's."""
    share = seconds.get("pass_share")
    if share is None:
        return "the pass's share of the compile: not measured (the compiled step took no CPU time)"
    nodes = seconds.get("pass_nodes")
    per_node = f", {seconds['pass_cpu'] * 1e6 / nodes:.0f} us per node of its {nodes} graph nodes" if nodes else ""
    return (f"the pass's share of the compile: {100 * share:.1f}% of the CPU time (the pass "
            f"{seconds['pass_cpu'] * 1000:.1f} ms{per_node}, of the compiled step's {seconds['step_cpu']:.2f} s, "
            "the report's own recording left out)")


def format_accounting(report: Dict[str, Any]) -> str:
    """Where the independently counted sites ended; only where the counter could tell which ran
    outside every compiled graph (``--framework``)."""
    if "accounting" not in report:
        return ""
    rows = [[op, a["expected"], a["fused"], a["missed"], a["outside"], a["unexplained"]]
            for op, a in report["accounting"].items()]
    out = ["\n## Where the counted sites ended\n\n",
           table(["op", "counted", "fused", "recorded miss", "outside compiled graphs", "unexplained"], rows)]
    out += [f"{op}: ran outside every compiled graph: {path}\n"
            for op, a in report["accounting"].items() for path in a["outside_paths"]]
    return "".join(out)


def format_text(report: Dict[str, Any]) -> str:
    return "".join([_format_header(report), format_ops(report), format_accounting(report),
                    _format_misses(report), _format_op_counts(report), format_traffic(report),
                    format_saved(report), _format_gradients(report)])


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
    step = "forward + backward" if s.get("train", True) else "forward (inference step, no_grad)"
    out.append(f"first {step} (compile and run) {total:.2f} s; the pass itself "
               f"{sec['pass'] * 1000:.1f} ms ({100 * sec['pass'] / total if total else 0:.1f}%)\n"
               f"{pass_share_line(sec)}\n")
    out += [f"PASS ERROR (graph left unchanged): {err}\n" for err in report["pass_errors"]]
    out += [f"ACCOUNTING ERROR (this report contradicts the pass's results): {err}\n"
            for err in report.get("accounting_errors", ())]
    return "".join(out)


def format_ops(report: Dict[str, Any]) -> str:
    out = ["\n## Fused ops\n\n"]
    rows = []
    for op, r in report["ops"].items():
        modes = ", ".join(f"{m}: {n}" if m != "-" else str(n) for m, n in r["modes"].items()) or "-"
        rows.append([op, r["expected"] if r["expected"] is not None else "?", r["found"], r["fused"],
                     r["unfused"], modes])
    out.append(table(["op", "expected", "found", "fused", "unfused", "modes fused"], rows))
    for op, r in report["ops"].items():
        if r["expected"] == 0 and not r["fused"]:
            out.append(f"{op}: no sites in this model\n")
        elif r["expected"] is not None and r["fused"] == r["expected"]:
            out.append(f"{op}: all {r['expected']} sites fused\n")
        elif r["expected"] is not None:
            out.append(f"{op}: {r['fused']} of {r['expected']} sites fused\n")
    return "".join(out)


def _format_misses(report: Dict[str, Any]) -> str:
    if not report["misses"]:
        return "\n## Left unfused\n\nnothing: no near miss was recorded\n"
    return "\n## Left unfused\n\n" + table(["op", "node", "reason"],
                                              [[m["op"], m["node"], m["reason"]] for m in report["misses"]])


def _format_op_counts(report: Dict[str, Any]) -> str:
    counts = report["op_counts"]
    names = sorted(set(counts["before"]) | set(counts["after"]))
    rows = [[n, counts["before"].get(n, 0), counts["after"].get(n, 0)] for n in names
            if counts["before"].get(n, 0) != counts["after"].get(n, 0)]
    rows.sort(key=lambda r: (-(r[1] - r[2]), r[0]))
    rows.append(["all nodes (placeholders and output too)", counts["nodes_before"], counts["nodes_after"]])
    graph = "Backward graph" if report["settings"].get("train", True) else "Inference graph"
    return (f"\n## {graph} ops, before and after the pass (changed ones)\n\n"
            + table(["op", "before", "after"], rows))


def format_traffic(report: Dict[str, Any]) -> str:
    rows = []
    for op, b in report["memory_traffic"].items():
        ratio = b["bytes_after"] / b["bytes_before"] if b["bytes_before"] else float("nan")
        rows.append([op, b["sites"], _bytes(b["bytes_before"]), _bytes(b["bytes_after"]),
                     _bytes(b["bytes_minimum"]), f"{ratio:.2f}"])
    return ("\n## Modelled memory traffic of the replaced subgraphs\n\n"
            "(each non-view node reads its inputs and writes its output; minimum: the fused op "
            "reads each input once and writes each output once)\n\n"
            + (table(["op", "sites", "before", "after", "fused-op minimum", "after / before"], rows)
               if rows else "no site was fused\n"))


def format_saved(report: Dict[str, Any]) -> str:
    saved = report.get("saved_activations")
    if not report["settings"].get("train", True):
        return ""  # an inference step saves nothing for a backward
    if not saved or not saved["graphs"]:
        return "\n## Saved for the backward\n\nunchanged: no site was fused\n"
    return (f"\n## Saved for the backward\n\n{_bytes(saved['bytes_before'])} in {saved['tensors_before']} tensors "
            f"without the pass, {_bytes(saved['bytes_after'])} in {saved['tensors_after']} with it (the partitioner "
            f"chose them for the fused backward), in the graphs where a site fused\n")


def _format_gradients(report: Dict[str, Any]) -> str:
    """The float64 check of the step: its parameters' gradients, or an inference step's outputs."""
    g = report["gradients"]
    train = report["settings"].get("train", True)
    title, counted, checked = (("Parameter gradients", "params", "gradient") if train else
                               ("Outputs (inference step)", "outputs", "output"))
    out = [f"\n## {title}: compiled with the pass vs eager, both vs float64\n\n"]
    rows = [[dt, r["params"], f"{r['max_abs_diff_vs_eager']:.3g}", f"{r['max_err_compiled_vs_fp64']:.3g}",
             f"{r['max_err_eager_vs_fp64']:.3g}", "yes" if r["as_close_to_fp64_as_eager"] else "NO"]
            for dt, r in g["per_dtype"].items()]
    out.append(table(["dtype", counted, "max abs diff compiled vs eager", "max err compiled vs fp64",
                      "max err eager vs fp64", f"compiled <= {FP64_FACTOR:g} x eager + floor"], rows))
    if train:
        out.append(f"loss: compiled {g['loss']['compiled']:.6g}, eager {g['loss']['eager']:.6g}\n")
    out += [f"{checked} check failed for {f['param']}: {f}\n" for f in g["failures"]]
    if train and g["params_without_grad_in_one_run"]:
        out.append(f"parameters with a gradient in only one run: {g['params_without_grad_in_one_run']}\n")
    out.append(f"\n{checked} check: {'PASSED' if g['passed'] else 'FAILED'}\n")
    return "".join(out)


def write_report(report: Dict[str, Any], as_json: bool, text=format_text) -> None:
    """``report`` on stdout: one JSON object, or ``text(report)``."""
    if as_json:
        json.dump(finite(report), sys.stdout, indent=2, allow_nan=False)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(text(report))
    sys.stdout.flush()
