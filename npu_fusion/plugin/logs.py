"""Logging through ``torch._logging``: ``TORCH_LOGS="npu_fusion"`` shows matches
and misses, ``TORCH_LOGS="+npu_fusion"`` adds debug detail (what each site replaced,
its modelled memory traffic). ``torch._logging.set_logs(modules={"npu_fusion": logging.INFO})``
does the same from Python.

Graph dumps (option ``dump_graphs=True`` or ``NPU_FUSION_DUMP_GRAPHS=1``) are written
through the same logger and its handlers whatever its level: asking for them is
enough, ``TORCH_LOGS`` is not needed.
"""
from __future__ import annotations

import logging
import sys

log = logging.getLogger("npu_fusion")

try:  # register the name with torch._logging so TORCH_LOGS accepts it
    from torch._logging._internal import log_registry, register_log

    if "npu_fusion" not in log_registry.log_alias_to_log_qnames:
        register_log("npu_fusion", "npu_fusion")
        import torch._logging

        torch._logging._internal._init_logs()
except Exception:  # an older or newer torch without this hook: plain logging still works
    pass


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
