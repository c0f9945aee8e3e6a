"""The NPU-side contracts of npu-fusion, checked on the CPU against one torch_npu wheel.

What only runs on an Ascend host is checked, for every fused op of
:data:`npu_fusion.lowering.FUSED_OPS` and every case it declares, against what the
torch_npu wheel of a release line says (read by :func:`harness.contract_sources`). Both
checks read the op's own declaration, never a table of their own:

* eager kernels (:func:`check_eager_kernels`): each op's NPU kernel
  (:func:`npu_fusion.lowering.npu.kernel_for`, from its ``NpuBinding``) runs on the CPU
  against a stand-in ``torch.ops.npu`` op defined from the wheel's own schema string (the
  one compiled into ``libtorch_npu.so`` and the codegen yaml's), which reads its
  arguments by position as torch_npu does, maps them back to ours by the binding,
  refuses the values the wheel's eager kernel refuses ("The rotary_mode of ... should be
  half or interleave") and computes with the op's reference kernel. A call that does
  not bind to the schema, or binds a tensor to the wrong role, fails; results must
  equal the reference kernel's.
* GE converters (:func:`check_ge_converters`): the node each registered converter
  builds (input names, order and sources, optional inputs left unfed, attribute names,
  types and values, output names, the declared dtypes) is compared with the
  ``REG_OP`` definition torchair generated in that wheel.

Each check returns a list of problems (empty: the contract holds) and what it saw.
Run as a module for one line (``python -m npu_fusion_testing.torchair.npu_contracts LINE``,
``NPU_FUSION_TORCH_NPU_VERSION``), it prints that line's results as JSON;
``scripts/check_npu_contracts.py`` runs it for every line.
"""
from __future__ import annotations

import collections
import contextlib
import json
import math
import re
import sys
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import torch

from npu_fusion.lowering import FUSED_OPS, npu
from . import harness

DTYPE_NAMES = {torch.float32: "DT_FLOAT", torch.float16: "DT_FLOAT16", torch.bfloat16: "DT_BF16"}
#: GE spells bfloat16 two ways in generated IR.
_DTYPE_ALIASES = {"DT_BFLOAT16": "DT_BF16"}
#: the GE attribute value field of each IR attribute type.
ATTR_FIELD = {"Int": "i", "Float": "f", "Bool": "b", "String": "s", "Str": "s", "ListInt": "list", "Type": "type"}


def describe(op, case) -> str:
    """A case for messages: each argument as dtype and shape, or its value."""
    shown = [f"{n}={a.dtype}{list(a.shape)}".replace("torch.", "") if isinstance(a, torch.Tensor) else f"{n}={a}"
             for n, a in zip(op.argument_names(), case)]
    return f"{op.name}({', '.join(shown)})"


# -- eager kernels ------------------------------------------------------------

def eager_values(sources, op) -> Dict[str, List[str]]:
    """``{our argument: [torch_npu values]}`` the wheel's eager kernel of ``op`` accepts, for each
    argument the binding translates; raises when the wheel does not say."""
    accepted = {}
    worded = sources.get("eager_values", {}).get(op.npu.op, {})
    for theirs, ours in op.npu.keywords:
        if ours in op.npu.values:
            if theirs not in worded:
                raise ValueError(f"{sources['wheel']}: no '{theirs}' message of {op.npu.op} found")
            accepted[ours] = [w.strip() for w in re.split(r",|\bor\b", worded[theirs]) if w.strip()]
    return accepted


def eager_rotary_modes(sources) -> List[str]:
    """The ``rotary_mode`` values the wheel's eager ``npu_rotary_mul_backward`` accepts."""
    words = sources.get("eager_rotary_modes")
    if not words:
        raise ValueError(f"{sources['wheel']}: no rotary_mode message of npu_rotary_mul_backward found")
    return [w.strip() for w in re.split(r",|\bor\b", words) if w.strip()]


@dataclass
class EagerCalls:
    """What reached the stand-in ops: calls per torch_npu op, translated values used per op."""
    calls: collections.Counter = field(default_factory=collections.Counter)
    values: Dict[str, set] = field(default_factory=lambda: collections.defaultdict(set))


