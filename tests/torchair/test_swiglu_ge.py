"""SwiGLU through torchair's real graph construction (CANN stubbed): the fused ops become one
``SwiGlu`` and one ``SwiGluGrad`` node with their ``dim``, and a Phi-3-style MLP trained through
``backend="npu_fusion"`` as on an Ascend host has ``SwiGlu`` in its forward GE graph and
``SwiGluGrad`` in its backward one, no decomposed SiLU left, gradients by the float64 criterion."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import npu_fusion  # noqa: F401  (registers torch.ops.npu_fusion)
from npu_fusion.measure.grads import MODEL_FACTOR, grad_failures
from npu_fusion.plugin import pass_manager
from npu_fusion.plugin.backend import get_backend

SWIGLU, SWIGLU_GRAD = torch.ops.npu_fusion.swiglu, torch.ops.npu_fusion.swiglu_grad


@pytest.mark.parametrize("dtype, dim", [(torch.float32, -1), (torch.bfloat16, -1), (torch.float16, 1)], ids=str)
def test_swiglu_ops_become_one_ge_node_each(ge, dtype, dim):
    def f(dy, x):
        return SWIGLU(x, dim), SWIGLU_GRAD(dy, x, dim)

    torch.manual_seed(0)
    x = torch.randn(4, 6, 32, dtype=dtype)
    dy = torch.randn([s // 2 if i == dim % 3 else s for i, s in enumerate(x.shape)], dtype=dtype)
    got = ge.compile(f)(dy, x)
    for a, b in zip(got, f(dy, x)):  # run eagerly: the reference kernels
        torch.testing.assert_close(a, b)
    g = ge.graph()
    forward, backward = g.one("SwiGlu"), g.one("SwiGluGrad")
    assert g.input_names(forward) == ["x"] and g.input_names(backward) == ["y_grad", "x"]
    for op in (forward, backward):
        assert g.attrs(op).get("dim", -1) == dim  # torchair omits an attribute equal to the IR default
        assert g.output_dtype(op) == dtype
    assert set(g.types()) <= {"Data", "SwiGlu", "SwiGluGrad", "NetOutput"}


class Phi3Mlp(torch.nn.Module):
    def __init__(self, dtype, hidden=32, intermediate=64):
        super().__init__()
        torch.manual_seed(0)
        self.gate_up_proj = torch.nn.Linear(hidden, 2 * intermediate, bias=False, dtype=dtype)
        self.down_proj = torch.nn.Linear(intermediate, hidden, bias=False, dtype=dtype)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(up * F.silu(gate))


def _outputs_and_grads(run, x, module=None):
    """The output and the gradients of x and of the parameters, by name, for a fixed random output gradient."""
    module = module or getattr(run, "_orig_mod", run)
    x = x.detach().requires_grad_()
    y = run(x)
    y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(y.dtype))
    out = {"y": y.detach().clone(), "x.grad": x.grad.clone()}
    out.update({f"{n}.grad": p.grad.clone() for n, p in module.named_parameters()})
    module.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_mlp_forward_and_backward_ge_graphs_hold_swiglu(ge, dtype):
    mlp = Phi3Mlp(dtype)
    x = torch.randn(2, 8, 32, dtype=dtype)
    torch._dynamo.reset()
    mark = pass_manager.HISTORY.mark()
    backend = get_backend({"target": "a2", "swiglu": True, "swiglu_forward": True}, torchair_config=ge.config(),
                          ascend_host=True)
    got = _outputs_and_grads(torch.compile(mlp, backend=backend, fullgraph=True), x)
    (result,) = pass_manager.HISTORY.since(mark)
    assert result.graph == "joint" and not result.misses, result.misses
    assert [result.fused(op) for op in ("swiglu", "swiglu_grad")] == [1, 1]
    eager = _outputs_and_grads(mlp, x)
    exact = _outputs_and_grads(copy.deepcopy(mlp).double(), x.double())
    assert not grad_failures(got, eager, exact, MODEL_FACTOR), grad_failures(got, eager, exact, MODEL_FACTOR)
    forward, backward = ge.forward(), ge.backward()
    assert forward.types()["SwiGlu"] == 1 and "SwiGluGrad" not in forward.types(), forward
    assert backward.types()["SwiGluGrad"] == 1 and "SwiGlu" not in backward.types(), backward
    for graph in (forward, backward):
        assert not {"Swish", "SwishGrad", "Sigmoid", "SiluGrad", "Silu"} & set(graph.types()), graph
    assert backward.input_shape(backward.one("SwiGluGrad"), "x")[-1] == 128  # the whole projection, saved


def test_mlp_through_install_is_one_miss_per_graph(ge):
    """torchair's post-partition hook (``npu_fusion.install``): the training forward saves the halves
    and silu for its backward, and the backward graph holds no x; each is one recorded miss saying
    the site fuses on the joint graph, nothing rewritten. torchair (2.13's wheel) then has no GE
    converter for the unfused ``aten.silu_backward`` at all, with or without the pass: the backward
    of a SwiGLU MLP lowers to GE only fused (``SwiGluGrad``, the backend's joint graph above)."""
    import npu_fusion

    mlp = Phi3Mlp(torch.bfloat16)
    x = torch.randn(2, 8, 32, dtype=torch.bfloat16)
    mark = pass_manager.HISTORY.mark()
    config = npu_fusion.install(ge.config(), target="a2", strict=True, swiglu=True, swiglu_forward=True)
    with pytest.raises(Exception, match="silu_backward"):
        _outputs_and_grads(ge.compile(mlp, config=config), x, mlp)
    results = pass_manager.HISTORY.since(mark)
    assert [r.graph for r in results] == ["forward", "backward"] and not any(r.sites for r in results), results
    (forward_miss,), (backward_miss,) = (r.misses for r in results)
    assert forward_miss.op == "swiglu" and "joint graph" in forward_miss.reason
    assert backward_miss.op == "swiglu_grad" and "joint graph" in backward_miss.reason
