"""What the rewrites and the evaluators rely on: fake values of inserted nodes (the rewrite),
and saved tensors seen as their forward expressions (provenance)."""
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

import npu_fusion  # noqa: F401  (registers the fused ops)
from npu_fusion.patterns.fake_values import static_fake_value as _static_fake_value

aten = torch.ops.aten

CASES = {
    "to_copy": (aten._to_copy.default, lambda t: ((t["x"],), {"dtype": torch.bfloat16})),
    "view": (aten.view.default, lambda t: ((t["x"], [8, 64]), {})),
    "slice-step": (aten.slice.Tensor, lambda t: ((t["x"], -1, 1, 64, 2), {})),
    "cat": (aten.cat.default, lambda t: (([t["x"], t["x"]], -1), {})),
    "stack": (aten.stack.default, lambda t: (([t["x"], t["x"]], -1), {})),
    "repeat_interleave": (aten.repeat_interleave.self_int, lambda t: ((t["x"], 2, -1), {})),
    "view_as_real": (aten.view_as_real.default, lambda t: ((t["c"],), {})),
    "transpose": (aten.transpose.int, lambda t: ((t["x"], 0, 1), {})),
    "rms_norm_grad": (torch.ops.npu_fusion.rms_norm_grad.default,
                      lambda t: ((t["x"], t["x"], t["rstd"], t["w"]), {})),
    "rope_grad": (torch.ops.npu_fusion.rotary_position_embedding_grad.default,
                  lambda t: ((t["x"], t["x"], t["x"], t["x"], 0), {})),
}


def _tensors(mode):
    with mode:
        return {"x": torch.empty(2, 4, 64), "c": torch.empty(2, 4, 32, dtype=torch.complex64),
                "rstd": torch.empty(2, 4, 1), "w": torch.empty(64)}


@pytest.mark.parametrize("name", sorted(CASES))
def test_static_fake_value_equals_fake_dispatch(name):
    target, make = CASES[name]
    mode = FakeTensorMode()
    args, kwargs = make(_tensors(mode))
    fast = _static_fake_value(mode, target, args, kwargs)
    with mode:
        slow = target(*args, **kwargs)
    assert fast is not None
    fast, slow = (fast, slow) if isinstance(slow, tuple) else ((fast,), (slow,))
    assert len(fast) == len(slow)
    for f, s in zip(fast, slow):
        assert isinstance(f, FakeTensor) and f.fake_mode is mode
        assert (f.shape, f.stride(), f.dtype, f.device) == (s.shape, s.stride(), s.dtype, s.device)


#: the cases whose meta result is not remembered: a view in another dtype than its input's, a view of
#: a tensor the kernel made
NOT_REMEMBERED = {"view_as_real", "repeat_interleave"}


@pytest.mark.parametrize("name", sorted(CASES))
def test_remembered_fake_values_equal_fake_dispatch(name):
    """A second call of one op on the same geometry (the next layer's), in another fake mode, answered
    from the remembered meta result: the same geometry (the storage offset included) as
    the fake mode's own dispatch, in that mode, never sharing the first call's memory; a view in another
    dtype than its input's, or of a tensor the kernel made, is computed again."""
    from npu_fusion.patterns import fake_values

    target, make = CASES[name]
    first = FakeTensorMode()
    args, kwargs = make(_tensors(first))
    earlier = _static_fake_value(first, target, args, kwargs)
    earlier = earlier if isinstance(earlier, tuple) else (earlier,)
    key = fake_values.geometry_key(target, args, kwargs)
    assert (key in fake_values.META_RESULTS) == (name not in NOT_REMEMBERED)
    mode = FakeTensorMode()
    args, kwargs = make(_tensors(mode))
    fast = _static_fake_value(mode, target, args, kwargs)
    with mode:
        slow = target(*args, **kwargs)
    fast, slow = (fast, slow) if isinstance(slow, tuple) else ((fast,), (slow,))
    assert len(fast) == len(slow)
    for f, s, e in zip(fast, slow, earlier):
        assert isinstance(f, FakeTensor) and f.fake_mode is mode
        assert (f.shape, f.stride(), f.dtype, f.device, f.storage_offset()) == \
            (s.shape, s.stride(), s.dtype, s.device, s.storage_offset())
        assert f.untyped_storage()._cdata != e.untyped_storage()._cdata


def test_remembered_views_share_their_input_as_the_kernels_do():
    """Two views of one input that one call returns, made from the remembered result, share one storage
    of the input's size, as the meta kernel's do."""
    mode = FakeTensorMode()
    x = _tensors(mode)["x"]
    for _ in range(2):  # computed, then remembered
        halves = _static_fake_value(mode, aten.split.Tensor, (x, 32, -1), {})
        with mode:
            slow = aten.split.Tensor(x, 32, -1)
        assert [(h.shape, h.stride(), h.storage_offset()) for h in halves] == \
            [(s.shape, s.stride(), s.storage_offset()) for s in slow]
        assert halves[0].untyped_storage()._cdata == halves[1].untyped_storage()._cdata
        assert halves[0].untyped_storage().nbytes() == x.untyped_storage().nbytes()


