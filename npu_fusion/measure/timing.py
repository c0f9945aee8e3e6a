"""The pass's share of a compile: its own CPU time over the compiled step's.

The pass times itself (:attr:`~npu_fusion.plugin.pass_manager.FusionResult.cpu_seconds`, this
process's CPU clock over ``fuse_joint``, ``fuse_backward`` or ``fuse_inference``: the backward
and the forward rules); :class:`Clock` times the compiled step around it on the same clock. The
CPU clock is the one to divide: a busy machine stretches wall times by whatever else runs, CPU
times much less. The recording backend's own work around the pass (copying the unfused graph and
partitioning it, :attr:`~.recording.Recorder.recording_cpu`) is no part of a compile and is taken
out of the step.
"""
from __future__ import annotations

import time
from typing import Iterable, Optional


class Clock:
    """Wall and CPU time (``time.process_time``: every thread of this process) of what runs inside it."""

    def __init__(self):
        self.wall = self.cpu = 0.0

    def __enter__(self) -> "Clock":
        self._wall, self._cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc) -> None:
        self.wall += time.perf_counter() - self._wall
        self.cpu += time.process_time() - self._cpu


def pass_share(results: Iterable, step_cpu: float, recording_cpu: float = 0.0) -> dict:
    """The pass's CPU time over ``results``, the step's CPU time and the share of the one in the other.

    The pass's CPU time over ``results`` (its ``FusionResult`` s), the compiled step's CPU time
    without ``recording_cpu``, and the share of the one in the other (None when the step took no
    measurable time), with the nodes of the graphs the pass ran on (``pass_nodes``, before it)."""
    results = list(results)
    pass_cpu = sum(r.cpu_seconds for r in results)
    step = max(step_cpu - recording_cpu, 0.0)
    share: Optional[float] = pass_cpu / step if step > 0 else None
    return {"pass_cpu": pass_cpu, "step_cpu": step, "pass_share": share,
            "pass_nodes": sum(r.nodes_before for r in results)}
