"""The NPU-side contracts of npu-fusion, checked on the CPU against one torch_npu wheel.

What only runs on an Ascend host is checked against what the torch_npu wheel of
a release line says (read by :func:`harness.contract_sources`):

* eager kernels (:func:`check_eager_kernels`): ``npu_fusion.lowering.npu``'s
  kernels run on the CPU against stand-in ``torch.ops.npu`` ops defined from the
  wheel's own schema strings (the one compiled into ``libtorch_npu.so`` and the
  codegen yaml's) and computed by our reference math, refusing the
  ``rotary_mode`` values the wheel's eager kernel refuses. A call that does not
  bind to the schema, or binds its tensors to the wrong roles, fails; results
  must equal the reference kernels'.
* GE converters (:func:`check_ge_converters`): the nodes our registered
  converters build (input names, order and sources, optional inputs left unfed,
  attribute names, types and values, output names, the dtypes per SPEC) are
  compared with the ``REG_OP`` definitions torchair generated in that wheel.

Each check returns a list of problems (empty: the contract holds) and what it saw.
Run as a module for one line (``python -m npu_fusion_testing.torchair.npu_contracts LINE``,
``NPU_FUSION_TORCH_NPU_VERSION``), it prints that line's results as JSON; ``scripts/check_npu_contracts.py`` runs it for every line.
"""
from __future__ import annotations

import collections
import contextlib
import itertools
import json
import re
import sys
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import torch

from npu_fusion.lowering import npu, rms_norm, rope
from npu_fusion.lowering.constraints import ROPE_MODES
from . import harness

ROPE_OP = torch.ops.npu_fusion.rotary_position_embedding_grad.default
RMS_OP = torch.ops.npu_fusion.rms_norm_grad.default
#: our op's arguments, each fed to the GE input of the same name (the IRs name them as we do).
ARGUMENTS = {ROPE_OP: ("dy", "cos", "sin", "x"), RMS_OP: ("dy", "x", "rstd", "gamma")}
GE_TYPE = {ROPE_OP: "RotaryPositionEmbeddingGrad", RMS_OP: "RmsNormGrad"}
DTYPE_NAMES = {torch.float32: "DT_FLOAT", torch.float16: "DT_FLOAT16", torch.bfloat16: "DT_BF16"}
#: GE spells bfloat16 two ways in generated IR.
_DTYPE_ALIASES = {"DT_BFLOAT16": "DT_BF16"}
#: the GE attribute value field of each IR attribute type.
ATTR_FIELD = {"Int": "i", "Float": "f", "Bool": "b", "String": "s", "Str": "s", "ListInt": "list", "Type": "type"}


# -- cases --------------------------------------------------------------------

def rope_cases():
    """``(dy, cos, sin, x, mode)``: every mode and dtype, with and without x; BSND and BNSD layouts."""
    torch.manual_seed(0)
    for mode, dtype, with_x in itertools.product(ROPE_MODES, DTYPE_NAMES, (True, False)):
        shape, table = ((2, 8, 3, 16), (1, 8, 1, 16)) if mode % 2 == 0 else ((2, 3, 8, 16), (1, 1, 8, 16))
        dy, x = torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype)
        cos, sin = torch.randn(table, dtype=dtype), torch.randn(table, dtype=dtype)
        yield dy, cos, sin, (x if with_x else None), mode


def rms_norm_cases():
    """``(dy, x, rstd, gamma)``: SPEC's five A2/A3 dtype combinations, keep-dim and plain rstd."""
    torch.manual_seed(0)
    combos = [(torch.float32, torch.float32), (torch.float16, torch.float32), (torch.bfloat16, torch.float32),
              (torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16)]
    for (dtype, gamma_dtype), keepdim in itertools.product(combos, (True, False)):
        dy, x = torch.randn(3, 5, 32, dtype=dtype), torch.randn(3, 5, 32, dtype=dtype)
        rstd = torch.rand((3, 5, 1) if keepdim else (3, 5), dtype=torch.float32) + 0.5
        yield dy, x, rstd, torch.randn(32, dtype=gamma_dtype)


# -- eager kernels ------------------------------------------------------------

def eager_rotary_modes(sources) -> List[str]:
    """The ``rotary_mode`` values the wheel's eager kernel accepts ("half or interleave")."""
    words = sources.get("eager_rotary_modes")
    if not words:
        raise ValueError(f"{sources['wheel']}: no rotary_mode message of npu_rotary_mul_backward found")
    return [w.strip() for w in re.split(r",|\bor\b", words) if w.strip()]