def _stand_in(op, accepted: Dict[str, List[str]], seen: EagerCalls) -> Callable:
    """``torch.ops.npu.<op.npu.op>`` on the CPU: refuses what the wheel refuses, computes with
    ``op``'s reference kernel from the arguments read by position."""
    binding = op.npu
    keyword_of = {ours: theirs for theirs, ours in binding.keywords}

    def implementation(*args, **kwargs):
        schema = getattr(torch.ops.npu, binding.op).default._schema
        names = [a.name for a in schema.arguments]
        given = {a.name: a.default_value for a in schema.arguments if a.has_default_value()}
        given.update(zip(names, args), **kwargs)
        for ours, values in accepted.items():
            if given[keyword_of[ours]] not in values:
                raise RuntimeError(f"The {keyword_of[ours]} of {binding.op} should be {' or '.join(values)}, "
                                   f"but got {given[keyword_of[ours]]}")
            seen.values[binding.op].add(given[keyword_of[ours]])
        seen.calls[binding.op] += 1
        ours = binding.our_arguments(tuple(given[n] for n in names), {}, names)
        return op.reference(*(ours.get(n) for n in op.argument_names()))

    return implementation


@contextlib.contextmanager
def stand_in_npu_ops(schemas: Dict[str, str], sources, seen: EagerCalls, ops=FUSED_OPS):
    """``torch.ops.npu.<op>`` defined from ``schemas`` for the CPU (see :func:`_stand_in`)."""
    for op in ops:
        if hasattr(torch.ops.npu, op.npu.op):
            raise RuntimeError(f"torch.ops.npu.{op.npu.op} already exists (torch_npu imported?): "
                               f"cannot stand in for it")
    library = torch.library.Library("npu", "FRAGMENT")
    try:
        for op in ops:
            library.define(schemas[op.npu.op])
            library.impl(op.npu.op, _stand_in(op, eager_values(sources, op), seen), "CPU")
        yield
    finally:
        library._destroy()


def _compare(name: str, got, want, problems: List[str]) -> None:
    try:
        got = got if isinstance(got, (tuple, list)) else (got,)
        want = want if isinstance(want, (tuple, list)) else (want,)
        assert len(got) == len(want), f"{len(got)} outputs, want {len(want)}"
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=0, atol=0)
    except Exception as error:  # noqa: BLE001  (any mismatch is a broken contract)
        problems.append(f"{name}: result differs from the reference kernel: {str(error).splitlines()[0]}")


def _run_kernels(kernels: Dict[str, Callable], problems: List[str], ops=FUSED_OPS) -> None:
    for op in ops:
        for case in op.cases():
            name = describe(op, case)
            try:
                _compare(name, kernels[op.name](*case), op.reference(*case), problems)
            except Exception as error:  # noqa: BLE001
                problems.append(f"{name}: {type(error).__name__}: {str(error).splitlines()[0]}")


def check_value_tables(sources, ops=FUSED_OPS, tables: Optional[Dict[str, dict]] = None) -> List[str]:
    """Each value a binding sends (``tables``: ``{op name: {argument: {ours: theirs}}}``, default the
    bindings' own) is one the eager kernel accepts, for the GE value torchair's own converter maps it to."""
    problems = []
    for op in ops:
        accepted = eager_values(sources, op)
        torchair_map = {name: int(number) for name, number in sources.get("torchair_value_maps", {}).get(op.npu.op, [])}
        for argument, table in ((tables or {}).get(op.name) or op.npu.values).items():
            for ours, theirs in table.items():
                if theirs not in accepted.get(argument, []):
                    problems.append(f"{op.npu.op} {argument} {theirs!r} ({argument} {ours}): torch_npu's eager kernel "
                                    f"accepts only {' or '.join(accepted.get(argument, []))}")
                if torchair_map and torchair_map.get(theirs) != ours:
                    problems.append(f"{op.npu.op} {argument} {theirs!r} is GE {argument} {torchair_map.get(theirs)} in "
                                    f"torchair's converter, we use it for {ours}")
    return problems


def _unused(seen: EagerCalls, ops, tables) -> List[str]:
    """Translated values, and ops, that never reached torch_npu (a kernel that falls back where
    torch_npu could run it binds nothing)."""
    unused = []
    for op in ops:
        table = (tables or {}).get(op.name) or op.npu.values
        unused += sorted(f"{op.npu.op} {v}" for t in table.values() for v in t.values()
                         if v not in seen.values[op.npu.op])
        unused += [] if seen.calls[op.npu.op] else [op.npu.op]
    return unused


