"""``npu-fusion report --hf-config`` on the meta device, and ``--html`` rendered in headless Chromium.

The configs here are small versions of the shipped examples (the full sizes trace in the same code
path; their timings are in docs/report.md), so each test compiles a step in seconds."""
import argparse
import json
import os

import pytest

from npu_fusion.report import command as report
from npu_fusion.report import fullsize, html, screenshot

pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples", "configs")
ROPE, RMS = "rotary_position_embedding_grad", "rms_norm_grad"
SMALL = ["hidden_size=256", "intermediate_size=512", "num_attention_heads=4", "num_key_value_heads=2",
         "vocab_size=512"]


def parse(*argv):
    parser = argparse.ArgumentParser()
    report.add_arguments(parser)
    fullsize.add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.fixture(scope="module")
def llama_two_targets():
    """A Llama-shaped config (the example's, shrunk) with head_dim 1024, on A2 (D < 896: RoPE
    refused) and on Ascend 950 (D <= 1024: every site runs)."""
    return fullsize.collect(parse("--hf-config", os.path.join(EXAMPLES, "llama-3-70b.json"), *SMALL, "head_dim=1024",
                                  "--layers", "2", "--seq", "64", "--target", "a2,950"))


def test_each_target_runs_or_refuses_every_counted_site(llama_two_targets):
    a2, ascend950 = llama_two_targets["targets"]["a2"], llama_two_targets["targets"]["950"]
    for r in (a2, ascend950):
        assert r["ops"][RMS]["expected"] == 5 and r["ops"][ROPE]["expected"] == 4  # the eager count on meta
        assert all(a["unexplained"] == 0 and a["outside"] == 0 for a in r["accounting"].values())
        assert r["pass_errors"] == [] and r["gradients"]["checked"] is False
        assert r["ops"][RMS]["fused"] == 5 and r["ops"]["rms_norm"]["fused"] == 5  # every chip runs RMSNorm
    assert ascend950["ops"][ROPE]["fused"] == 4 and ascend950["ops"]["rotary_position_embedding"]["fused"] == 4
    assert ascend950["misses"] == []
    # A2 refuses each rotation (q and k of each layer) both ways by name, with its module
    assert a2["ops"][ROPE]["fused"] == 0 and a2["ops"]["rotary_position_embedding"]["fused"] == 0
    attention = ["model.layers.0.self_attn"] * 2 + ["model.layers.1.self_attn"] * 2
    for op in (ROPE, "rotary_position_embedding"):
        assert sorted(m["module"] for m in a2["misses"] if m["op"] == op) == attention, a2["misses"]
    assert all("A2/A3 need D < 896, got 1024" == m["reason"] for m in a2["misses"])
    assert len(a2["misses"]) == 2 * len(attention)
    assert {s["module"] for s in ascend950["sites"] if s["op"] == ROPE} == {"model.layers.0.self_attn",
                                                                            "model.layers.1.self_attn"}
    # traffic and saved bytes come from the shapes: batch 2 x seq 64 x hidden 256 in bfloat16
    traffic = a2["memory_traffic"][RMS]
    assert traffic["bytes_minimum"] <= traffic["bytes_after"] < traffic["bytes_before"]
    assert a2["saved_activations"]["bytes_after"] < a2["saved_activations"]["bytes_before"]
    assert fullsize.status(llama_two_targets) == report.EXIT_OK
    text = fullsize.format_text(llama_two_targets)
    assert "# Target a2" in text and "REFUSED" in text and "model.layers.1.self_attn" in text


def test_mla_and_moe_trace_on_meta_and_a2_refuses_interleave_half():
    """DeepSeek-V3's shape (MLA, routed experts through grouped_mm), shrunk."""
    r = fullsize.collect(parse("--hf-config", os.path.join(EXAMPLES, "deepseek-v3.json"), "hidden_size=256",
                               "intermediate_size=256", "moe_intermediate_size=64", "n_routed_experts=8", "n_group=1",
                               "topk_group=1", "num_experts_per_tok=2", "first_k_dense_replace=0",
                               "--layers", "1", "--seq", "64", "--target", "a2"))["targets"]["a2"]
    assert r["ops"][RMS]["fused"] == r["ops"][RMS]["expected"] == 5  # q_a and kv_a norms too
    assert r["ops"][ROPE]["fused"] == 0 and r["ops"][ROPE]["unfused"] == r["ops"][ROPE]["expected"] == 2
    assert all("Ascend 950" in m["reason"] and m["module"] == "model.layers.0.self_attn" for m in r["misses"])