@dataclass
class EagerCalls:
    """What reached the stand-in ops: calls per op, rotary modes used, refusals."""
    calls: collections.Counter = field(default_factory=collections.Counter)
    rotary_modes: set = field(default_factory=set)


@contextlib.contextmanager
def stand_in_npu_ops(schemas: Dict[str, str], accepted_modes: List[str], seen: EagerCalls):
    """``torch.ops.npu.<op>`` defined from ``schemas`` for the CPU, computed by the reference kernels.

    Arguments are read by their position in the schema, as torch_npu reads them:
    ``(grad, self, r1, r2, rotary_mode)`` and ``(dy, self, gamma, rstd)``."""
    for op in schemas:
        if hasattr(torch.ops.npu, op):
            raise RuntimeError(f"torch.ops.npu.{op} already exists (torch_npu imported?): cannot stand in for it")
    mode_numbers = {name: number for number, name in ROPE_MODES.items()}

    def rotary_mul_backward(grad, input, r1, r2, rotary_mode="half"):  # noqa: A002  (the schema's names)
        if rotary_mode not in accepted_modes:
            raise RuntimeError(f"The rotary_mode of npu_rotary_mul_backward should be "
                               f"{' or '.join(accepted_modes)}, but got {rotary_mode}")
        seen.calls["npu_rotary_mul_backward"] += 1
        seen.rotary_modes.add(rotary_mode)
        return rope.reference_kernel(grad, r1, r2, input, mode_numbers[rotary_mode])

    def rms_norm_backward(dy, input, gamma, rstd):  # noqa: A002
        seen.calls["npu_rms_norm_backward"] += 1
        return rms_norm.reference_kernel(dy, input, rstd, gamma)

    implementations = {"npu_rotary_mul_backward": rotary_mul_backward, "npu_rms_norm_backward": rms_norm_backward}
    library = torch.library.Library("npu", "FRAGMENT")
    try:
        for op, schema in schemas.items():
            library.define(schema)
            library.impl(op, implementations[op], "CPU")
        yield
    finally:
        library._destroy()


def _compare(name: str, got, want, problems: List[str]) -> None:
    try:
        assert len(got) == len(want), f"{len(got)} outputs, want {len(want)}"
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=0, atol=0)
    except Exception as error:  # noqa: BLE001  (any mismatch is a broken contract)
        problems.append(f"{name}: result differs from the reference kernel: {str(error).splitlines()[0]}")


def _run_kernels(rope_kernel, rms_kernel, problems: List[str]) -> None:
    for dy, cos, sin, x, mode in rope_cases():
        case = f"rotary_position_embedding_grad mode={mode} {dy.dtype} x={'given' if x is not None else 'None'}"
        try:
            _compare(case, rope_kernel(dy, cos, sin, x, mode), rope.reference_kernel(dy, cos, sin, x, mode), problems)
        except Exception as error:  # noqa: BLE001
            problems.append(f"{case}: {type(error).__name__}: {str(error).splitlines()[0]}")
    for dy, x, rstd, gamma in rms_norm_cases():
        case = f"rms_norm_grad {dy.dtype}/{gamma.dtype} rstd {list(rstd.shape)}"
        try:
            _compare(case, rms_kernel(dy, x, rstd, gamma), rms_norm.reference_kernel(dy, x, rstd, gamma), problems)
        except Exception as error:  # noqa: BLE001
            problems.append(f"{case}: {type(error).__name__}: {str(error).splitlines()[0]}")


def check_rotary_mode_table(sources, rotary_modes: Dict[int, str]) -> List[str]:
    """Each ``mode: rotary_mode`` we send is one the eager kernel accepts, for the GE mode
    torchair's own converter maps it to."""
    problems = []
    accepted = eager_rotary_modes(sources)
    torchair_modes = {name: int(number) for name, number in sources.get("torchair_rotary_modes", [])}
    for mode, name in rotary_modes.items():
        if name not in accepted:
            problems.append(f"rotary_mode {name!r} (mode {mode}): torch_npu's eager kernel accepts only "
                            f"{' or '.join(accepted)}")
        if torchair_modes and torchair_modes.get(name) != mode:
            problems.append(f"rotary_mode {name!r} is GE mode {torchair_modes.get(name)} in torchair's converter, "
                            f"we use it for mode {mode}")
    return problems


