"""Logging through ``torch._logging``: ``TORCH_LOGS="npu_fusion"`` shows matches
and misses, ``TORCH_LOGS="+npu_fusion"`` adds debug detail."""
from __future__ import annotations

import logging

log = logging.getLogger("npu_fusion")

try:  # register the name with torch._logging so TORCH_LOGS accepts it
    from torch._logging._internal import log_registry, register_log

    if "npu_fusion" not in log_registry.log_alias_to_log_qnames:
        register_log("npu_fusion", "npu_fusion")
        import torch._logging

        torch._logging._internal._init_logs()
except Exception:  # an older or newer torch without this hook: plain logging still works
    pass
