"""Forward fusion on inference graphs (issue 35): under ``torch.no_grad()``, or where no input needs a
gradient, AOTAutograd makes an inference graph instead of a joint one; the forward rules run on it,
through the ``npu_fusion`` backend and through Inductor after ``install_inductor``. Every norm and
rotation of a bf16 transformers Llama and Qwen3 in ``eval()`` fuses, the outputs by the float64
criterion."""
import copy

import pytest
import torch

from npu_fusion.measure.grads import MODEL_FACTOR, assert_close_as_unfused
from npu_fusion.measure.recording import InductorRecorder
from npu_fusion.plugin.options import FusionOptions
from npu_fusion.plugin.pass_manager import HISTORY
from npu_fusion_testing.capture import Capture, decomposed_leftovers

transformers = pytest.importorskip("transformers")

from test_forward_near_misses import NORM_NEAR_MISSES, ROPE_NEAR_MISSES, _seeded  # noqa: E402
from test_models import count_sites, tiny_causal_lm  # noqa: E402

FORWARD_OPS = ("rms_norm", "rotary_position_embedding")


def eval_model(architecture):
    """A 2-layer bf16 transformers causal LM of ``architecture`` in ``eval()``, and its sites
    counted in an eager run (independently of the pass)."""
    model = tiny_causal_lm(architecture, kv_heads=2).to(torch.bfloat16).eval()
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), count_sites(model) as expected:
        eager = model(input_ids=ids).logits
    with torch.no_grad():
        exact = copy.deepcopy(model).double()(input_ids=ids).logits
    return model, ids, expected, eager, exact


def assert_every_site_fused(results, expected):
    assert results and all(r.graph == "inference" and r.error is None for r in results), results
    assert [m for r in results for m in r.misses] == []
    assert sum(r.fused("rms_norm") for r in results) == expected["rms_norm"]
    assert sum(r.fused("rotary_position_embedding") for r in results) == expected["rope"]
    assert not any(s.op.endswith("_grad") for r in results for s in r.sites)


@pytest.mark.parametrize("architecture, norms", [("llama", 5), ("qwen3", 9)])
def test_eval_under_no_grad_fuses_every_site_through_the_backend(architecture, norms):
    """The inference graph of a bf16 Llama (5 norms, 4 rotations) and Qwen3 (its q/k norms too):
    every norm and rotation fused, nothing of a decomposed norm or rotation left, and the logits
    as close to float64 as eager's."""
    model, ids, expected, eager, exact = eval_model(architecture)
    assert expected == {"rms_norm": norms, "rope": 4}
    torch._dynamo.reset()
    capture = Capture(target="generic")
    with torch.no_grad():
        got = torch.compile(model, backend=capture)(input_ids=ids).logits
    assert_every_site_fused(capture.results, expected)
    assert all(decomposed_leftovers(graph) == [] for graph in capture.after)
    assert capture.backwards == []  # an inference graph is no backward
    assert got.dtype == eager.dtype and got.shape == eager.shape
    assert_close_as_unfused(got, eager, exact, factor=MODEL_FACTOR)


@pytest.mark.parametrize("architecture", ["llama", "qwen3"])
def test_eval_under_no_grad_fuses_every_site_through_inductor(architecture):
    """The same models through stock Inductor after ``install_inductor``: its joint-graph passes
    run on the inference graph, so the installed pass fuses it."""
    model, ids, expected, eager, exact = eval_model(architecture)
    torch._dynamo.reset()
    recorder = InductorRecorder(FusionOptions.from_mapping({"target": "generic", "strict": True}))
    with recorder.installed(), torch.no_grad():
        got = torch.compile(model, backend=recorder)(input_ids=ids).logits
    assert_every_site_fused(recorder.results, expected)
    assert got.dtype == eager.dtype and got.shape == eager.shape
    assert_close_as_unfused(got, eager, exact, factor=MODEL_FACTOR)


def hf_norm_and_rotation(x, w, cos, sin):
    """An HF bf16 RMSNorm, then HF's ``rotate_half`` RoPE of its output."""
    x32 = x.float()
    h = w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)
    half = h.shape[-1] // 2
    return h * cos + torch.cat((-h[..., half:], h[..., :half]), -1) * sin


def norm_and_rotation_inputs(requires_grad=False):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 4, 8, 32, generator=g).to(torch.bfloat16).requires_grad_(requires_grad)
    w = torch.randn(32, generator=g).to(torch.bfloat16).requires_grad_(requires_grad)
    angles = torch.randn(8, 16, generator=g)
    cos, sin = (torch.cat((f(angles), f(angles)), -1).to(torch.bfloat16) for f in (torch.cos, torch.sin))
    return x, w, cos, sin