def check_eager_kernels(sources, rope_kernel: Callable = npu.rope_grad_on_npu,
                        rms_kernel: Callable = npu.rms_norm_grad_on_npu,
                        rotary_modes: Optional[Dict[int, str]] = None) -> Tuple[List[str], dict]:
    """Run the eager kernels against the wheel's schemas (each source in turn); every op, and
    every rotary mode we map, must reach the stand-in."""
    accepted = eager_rotary_modes(sources)
    problems = check_rotary_mode_table(sources, npu.TORCH_NPU_ROTARY_MODES if rotary_modes is None else rotary_modes)
    seen = EagerCalls()
    sets = {"registered": sources["registered_schemas"], "yaml": sources["yaml_schemas"]}
    for label, schemas in sets.items():
        missing = {"npu_rotary_mul_backward", "npu_rms_norm_backward"} - set(schemas)
        if missing:
            problems.append(f"{label} schemas: no schema for {sorted(missing)} in {sources['wheel']}")
            continue
        before = len(problems)
        with stand_in_npu_ops(schemas, accepted, seen):
            _run_kernels(rope_kernel, rms_kernel, problems)
        problems[before:] = [f"[{label} schema] {p}" for p in problems[before:]]
    table = npu.TORCH_NPU_ROTARY_MODES if rotary_modes is None else rotary_modes
    unused = sorted(set(table.values()) - seen.rotary_modes) + [
        op for op in ("npu_rotary_mul_backward", "npu_rms_norm_backward") if not seen.calls[op]]
    if unused:  # a kernel that falls back where torch_npu could run it binds nothing
        problems.append(f"never reached torch_npu: {unused}")
    summary = {"calls": dict(seen.calls), "rotary_modes_on_npu": sorted(seen.rotary_modes),
               "eager_rotary_modes": accepted, "schemas": sets}
    return problems, summary


# -- GE IR definitions --------------------------------------------------------

@dataclass
class IrDef:
    """One ``REG_OP``: inputs ``(name, optional, dtypes)`` in order, outputs ``(name, dtypes)``, attrs."""
    name: str
    inputs: List[Tuple[str, bool, frozenset]]
    outputs: List[Tuple[str, frozenset]]
    attrs: Dict[str, Tuple[str, str]]


def _dtypes(kinds: str) -> frozenset:
    return frozenset(_DTYPE_ALIASES.get(k.strip(), k.strip()) for k in kinds.split(",") if k.strip())


def parse_reg_op(text: str) -> IrDef:
    """Parse torchair's docstring form of a ``REG_OP`` definition."""
    name = re.match(r"REG_OP\((\w+)\)", text.strip()).group(1)
    inputs, outputs, attrs = [], [], {}
    for kind, body in re.findall(r"\.(INPUT|OPTIONAL_INPUT|DYNAMIC_INPUT|OUTPUT|DYNAMIC_OUTPUT|"
                                 r"REQUIRED_ATTR|ATTR)\((.*)\)\s*$", text, flags=re.M):
        if kind.endswith("ATTR"):
            attr_name, attr_type, *default = [p.strip() for p in body.split(",", 2)]
            attrs[attr_name] = (attr_type, default[0] if default else None)
            continue
        io_name, kinds = re.match(r"(\w+),\s*TensorType\(\{(.*)\}\)", body).groups()
        if kind.endswith("OUTPUT"):
            outputs.append((io_name, _dtypes(kinds)))
        else:
            inputs.append((io_name, kind == "OPTIONAL_INPUT", _dtypes(kinds)))
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


def build_node(converter, op, args: tuple, kwargs: dict):
    """Build ``op(*args, **kwargs)`` with ``converter`` in a fresh GE graph: one Data per
    tensor argument, named after it. Returns (the graph, the converter's outputs)."""
    from torchair._ge_concrete_graph import ge_apis as ge
    from torchair.ge._ge_graph import GeGraph, torch_type_to_ge_type

    fakes = op(*[a.to("meta") if a is not None else None for a in args], **kwargs)
    with GeGraph(name="npu_fusion_contract") as graph:
        data = []
        for index, (name, arg) in enumerate(zip(ARGUMENTS[op], args)):
            if arg is not None:  # torchair stamps each input with its FX meta, so does this
                data.append(ge.Data(index=index, dtype=torch_type_to_ge_type(arg.dtype), shape=list(arg.shape),
                                    placement="CPU", node_name=name))
                data[-1].set_meta(arg.to("meta"))
            else:
                data.append(None)
        outputs = converter(*data, **kwargs, meta_outputs=list(fakes))
    return graph, outputs, fakes


def _the_node(graph, ge_type: str, problems: List[str], case: str):
    nodes = [n for n in graph.op if n.type == ge_type]
    if len(nodes) != 1:
        problems.append(f"{case}: expected one {ge_type} node, found {[n.type for n in graph.op]}")
        return None
    return nodes[0]


