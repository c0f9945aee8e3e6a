"""SwiGLU fused on the joint graph: each form of a gate and an up that are the two halves of one
projection becomes ``swiglu`` and ``swiglu_grad``, outputs and gradients by the float64 criterion;
its near misses (swapped halves, silu on the wrong half, an odd width, rounding the program does)
are recorded and left as they are; a gate and an up of two projections (Llama's MLP) are no site."""
import pytest
import torch
import torch.nn.functional as F

from npu_fusion.measure.grads import MODEL_FACTOR, assert_close_as_unfused, float64_grads, float64_output, run_grads
from npu_fusion.measure.recording import op_counts
from npu_fusion_testing.capture import Capture

ON = {"swiglu": True, "swiglu_forward": True}
FORWARD, BACKWARD = "swiglu", "swiglu_grad"
H = 8  # the width of each half


def check(fn, inputs, params=(), **options):
    """Compile ``fn`` with the pass (SwiGLU on); its output and every gradient pass the float64
    criterion against eager, in eager's dtypes and shapes. Returns the pass's results."""
    capture = Capture(**dict(ON, **options))
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=capture)
    with torch.no_grad():
        got, eager, exact = compiled(*inputs), fn(*inputs), float64_output(fn, inputs, params)
    assert got.dtype == eager.dtype and got.shape == eager.shape
    assert_close_as_unfused(got, eager, exact, factor=MODEL_FACTOR)
    fused, grad_outputs = run_grads(compiled, inputs, params)
    unfused, _ = run_grads(fn, inputs, params, grad_outputs)
    for f, e, x in zip(fused, unfused, float64_grads(fn, inputs, params, grad_outputs)):
        assert f.dtype == e.dtype and f.shape == e.shape
        assert_close_as_unfused(f, e, x, factor=MODEL_FACTOR)
    return capture


def _inputs(dtype, lead=(2, 3), width=2 * H, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(*lead, d, generator=g) * 0.5).to(dtype).requires_grad_()
    w = (torch.randn(d, width, generator=g) / 4).to(dtype).requires_grad_()
    return [x, w]


def chunked(x, w):  # Phi-3's and GLM-4's MLP: gate_up_proj(x).chunk(2, -1)
    gate, up = (x @ w).chunk(2, dim=-1)
    return F.silu(gate) * up


def split(x, w):
    gate, up = torch.split(x @ w, H, dim=-1)
    return up * F.silu(gate)  # either factor order


def sliced(x, w):
    h = x @ w
    return F.silu(h[..., :H]) * h[..., H:]


def upcast(x, w):  # silu and the product in float32, cast back: rounded once, as the fused op does
    gate, up = (x @ w).chunk(2, dim=-1)
    return (F.silu(gate.float()) * up.float()).to(x.dtype)


def megatron(x, w):  # [S, B, 2H] fc1 output with torch.chunk, as Megatron's gated linear unit
    h = F.linear(x.transpose(0, 1), w.t())
    gate, up = torch.chunk(h, 2, dim=-1)
    return F.silu(gate) * up


class Phi3Mlp(torch.nn.Module):
    """Phi-3's MLP as transformers writes it: one gate_up_proj, chunk, silu, down_proj."""

    def __init__(self, dtype):
        super().__init__()
        torch.manual_seed(0)
        self.gate_up_proj = torch.nn.Linear(16, 2 * H, bias=False, dtype=dtype)
        self.down_proj = torch.nn.Linear(H, 16, bias=False, dtype=dtype)

    def forward(self, x):
        up_states = self.gate_up_proj(x)
        gate, up_states = up_states.chunk(2, dim=-1)
        return self.down_proj(up_states * F.silu(gate))


def _joint(capture):
    """The pass's result on the joint graph (``check`` also compiles an inference graph)."""
    (result,) = [r for r in capture.results if r.graph == "joint"]
    return result


def _fused(capture, op):
    return _joint(capture).fused(op)


def _misses(capture, op):
    return [m for m in _joint(capture).misses if m.op == op]