def test_overrides_and_usage_errors(capsys):
    assert fullsize.run(parse("--hf-config", "no_such_model_type")) == report.EXIT_USAGE
    assert "does not know the model type" in capsys.readouterr().err
    assert fullsize.run(parse("--hf-config", "lama")) == report.EXIT_USAGE
    assert "the closest it knows: llama" in capsys.readouterr().err
    assert fullsize.run(parse("--hf-config", "examples/configs/no-such.json")) == report.EXIT_USAGE
    assert "no such file 'examples/configs/no-such.json'" in capsys.readouterr().err
    assert fullsize.run(parse("--hf-config", "llama", "hidden_size")) == report.EXIT_USAGE
    assert "not key=value" in capsys.readouterr().err
    assert fullsize.run(parse("--hf-config", "llama", "--dynamic")) == report.EXIT_USAGE
    assert "--hf-config takes" in capsys.readouterr().err
    config = fullsize.load_config(os.path.join(EXAMPLES, "qwen3-32b.json"), ["hidden_size=1024"], 3)
    assert (config.hidden_size, config.num_hidden_layers, config.head_dim) == (1024, 3, 128)
    assert report.run(parse("--target", "a2,950")) == report.EXIT_USAGE  # several targets: --hf-config only


def test_the_pass_share_of_the_compile_is_printed_per_target(llama_two_targets):
    """Each target's compiled step on fake tensors: the pass's CPU time is a fraction of the step's,
    printed in the text and on the page."""
    from test_report import share_printed

    text, page = fullsize.format_text(llama_two_targets), html.render(llama_two_targets)
    for target, r in llama_two_targets["targets"].items():
        assert 0 < r["seconds"]["pass_share"] < 1, (target, r["seconds"])
        section = text.split(f"# Target {r['settings']['resolved_target']}")[1]
        assert share_printed(section) == pytest.approx(r["seconds"]["pass_share"], abs=6e-4)
        # the pass's time per node of the graphs it ran on, which the report counts off the graphs themselves
        nodes = r["seconds"]["pass_nodes"]
        assert nodes > 100, r["seconds"]
        assert f"us per node of its {nodes} graph nodes" in section
        assert share_printed(html.html.unescape(page.split(f"Target {r['settings']['resolved_target']}:")[1])) == \
            pytest.approx(r["seconds"]["pass_share"], abs=6e-4)


def test_html_page_is_self_contained_and_names_every_site(llama_two_targets):
    page = html.render(llama_two_targets)
    assert "http" not in page and "<script" not in page and "<link" not in page and "src=" not in page
    assert page.count("<title>") > 1 + len(llama_two_targets["targets"]["a2"]["misses"])  # a tooltip per site
    # each site a row per op, forward and backward: A2 refuses the 4 rotations both ways
    assert page.count("<tr class='missed'>") == 2 * 4 and page.count("<tr class='fused'>") == 2 * (5 + 9)
    assert "A2/A3 need D &lt; 896, got 1024" in page  # the reason, escaped
    assert "Target 950" in page and "Target a2" in page


def test_html_page_renders_in_headless_chromium(tmp_path, llama_two_targets):
    """In CI (``CI`` set: ``.ci/run`` installs Debian's chromium) a missing browser fails the test;
    elsewhere it skips, saying how to install one."""
    if screenshot.find_browser() is None:
        if os.environ.get("CI", "") not in ("", "0", "false"):
            pytest.fail("no Chromium in CI: .ci/run installs Debian's chromium package")
        pytest.skip("no Chromium installed (apt-get install chromium)")
    page, png = tmp_path / "report.html", tmp_path / "report.png"
    html.writer(str(page))(llama_two_targets)
    screenshot.screenshot(str(page), str(png), width=800, height=500)
    shot = screenshot.png_summary(str(png))
    assert (shot.width, shot.height) == (800, 500)
    # text, boxes and bars: many colours, a fair share of ink, the fused (green) and missed (red) marks
    assert shot.colours > 50 and shot.non_white > 0.03
    assert {"green", "red"} <= set(shot.coloured)


def test_command_line_writes_json_and_html(tmp_path, capsys):
    """The command line's parsing and dispatch, in this process (``tests/test_report.py``'s
    ``test_command_line_json`` runs ``python -m npu_fusion`` itself: a second interpreter here
    would add its imports, not a check); stdout is the JSON alone."""
    from npu_fusion import cli

    page = tmp_path / "r.html"
    status = cli.main(["report", "--hf-config", "llama", *SMALL, "--layers", "1", "--seq", "32", "--target", "950",
                       "--json", "--html", str(page)])
    out, err = capsys.readouterr()
    assert status == 0, err[-3000:]
    r = json.loads(out)
    assert r["targets"]["950"]["ops"][RMS]["fused"] == 3 and r["targets"]["950"]["ops"][RMS]["unfused"] == 0
    assert r["targets"]["950"]["ops"]["rms_norm"]["fused"] == 3 and r["peak_rss_bytes"] > 0
    assert "Target 950" in page.read_text()
