"""Logging through ``torch._logging``: ``TORCH_LOGS="npu_fusion"`` shows matches
and misses, ``TORCH_LOGS="+npu_fusion"`` adds debug detail (what each site replaced,
its modelled memory traffic). ``torch._logging.set_logs(modules={"npu_fusion": logging.INFO})``
does the same from Python.

Graph dumps (option ``dump_graphs=True`` or ``NPU_FUSION_DUMP_GRAPHS=1``) are written
through the same logger and its handlers whatever its level: asking for them is
enough, ``TORCH_LOGS`` is not needed.

With ``TORCH_TRACE=<dir>`` the pass also writes structured-trace artifacts, which
``tlparse`` lists on each compile's page beside Dynamo's and AOTAutograd's:
``npu_fusion_backward_before`` and ``npu_fusion_backward_after`` (the backward graph
around the pass) and ``npu_fusion_decisions`` (JSON: each site fused, each site left
unfused with its reason, node counts, an internal error if any).
"""
from __future__ import annotations

import dataclasses
import logging
import sys

from ..compat import register_log_name, trace_artifact

log = logging.getLogger("npu_fusion")
register_log_name("npu_fusion")  # so that TORCH_LOGS accepts it


def graph_text(gm) -> str:
    """A graph module as readable Python with shapes and dtypes, or the FX IR if that fails."""
    try:
        return gm.print_readable(print_output=False, include_stride=False, include_device=False)
    except Exception:
        return str(getattr(gm, "graph", gm))


def dump_graph(title: str, gm) -> None:
    """Write ``gm`` under ``title`` at INFO, even when the ``npu_fusion`` log is not enabled
    for INFO: a dump is asked for explicitly."""
    if log.isEnabledFor(logging.INFO):
        log.info("%s\n%s", title, graph_text(gm), stacklevel=2)
        return
    if log.disabled:
        return
    record = log.makeRecord(log.name, logging.INFO, *_caller(), "%s\n%s", (title, graph_text(gm)), None)
    if _has_handlers(log):
        log.handle(record)
    else:  # no handler anywhere: logging's last resort would drop an INFO record
        sys.stderr.write(f"{title}\n{graph_text(gm)}\n")


def _caller():
    frame = sys._getframe(2)
    return frame.f_code.co_filename, frame.f_lineno


def _has_handlers(logger: logging.Logger) -> bool:
    current = logger
    while current is not None:
        if current.handlers:
            return True
        if not current.propagate:
            return False
        current = current.parent
    return False


#: names of the structured-trace artifacts, as tlparse shows them
TRACE_BEFORE = "npu_fusion_backward_before"
TRACE_AFTER = "npu_fusion_backward_after"
TRACE_DECISIONS = "npu_fusion_decisions"


def trace_graph(name: str, gm) -> None:
    """The graph as readable code in the structured trace (rendered only when tracing is on)."""
    trace_artifact(name, lambda: graph_text(gm))


def trace_decisions(result) -> None:
    """What the pass decided on one graph, as JSON in the structured trace."""
    def payload():
        return {
            "target": result.target,
            "nodes_before": result.nodes_before,
            "nodes_after": result.nodes_after,
            "sites": [dataclasses.asdict(site) for site in result.sites],
            "misses": [dataclasses.asdict(miss) for miss in result.misses],
            "error": result.error,
        }

    trace_artifact(TRACE_DECISIONS, payload, as_json=True)