@pytest.mark.parametrize("form", [chunked, split, sliced, megatron], ids=lambda f: f.__name__)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_form_fuses_forward_and_backward(form, dtype):
    capture = check(form, _inputs(dtype))
    assert (_fused(capture, FORWARD), _fused(capture, BACKWARD)) == (1, 1), _joint(capture).misses
    assert not _joint(capture).misses
    joint = capture.after[capture.results.index(_joint(capture))]
    assert not [n for n in joint.nodes if getattr(n.target, "__name__", "").split(".")[0] in ("silu", "silu_backward")]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_upcast_product_cast_back_fuses(dtype):
    capture = check(upcast, _inputs(dtype))
    assert (_fused(capture, FORWARD), _fused(capture, BACKWARD)) == (1, 1), _joint(capture).misses


def test_phi3_mlp_module_fuses_and_saves_the_projection():
    mlp = Phi3Mlp(torch.bfloat16)
    x = torch.randn(2, 3, 16, dtype=torch.bfloat16, requires_grad=True)
    capture = check(mlp, [x], list(mlp.parameters()))
    assert (_fused(capture, FORWARD), _fused(capture, BACKWARD)) == (1, 1), _joint(capture).misses
    joint = capture.after[capture.results.index(_joint(capture))]
    (fused_grad,) = [n for n in joint.nodes if getattr(n.target, "__name__", "").split(".")[0] == BACKWARD]
    x_read = fused_grad.args[1]  # the whole projection, not its halves: what the partition saves
    assert x_read.meta["val"].shape[-1] == 2 * H and "tangents" not in str(x_read.all_input_nodes)


def test_backward_alone_fuses_and_the_forward_waits_for_it():
    capture = check(chunked, _inputs(torch.float32), swiglu_forward=False)
    assert (_fused(capture, FORWARD), _fused(capture, BACKWARD)) == (0, 1)
    capture = check(chunked, _inputs(torch.float32), swiglu=False)
    assert (_fused(capture, FORWARD), _fused(capture, BACKWARD)) == (0, 0)
    (miss,) = _misses(capture, FORWARD)
    assert "decomposed backward" in miss.reason


def test_on_by_default_and_off_when_switched_off():
    """Both rules on by default (the sweeps fused every counted site); switched off, nothing fuses
    and nothing is recorded."""
    capture = check(chunked, _inputs(torch.float32), swiglu=False, swiglu_forward=False)
    assert not _joint(capture).misses and (_fused(capture, FORWARD), _fused(capture, BACKWARD)) == (0, 0)
    from npu_fusion.plugin.options import FusionOptions
    assert FusionOptions().swiglu is True and FusionOptions().swiglu_forward is True


# -- near misses: recorded, never rewritten ----------------------------------------------

def swapped(x, w):  # silu on the second half, the first the up
    gate, up = (x @ w).chunk(2, dim=-1)
    return F.silu(up) * gate


def odd(x, w):  # a 15-wide projection: unequal pieces around a middle lane
    h = x @ w
    return F.silu(h[..., :7]) * h[..., 8:]


def rounded_inside(x, w):  # a float32 program that rounds the gate to bf16 inside the site
    gate, up = (x @ w).chunk(2, dim=-1)
    return F.silu(gate.to(torch.bfloat16).float()) * up


def kept_wider(x, w):  # bf16 halves, product in float32 kept in float32: the fused op would round it
    gate, up = (x @ w).chunk(2, dim=-1)
    return F.silu(gate.float()) * up.float()


@pytest.mark.parametrize("form, dtype, width, reason", [
    (swapped, torch.float32, 2 * H, "second half"),
    (odd, torch.float32, 15, "odd"),
    (rounded_inside, torch.float32, 2 * H, "rounds"),
], ids=["swapped", "odd", "rounded_inside"])
def test_near_miss_is_recorded_and_left(form, dtype, width, reason):
    capture = check(form, _inputs(dtype, width=width))
    assert (_fused(capture, FORWARD), _fused(capture, BACKWARD)) == (0, 0)
    backward, forward = _misses(capture, BACKWARD), _misses(capture, FORWARD)
    assert len(backward) == 1 and reason in backward[0].reason, _joint(capture).misses
    assert len(forward) == 1, _joint(capture).misses


def test_product_kept_wider_than_the_halves_keeps_its_forward():
    capture = check(kept_wider, _inputs(torch.bfloat16))
    assert _fused(capture, FORWARD) == 0
    (miss,) = _misses(capture, FORWARD)
    assert "float32" in miss.reason
    assert _fused(capture, BACKWARD) == 1, capture.misses  # dx is rounded to bf16 as the program rounds it