def _check_inputs(node, ir: IrDef, args: tuple, names: tuple, case: str, problems: List[str]) -> None:
    given = {name: arg for name, arg in zip(names, args)}
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
        if arg is not None and name in kinds and DTYPE_NAMES[arg.dtype] not in kinds[name]:
            problems.append(f"{case}: input {name} dtype {DTYPE_NAMES[arg.dtype]} not in the IR's {sorted(kinds[name])}")


def _check_attrs(node, ir: IrDef, kwargs: dict, case: str, problems: List[str]) -> None:
    ours = {k: v for k, v in node.attr.items() if not k.startswith("_")}
    for name, value in ours.items():
        if name not in ir.attrs:
            problems.append(f"{case}: attribute {name!r} is not in the IR (which has {sorted(ir.attrs)})")
            continue
        wanted = ATTR_FIELD.get(ir.attrs[name][0], ir.attrs[name][0])
        if value.WhichOneof("value") != wanted:
            problems.append(f"{case}: attribute {name!r} is {value.WhichOneof('value')!r}, "
                            f"the IR's type {ir.attrs[name][0]} wants {wanted!r}")
        elif name in kwargs and getattr(value, wanted) != kwargs[name]:
            problems.append(f"{case}: attribute {name!r} = {getattr(value, wanted)!r}, the op's is {kwargs[name]!r}")
    for name, (_, default) in ir.attrs.items():
        if name in kwargs and name not in ours and str(kwargs[name]) != str(default):
            problems.append(f"{case}: attribute {name!r} left out, so GE uses the IR default {default}, "
                            f"not the op's {kwargs[name]}")


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


def _ge_cases():
    for dy, cos, sin, x, mode in rope_cases():
        yield ROPE_OP, (dy, cos, sin, x), {"mode": mode}
    for args in rms_norm_cases():
        yield RMS_OP, args, {}


def check_ge_converters(sources, converters: Optional[dict] = None) -> Tuple[List[str], dict]:
    """Build every case with our converters and compare each node with the wheel's IR."""
    irs = ir_definitions(sources)
    problems: List[str] = []
    nodes = collections.Counter()
    for op, args, kwargs in _ge_cases():
        case = f"{GE_TYPE[op]} {args[0].dtype} {kwargs or ''} x={'None' if args[3] is None else 'given'}"
        ir = irs.get(GE_TYPE[op])
        if ir is None:
            problems.append(f"{sources['wheel']}: torchair generated no {GE_TYPE[op]}")
            continue
        converter = (converters or {}).get(op) or registered_converter(op)
        try:
            graph, outputs, fakes = build_node(converter, op, args, kwargs)
        except Exception as error:  # noqa: BLE001
            problems.append(f"{case}: the converter raised {type(error).__name__}: {str(error).splitlines()[0]}")
            continue
        node = _the_node(graph, GE_TYPE[op], problems, case)
        if node is not None:
            nodes[GE_TYPE[op]] += 1
            _check_inputs(node, ir, args, ARGUMENTS[op], case, problems)
            _check_attrs(node, ir, kwargs, case, problems)
            _check_outputs(node, ir, outputs, fakes, case, problems)
    return problems, {"nodes_checked": dict(nodes), "ir": {k: str(v) for k, v in irs.items()}}


def builders_in_use() -> Dict[str, str]:
    """Whose GE builder each converter calls: torchair's generated one, or ours written from the IR."""
    from torchair._ge_concrete_graph import ge_apis as ge

    from npu_fusion.lowering.ge_converters import rms_norm_grad, rotary_position_embedding_grad as rope_module

    def whose(builder, name):
        return "torchair" if builder is getattr(ge, name, None) else "own"

    return {"RotaryPositionEmbeddingGrad": whose(rope_module.ROPE_BUILDER, "RotaryPositionEmbeddingGrad"),
            "RotaryPositionEmbeddingGrad without x": whose(rope_module.ROPE_BUILDER_WITHOUT_X,
                                                           "RotaryPositionEmbeddingGrad"),
            "RmsNormGrad": whose(rms_norm_grad.RMS_NORM_BUILDER, "RmsNormGrad")}


def line_report(line: str) -> dict:
    """Both checks for torch_npu ``line``, GE nodes built by the torchair this process loads
    (``NPU_FUSION_TORCH_NPU_VERSION``; the line's own unless it does not import with this torch)."""
    sources = harness.contract_sources(line)
    eager_problems, eager = check_eager_kernels(sources)
    report = {"line": line, "wheel": sources["wheel"], "eager_problems": eager_problems, "eager": eager,
              "torchair": harness.torch_npu_version()}
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
