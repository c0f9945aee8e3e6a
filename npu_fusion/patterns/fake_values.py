"""The fake values of the nodes a rewrite inserts, computed once per op and geometry.

Every node the pass inserts (a fused call, a cast, a view) needs its fake value and its
``tensor_meta``. FakeTensorMode's dispatch costs ~0.1-0.5 ms a call, most of it bookkeeping that
only symbolic shapes need, and inside the backward compiler every op also goes through the Python
dispatcher. With static shapes :func:`static_fake_value` runs the op's meta kernel on meta tensors
of the same geometry once, remembers the result's geometry by the op and its arguments' geometry
(:data:`META_RESULTS`), and answers every later call of that op on that geometry (each layer of a
model repeats the previous one's) by making tensors of the remembered geometry with the C++ kernels
alone: fresh memory, or, where the meta kernel's result was a view of an input, a tensor on that
input's fake storage, as the fake mode's own dispatch makes a view (its storage, storage offset and
strides are what tracing records, which Inductor's and AOTAutograd's aliasing analyses read: donated
buffers, reinplacing). ``tensor_meta`` is likewise remembered by geometry (:func:`set_fake_value`).
Neither depends on the tensors' widths. :func:`move_views` moves the program's views of a replaced
node onto its replacement's storage.
"""
from __future__ import annotations

from typing import Dict, Optional

import torch

from ..compat import fake_tensor_type, outside_fake_mode, plain_dispatch, set_value_meta, tensor_metadata
from .evaluator import Unsupported

__all__ = ["static_fake_value", "set_fake_value", "geometry_key", "move_views", "META_RESULTS", "META_RESULTS_KEPT"]

#: meta kernels' results by the op and the geometry of its arguments (:func:`geometry_key`): the
#: device of the first tensor argument (the results' fake device), and per result its shape,
#: strides, dtype, storage offset and the input it is a view of (the index of a top-level argument;
#: None for fresh memory), which is all a meta kernel reads of a tensor, so one computed result
#: serves every later call of the op on the same geometry
META_RESULTS: Dict[tuple, tuple] = {}
#: how many results :data:`META_RESULTS` keeps (it starts over past that)
META_RESULTS_KEPT = 4096
#: ``tensor_meta`` by a static tensor's shape, strides, dtype and ``requires_grad``
_TENSOR_METAS: Dict[tuple, object] = {}


def geometry_key(target, args, kwargs) -> tuple:
    """What a meta kernel reads of a call: the op, each tensor's static geometry, dtype and device,
    and every other argument with its type; raises :class:`Unsupported` for anything else."""
    def key(v):
        if isinstance(v, torch.Tensor):
            if not all(type(x) is int for x in (*v.shape, *v.stride())) or v.storage_offset() != 0:
                raise Unsupported("not a static tensor")
            return ("tensor", tuple(v.shape), v.stride(), v.dtype, v.device)
        if isinstance(v, (list, tuple)):
            return (type(v).__name__, tuple(key(x) for x in v))
        if v is None or type(v) in (bool, int, float, str, torch.dtype, torch.device, torch.layout,
                                    torch.memory_format):
            return (type(v).__name__, v)
        raise Unsupported(f"argument {type(v).__name__}")
    return (target, key(tuple(args)), tuple((k, key(v)) for k, v in sorted(kwargs.items())))