def test_two_projections_are_no_site():
    def llama(x, w):  # Llama's MLP: gate_proj and up_proj, two weights
        return F.silu(x @ w[:, :H]) * (x @ w[:, H:])

    capture = check(llama, _inputs(torch.float32))
    assert not _joint(capture).misses and (_fused(capture, FORWARD), _fused(capture, BACKWARD)) == (0, 0)


def test_inference_graph_fuses_the_forward():
    x, w = [t.detach() for t in _inputs(torch.bfloat16)]
    capture = Capture(**ON)
    torch._dynamo.reset()
    with torch.no_grad():
        got = torch.compile(chunked, backend=capture)(x, w)
        eager, exact = chunked(x, w), float64_output(chunked, [x, w])
    assert_close_as_unfused(got, eager, exact, factor=MODEL_FACTOR)
    assert capture.fused(FORWARD) == 1 and not capture.misses()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("partitioner, decompositions", [("min_cut", "none"), ("default", "core"), ("min_cut", "core")])
def test_partitioners_and_decompositions(partitioner, decompositions, dtype):
    """min-cut fuses as the default partitioner; under the core ATen decompositions SiLU is
    ``x * sigmoid(x)`` and its backward its formula, which the backend puts back where the graph
    holds exactly that table's trace of them (``npu_fusion.plugin.recompose``): fused both ways."""
    capture = check(chunked, _inputs(dtype), partitioner=partitioner, decompositions=decompositions)
    assert (_fused(capture, FORWARD), _fused(capture, BACKWARD)) == (1, 1), _joint(capture).misses
    assert not _joint(capture).misses


def _two_projections(x, w):  # Llama's MLP: gate_proj and up_proj, two weights (no site)
    return F.silu(x @ w[:, :H]) * (x @ w[:, H:])


@pytest.mark.parametrize("form, reason", [(swapped, "second half"), (rounded_inside, "rounds"),
                                          (_two_projections, None)], ids=["swapped", "rounded_inside", "no_site"])
def test_core_decompositions_leave_what_stays_unfused_as_the_table_made_it(form, reason):
    """Under the core ATen decompositions the SiLU put back for the rules is decomposed again where
    the site stays unfused: one miss per fused op for a near miss (none for no site), and every
    graph after the pass holds the table's trace again, op for op (no ``silu`` left)."""
    capture = check(form, _inputs(torch.float32), decompositions="core")
    assert (_fused(capture, FORWARD), _fused(capture, BACKWARD)) == (0, 0)
    if reason is None:
        assert not _joint(capture).misses, _joint(capture).misses
    for op in (FORWARD, BACKWARD) if reason is not None else ():
        misses = _misses(capture, op)
        assert len(misses) == 1 and reason in misses[0].reason, _joint(capture).misses
    after = capture.after
    for graph in after:
        assert not [n for n in graph.nodes if n.target in (torch.ops.aten.silu.default,
                                                           torch.ops.aten.silu_backward.default)], graph
    (inference,) = [i for i, r in enumerate(capture.results) if r.graph == "inference"]
    assert op_counts(after[inference]) == capture.before_counts()[inference]


def test_dynamic_batch_and_sequence():
    """Batch and sequence symbolic: the halves are proven over the static last axis, x is viewed in
    dy's symbolic leading shape, gradients by the float64 criterion (``compile_and_compare``)."""
    from npu_fusion_testing.capture import compile_and_compare

    mlp = Phi3Mlp(torch.float32)
    x = torch.randn(2, 5, 16, requires_grad=True)
    capture = compile_and_compare(mlp, [x], list(mlp.parameters()), dynamic_dims={0: (0, 1)}, **ON)
    (result,) = capture.results
    assert [s.op for s in result.sites] == [BACKWARD, FORWARD] and not result.misses


def test_backward_graph_alone_is_one_recorded_miss():
    """torchair's post-partition hook hands the pass the backward graph: the halves are two saved
    tensors and x is not saved, so the site is one miss saying where it fuses, never silence."""
    capture = Capture(stage="backward", **ON)
    torch._dynamo.reset()
    compiled = torch.compile(chunked, backend=capture)
    fused, grad_outputs = run_grads(compiled, _inputs(torch.float32))
    unfused, _ = run_grads(chunked, _inputs(torch.float32), (), grad_outputs)
    for f, e in zip(fused, unfused):
        torch.testing.assert_close(f, e)  # the graph is left as it was
    (result,) = capture.results
    assert result.graph == "backward" and not result.sites
    (miss,) = result.misses
    assert miss.op == BACKWARD and "joint graph" in miss.reason