def test_no_input_needing_a_gradient_is_an_inference_graph_too():
    """Grad mode on, but no input requires grad (frozen weights): AOTAutograd makes an inference
    graph, and both sites fuse there; the output by the float64 criterion."""
    inputs = norm_and_rotation_inputs()
    torch._dynamo.reset()
    capture = Capture(target="generic")
    got = torch.compile(hf_norm_and_rotation, backend=capture)(*inputs)
    (result,) = capture.results
    assert result.graph == "inference" and result.fused("rms_norm") == 1
    assert result.fused("rotary_position_embedding") == 1 and not result.misses
    eager = hf_norm_and_rotation(*inputs)
    exact = hf_norm_and_rotation(*(t.double() for t in inputs))
    assert_close_as_unfused(got, eager, exact, factor=MODEL_FACTOR)


def test_training_still_runs_the_joint_graph():
    """With inputs that need a gradient, the same program is a joint graph, fused as before
    (forward and backward); no inference result."""
    inputs = norm_and_rotation_inputs(requires_grad=True)
    torch._dynamo.reset()
    capture = Capture(target="generic")
    torch.compile(hf_norm_and_rotation, backend=capture)(*inputs).sum().backward()
    (result,) = capture.results
    assert result.graph == "joint" and result.fused("rms_norm_grad") == 1 and result.fused("rms_norm") == 1
    assert result.fused("rotary_position_embedding_grad") == 1 and result.fused("rotary_position_embedding") == 1


