"""torchair GE converters: how the fused ops reach the Ascend graph engine.

With torchair's ``max-autotune`` mode every FX node becomes GE operators through a
converter registered with ``torchair.register_fx_node_ge_converter``. Each fused op
declares the GE operator it becomes (:class:`~..fused_op.GeIr`: inputs, each fed from
our argument of the same name, attributes set from our arguments, outputs in our
order); :func:`converter_for` makes its converter from that, or wraps the op's hand
converter where the IR cannot say what the op does (RoPE's backward without x). The
converter casts a float32-only IR input to float32 and a float32-only IR output to the
op's declared dtype where they differ (never for inputs that pass the op's checks).
Each op's declared cases (``FusedOp.cases``) become its ``declare_supported`` cases.

:mod:`.builders` chooses the GE op builders. The test suite compares the nodes these
converters build with the IR torchair generated in every torch_npu release line
(``scripts/check_npu_contracts.py``).

:func:`register` imports torchair, so it runs only when torchair is importable (called
when :mod:`npu_fusion.lowering` is imported, and again by the backends). It returns
False, and changes nothing, when torchair cannot be imported (a machine without
torch_npu/CANN); calling it again after torchair became importable registers then.
"""
from __future__ import annotations

import importlib.util
import logging
import sys
import types
from typing import Dict

import torch

from ...fallback import warn_fallback
from ..fused_op import FusedOp

log = logging.getLogger(__name__)

_REGISTERED = False
#: the builders each registered converter calls, by op name
BUILDERS: Dict[str, object] = {}


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


def _feed(op: FusedOp, arguments: dict):
    """The IR's inputs from our arguments (a float32-only input cast to float32) and its attributes."""
    from torchair.ge import Cast, DataType

    inputs = {}
    for item in op.ge.inputs:
        value = arguments.get(item.name)
        if value is not None and item.dtypes == "DT_FLOAT" and value.dtype != DataType.DT_FLOAT:
            value = Cast(value, dst_type=DataType.DT_FLOAT)
        inputs[item.name] = value
    kinds = {"Int": int, "Float": float}
    attrs = {a.name: kinds.get(a.kind, lambda v: v)(arguments[a.source]) for a in op.ge.attrs}
    return inputs, attrs


def _outputs_as_declared(op: FusedOp, outputs, meta_outputs):
    from torchair.ge import DataType

    from .builders import as_dtype

    outputs = tuple(outputs) if isinstance(outputs, (tuple, list)) else (outputs,)
    if meta_outputs is not None:
        metas = meta_outputs if isinstance(meta_outputs, (tuple, list)) else (meta_outputs,)
        outputs = tuple(as_dtype(out, DataType.DT_FLOAT, meta.dtype) if dtypes == "DT_FLOAT" else out
                        for out, meta, (_, dtypes) in zip(outputs, metas, op.ge.outputs))
    return outputs if len(outputs) > 1 else outputs[0]


def converter_for(op: FusedOp, builders):
    """``op``'s converter: build its GE op from the IR; the op's hand converter where it has one."""
    def build(arguments):
        inputs, attrs = _feed(op, arguments)
        builder = builders.for_inputs(inputs, op.ge)
        required = [inputs[i.name] for i in op.ge.required()]
        optional = {i.name: inputs[i.name] for i in op.ge.optional()}
        return builder(*required, **optional, **attrs)

    def convert(*args, meta_outputs=None, **kwargs):
        arguments = op.bind(args, kwargs)
        if op.ge_converter is not None:
            outputs = op.ge_converter(build, arguments, meta_outputs)
        else:
            outputs = build(arguments)
        return _outputs_as_declared(op, outputs, meta_outputs)

    convert.__name__ = f"convert_{op.name}"
    convert.__doc__ = f"NB: npu_fusion::{op.name}{op.schema}"
    return convert


def supported(op: FusedOp) -> list:
    """``op``'s declared cases as torchair ``Support`` s: tensors as specs by position, the rest by name."""
    from ...compat import torchair_converter_api
    from .builders import tensor_spec

    Support = torchair_converter_api().Support

    names = op.argument_names()
    declared = []
    for case in op.cases():
        tensors = [tensor_spec(a.dtype, tuple(a.shape)) if isinstance(a, torch.Tensor) else None
                   for a, n in zip(case, names) if isinstance(a, torch.Tensor) or a is None]
        others = {n: a for a, n in zip(case, names) if a is not None and not isinstance(a, torch.Tensor)}
        declared.append(Support(*tensors, **others))
    return declared


def _register_all(ops) -> None:
    from torchair import register_fx_node_ge_converter

    from .builders import declare_supported, op_builders

    for op in ops:
        BUILDERS[op.name] = op_builders(op.ge)
        converter = register_fx_node_ge_converter(op.overload)(converter_for(op, BUILDERS[op.name]))
        declare_supported(supported(op))(converter)


def register(ops=None) -> bool:
    """Register the GE converters of ``ops`` (every fused op) with torchair; False when torchair
    is unavailable or unusable (then it warns)."""
    global _REGISTERED
    if _REGISTERED:
        return True
    if not _torchair_available():
        return False
    if ops is None:
        from ..ops import FUSED_OPS as ops
    try:
        _register_all(ops)
    except Exception as error:  # torchair present but unusable (CANN missing, API drift)
        warn_fallback("ge_converters", f"the torchair GE converters of the fused ops were not registered "
                                       f"({type(error).__name__}: {error}): a torchair graph holding a fused op "
                                       f"will not compile. Fix torchair/CANN, or compile without the pass")
        BUILDERS.clear()
        return False
    _REGISTERED = True
    return True


def registered() -> bool:
    return _REGISTERED


__all__ = ["BUILDERS", "converter_for", "register", "registered", "supported"]