def check_eager_kernels(sources, kernels: Optional[Dict[str, Callable]] = None, ops=FUSED_OPS,
                        tables: Optional[Dict[str, dict]] = None) -> Tuple[List[str], dict]:
    """Run every op's NPU kernel (``kernels`` by op name replace some) against the wheel's schemas,
    each schema source in turn; every op, and every value a binding translates, must reach the stand-in."""
    kernels = {op.name: npu.kernel_for(op) for op in ops} | dict(kernels or {})
    problems = check_value_tables(sources, ops, tables)
    seen = EagerCalls()
    sets = {"registered": sources["registered_schemas"], "yaml": sources["yaml_schemas"]}
    for label, schemas in sets.items():
        missing = {op.npu.op for op in ops} - set(schemas)
        if missing:
            problems.append(f"{label} schemas: no schema for {sorted(missing)} in {sources['wheel']}")
            continue
        before = len(problems)
        with stand_in_npu_ops(schemas, sources, seen, ops):
            _run_kernels(kernels, problems, ops)
        problems[before:] = [f"[{label} schema] {p}" for p in problems[before:]]
    unused = _unused(seen, ops, tables)
    if unused:
        problems.append(f"never reached torch_npu: {unused}")
    summary = {"calls": dict(seen.calls), "values_on_npu": {k: sorted(v) for k, v in seen.values.items()},
               "eager_values": {op.npu.op: eager_values(sources, op) for op in ops}, "schemas": sets,
               # the table's column: RoPE's modes (npu_rotary_mul_backward's, as before the forward ops)
               "rotary_modes_on_npu": sorted(seen.values.get("npu_rotary_mul_backward", ())),
               "eager_rotary_modes": eager_rotary_modes(sources)}
    return problems, summary


# -- GE IR definitions --------------------------------------------------------

@dataclass
class IrDef:
    """One ``REG_OP``: inputs ``(name, optional, dtypes)`` in order, outputs ``(name, dtypes)``, attrs."""
    name: str
    inputs: List[Tuple[str, bool, frozenset]]
    outputs: List[Tuple[str, frozenset]]
    attrs: Dict[str, Tuple[str, str]]


class _AnyDtype(frozenset):
    """The dtypes of a type variable the IR text does not list (torchair's docstring of
    ``SwiGlu`` names ``"T"`` without its DATATYPE line): every dtype is in it."""

    def __contains__(self, item) -> bool:
        return True


ANY_DTYPE = _AnyDtype()


def _dtypes(kinds: str) -> frozenset:
    return frozenset(_DTYPE_ALIASES.get(k.strip(), k.strip()) for k in kinds.split(",") if k.strip())


def parse_reg_op(text: str) -> IrDef:
    """Parse torchair's docstring form of a ``REG_OP`` definition."""
    name = re.match(r"REG_OP\((\w+)\)", text.strip()).group(1)
    inputs, outputs, attrs = [], [], {}
    variables = {name: _dtypes(kinds) for name, kinds in
                 re.findall(r"\.DATATYPE\((\w+),\s*TensorType\(\{(.*)\}\)\)", text)}
    for kind, body in re.findall(r"\.(INPUT|OPTIONAL_INPUT|DYNAMIC_INPUT|OUTPUT|DYNAMIC_OUTPUT|"
                                 r"REQUIRED_ATTR|ATTR)\((.*)\)\s*$", text, flags=re.M):
        if kind.endswith("ATTR"):
            attr_name, attr_type, *default = [p.strip() for p in body.split(",", 2)]
            attrs[attr_name] = (attr_type, default[0] if default else None)
            continue
        listed = re.match(r"(\w+),\s*TensorType\(\{(.*)\}\)", body)
        if listed is not None:
            io_name, dtypes = listed.group(1), _dtypes(listed.group(2))
        else:  # a type variable (``.INPUT(x, "T")``): its DATATYPE line, when the text has one
            io_name, variable = re.match(r'(\w+),\s*"(\w+)"', body).groups()
            dtypes = variables.get(variable, ANY_DTYPE)
        if kind.endswith("OUTPUT"):
            outputs.append((io_name, dtypes))
        else:
            inputs.append((io_name, kind == "OPTIONAL_INPUT", dtypes))
    return IrDef(name, inputs, outputs, attrs)


def ir_definitions(sources) -> Dict[str, IrDef]:
    return {op: parse_reg_op(text) for op, text in sources["ge_ir"].items()}


# -- GE converters ------------------------------------------------------------