def static_fake_value(fake_mode, target, args, kwargs):
    """The fake value of ``target(*args, **kwargs)`` from its meta kernel, or None.

    The fake value of ``target(*args, **kwargs)`` in ``fake_mode`` from the op's meta kernel run on
    meta tensors of its arguments' geometry (or from :data:`META_RESULTS`), or None where the fake
    mode must decide: symbolic sizes, an explicit device, an argument that is no static fake tensor
    of ``fake_mode``, an op without a meta kernel."""
    if "device" in kwargs:
        return None
    try:
        key = geometry_key(target, args, kwargs)
    except Unsupported:  # a symbolic size, an argument that is no plain value: computed, never remembered
        key = None
    known = META_RESULTS.get(key) if key is not None else None
    FakeTensor = fake_tensor_type()
    tensors = [v for a in (*args, *kwargs.values()) for v in (a if isinstance(a, (list, tuple)) else (a,))
               if isinstance(v, torch.Tensor)]
    if not tensors or not all(isinstance(v, FakeTensor) and v.fake_mode is fake_mode for v in tensors):
        return None
    if known is not None:
        return _made(fake_mode, known, args)
    computed = _computed(target, args, kwargs)
    if computed is None:
        return None
    out, outs, meta_args, pairs = computed
    if key is not None:
        _remember(key, tensors[0].device, out, outs, meta_args)
    fakes = [_aliasing(fake_mode, tensors[0].device, o, pairs) for o in outs]
    return type(out)(fakes) if isinstance(out, (tuple, list)) else fakes[0]


def _aliasing(fake_mode, device, o, pairs):
    """The fake tensor of the meta kernel's result ``o``: the argument itself where ``o`` is its meta
    tensor (an op that returns its input), on the argument's storage where ``o`` is a view of it, else
    ``o``'s own memory. ``pairs``: (meta tensor, the fake argument it stands for)."""
    storage = o.untyped_storage()._cdata
    for meta, fake in pairs:
        if o is meta:
            return fake
        if meta.untyped_storage()._cdata == storage:
            return fake_tensor_type()(fake_mode, _on_storage_of(fake, o.shape, o.stride(), o.dtype,
                                                                o.storage_offset(), o), device)
    return fake_tensor_type()(fake_mode, o, device)


def _on_storage_of(fake, size, stride, dtype, offset, like, requires_grad=False):
    """A meta tensor of the given geometry on ``fake``'s storage (as the fake mode makes a view), with
    ``like``'s conjugate and negative bits."""
    with outside_fake_mode(), plain_dispatch():
        t = torch.empty((0,), dtype=dtype, device="meta")
        t.set_(fake.untyped_storage(), offset, size, stride)
        if like.is_conj():
            torch._C._set_conj(t, True)
        if like.is_neg():
            torch._C._set_neg(t, True)
        if requires_grad:
            t.requires_grad_()
    return t


def _computed(target, args, kwargs):
    """(result, its tensors, the meta arguments, (meta tensor, fake argument) pairs) of the op's meta
    kernel on meta tensors of the arguments' geometry, each a static tensor at offset 0; None where it
    is none or the kernel fails."""
    pairs = []

    def to_meta(v):
        if not isinstance(v, torch.Tensor):
            return v
        if not (v.storage_offset() == 0 and all(type(x) is int for x in (*v.shape, *v.stride()))):
            raise Unsupported("not a static fake tensor")
        meta = torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="meta")
        pairs.append((meta, v))
        return meta

    def convert(v):  # op arguments nest tensors in lists at most (cat, stack)
        return type(v)(to_meta(x) for x in v) if isinstance(v, (list, tuple)) else to_meta(v)

    try:
        with outside_fake_mode():  # torch 2.6 and 2.7 call backward compilers inside the fake mode
            meta_args = tuple(convert(a) for a in args)
            out = target(*meta_args, **{k: convert(v) for k, v in kwargs.items()})
    except Exception:  # the fake mode decides: it has decompositions and fallbacks
        return None
    outs = out if isinstance(out, (tuple, list)) else (out,)
    if not all(isinstance(o, torch.Tensor) and o.device.type == "meta" for o in outs):
        return None
    return out, outs, meta_args, pairs


