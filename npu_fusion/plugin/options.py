"""The npu-fusion pass's options: one switch per fusion rule, plus the target and safety switches.

Given as ``torch.compile(..., backend="npu_fusion", options={...})``, to
``npu_fusion.install(config, **options)``, ``npu_fusion.install_inductor(**options)`` or to
:func:`fuse_backward`. The README's options table lists them (a test holds it to these fields).

The switches derive from :data:`npu_fusion.patterns.RULES`: each rule's
:attr:`~npu_fusion.patterns.FusionRule.option` (its fused op's option unless the rule names
another: ``rope`` fuses RoPE backward subgraphs into ``npu_fusion.rotary_position_embedding_grad``,
``rms_norm`` RMSNorm backward subgraphs into ``npu_fusion.rms_norm_grad``, ``rms_norm_forward``
forward RMSNorm into ``npu_fusion.rms_norm``, ``rope_forward`` forward RoPE into
``npu_fusion.rotary_position_embedding``, ``swiglu`` and ``swiglu_forward`` SwiGLU's backward and
forward into ``npu_fusion.swiglu_grad`` and ``npu_fusion.swiglu``), on by default unless the rule
says otherwise (all six are on); a rule's older option names (:attr:`~npu_fusion.patterns.FusionRule.option_aliases`) are
still taken.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Dict, Mapping, Optional, Tuple

from ..lowering.checks import TARGETS
from ..patterns import RULES


@dataclasses.dataclass(frozen=True)
class PassOptions:
    """The options every run has; :class:`FusionOptions` adds one switch per rule."""
    #: ``"auto"`` (detect on an NPU host, ``"generic"`` elsewhere, ``"common"`` with a warning
    #: when the chip cannot be told) or one of :data:`TARGETS`.
    target: str = "auto"
    #: raise on an internal error of the pass instead of leaving the graph as it was.
    strict: bool = False
    #: log the backward graph before and after the pass (also ``NPU_FUSION_DUMP_GRAPHS=1``).
    dump_graphs: bool = False
    #: backend only: AOTAutograd partitioner, ``"default"`` or ``"min_cut"``.
    partitioner: str = "default"
    #: backend only: decomposition table, ``"none"`` (AOTAutograd's default) or ``"core"`` (core ATen).
    decompositions: str = "none"

    @classmethod
    def from_mapping(cls, options: Optional[Mapping[str, Any]] = None) -> "FusionOptions":
        options = {ALIASES.get(name, name): value for name, value in dict(options or {}).items()}
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - names)
        if unknown:
            raise ValueError(f"unknown npu_fusion option(s) {unknown}; known: {sorted(names | set(ALIASES))}")
        made = cls(**options)
        if made.target not in TARGETS + ("auto",):
            raise ValueError(f"npu_fusion option target must be 'auto' or one of {TARGETS}, got {made.target!r}")
        if made.partitioner not in ("default", "min_cut"):
            raise ValueError(f"npu_fusion option partitioner must be 'default' or 'min_cut', got {made.partitioner!r}")
        if made.decompositions not in ("none", "core"):
            raise ValueError(f"npu_fusion option decompositions must be 'none' or 'core', got {made.decompositions!r}")
        if not made.dump_graphs and os.environ.get("NPU_FUSION_DUMP_GRAPHS", "") not in ("", "0"):
            made = dataclasses.replace(made, dump_graphs=True)
        return made

    def resolved_target(self) -> str:
        if self.target != "auto":
            return self.target
        from .targets import detect_target
        return detect_target()

    def enables(self, rule) -> bool:
        """Whether ``rule`` (one of :data:`~npu_fusion.patterns.RULES`) runs."""
        return bool(getattr(self, rule.option))


#: a rule's older option names -> its option
ALIASES: Dict[str, str] = {alias: rule.option for rule in RULES for alias in rule.option_aliases}

FusionOptions = dataclasses.make_dataclass(
    "FusionOptions", [(rule.option, bool, dataclasses.field(default=rule.enabled_by_default)) for rule in RULES],
    bases=(PassOptions,), frozen=True, namespace={"__module__": __name__, "__doc__": (
        "The pass's options: :class:`PassOptions` and, per rule of :data:`~npu_fusion.patterns.RULES`, "
        "its switch (a bool, on unless the rule says otherwise).")})


def rule_options() -> Tuple[str, ...]:
    """Every rule's switch, in rule order (all off: the compile without the pass's rewrites)."""
    return tuple(rule.option for rule in RULES)


def forward_options() -> Tuple[str, ...]:
    """The switches of the rules that fuse the forward (stage ``joint`` or ``forward``), in rule order."""
    return tuple(rule.option for rule in RULES if rule.stage != "backward")


def forward_ops() -> Tuple[str, ...]:
    """The fused ops the forward rules emit, in rule order."""
    return tuple(rule.op.name for rule in RULES if rule.stage != "backward")
