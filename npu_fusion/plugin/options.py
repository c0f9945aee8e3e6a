"""Options of the npu-fusion pass, one per fusion plus the target and safety switches.

Given as ``torch.compile(..., backend="npu_fusion", options={...})``, to
``npu_fusion.install(config, **options)`` or to :func:`fuse_backward`.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping, Optional

from ..lowering.constraints import TARGETS


@dataclasses.dataclass(frozen=True)
class FusionOptions:
    #: ``"auto"`` (detect on an NPU host, ``"generic"`` elsewhere, ``"common"`` with a warning
    #: when the chip cannot be told) or one of :data:`TARGETS`.
    target: str = "auto"
    #: fuse RoPE backward subgraphs into ``npu_fusion.rotary_position_embedding_grad``.
    rope: bool = True
    #: fuse RMSNorm backward subgraphs into ``npu_fusion.rms_norm_grad``.
    rms_norm: bool = True
    #: fuse forward RMSNorm on the joint graph into ``npu_fusion.rms_norm``, paired with its fused
    #: backward (whose rstd it then produces); off by default until the sweeps show it complete.
    rms_norm_forward: bool = False
    #: fuse forward RoPE into ``npu_fusion.rotary_position_embedding``: no rule yet (the op exists),
    #: so turning it on changes nothing; off by default.
    rope_forward: bool = False
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
        options = dict(options or {})
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - names)
        if unknown:
            raise ValueError(f"unknown npu_fusion option(s) {unknown}; known: {sorted(names)}")
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