def _remember(key, device, out, outs, meta_args) -> None:
    """Keep a meta kernel's result's geometry for :func:`static_fake_value`, where each result is
    fresh memory at offset 0 or a view of one top-level argument in that argument's dtype (else
    nothing: the op runs again next time)."""
    results = []
    for o in outs:
        if o.is_conj() or o.is_neg():  # bits the remembered geometry does not hold
            return
        base = next((i for i, a in enumerate(meta_args) if o._is_view() and o._base is a), None)
        if base is not None and o.dtype == meta_args[base].dtype and o is not meta_args[base]:
            alias = base
        elif not o._is_view() and o.storage_offset() == 0 and not any(o is a for a in meta_args):
            alias = None
        else:
            return
        results.append((tuple(o.shape), o.stride(), o.dtype, o.storage_offset(), alias))
    if len(META_RESULTS) >= META_RESULTS_KEPT:
        META_RESULTS.clear()
    container = type(out) if isinstance(out, (tuple, list)) else None
    META_RESULTS[key] = (container, device, tuple(results))


def _made(fake_mode, known, args):
    """Fake tensors of a remembered result's geometry: fresh memory, or a view on the storage of the
    argument the meta kernel's result was a view of (``args``: the call's arguments)."""
    container, device, results = known
    FakeTensor = fake_tensor_type()
    outs = []
    with outside_fake_mode(), plain_dispatch():
        for size, stride, dtype, offset, alias in results:
            if alias is None:
                outs.append(torch.empty_strided(size, stride, dtype=dtype, device="meta"))
            else:
                outs.append(torch.empty((0,), dtype=dtype, device="meta").set_(
                    args[alias].untyped_storage(), offset, size, stride))
    fakes = [FakeTensor(fake_mode, o, device) for o in outs]
    return container(fakes) if container is not None else fakes[0]


def move_views(old, new, users=None) -> None:
    """Put the program's views of ``old`` on the storage of ``new``, which replaces it.

    The fake values of ``old``'s views (its ``users``, by default all, and theirs, transitively, whose
    values share ``old``'s storage) were traced on ``old``'s storage; once they read ``new`` they alias
    its memory, and Inductor's and AOTAutograd's aliasing analyses read that from the fake values (a
    saved tensor that seems to alias no output is a donated buffer the backward overwrites). Each such
    value is remade on ``new``'s storage, its geometry kept, the storage offset moved as ``new``'s is
    from ``old``'s; nothing moves where the two differ in shape, strides or dtype (a symbolic geometry:
    or storage offset), or a value would not fit in ``new``'s storage."""
    before, after = old.meta.get("val"), new.meta.get("val")
    if not (_static(before) and _static(after)):
        _move_symbolic_views(old, before, after, users)
        return
    if before.untyped_storage()._cdata == after.untyped_storage()._cdata:
        return
    if (before.shape, before.stride(), before.dtype) != (after.shape, after.stride(), after.dtype):
        return
    shift = (after.storage_offset() - before.storage_offset()) * before.element_size()  # bytes
    source, remade = before.untyped_storage()._cdata, {}

    def moved(v):
        if isinstance(v, (tuple, list)):
            items = [moved(x) for x in v]
            return type(v)(items) if any(a is not b for a, b in zip(items, v)) else v
        if not _static(v) or v.untyped_storage()._cdata != source:
            return v
        if id(v) not in remade:
            offset, rest = divmod(v.storage_offset() * v.element_size() + shift, v.element_size())
            end = offset + sum((n - 1) * s for n, s in zip(v.shape, v.stride())) + 1 if v.numel() else offset
            if rest or offset < 0 or end * v.element_size() > after.untyped_storage().nbytes():
                return v
            t = _on_storage_of(after, v.shape, v.stride(), v.dtype, offset, v, v.requires_grad)
            remade[id(v)] = fake_tensor_type()(v.fake_mode, t, v.device)
        return remade[id(v)]

    _move_users(old, users, moved)


def _move_users(old, users, moved) -> None:
    """Set each of ``old``'s users' (``users``, by default all) fake values to ``moved`` of them, and
    their users' in turn where a value moved."""
    stack, seen = list(old.users if users is None else users), set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        value = node.meta.get("val")
        now = moved(value)
        if now is not value:  # a view of old: its own users may view it in turn
            # a new dict, never the old one changed: the pass's rollback snapshot holds that (Snapshot)
            node.meta = {**node.meta, "val": now}
            stack.extend(node.users)


