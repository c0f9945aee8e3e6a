"""The GE op builders the converters call, chosen per op from its :class:`~..fused_op.GeIr`:
torchair's generated builder (``auto_generated_ge_raw_ops``) wherever it accepts our
inputs, a builder written from the same IR otherwise.

torchair's generated ``RotaryPositionEmbeddingGrad`` (every torch_npu line from 2.6 to
2.14) declares x optional in its signature and IR but not in its
``auto_convert_to_tensor`` flags, so it rejects ``x=None``: :func:`op_builders` finds
that out by building once with every optional input absent, and only then uses
:func:`ir_builder`'s builder for such calls.

Every builder is called the same way: the IR's required inputs by position, its
optional inputs and its attributes by keyword (how torchair's generated builders
take them: ``RotaryPositionEmbedding(x, cos, sin, *, mode=0, rotate=None)``).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from ...compat import torchair_converter_api
from ..fused_op import GeIr


def ir_builder(ir: GeIr) -> Callable:
    """A GE op builder written from ``ir`` the way torchair generates them."""
    from torchair.ge import attr

    api = torchair_converter_api()
    ge_op = api.ge_op
    definition = api.IrDef(ir.op)
    for item in ir.inputs:
        definition = (definition.optional_input if item.optional else definition.input)(item.name, item.dtypes)
    for item in ir.attrs:
        definition = definition.attr(item.name, getattr(attr, item.kind)(item.default))
    for name, dtypes in ir.outputs:
        definition = definition.output(name, dtypes)

    def build(*required, dependencies=(), node_name=None, **keywords):
        inputs = dict(zip((i.name for i in ir.required()), required))
        inputs.update({i.name: keywords.get(i.name) for i in ir.optional()})
        attrs = {a.name: getattr(attr, a.kind)(keywords.get(a.name, a.default)) for a in ir.attrs}
        return ge_op(op_type=ir.op, inputs={i.name: inputs[i.name] for i in ir.inputs}, attrs=attrs,
                     outputs=[name for name, _ in ir.outputs], dependencies=list(dependencies),
                     node_name=node_name, ir=definition)

    build.__name__ = ir.op
    return build


def _accepts_absent_optionals(builder, ir: GeIr) -> bool:
    """Whether ``builder`` builds ``ir``'s op with every optional input absent (in a scratch graph)."""
    from torchair.ge import DataType

    api = torchair_converter_api()
    try:
        with api.GeGraph(name="npu_fusion_builder_probe"):
            data = [api.ge.Data(index=i, dtype=DataType.DT_FLOAT, shape=[1, 2, 1, 4], placement="CPU")
                    for i in range(len(ir.required()))]
            builder(*data, **{i.name: None for i in ir.optional()})
    except (AssertionError, TypeError, ValueError):
        return False
    return True


@dataclasses.dataclass(frozen=True)
class OpBuilders:
    """The builders of one GE op: ``full`` when every optional input is fed, ``without_optional``
    when one is absent; each ``torchair``'s generated one or ``own`` (:func:`ir_builder`)."""
    full: Callable
    without_optional: Callable
    full_source: str
    without_optional_source: str

    def for_inputs(self, inputs: dict, ir: GeIr) -> Callable:
        return self.without_optional if any(inputs.get(i.name) is None for i in ir.optional()) else self.full


def op_builders(ir: GeIr) -> OpBuilders:
    """torchair's generated builders where they exist and accept the call, :func:`ir_builder`'s otherwise."""
    generated = getattr(torchair_converter_api().ge, ir.op, None)
    own = ir_builder(ir)
    full = generated or own
    if not ir.optional() or (generated is not None and _accepts_absent_optionals(generated, ir)):
        without = full
    else:
        without = own
    return OpBuilders(full, without, "torchair" if full is generated else "own",
                      "torchair" if without is generated else "own")


def as_dtype(tensor, produced, wanted):
    """``tensor`` is a GE output known to be of GE dtype ``produced``; Cast it to
    ``wanted`` (the op's declared output dtype, a GE dtype) where they differ."""
    from torchair.ge import Cast

    if wanted is None or wanted == produced:
        return tensor
    tensor.set_torch_dtype(torchair_converter_api().ge_type_to_torch_type(produced))
    return Cast(tensor, dst_type=wanted)


def tensor_spec(dtype, shape):
    """torchair's ``F32(*shape)``-style supported-shape spec of a torch dtype and shape."""
    return torchair_converter_api().specs[dtype](*shape)


def declare_supported(cases):
    """torchair's ``declare_supported(cases)`` where this torchair has the API, else no decorator."""
    declare = torchair_converter_api().declare_supported
    return declare(cases) if declare is not None else (lambda converter: converter)
