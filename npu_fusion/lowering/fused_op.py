"""What one fused op is to the rest of the project: its declaration.

Each op's module under :mod:`.ops` declares one :class:`FusedOp`: its name and
schema, its meta and reference kernels, the unfused program it replaces (plain
torch, which the conformance tests run in the inputs' dtype and in float64), its
input checks and per-target limits, the GE cases it declares supported, how its
NPU eager kernel calls torch_npu (:class:`NpuBinding`) and the GE operator its
converter builds (:class:`GeIr`), and for an op whose sites the independent counter counts,
how a user's model spells one (:class:`CountedSite`). :mod:`.registrar` turns the declaration into
``torch.ops.npu_fusion.<name>`` with its fake kernel, NPU kernel and GE
converter; the contract checks read the same binding and IR. The pattern rule
that emits an op, the pass manager's options and counters, the report and the
benchmarks key on the description, never on a spelled-out name.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Tuple

import torch

from ..compat import op_schema


@dataclasses.dataclass(frozen=True)
class NpuBinding:
    """How the NPU eager kernel calls ``torch.ops.npu.<op>`` (torch_npu's schema, the same in
    every torch_npu line; the contract checks hold it to each wheel's).

    Our arguments are passed by position in ``positional`` order and by keyword as
    ``keywords``; an argument in ``values`` is translated (``{our value: torch_npu's}``).
    A call torch_npu cannot express runs the reference kernel instead: an argument it
    binds that is None (torch_npu's schema has no optional there) or a value ``values``
    does not map."""
    op: str
    positional: Tuple[str, ...]
    keywords: Tuple[Tuple[str, str], ...] = ()
    values: Mapping[str, Mapping[Any, Any]] = dataclasses.field(default_factory=dict)

    def bound_names(self) -> Tuple[str, ...]:
        return self.positional + tuple(ours for _, ours in self.keywords)

    def fallback_reason(self, arguments: Mapping[str, Any]) -> Optional[str]:
        """Why torch_npu's op cannot compute this call (None: it can)."""
        for name in self.bound_names():
            if arguments[name] is None:
                return f"{name} is None, which {self.op}'s schema cannot take"
            if name in self.values and arguments[name] not in self.values[name]:
                return f"{name}={arguments[name]!r} is not one {self.op} runs eagerly"
        return None

    def call_arguments(self, arguments: Mapping[str, Any]) -> Tuple[tuple, dict]:
        """``(args, kwargs)`` of the torch_npu call for our ``arguments``."""
        def value(name):
            table = self.values.get(name)
            return table[arguments[name]] if table is not None else arguments[name]

        return (tuple(value(n) for n in self.positional),
                {theirs: value(ours) for theirs, ours in self.keywords})

    def our_arguments(self, args: tuple, kwargs: Mapping[str, Any], schema_names: Sequence[str]) -> dict:
        """Our arguments from a torch_npu call made as :meth:`call_arguments` makes it, read by
        position as torch_npu reads them (``schema_names``: the wheel's parameter names)."""
        given = dict(zip(schema_names, args))
        given.update(kwargs)
        ours = dict(zip(self.positional, (given[n] for n in schema_names[:len(self.positional)])))
        for theirs, name in self.keywords:
            if theirs in given:
                ours[name] = given[theirs]
        for name, table in self.values.items():
            if name in ours:
                inverse = {v: k for k, v in table.items()}
                ours[name] = inverse.get(ours[name], ours[name])
        return ours


@dataclasses.dataclass(frozen=True)
class GeInput:
    """A GE input, fed from our argument of the same name."""
    name: str
    dtypes: str
    optional: bool = False


@dataclasses.dataclass(frozen=True)
class GeAttr:
    """A GE attribute of IR type ``kind`` (``Int``, ``Float``), set from our argument ``source``."""
    name: str
    kind: str
    default: Any
    source: str


@dataclasses.dataclass(frozen=True)
class GeIr:
    """The ``REG_OP`` of the GE operator an op becomes: inputs in order, attributes, outputs
    (``(name, dtypes)``; our outputs, in order, are the IR's)."""
    op: str
    inputs: Tuple[GeInput, ...]
    attrs: Tuple[GeAttr, ...]
    outputs: Tuple[Tuple[str, str], ...]

    def required(self) -> Tuple[GeInput, ...]:
        return tuple(i for i in self.inputs if not i.optional)

    def optional(self) -> Tuple[GeInput, ...]:
        return tuple(i for i in self.inputs if i.optional)


@dataclasses.dataclass(frozen=True)
class CountedSite:
    """How the independent site counter (:mod:`npu_fusion.measure.sites`) sees one site of the op in a user's model.

    The counter records a site under the op's :attr:`FusedOp.option` (its kind) when a module it
    hooks or a function it wraps returns a tensor that receives a gradient; which modules and
    functions those are comes from the caller (a framework's classes) or, for the report's own
    counter, from the transformers naming convention stated here."""
    #: the convention's modules: classes whose name, lowercased, ends in it (every call is a site)
    class_suffix: str = ""
    #: the convention's functions: module-level functions whose name starts with it (each tensor
    #: they return that receives a gradient is a site)
    function_prefix: str = ""
    #: a site's module path is that of the module whose forward made the call, not the called
    #: module's own (a module of this kind is often one instance shared by every layer)
    path_of_caller: bool = False
    #: gated products: every module whose class name matches this regular expression, anywhere
    #: in the model, is a gate activation; each call of it is a site where it computes SwiGLU's
    #: value, checked in the eager run (its input the first half of a tensor along the last axis,
    #: its output multiplied by the second half: :class:`~npu_fusion.measure.sites.GatedProducts`),
    #: at the path of the module that holds it (a dense MLP calls it once, MoE experts once per expert)
    gate_activation: str = ""
    #: the modules that usually hold such a site, by their ``forward`` source (a regular
    #: expression): where a sweep looks for models with a site (the rule's site probe), and how it
    #: names one; no part of counting, which reads values
    gated_source: str = ""


@dataclasses.dataclass(frozen=True)
class FusedOp:
    #: ``torch.ops.npu_fusion.<name>``; also the key of counters, reports and site counts
    name: str
    #: the CANN operator its GE converter builds
    ge_op: str
    #: the computation it performs, as users name it (reports)
    label: str
    #: the :class:`~npu_fusion.plugin.options.FusionOptions` field that turns its fusion on,
    #: and the key of the independent site counters (one site per forward call)
    option: str
    #: the section of docs/fused-ops.md that states its semantics (a path with its anchor)
    spec_section: str
    #: its outputs, in order
    outputs: Tuple[str, ...]
    #: its input checks, ``checks(name, *inputs)``
    checks: Callable
    #: its ``torch.library`` schema (the part after the name)
    schema: str = ""
    #: the reference kernel (any device); the meta (fake) kernel
    reference: Optional[Callable] = None
    meta: Optional[Callable] = None
    #: the program the op replaces, as plain torch ops, without code shared with the kernel
    unfused: Optional[Callable] = None
    #: ``target_problem(target, *inputs)``: why the chip cannot run these inputs, or None
    target_problem: Optional[Callable] = None
    #: the cases it declares supported (GE ``declare_supported``, the conformance tests):
    #: ``cases()`` yields argument tuples of real CPU tensors
    cases: Optional[Callable[[], Sequence[tuple]]] = None
    #: the NPU eager kernel's call into torch_npu, and the GE operator's IR
    npu: Optional[NpuBinding] = None
    ge: Optional[GeIr] = None
    #: a converter written by hand, ``convert(builders, arguments, meta_outputs)``, where the
    #: IR cannot say what the op does (else the registrar's generic one)
    ge_converter: Optional[Callable] = None
    #: the label of its sites' boxes in the HTML report's map and of its columns in the coverage
    #: tables, a word or two; its name where empty
    short_label: str = ""
    #: how the independent site counter recognises its sites in a user's model: an op whose sites
    #: are counted on their own (a backward op; a forward op's sites are its backward's)
    counted_site: Optional[CountedSite] = None
    #: the arguments min-cut may recompute rather than save, each read in the backward through a
    #: hand-off (``plugin.joint``): values cheap to recompute from small inputs, never an activation
    recomputable: Tuple[str, ...] = ()

    def check_inputs(self, *inputs) -> None:
        """Raise ``FusedOpInputError`` naming the constraint the inputs break, if any."""
        self.checks(self.name, *inputs)

    @property
    def overload(self):
        """The op's ``.default`` overload, what a rewritten graph calls."""
        return getattr(torch.ops.npu_fusion, self.name).default

    def argument_names(self) -> Tuple[str, ...]:
        return tuple(a.name for a in op_schema(self.overload).arguments)

    def bind(self, args: tuple, kwargs: Mapping[str, Any]) -> Dict[str, Any]:
        """Our arguments by name, defaults filled in from the schema."""
        bound = {}
        for index, argument in enumerate(op_schema(self.overload).arguments):
            if index < len(args):
                bound[argument.name] = args[index]
            elif argument.name in kwargs:
                bound[argument.name] = kwargs[argument.name]
            else:
                bound[argument.name] = argument.default_value
        return bound
