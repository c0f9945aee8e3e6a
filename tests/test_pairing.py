"""The torchair hook pairs a backward with its forward by compile id, and uses the forward
only when every saved tensor matches it in name, shape, dtype and count; otherwise the pass
runs on the backward alone and logs why (pass_manager.forward_for)."""
import copy
import logging

import pytest
import torch
import torch.fx as fx
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func

from npu_fusion.models import bundled
from npu_fusion.plugin import pass_manager
from npu_fusion.plugin.pass_manager import make_torchair_pass, saved_tensor_mismatch
from npu_fusion_testing.capture import VARIANTS, Capture
from npu_fusion.measure.grads import MODEL_FACTOR, assert_close_as_unfused, float64_grads, run_grads

pytestmark = pytest.mark.smoke  # in the version matrix's smoke set: the torchair hook's pairing

ROPE, RMS = "rotary_position_embedding_grad", "rms_norm_grad"


def llama_partitions(batch, dynamic=False, **capture_options):
    """The bundled one-layer Llama's backward graph modules and their partitions' forward graphs."""
    model = bundled("llama", num_layers=1)
    ids = torch.randint(0, model.config.vocab_size, (batch, 8), generator=torch.Generator().manual_seed(0))
    if dynamic:
        torch._dynamo.mark_dynamic(ids, 0)
    capture = Capture(fuse=False, **capture_options)
    torch._dynamo.reset()
    torch.compile(lambda i: model.loss(i), backend=capture)(ids).backward()
    return capture.backwards, capture.partition_forwards


@pytest.mark.parametrize("partitioner, decompositions", VARIANTS)
@pytest.mark.parametrize("dynamic", [False, True])
def test_each_partition_pairs_with_its_own_forward(partitioner, decompositions, dynamic):
    backwards, forwards = llama_partitions(2, dynamic, partitioner=partitioner, decompositions=decompositions)
    assert backwards
    for bw, fw in zip(backwards, forwards):
        assert saved_tensor_mismatch(fw, bw.graph) is None


def test_a_forward_of_other_shapes_or_another_program_does_not_pair():
    (bw,), (fw,) = llama_partitions(2)
    (_,), (fw_batch3,) = llama_partitions(3)
    assert "in the backward" in saved_tensor_mismatch(fw_batch3, bw.graph)  # same names, other shapes
    rope_only = torch.fx.symbolic_trace(lambda x: (x * 2, x)).graph  # returns no saved tensor values
    assert "saved tensor" in saved_tensor_mismatch(rope_only, bw.graph)


OPTIONS = {"target": "generic", "strict": True}


def hook_backend(wrong_forward=None, alone=None):
    """AOTAutograd running the torchair hook as torchair does (on the forward, then on the
    backward under the same compile id); ``wrong_forward`` is remembered in place of the real one.
    ``alone`` gets the result of the pass on a copy of each backward without any forward."""
    hook = make_torchair_pass(OPTIONS)

    def fw_compiler(gm, _inputs):
        hook(gm)
        if wrong_forward is not None:
            pass_manager.remember_forward(fx.GraphModule(torch.nn.Module(), wrong_forward))
        return make_boxed_func(gm.forward)

    def bw_compiler(gm, _inputs):
        if alone is not None:
            alone.append(pass_manager.fuse_backward(copy.deepcopy(gm), OPTIONS, forward=None))
        hook(gm)
        return make_boxed_func(gm.forward)

    return aot_autograd(fw_compiler=fw_compiler, bw_compiler=bw_compiler)


@pytest.fixture
def npu_fusion_log(caplog):
    logger = logging.getLogger("npu_fusion")  # torch._logging stops it propagating to the root
    logger.addHandler(caplog.handler)
    caplog.set_level(logging.WARNING, logger="npu_fusion")
    yield caplog
    logger.removeHandler(caplog.handler)


@pytest.mark.parametrize("mismatched", [False, True])
def test_hook_uses_a_matching_forward_and_runs_alone_on_a_mismatched_one(npu_fusion_log, mismatched):
    """Through the hook: the real forward pairs silently; a forward of other shapes remembered
    under the same compile id is refused with a warning, and the pass runs on the backward
    alone. Every site ends fused or a recorded miss, and the gradients are right."""
    (_,), (fw_batch3,) = llama_partitions(3)
    model = bundled("llama", num_layers=1)
    ids = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    params = list(model.parameters())
    alone = []
    mark = pass_manager.HISTORY.mark()
    torch._dynamo.reset()
    compiled = torch.compile(lambda: model.loss(ids), backend=hook_backend(fw_batch3 if mismatched else None, alone))
    got, grad_outputs = run_grads(compiled, [], params)
    eager, _ = run_grads(lambda: model.loss(ids), [], params, grad_outputs)
    exact = float64_grads(lambda: model.loss(ids), [], params, grad_outputs)
    for g, e, x in zip(got, eager, exact):
        assert_close_as_unfused(g, e, x, factor=MODEL_FACTOR)
    # the hook's pass on the forward, then on a copy of the backward, then on the backward
    _, _, result = pass_manager.HISTORY.since(mark)
    refused = [r.getMessage() for r in npu_fusion_log.records if "is not this backward's" in r.getMessage()]
    assert len(refused) == (1 if mismatched else 0)
    if mismatched:
        assert "the pass runs on the backward alone" in refused[0] and "in the backward" in refused[0]
    (by_itself,) = alone
    if mismatched:  # exactly what the pass does on the backward alone
        assert [(s.op, s.outputs) for s in result.sites] == [(s.op, s.outputs) for s in by_itself.sites]
        assert [(m.op, m.node) for m in result.misses] == [(m.op, m.node) for m in by_itself.misses]
    else:
        assert result.fused(ROPE) == model.expected_sites[ROPE] and result.fused(RMS) == model.expected_sites[RMS]


def test_backward_alone_leaves_no_silent_miss():
    """On torch 2.10 and 2.13 the partition saves each norm's rstd twice (as it is and detached), which the
    backward alone cannot prove one statistic: its 3 norms were 2 recorded misses and one silent (the
    residual gradient sums each norm's dx into the next, and the third's sum was too large to read).
    Each is now one miss per norm saying what to give the pass (torch 2.6 and 2.7.1 fuse all three)."""
    (bw,), _ = llama_partitions(2)
    result = pass_manager.fuse_backward(bw, {"target": "generic", "strict": True}, forward=None)
    expected = bundled("llama", num_layers=1).expected_sites
    for op in (ROPE, RMS):
        assert result.fused(op) + sum(m.op == op for m in result.misses) == expected[op], result.misses
    norm_misses = [m for m in result.misses if m.op == RMS]
    assert len({m.node for m in norm_misses}) == len(norm_misses), norm_misses
    if not result.fused(RMS):  # the torch versions that save rstd twice: the miss says what to do
        assert all("forward=fw" in m.reason and "backend='npu_fusion'" in m.reason for m in norm_misses), norm_misses
