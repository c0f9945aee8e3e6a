"""What the pass can emit, read from its sources: every op a rule or hook inserts into a graph.

The pass inserts nodes through one helper (:func:`npu_fusion.patterns.rewrite.call`, also as
``Edit.call``); its target is an op spelled out at the call (``aten.stack.default``), or a
fused op's overload. :func:`emittable_targets` reads every such call in ``npu_fusion/patterns``
and ``npu_fusion/plugin`` with :mod:`ast`, and adds each fused op of the registry
(:data:`~npu_fusion.lowering.ops.FUSED_OPS`), so that a test can require each one to go
through a compiler (``tests/test_inductor_emits.py``). A call whose target is neither a
spelled-out op nor one of :data:`DELEGATING_TARGETS` is reported, so a new way of emitting
cannot escape the list.
"""
from __future__ import annotations

import ast
import pathlib
from typing import Dict, List, Set, Tuple

import torch

from npu_fusion.lowering.ops import FUSED_OPS
from npu_fusion.plugin.pass_manager import emitted_target_name

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "npu_fusion"
#: the sources of everything that inserts nodes into the compiler's graph
EMITTING_PACKAGES = ("patterns", "plugin")
#: op namespaces a target is spelled with
NAMESPACES = {"aten": torch.ops.aten, "prims": torch.ops.prims}
#: target expressions that are not an op of their own: the helper passing its target on, a fused
#: op's overload (each fused op of the registry is counted instead), and a view the graph holds made
#: again in the backward (plugin/joint.py: the op is the graph's own, already compiled there)
DELEGATING_TARGETS = {"target", "op.overload", "OP.overload", "view.target"}


def _target_argument(call: ast.Call):
    """The target expression of a ``call(graph, fake_mode, target, ...)`` or
    ``<edit>.call(target, ...)``, or None when ``call`` is neither."""
    func = call.func
    if isinstance(func, ast.Name) and func.id == "call" and len(call.args) > 2:
        return call.args[2]
    if isinstance(func, ast.Attribute) and func.attr == "call" and call.args:
        return call.args[0]
    return None


def _spelled_ops(expression: ast.AST) -> List[str]:
    """The ``aten.x.overload`` (or ``torch.ops.aten``, ``prims``) chains in ``expression``."""
    found = []
    for node in ast.walk(expression):
        text = ast.unparse(node) if isinstance(node, ast.Attribute) else ""
        parts = text.removeprefix("torch.ops.").split(".")
        if len(parts) == 3 and parts[0] in NAMESPACES:
            found.append(emitted_target_name(getattr(getattr(NAMESPACES[parts[0]], parts[1]), parts[2])))
    return found


def scan(root: pathlib.Path = PACKAGE) -> Tuple[Dict[str, List[str]], List[str]]:
    """``({op: [where it is emitted]}, [calls whose target is not understood])``."""
    ops: Dict[str, List[str]] = {}
    unknown: List[str] = []
    for package in EMITTING_PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                target = _target_argument(node) if isinstance(node, ast.Call) else None
                if target is None:
                    continue
                where = f"{path.relative_to(root.parent)}:{node.lineno}"
                spelled = _spelled_ops(target)
                for op in spelled:
                    ops.setdefault(op, []).append(where)
                if not spelled and ast.unparse(target) not in DELEGATING_TARGETS:
                    unknown.append(f"{where}: {ast.unparse(target)}")
    return ops, unknown


def emittable_targets() -> Set[str]:
    """Every op the pass can insert into a graph, named as ``FusionResult.emitted`` names them."""
    ops, _ = scan()
    return set(ops) | {emitted_target_name(op.overload) for op in FUSED_OPS}
