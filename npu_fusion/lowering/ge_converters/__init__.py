"""torchair GE converters: how the fused ops reach the Ascend graph engine.

With torchair's ``max-autotune`` mode every FX node becomes GE operators through
a converter registered with ``torchair.register_fx_node_ge_converter``. As in
torchair's own ``ge_converter/custom/<op>.py``, each fused op has one module
here, its converter at module level with its supported cases declared beside it:

* :mod:`.rotary_position_embedding_grad`: GE ``RotaryPositionEmbeddingGrad(dy,
  cos, sin, x?, mode=mode)``; x is the IR's optional input, left unfed when the
  op's x is None (dcos/dsin are then ``[0]``-shaped, as the meta kernel says).
* :mod:`.rms_norm_grad`: GE ``RmsNormGrad(dy, x, rstd, gamma)``, rstd before gamma.

:mod:`.builders` chooses the GE op builders: torchair's generated ones
(``auto_generated_ge_raw_ops``) wherever they accept our inputs, builders
written from the same IR otherwise. The test suite compares the nodes these
converters build with the IR torchair generated in every torch_npu release line
(``scripts/check_npu_contracts.py``).

The converter modules import torchair, so they are imported only by
:func:`register`, called when :mod:`npu_fusion.lowering` is imported. It returns
False, and changes nothing, when torchair cannot be imported (a machine without
torch_npu/CANN); calling it again after torchair became importable registers then.
"""
from __future__ import annotations

import importlib
import importlib.util
import logging
import sys
import types

from ...fallback import warn_fallback

log = logging.getLogger(__name__)


def converter_modules():
    """The converter module of each fused op, relative to this package: named after the op."""
    from .. import FUSED_OPS  # defined before lowering imports this package

    return tuple(f".{op.name}" for op in FUSED_OPS)

_REGISTERED = False


def _torchair_available() -> bool:
    """Whether a real torchair package is importable (a bare ``torchair/``
    directory on sys.path, a namespace package, does not count)."""
    module = sys.modules.get("torchair")
    if module is not None:
        if isinstance(module, types.ModuleType):
            return getattr(module, "__file__", None) is not None
        return True  # torch_npu's lazy proxy: importing from it loads torchair
    try:
        spec = importlib.util.find_spec("torchair")
    except (ImportError, ValueError):
        return False
    return spec is not None and spec.origin not in (None, "namespace")


def register() -> bool:
    """Register the GE converters with torchair; False when torchair is unavailable."""
    global _REGISTERED
    if _REGISTERED:
        return True
    if not _torchair_available():
        return False
    try:
        for name in converter_modules():  # each registers its converter when imported
            importlib.import_module(name, __name__)
    except Exception as error:  # torchair present but unusable (CANN missing, API drift)
        warn_fallback("ge_converters", f"the torchair GE converters of the fused ops were not registered "
                                       f"({type(error).__name__}: {error}): a torchair graph holding a fused op "
                                       f"will not compile. Fix torchair/CANN, or compile without the pass")
        for name in converter_modules():  # a later call imports (and registers) them again
            sys.modules.pop(__name__ + name, None)
        return False
    _REGISTERED = True
    return True


def registered() -> bool:
    return _REGISTERED


__all__ = ["converter_modules", "register", "registered"]