def test_tensor_meta_is_the_extracted_one():
    """The ``tensor_meta`` remembered by geometry equals the one extracted from each value (channels-last
    and transposed strides included), and is never one object shared by two nodes."""
    from torch.fx.passes.shape_prop import _extract_tensor_metadata

    from npu_fusion.patterns.fake_values import set_fake_value

    mode = FakeTensorMode()
    with mode:
        values = [torch.empty(2, 4, 64), torch.empty(2, 4, 64).transpose(0, 1), torch.empty(2, 3, 4, 5).to(
            memory_format=torch.channels_last), torch.empty(2, 4, 64, dtype=torch.bfloat16), torch.empty(())]
    graph = torch.fx.Graph()
    for value in values * 2:
        node = graph.placeholder("v")
        set_fake_value(node, value)
        assert node.meta["val"] is value and node.meta["tensor_meta"] == _extract_tensor_metadata(value)
    metas = [n.meta["tensor_meta"] for n in graph.nodes]
    assert len({id(m) for m in metas}) == len(metas)


def test_symbolic_shapes_go_through_the_fake_mode():
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic, StatelessSymbolicContext

    mode = FakeTensorMode(shape_env=ShapeEnv())
    ctx = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.STATIC, DimDynamic.STATIC])
    x = mode.from_tensor(torch.empty(2, 4, 64), source=ConstantSource("x"), symbolic_context=ctx)
    assert not isinstance(x.shape[0], int)
    assert _static_fake_value(mode, aten._to_copy.default, (x,), {"dtype": torch.bfloat16}) is None


def test_explicit_device_goes_through_the_fake_mode():
    mode = FakeTensorMode()
    x = _tensors(mode)["x"]
    assert _static_fake_value(mode, aten._to_copy.default, (x,), {"device": "cpu"}) is None


def _saved_copies_graphs():
    """A forward that computes ``cache[..., 0]`` twice, ``cache.flip(0)[..., 0]`` and two
    Bernoulli draws of one shape, all saved; the backward's placeholders of the same names."""
    aten = torch.ops.aten
    forward = torch.fx.Graph()
    cache = forward.placeholder("cache")
    cache.meta["val"] = torch.empty(6, 8, 2)
    flipped = forward.call_function(aten.flip.default, (cache, [0]))
    saved = {
        "first": forward.call_function(aten.select.int, (cache, -1, 0)),
        "second": forward.call_function(aten.select.int, (cache, -1, 0)),
        "of_flipped": forward.call_function(aten.select.int, (flipped, -1, 0)),
        "draw_a": forward.call_function(aten.bernoulli.p, (cache, 0.5)),
        "draw_b": forward.call_function(aten.bernoulli.p, (cache, 0.5)),
    }
    for name, node in saved.items():
        node.name = name
        node.meta["val"] = torch.empty(6, 8) if "draw" not in name else torch.empty(6, 8, 2)
    forward.output(tuple(saved.values()))
    backward = torch.fx.Graph()
    placeholders = {}
    for name, node in saved.items():
        placeholders[name] = backward.placeholder(name)
        placeholders[name].meta["val"] = node.meta["val"]
    return forward, backward, placeholders


def test_saved_copies_of_one_expression_are_one_value():
    from npu_fusion.patterns.evaluator import Provenance

    forward, backward, bw = _saved_copies_graphs()
    provenance = Provenance(forward, backward)
    assert provenance.same_saved_value(bw["second"]) is bw["first"]
    assert provenance.same_saved_value(bw["first"]) is bw["first"]
    # another input (a flipped cache) is another value
    assert provenance.same_saved_value(bw["of_flipped"]) is bw["of_flipped"]
    # random draws are never the same value, however alike their expressions
    assert provenance.same_saved_value(bw["draw_b"]) is bw["draw_b"]


def test_gradient_dependence_inside_a_round_judges_inserted_nodes_by_their_inputs():
    """Within one round the set of gradient-dependent nodes is computed once; nodes a rewrite
    inserts afterwards (chains of them too) are judged by what they read, as a fresh walk would."""
    from npu_fusion.patterns.nodes import gradient_dependent, one_round

    aten = torch.ops.aten
    graph = torch.fx.Graph()
    x, dy = graph.placeholder("primals_1"), graph.placeholder("tangents_1")
    forward = graph.call_function(aten.neg.default, (x,))
    backward = graph.call_function(aten.mul.Tensor, (dy, forward))
    out = graph.output((forward, backward))
    with one_round(graph):
        answer = gradient_dependent(graph)
        assert gradient_dependent(graph) is answer  # computed once in the round
        assert backward in answer and dy in answer and forward not in answer and x not in answer
        with graph.inserting_before(out):
            first = graph.call_function(aten.mul.Tensor, (backward, x))
            second = graph.call_function(aten.neg.default, (first,))
            forward_only = graph.call_function(aten.add.Tensor, (x, forward))
        assert second in answer and first in answer and forward_only not in answer
    fresh = gradient_dependent(graph)
    assert fresh is not answer and {n for n in graph.nodes if n in fresh} == {dy, backward, first, second, out}