def test_a_site_the_target_refuses_is_one_recorded_miss():
    """A2 runs no rotation of a head dim of 896 or more: in inference the rotation stays as it is,
    one miss with the target's reason; the norm fuses."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 2, 4, 1024, generator=g).to(torch.bfloat16)
    w = torch.randn(1024, generator=g).to(torch.bfloat16)
    angles = torch.randn(4, 512, generator=g)
    cos, sin = (torch.cat((f(angles), f(angles)), -1).to(torch.bfloat16) for f in (torch.cos, torch.sin))
    inputs = (x, w, cos, sin)
    torch._dynamo.reset()
    capture = Capture(target="a2")
    with torch.no_grad():
        got = torch.compile(hf_norm_and_rotation, backend=capture)(*inputs)
    (result,) = capture.results
    assert result.fused("rms_norm") == 1 and result.fused("rotary_position_embedding") == 0
    (miss,) = result.misses
    assert miss.op == "rotary_position_embedding" and "896" in miss.reason, miss
    eager = hf_norm_and_rotation(*inputs)
    exact = hf_norm_and_rotation(*(t.double() for t in inputs))
    assert_close_as_unfused(got, eager, exact, factor=MODEL_FACTOR)


def test_a_rotation_of_an_unfused_norm_fuses():
    """The norm's forward left to the program (``rms_norm_forward=False``): the rotation of its
    output still fuses, the product feeding it read as one input (with no backward to pair with,
    it was neither fused nor recorded); the output by the float64 criterion."""
    inputs = norm_and_rotation_inputs()
    torch._dynamo.reset()
    capture = Capture(target="950", rms_norm_forward=False)
    with torch.no_grad():
        got = torch.compile(hf_norm_and_rotation, backend=capture)(*inputs)
    (result,) = capture.results
    assert result.fused("rotary_position_embedding") == 1 and not result.misses, result.misses
    eager = hf_norm_and_rotation(*inputs)
    exact = hf_norm_and_rotation(*(t.double() for t in inputs))
    assert_close_as_unfused(got, eager, exact, factor=MODEL_FACTOR)


def test_qwen3_rotations_of_unfused_qk_norms_fuse():
    """With the norms' forward left to the program (``rms_norm_forward=False``), Qwen3's 4
    rotations, whose q and k are the unfused q/k norms' outputs, fuse on Ascend 950: the
    product feeding them is read as one input."""
    model, ids, expected, eager, exact = eval_model("qwen3")
    torch._dynamo.reset()
    capture = Capture(target="950", rms_norm_forward=False)
    with torch.no_grad():
        got = torch.compile(model, backend=capture)(input_ids=ids).logits
    (result,) = capture.results
    assert result.fused("rotary_position_embedding") == expected["rope"] and result.fused("rms_norm") == 0
    assert not result.misses, result.misses
    assert_close_as_unfused(got, eager, exact, factor=MODEL_FACTOR)


#: near misses whose statistic is no RMS statistic (a variance): no RMSNorm, so nothing to record (a
#: centred value's statistic is one now, of the centred value: a norm of it that scales the
#: uncentred x is one recorded miss; a sum of squares over 15 of 16 elements is one recorded miss
#: too, as the backward rule records its backward)
NO_RMS_STATISTIC = {"variance_not_mean_square"}


#: (op, near miss, its table, x's size) of both forward rules
NEAR_MISSES = [pytest.param("rms_norm", n, NORM_NEAR_MISSES, (2, 3, 16), id=f"norm-{n}") for n in NORM_NEAR_MISSES] + \
    [pytest.param("rotary_position_embedding", n, ROPE_NEAR_MISSES, (2, 4, 6, 16), id=f"rope-{n}")
     for n in ROPE_NEAR_MISSES]


@pytest.mark.parametrize("op, name, table, size", NEAR_MISSES)
def test_near_misses_on_an_inference_graph(op, name, table, size):
    """The forward rules' near misses and odd spellings under no_grad, with no backward to pair a
    miss with: each fuses exactly where the joint graph's does, and otherwise is one recorded
    miss (never silent, never twice); the output by the float64 criterion."""
    body, fuses = table[name]
    x = _seeded(2 if op == "rms_norm" else 1, *size)
    torch._dynamo.reset()
    capture = Capture(target="generic")
    with torch.no_grad():
        got = torch.compile(lambda t: body(t) * 2, backend=capture)(x)
    (result,) = capture.results
    misses = [m for m in result.misses if m.op == op]
    assert result.graph == "inference" and result.fused(op) == int(fuses), (result.sites, result.misses)
    assert len(misses) == (0 if fuses or name in NO_RMS_STATISTIC else 1), misses
    eager, exact = body(x) * 2, body(x.double()) * 2
    assert got.dtype == eager.dtype
    assert_close_as_unfused(got, eager, exact, factor=MODEL_FACTOR)


def test_explain_an_inference_step():
    """``explain(train=False)``: the forward under no_grad, each counted norm and rotation fused on
    the inference graph and accounted for, the logits by the float64 criterion."""
    import npu_fusion
    from npu_fusion.report import html

    model, ids, expected, _, _ = eval_model("qwen3")
    report = npu_fusion.explain(model, ids, train=False, target="generic").report
    assert report["settings"]["train"] is False and not report["pass_errors"] and not report["accounting_errors"]
    assert report["ops"]["rms_norm"]["fused"] == report["ops"]["rms_norm"]["expected"] == expected["rms_norm"]
    assert report["ops"]["rotary_position_embedding"]["fused"] == expected["rope"]
    assert report["ops"]["rms_norm_grad"]["found"] == 0 and report["misses"] == []
    # the forward kinds (SwiGLU's too, on by default: Qwen3's MLP has separate gate and up, 0 sites)
    assert set(report["accounting"]) == {"rms_norm", "rotary_position_embedding", "swiglu"}
    assert report["accounting"]["swiglu"]["expected"] == report["accounting"]["swiglu"]["fused"] == 0
    assert all(row["unexplained"] == 0 and row["fused"] == row["expected"] for row in report["accounting"].values())
    assert report["gradients"]["passed"] and report["gradients"]["per_dtype"]["bfloat16"]["params"] == 1
    # the page names what was checked (outputs) and the graph the pass ran on, and no saved set
    page = html.render(report)
    assert "output check against eager and float64: <span class='ok'>PASSED</span>" in page
    assert "gradient" not in page and "Inference graph ops" in page and "saved for the backward" not in page


def test_report_command_line_inference(capsys):
    """``npu-fusion report --hf llama --inference``: the inference step, exit status 0, the text
    report checks outputs, not gradients."""
    import json

    from npu_fusion import cli

    assert cli.main(["report", "--hf", "llama", "--layers", "1", "--target", "generic", "--inference", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ops"]["rms_norm"]["fused"] == report["ops"]["rms_norm"]["expected"] == 3
    assert report["ops"]["rotary_position_embedding"]["fused"] == report["ops"]["rotary_position_embedding"]["expected"] == 2
    assert report["gradients"]["passed"]
    assert cli.main(["report", "--inference", "--compiled-autograd"]) == 2


def test_static_cache_generation_fuses_prefill_and_decode_graphs():
    """Greedy ``generate()`` of 16 tokens with a static cache and the model's forward compiled: the
    same tokens as eager; one prefill and one decode graph (sequence length 1, positions from the
    cache), each with its 5 norms and 4 rotations fused; no recompile after the first decode step,
    whose graph then runs for each of the other 15 tokens."""
    model = tiny_causal_lm("llama", kv_heads=2).eval()
    ids = torch.randint(3, 96, (2, 8), generator=torch.Generator().manual_seed(1))
    generation = dict(max_new_tokens=16, do_sample=False, cache_implementation="static", pad_token_id=0)
    eager = model.generate(ids, **generation)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    capture = Capture(target="generic")
    model.forward = torch.compile(model.forward, backend=capture)
    got = model.generate(ids, **generation)
    assert torch.equal(got, eager)
    assert len(capture.results) == 2 and all(r.graph == "inference" and not r.misses for r in capture.results)
    assert [r.fused("rms_norm") for r in capture.results] == [5, 5]
    assert [r.fused("rotary_position_embedding") for r in capture.results] == [4, 4]
    assert torch._dynamo.utils.counters["frames"]["total"] == 2  # prefill, then the first decode step
    assert capture.runs == [1, 15]


@pytest.mark.parametrize("target", ["generic", "a2"])
def test_static_cache_generation_with_dynamic_shapes(target):
    """``generate()`` with a static cache and the forward compiled with ``dynamic=True``: the prefill
    graph takes the batch and prompt length symbolic, the decode graph the cache length (the static
    cache's buffers fix its batch). The same tokens as eager; every norm and rotation fused in both
    graphs, on A2 too: the prefill's symbolic batch and prompt length are kept within A2's RoPE
    limits (B < 1000, B < S for per-batch tables) by guards the example sizes satisfy; no recompile
    after the first decode step. A second prompt of another batch and length, within the limits,
    reuses the prefill graph and compiles one decode graph for the new cache, fused the same way."""
    model = tiny_causal_lm("llama", kv_heads=2).eval()
    generation = dict(max_new_tokens=8, do_sample=False, cache_implementation="static", pad_token_id=0)
    prompts = [torch.randint(3, 96, shape, generator=torch.Generator().manual_seed(1)) for shape in ((2, 8), (3, 5))]
    eager = [model.generate(ids, **generation) for ids in prompts]
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    capture = Capture(target=target)
    model.forward = torch.compile(model.forward, backend=capture, dynamic=True)
    assert torch.equal(model.generate(prompts[0], **generation), eager[0])
    assert torch._dynamo.utils.counters["frames"]["total"] == 2 and capture.runs == [1, 7]
    assert torch.equal(model.generate(prompts[1], **generation), eager[1])
    assert torch._dynamo.utils.counters["frames"]["total"] == 3 and capture.runs == [2, 7, 7]

    prefill, *decodes = capture.results
    assert all(r.graph == "inference" and not r.error for r in capture.results)
    assert [r.fused("rms_norm") for r in capture.results] == [5, 5, 5]
    assert [r.fused("rotary_position_embedding") for r in decodes] == [4, 4] and not any(r.misses for r in decodes)
    symbolic = {str(d) for n in capture.after[0].nodes if n.op == "placeholder"
                and isinstance(n.meta.get("val"), torch.Tensor) for d in n.meta["val"].shape if not str(d).isdigit()}
    assert len(symbolic) >= 2, symbolic  # the batch and the prompt length
    assert prefill.fused("rotary_position_embedding") == 4 and not prefill.misses


def test_hugging_face_trainer_evaluation_step_is_fused(tmp_path):
    """Trainer with ``torch_compile=True`` (backend "inductor", after ``install_inductor``)
    evaluates under no_grad: its evaluation graph is an inference graph, every norm and rotation
    fused there, and the evaluation loss by the float64 criterion."""
    from transformers import Trainer, TrainingArguments

    model = tiny_causal_lm("llama", kv_heads=2).eval()
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        eager = model(input_ids=ids, labels=ids).loss
        exact = copy.deepcopy(model).double()(input_ids=ids, labels=ids).loss
    args = TrainingArguments(output_dir=str(tmp_path), torch_compile=True, torch_compile_backend="inductor",
                             use_cpu=True, per_device_eval_batch_size=2, report_to=[])
    torch._dynamo.reset()
    recorder = InductorRecorder(FusionOptions.from_mapping({"target": "generic", "strict": True}))
    mark = HISTORY.mark()
    with recorder.installed():
        metrics = Trainer(model=model, args=args).evaluate([{"input_ids": r, "labels": r} for r in ids])
    assert_every_site_fused(HISTORY.since(mark), {"rms_norm": 5, "rope": 4})
    got = torch.tensor(metrics["eval_loss"], dtype=eager.dtype)
    assert_close_as_unfused(got, eager, exact, factor=MODEL_FACTOR)