def registered_converter(op):
    """The converter torchair calls for ``op`` (wrapped as torchair wraps it)."""
    from torchair._ge_concrete_graph import fx2ge_converter

    converter = getattr(op, "_ge_converter", None) or getattr(fx2ge_converter, "_CONVERTERS", {}).get(op)
    if converter is None:
        raise LookupError(f"no GE converter registered for {op}")
    return converter


def build_node(converter, op, case: tuple):
    """Build ``op(*case)`` with ``converter`` in a fresh GE graph: one Data per tensor argument,
    named after it. Returns (the graph, the converter's outputs as a tuple, the meta outputs)."""
    from torchair._ge_concrete_graph import ge_apis as ge
    from torchair.ge._ge_graph import GeGraph, torch_type_to_ge_type

    fakes = op.overload(*[a.to("meta") if isinstance(a, torch.Tensor) else a for a in case])
    fakes = tuple(fakes) if isinstance(fakes, (tuple, list)) else (fakes,)
    with GeGraph(name="npu_fusion_contract") as graph:
        args = []
        for index, (name, arg) in enumerate(zip(op.argument_names(), case)):
            if isinstance(arg, torch.Tensor):  # torchair stamps each input with its FX meta, so does this
                args.append(ge.Data(index=index, dtype=torch_type_to_ge_type(arg.dtype), shape=list(arg.shape),
                                    placement="CPU", node_name=name))
                args[-1].set_meta(arg.to("meta"))
            else:
                args.append(arg)
        outputs = converter(*args, meta_outputs=list(fakes) if len(fakes) > 1 else fakes[0])
    return graph, (tuple(outputs) if isinstance(outputs, (tuple, list)) else (outputs,)), fakes


def _the_node(graph, ge_type: str, problems: List[str], case: str):
    nodes = [n for n in graph.op if n.type == ge_type]
    if len(nodes) != 1:
        problems.append(f"{case}: expected one {ge_type} node, found {[n.type for n in graph.op]}")
        return None
    return nodes[0]


def _check_inputs(node, ir: IrDef, given: dict, case: str, problems: List[str]) -> None:
    fed = [d.name for d in node.input_desc]
    expected = [n for n, optional, _ in ir.inputs if given.get(n) is not None or not optional]
    if fed != expected:
        problems.append(f"{case}: inputs {fed}, the IR with these arguments wants {expected}")
    sources = [i.split(":")[0] for i in node.input if not i.endswith(":-1")]
    for desc, source in zip(node.input_desc, sources):
        if source != desc.name:
            problems.append(f"{case}: IR input {desc.name!r} is fed from our argument {source!r}")
    kinds = {n: k for n, _, k in ir.inputs}
    for name in fed:
        arg = given.get(name)
        if isinstance(arg, torch.Tensor) and name in kinds and DTYPE_NAMES[arg.dtype] not in kinds[name]:
            problems.append(f"{case}: input {name} dtype {DTYPE_NAMES[arg.dtype]} not in the IR's {sorted(kinds[name])}")


def _same_value(a, b) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return math.isclose(float(a), float(b), rel_tol=1e-6)
    return a == b


def _check_attrs(node, ir: IrDef, wanted: dict, case: str, problems: List[str]) -> None:
    """``wanted``: each attribute's value as the op's declaration sets it from our arguments."""
    ours = {k: v for k, v in node.attr.items() if not k.startswith("_")}
    for name, value in ours.items():
        if name not in ir.attrs:
            problems.append(f"{case}: attribute {name!r} is not in the IR (which has {sorted(ir.attrs)})")
            continue
        field_name = ATTR_FIELD.get(ir.attrs[name][0], ir.attrs[name][0])
        if value.WhichOneof("value") != field_name:
            problems.append(f"{case}: attribute {name!r} is {value.WhichOneof('value')!r}, "
                            f"the IR's type {ir.attrs[name][0]} wants {field_name!r}")
        elif name in wanted and not _same_value(getattr(value, field_name), wanted[name]):
            problems.append(f"{case}: attribute {name!r} = {getattr(value, field_name)!r}, the op's is {wanted[name]!r}")
    for name, (_, default) in ir.attrs.items():
        if name in wanted and name not in ours and not _same_value(wanted[name], type(wanted[name])(float(default))):
            problems.append(f"{case}: attribute {name!r} left out, so GE uses the IR default {default}, "
                            f"not the op's {wanted[name]}")


