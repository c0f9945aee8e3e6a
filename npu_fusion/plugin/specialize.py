"""Model constants that ``dynamic=True`` passes as graph inputs, turned back into constants under a guard.

Under ``torch.compile(dynamic=True)`` Dynamo does not specialize Python floats: an RMSNorm's
``eps`` (a module attribute) reaches the graph as a 0-d float64 tensor input read with
``.item()``. The fused ``rms_norm`` takes eps as an attribute (GE's ``RmsNorm`` too), so a norm
whose eps is a graph input cannot fuse its forward. An eps is a constant of the model, as the
head dim is; Inductor specializes what its kernels need static and guards on it, and so does
this step, before AOTAutograd traces the graph:

* which floats: a float passed as a tensor (a module attribute, or an argument) whose value reaches a root
  (``rsqrt``, ``sqrt``, ``pow``, ``reciprocal``) through at most :data:`REACH` arithmetic
  nodes, as a norm's eps does. Nothing else: a learning rate or a scale stays symbolic.
* how: its ``.item()`` readers read the Python float instead (the value eager adds, so the
  result is eager's bit for bit), and Dynamo guards the attribute on that value
  (:func:`~npu_fusion.compat.guard_constant`): a model whose eps never changes never
  recompiles, one whose eps changes recompiles with the new constant.

Batch and sequence stay symbolic: their sizes are never touched here.
"""
from __future__ import annotations

import operator
from typing import Callable, List, Optional, Sequence

import torch
import torch.fx as fx

from ..compat import graph_argument, guard_constant

#: arithmetic nodes between an eps and the root it feeds (``mean + eps``, ``(var + eps) * c``)
REACH = 3

_ARITHMETIC = {operator.add, operator.sub, operator.mul, operator.truediv, operator.neg,
               torch.add, torch.sub, torch.mul, torch.div, torch.neg, "add", "sub", "mul", "div", "neg",
               "__add__", "__radd__", "__mul__", "__rmul__", "__truediv__"}
_ROOTS = {torch.rsqrt, torch.sqrt, torch.pow, torch.reciprocal, operator.pow,
          "rsqrt", "sqrt", "pow", "reciprocal", "__pow__", "__rpow__"}


def _reaches_root(node: fx.Node, reach: int = REACH) -> bool:
    for user in node.users:
        if user.op not in ("call_function", "call_method"):
            continue
        if user.target in _ROOTS:
            return True
        if user.target in _ARITHMETIC and reach > 0 and _reaches_root(user, reach - 1):
            return True
    return False


def _item_readers(placeholder: fx.Node) -> List[fx.Node]:
    """The ``.item()`` calls that are a placeholder's only readers, or [] where anything else reads it."""
    users = list(placeholder.users)
    if users and all(u.op == "call_method" and u.target == "item" for u in users):
        return users
    return []


def specialize_model_constants(gm: fx.GraphModule, example_inputs: Optional[Sequence] = None) -> List[str]:
    """Turn the eps-like float module attributes of a Dynamo graph into constants under a guard, in place.

    Returns the attributes specialized (their Dynamo sources). ``example_inputs`` are the
    backend's; without them (Inductor's pre-grad hook gets the graph alone) each placeholder's
    example is Dynamo's record of it. A graph not produced by Dynamo (no graph arguments in its
    placeholders' meta), or a torch without the guard API, is left as it is.
    """
    specialized = []
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if example_inputs is None:
        example_inputs = [getattr(graph_argument(n), "example", None) for n in placeholders]
    for node, example in zip(placeholders, example_inputs):
        argument = graph_argument(node)
        if argument is None or not argument.pass_arg_as_tensor:
            continue
        if not isinstance(example, torch.Tensor) or example.dim() != 0 or not example.dtype.is_floating_point:
            continue
        readers = _item_readers(node)
        if not readers or not any(_reaches_root(r) for r in readers):
            continue
        value = float(argument.example.item())
        if not guard_constant(argument.source):
            continue
        for reader in readers:
            for user in list(reader.users):
                user.args = fx.map_arg(user.args, lambda n: value if n is reader else n)
                user.kwargs = fx.map_arg(user.kwargs, lambda n: value if n is reader else n)
            gm.graph.erase_node(reader)
        specialized.append(argument.source.name)
    if specialized:
        gm.recompile()
    return specialized


def reads_constant_floats(options) -> bool:
    """Whether an enabled rule's fused op takes a float as a number (the forward norm's eps), so specializing pays."""
    from ..patterns import RULES

    return any(rule.reads_constant_floats and options.enables(rule) for rule in RULES)


def specializing(backend: Callable, options) -> Callable:
    """``backend`` (a ``torch.compile`` backend running AOTAutograd) behind :func:`specialize_model_constants`.

    Returns ``backend`` itself where no enabled rule reads a constant float
    (:func:`reads_constant_floats`); the wrapper keeps ``backend``'s ``kwargs`` (AOTAutograd's
    compilers, partitioner and decompositions, which tests and tools read)."""
    if not reads_constant_floats(options):
        return backend

    def specialized_backend(gm, example_inputs):
        specialize_model_constants(gm, example_inputs)
        return backend(gm, example_inputs)
    if hasattr(backend, "kwargs"):
        specialized_backend.kwargs = backend.kwargs
    return specialized_backend
