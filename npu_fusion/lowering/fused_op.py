"""What one fused op is to the rest of the project: its description.

Each op's lowering module (:mod:`.rope`, :mod:`.rms_norm`) defines one
:class:`FusedOp`; the pattern rule that emits it, the pass manager's options and
counters, the report, the expected-site counts of the bundled models and the
benchmarks all key on it, never on a spelled-out name.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Tuple

import torch


@dataclasses.dataclass(frozen=True)
class FusedOp:
    #: ``torch.ops.npu_fusion.<name>``; also the key of counters, reports and site counts
    name: str
    #: the CANN operator its GE converter builds
    ge_op: str
    #: the forward whose backward it computes, as users name it (reports)
    label: str
    #: the :class:`~npu_fusion.plugin.options.FusionOptions` field that turns its fusion on,
    #: and the key of the independent site counters (one site per forward call)
    option: str
    #: where SPEC states its semantics and constraints
    spec_section: str
    #: its outputs, in order
    outputs: Tuple[str, ...]
    #: its input checks, ``checks(name, *inputs)`` (:mod:`.constraints`)
    checks: Callable

    def check_inputs(self, *inputs) -> None:
        """Raise ``FusedOpInputError`` naming the constraint the inputs break, if any."""
        self.checks(self.name, *inputs)

    @property
    def overload(self):
        """The op's ``.default`` overload, what a rewritten graph calls."""
        return getattr(torch.ops.npu_fusion, self.name).default
