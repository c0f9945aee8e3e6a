"""The aliasing the fake values of a graph tell: every view's value on its input's storage.

AOTAutograd reads aliasing off the fake values after the partition (a saved tensor whose storage no
output shares is a donated buffer, which Inductor's backward may overwrite), so a view whose value
has a storage of its own is a wrong value waiting for a program that returns it.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, List, Tuple

import torch
import torch.fx as fx

__all__ = ["unaliased_views", "views_checked"]


def _storage(t):
    return t.untyped_storage()._cdata


def _is_view(node) -> bool:
    """Whether the node calls an ATen op whose result aliases its first argument (its schema says so)."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    returns = target._schema.returns
    return bool(returns) and returns[0].alias_info is not None and not returns[0].alias_info.is_write


def unaliased_views(graph: fx.Graph) -> Tuple[List[str], int]:
    """The view nodes whose fake values (each, for a view returning several) are on another storage
    than their input's; and how many view nodes were checked."""
    bad, checked = [], 0
    for node in graph.nodes:
        source = node.args[0] if _is_view(node) else None
        if not isinstance(source, fx.Node) or not isinstance(source.meta.get("val"), torch.Tensor):
            continue
        checked += 1
        value = node.meta.get("val")
        if any(_storage(v) != _storage(source.meta["val"])
               for v in (value if isinstance(value, (tuple, list)) else (value,)) if isinstance(v, torch.Tensor)):
            bad.append(f"{node.name} = {node.target}({source.name})")
    return bad, checked


@contextlib.contextmanager
def views_checked() -> Iterator[List[List[str]]]:
    """Yield a list that gets, for each graph Inductor's joint pass slot sees while the block runs, the
    views whose fake values are not on their input's storage after the installed pass and were before it."""
    from npu_fusion.compat import inductor_config

    config, unaliased = inductor_config(), []
    installed_pass = config.joint_custom_pre_pass

    def checked(graph):
        before = set(unaliased_views(graph)[0])
        installed_pass(graph)
        unaliased.append([v for v in unaliased_views(graph)[0] if v not in before])

    checked.uuid = lambda: None  # no FX graph cache entry for a checked compile
    config.joint_custom_pre_pass = checked
    try:
        yield unaliased
    finally:
        if config.joint_custom_pre_pass is checked:
            config.joint_custom_pre_pass = installed_pass