def test_leading_axes_moved_inside_is_a_near_miss():
    """A transpose of the leading axes between the projection and its halves: the lanes domain sees
    the same values position by position, but the fused op would keep the projection's order."""
    def transposed(x, w):
        gate, up = (x @ w).transpose(0, 1).chunk(2, dim=-1)
        return F.silu(gate) * up

    capture = check(transposed, _inputs(torch.float32))
    fused = (_fused(capture, FORWARD), _fused(capture, BACKWARD))
    assert fused == (0, 0) or not [m for m in _joint(capture).misses if "leading axes" not in m.reason], fused


# -- runs of positions are a spelling of the same values -----------------------------------

@pytest.mark.parametrize("form, width", [(chunked, 2 * H), (split, 2 * H), (sliced, 2 * H), (megatron, 2 * H),
                                         (swapped, 2 * H), (odd, 15)],
                         ids=["chunked", "split", "sliced", "megatron", "swapped", "odd"])
def test_runs_of_positions_change_no_decision(form, width, monkeypatch):
    """Both rules decide the same with the lane values kept as runs of positions as position by position
    (the forward compares its product, the backward its dx, once a run): the same sites and misses."""
    from npu_fusion.patterns import lane_polys

    def decided(runs: bool):
        monkeypatch.setattr(lane_polys, "RUNS", runs)
        capture = Capture(**ON)
        torch._dynamo.reset()
        torch.compile(form, backend=capture)(*_inputs(torch.float32, width=width)).sum().backward()
        result = _joint(capture)
        return ([(s.op, s.outputs, s.replaced_nodes) for s in result.sites],
                [(m.op, m.node, m.reason) for m in result.misses])

    with_runs = decided(True)
    assert with_runs == decided(False)
    assert with_runs[0] or with_runs[1]  # each form is a site or a recorded near miss


# -- a projection viewed with more axes before its halves ------------------------------------

def unbound(x, w):  # the halves on an axis of their own: view(B, S, 2, H).unbind(-2) is chunk(2, -1)
    gate, up = (x @ w).view(*x.shape[:-1], 2, H).unbind(-2)
    return F.silu(gate) * up


def selected(x, w):
    h = (x @ w).view(*x.shape[:-1], 2, H)
    return F.silu(h[..., 0, :]) * h[..., 1, :]


def chunked_across(x, w):  # chunk(2, -2) of [..., 2, H]: halves [..., 1, H], swiglu(x, -1) viewed so
    gate, up = (x @ w).view(*x.shape[:-1], 2, H).chunk(2, dim=-2)
    return F.silu(gate) * up


def per_head(x, w):  # each of 2 heads has its own halves: swiglu over the view [..., 2, H] (halves H/2 wide)
    gate, up = (x @ w).view(*x.shape[:-1], 2, H).chunk(2, dim=-1)
    return F.silu(gate) * up


def interleaved_view(x, w):  # gate x[..., 0::2], up x[..., 1::2]: halves one element wide
    gate, up = (x @ w).view(*x.shape[:-1], H, 2).unbind(-1)
    return F.silu(gate) * up


def halves_across_leading(x, w):  # [B, S, 2H] viewed [B, 2, S, H]: each "half" mixes gate and up rows
    gate, up = (x @ w).view(x.shape[0], 2, x.shape[1], H).unbind(1)
    return F.silu(gate) * up


def halves_moved_first(x, w):  # [..., 2, H] permuted so the halves' axis leads: no permutation is followed
    gate, up = (x @ w).view(*x.shape[:-1], 2, H).permute(2, 0, 1, 3)
    return F.silu(gate) * up


def _inference_fused(form, inputs):
    capture = Capture(**ON)
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(form, backend=capture)(*[t.detach() for t in inputs])
    (result,) = capture.results
    return result.fused(FORWARD), result.misses