def _check_outputs(node, ir: IrDef, outputs, fakes, case: str, problems: List[str]) -> None:
    names = [d.name for d in node.output_desc]
    if names != [n for n, _ in ir.outputs]:
        problems.append(f"{case}: outputs {names}, the IR's are {[n for n, _ in ir.outputs]}")
    for index, (out, fake) in enumerate(zip(outputs, fakes)):
        if out.node.name != node.name:
            continue  # made by other nodes (rope's empty dcos/dsin without x)
        if out.index != index:
            problems.append(f"{case}: the op's output {index} is the IR's output {out.index} ({names[out.index]})")
        if out.index < len(ir.outputs) and DTYPE_NAMES[fake.dtype] not in ir.outputs[out.index][1]:
            problems.append(f"{case}: output {names[out.index]} declared {DTYPE_NAMES[fake.dtype]}, "
                            f"not in the IR's {sorted(ir.outputs[out.index][1])}")


def check_case(op, case, ir: IrDef, converter, problems: List[str]) -> bool:
    """Build one case and compare its node with ``ir``; whether a node was built."""
    name = describe(op, case)
    try:
        graph, outputs, fakes = build_node(converter, op, case)
    except Exception as error:  # noqa: BLE001
        problems.append(f"{name}: the converter raised {type(error).__name__}: {str(error).splitlines()[0]}")
        return False
    node = _the_node(graph, op.ge.op, problems, name)
    if node is None:
        return False
    arguments = dict(zip(op.argument_names(), case))
    _check_inputs(node, ir, arguments, name, problems)
    _check_attrs(node, ir, {a.name: arguments[a.source] for a in op.ge.attrs}, name, problems)
    _check_outputs(node, ir, outputs, fakes, name, problems)
    return True


def check_ge_converters(sources, converters: Optional[dict] = None, ops=FUSED_OPS) -> Tuple[List[str], dict]:
    """Build every op's every declared case with our converters (``converters`` by overload replace
    some) and compare each node with the wheel's IR."""
    irs = ir_definitions(sources)
    problems: List[str] = []
    nodes = collections.Counter()
    for op in ops:
        ir = irs.get(op.ge.op)
        if ir is None:
            problems.append(f"{sources['wheel']}: torchair generated no {op.ge.op}")
            continue
        converter = (converters or {}).get(op.overload) or registered_converter(op.overload)
        nodes[op.ge.op] += sum(check_case(op, case, ir, converter, problems) for case in op.cases())
    return problems, {"nodes_checked": dict(nodes), "ir": {k: str(v) for k, v in irs.items()}}


def builders_in_use() -> Dict[str, str]:
    """Whose GE builder each converter calls: torchair's generated one, or ours written from the IR
    (and, for an IR with optional inputs, whose when one is absent)."""
    from npu_fusion.lowering.ge_converters import BUILDERS

    used = {}
    for op in FUSED_OPS:
        builders = BUILDERS[op.name]
        used[op.ge.op] = builders.full_source
        if op.ge.optional():
            absent = "/".join(i.name for i in op.ge.optional())
            used[f"{op.ge.op} without {absent}"] = builders.without_optional_source
    return used


def line_report(line: str) -> dict:
    """Both checks for torch_npu ``line``, GE nodes built by the torchair this process loads
    (``NPU_FUSION_TORCH_NPU_VERSION``; the line's own unless it does not import with this torch)."""
    sources = harness.contract_sources(line)
    eager_problems, eager = check_eager_kernels(sources)
    report = {"line": line, "wheel": sources["wheel"], "eager_problems": eager_problems, "eager": eager,
              "torchair": harness.torch_npu_version(), "ops": {op.name: [op.npu.op, op.ge.op] for op in FUSED_OPS}}
    try:
        harness.load_torchair()
    except Exception as error:  # noqa: BLE001  (an old torchair against this torch: reported, not fatal)
        report["torchair_error"] = f"{type(error).__name__}: {error}"
        return report
    from npu_fusion.lowering import ge_converters

    if not ge_converters.register():
        raise RuntimeError("npu_fusion's GE converters did not register with torchair")
    report["ge_problems"], report["ge"] = check_ge_converters(sources)
    report["builders"] = builders_in_use()
    return report


if __name__ == "__main__":
    print(json.dumps(line_report(sys.argv[1] if len(sys.argv) > 1 else harness.torch_npu_version()),
                     default=sorted))