def _move_symbolic_views(old, before, after, users) -> None:
    """Do :func:`move_views` where a geometry is symbolic.

    Each view is made again by the fake mode, as ``as_strided`` of ``new``'s value with its own
    geometry (a view in another dtype of the same item size as well), where ``old``'s and ``new``'s
    values have the same shape, strides, storage offset and dtype (else nothing moves)."""
    FakeTensor = fake_tensor_type()
    if not (isinstance(before, FakeTensor) and isinstance(after, FakeTensor)) or before.fake_mode is not after.fake_mode \
            or before.layout is not torch.strided or after.layout is not torch.strided:
        return
    if before.untyped_storage()._cdata == after.untyped_storage()._cdata:
        return
    try:
        same = (before.dtype == after.dtype and len(before.shape) == len(after.shape)
                and all(_same_size(a, b) for a, b in zip((*before.shape, *before.stride(), before.storage_offset()),
                                                         (*after.shape, *after.stride(), after.storage_offset()))))
    except Exception:  # a comparison the shape environment cannot decide
        same = False
    if not same:
        return
    source, mode, remade = before.untyped_storage()._cdata, after.fake_mode, {}

    def moved(v):
        if isinstance(v, (tuple, list)):
            items = [moved(x) for x in v]
            return type(v)(items) if any(a is not b for a, b in zip(items, v)) else v
        if not isinstance(v, FakeTensor) or v.layout is not torch.strided or v.untyped_storage()._cdata != source \
                or v.requires_grad or v.is_conj() or v.is_neg():
            return v
        if id(v) not in remade:
            with mode:  # a view in another dtype of the same item size (``view(torch.int32)``) too
                remade[id(v)] = torch.as_strided(after if v.dtype == after.dtype else after.view(v.dtype), v.shape,
                                                 v.stride(), v.storage_offset()) \
                    if v.element_size() == after.element_size() else None
        return remade[id(v)] if remade[id(v)] is not None else v

    _move_users(old, users, moved)


def _same_size(a, b) -> bool:
    """Whether two sizes (ints or SymInts) are the same expression."""
    if type(a) is int and type(b) is int:
        return a == b
    return str(a) == str(b)


def _static(v) -> bool:
    """Whether ``v`` is a strided fake tensor of static geometry."""
    return (isinstance(v, fake_tensor_type()) and v.layout is torch.strided
            and all(type(x) is int for x in (*v.shape, *v.stride(), v.storage_offset())))


def set_fake_value(node, value) -> None:
    """:func:`~..compat.set_value_meta`, its ``tensor_meta`` remembered by geometry for a static
    tensor (the same memory format, ``TensorMetadata`` otherwise made afresh)."""
    tensor_meta = None
    if isinstance(value, torch.Tensor) and value.layout is torch.strided and not value.is_quantized:
        shape, stride = tuple(value.shape), value.stride()
        if all(type(x) is int for x in (*shape, *stride)):
            key = (shape, stride, value.dtype, value.requires_grad)
            known = _TENSOR_METAS.get(key)
            if known is None:
                known = _TENSOR_METAS[key] = tensor_metadata(value)
                if len(_TENSOR_METAS) >= META_RESULTS_KEPT:
                    _TENSOR_METAS.clear()
            tensor_meta = known._replace(shape=value.shape, qparams={})
    set_value_meta(node, value, tensor_meta)


def fake_value_of(fake_mode, target, args, kwargs) -> Optional[object]:
    """The fake value of a call on fake values: :func:`static_fake_value`, else the fake mode's dispatch."""
    value = static_fake_value(fake_mode, target, args, kwargs)
    if value is None:
        with fake_mode:
            value = target(*args, **kwargs)
    return value