@pytest.mark.parametrize("form, lead", [(unbound, (2, 3)), (selected, (2, 3)), (chunked_across, (2, 3)),
                                        (per_head, (2, 3)), (chunked, (2, 3, 2))],
                         ids=["unbound", "selected", "chunked_across", "per_head", "x_4d"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_projection_viewed_before_its_halves_fuses_both_ways(form, lead, dtype):
    """A view of the projection whose halves are the fused op's over the projection (``unbind(-2)`` of
    ``[..., 2, H]``) or over the view (``chunk(2, -1)`` of ``[..., N, 2I]``): fused both ways, outputs and
    gradients by the float64 criterion, and the inference graph's forward too."""
    inputs = _inputs(dtype, lead=lead)
    capture = check(form, inputs)
    assert (_fused(capture, FORWARD), _fused(capture, BACKWARD)) == (1, 1), _joint(capture).misses
    assert not _joint(capture).misses
    assert _inference_fused(form, inputs) == (1, [])


@pytest.mark.parametrize("form, reason", [(interleaved_view, "interleave element by element"),
                                          (halves_across_leading, "along axis 1"),
                                          (halves_moved_first, "moved there from axis 2")],
                         ids=["interleaved_view", "across_leading", "moved_first"])
def test_view_whose_halves_are_not_the_fused_ops_is_one_miss_each_way(form, reason):
    """Halves that interleave along x's last axis, that a view cuts across the leading axes, or whose axis
    a permutation moves among the leading ones: not two blocks the rules read, one recorded miss each way."""
    capture = check(form, _inputs(torch.float32))
    assert (_fused(capture, FORWARD), _fused(capture, BACKWARD)) == (0, 0)
    for op in (FORWARD, BACKWARD):
        (miss,) = _misses(capture, op)
        assert reason in miss.reason, miss.reason
    fused, (miss,) = _inference_fused(form, _inputs(torch.float32))
    assert fused == 0 and reason in miss.reason


# -- the halves read elsewhere: their other gradients are added to the fused dx's halves ----------

def gate_reused(x, w):
    gate, up = (x @ w).chunk(2, dim=-1)
    return F.silu(gate) * up + gate


def up_reused(x, w):
    gate, up = (x @ w).chunk(2, dim=-1)
    return F.silu(gate) * up + up.sum(-1, keepdim=True)


def gate_returned(x, w):
    gate, up = (x @ w).chunk(2, dim=-1)
    return F.silu(gate) * up, gate


def up_returned_upcast(x, w):
    gate, up = (x @ w).chunk(2, dim=-1)
    return (F.silu(gate.float()) * up.float()).to(x.dtype), up


def gate_squared(x, w):  # the gate's other gradient is a backward of its own that reads the gate
    gate, up = (x @ w).chunk(2, dim=-1)
    return F.silu(gate) * up + gate * gate


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("form", [gate_reused, up_reused, gate_returned, up_returned_upcast, gate_squared],
                         ids=lambda f: f.__name__)
def test_halves_with_other_users_fuse_both_ways(form, dtype):
    """The gate or the up read besides the product (returned, added): autograd adds their other
    gradients to the halves' before joining them; the fused dx's halves replace the product's two,
    the sums stay. Fused both ways, outputs and every gradient by the float64 criterion."""
    from npu_fusion_testing.capture import compile_and_compare

    inputs = _inputs(dtype)
    capture = compile_and_compare(form, inputs, **ON)
    (result,) = capture.results
    assert sorted(s.op for s in result.sites) == [FORWARD, BACKWARD] and not result.misses, result.misses
    with torch.no_grad():
        got = torch.compile(form, backend=Capture(**ON))(*inputs)
        eager, exact = form(*inputs), float64_output(form, inputs)
    for g, e, x in zip(*(o if isinstance(o, tuple) else (o,) for o in (got, eager, exact))):
        assert_close_as_unfused(g, e, x, factor=MODEL_FACTOR)


def rounded_inside_gate_reused(x, w):  # a float32 program rounding the gate to bf16 inside the site
    gate, up = (x @ w).chunk(2, dim=-1)
    return F.silu(gate.to(torch.bfloat16).float()) * up + gate


def test_halves_with_other_users_keep_the_near_misses_of_the_site():
    """A site whose halves have other users is judged as any other: silu reading a copy of the gate
    rounded to bf16 in a float32 program stays unfused both ways, one miss each saying so."""
    capture = check(rounded_inside_gate_reused, _inputs(torch.float32))
    assert (_fused(capture, FORWARD), _fused(capture, BACKWARD)) == (0, 0)
    for op in (FORWARD, BACKWARD):
        (miss,) = _misses(capture, op)
        assert "rounded to torch.bfloat16" in miss.reason, miss.reason
