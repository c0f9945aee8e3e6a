"""The documentation is checked like code: links, the README's snippets and tables, docstrings.

README.md and docs/*.md: every relative link resolves to a file, and every anchor to a heading
of that file; every Python snippet of the README is marked to run (it runs, in its own process
from an empty folder) or to be skipped with a reason; the README's options table is
``FusionOptions``; docs/supported-forms.md's table is the rules' own (``render_forms``); the
generated blocks are well formed and their writer replaces one block only; nothing cites a file
outside the repository; every docstring of the package opens with one sentence.
"""
from __future__ import annotations

import ast
import dataclasses
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README] + sorted((ROOT / "docs").glob("*.md"))

FENCE = re.compile(r"^```.*?^```", re.S | re.M)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
SNIPPET = re.compile(r"<!-- snippet: (run|skip \(([^)]+)\)) -->\n```python\n(.*?)```", re.S)


def prose(text: str) -> str:
    """The page without its fenced code blocks (links in code are code)."""
    return FENCE.sub("", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = heading.strip().lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: pathlib.Path) -> set:
    seen, found = {}, set()
    for line in prose(page.read_text()).splitlines():
        match = re.match(r"^#{1,6} (.+)$", line)
        if not match:
            continue
        base = slug(match.group(1))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(page: pathlib.Path):
    for target in LINK.findall(prose(page.read_text())):
        if not re.match(r"^[a-z]+:", target):
            yield target


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve_to_files_and_headings(page):
    broken = []
    for target in links(page):
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no file {file}")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target}: no heading #{anchor} in {file.relative_to(ROOT)}")
    assert not broken, "\n".join(broken)


def test_every_docs_page_is_in_the_readme_index():
    linked = {(README.parent / target.partition("#")[0]).resolve() for target in links(README)}
    missing = [p.name for p in PAGES[1:] if p.resolve() not in linked]
    assert not missing, f"docs pages the README does not link: {missing}"


def test_readme_is_short_and_leads_with_the_backend():
    lines = README.read_text().splitlines()
    assert len(lines) <= 200, len(lines)
    assert any('torch.compile(model, backend="npu_fusion")' in line for line in lines[:60])


def test_readme_keeps_the_test_command_ci_runs():
    """``.ci/run`` runs the line two after the marker (awk's two getlines): a bash fence, then it."""
    lines = README.read_text().splitlines()
    marker = lines.index("<!-- test-command -->")
    assert lines[marker + 1] == "```bash"
    assert "python -m pytest" in lines[marker + 2] and "pip install -e '.[test]'" in lines[marker + 2]


# -- the README's Python snippets ---------------------------------------------------------

def snippets():
    text = README.read_text()
    marked = SNIPPET.findall(text)
    return [(kind.split(" ")[0], reason, code) for kind, reason, code in marked]


def test_every_readme_python_snippet_is_marked():
    assert len(re.findall(r"^```python$", README.read_text(), re.M)) == len(snippets())


@pytest.mark.parametrize("index", range(len(snippets())))
def test_readme_snippet_runs(index, tmp_path):
    kind, reason, code = snippets()[index]
    if kind == "skip":
        pytest.skip(reason)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, f"snippet {index} failed:\n{code}\n{done.stderr[-4000:]}"


# -- tables generated from the code ------------------------------------------------------

def section(text: str, heading: str) -> str:
    return text.split(f"\n{heading}\n", 1)[1].split("\n## ", 1)[0]


@pytest.mark.parametrize("page", [README, ROOT / "docs" / "usage.md"], ids=lambda p: p.name)
def test_options_table_is_fusion_options(page):
    from npu_fusion.plugin.options import FusionOptions

    rows = [line.split("|")[1:3] for line in section(page.read_text(), "## Options").splitlines()
            if line.startswith("| `")]
    table = {name.strip().strip("`"): ast.literal_eval(default.strip().strip("`")) for name, default in rows}
    fields = {f.name: f.default for f in dataclasses.fields(FusionOptions)}
    assert table == fields


def test_supported_forms_table_is_rendered_from_the_rules():
    from npu_fusion.patterns import render_forms

    page = (ROOT / "docs" / "supported-forms.md").read_text()
    table = page.split("<!-- forms -->")[1].split("<!-- /forms -->")[0].strip()
    assert table == render_forms()


def test_readme_schemas_are_the_registry():
    from npu_fusion.lowering.ops import render_schemas

    block = README.read_text().split("<!-- schemas -->")[1].split("<!-- /schemas -->")[0]
    assert block.strip().strip("`").strip() == render_schemas()


# -- generated blocks -------------------------------------------------------------------

def test_generated_blocks_are_closed_and_named_once():
    from npu_fusion_testing.generated import END

    names = []
    for page in PAGES[1:]:
        markers = re.findall(r"<!-- generated:([\w.-]+) -->|(" + re.escape(END) + ")", page.read_text())
        kinds = ["start" if name else "end" for name, _ in markers]
        assert kinds == ["start", "end"] * (len(kinds) // 2), f"{page.name}: unbalanced generated blocks"
        names += [name for name, _ in markers if name]
    assert len(names) == len(set(names)), names


def test_write_block_replaces_one_block_and_says_how_it_was_made(tmp_path):
    from npu_fusion_testing.generated import publishing, render, script_command, write_block

    page = tmp_path / "page.md"
    page.write_text("# Page\n\nprose\n\n<!-- generated:a -->\nold a\n<!-- /generated -->\n\nmiddle\n\n"
                    "<!-- generated:b -->\nold b\n<!-- /generated -->\n")
    command = script_command(str(ROOT / "benchmarks" / "x.py"), ["--fast", "--write-docs", "b"])
    write_block("b", render("| x |\n|---|\n| 1 |\n", command, fenced=False), docs=tmp_path)
    text = page.read_text()
    assert "old a" in text and "old b" not in text and "prose" in text and "middle" in text
    written = text.split("<!-- generated:b -->\n")[1].split("<!-- /generated -->")[0]
    first, _, body = written.partition("\n\n")
    assert first.startswith("Last run: `python -m benchmarks.x --fast` on ") and "torch " in first
    assert "CPU cores" in first and body == "| x |\n|---|\n| 1 |\n"
    with pytest.raises(LookupError):
        with publishing("no-such-block", ["python", "x.py"]):
            pass


def test_no_printer_binds_the_terminal_when_it_is_defined():
    """``--write-docs`` copies what is printed by redirecting ``sys.stdout``: a default argument
    ``file=sys.stdout`` is the stream of the import, so what it prints never reaches the block."""
    bad = []
    files = [p for d in ("npu_fusion", "npu_fusion_testing", "benchmarks", "scripts") for p in (ROOT / d).rglob("*.py")]
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                for default in node.args.defaults + [d for d in node.args.kw_defaults if d is not None]:
                    if ast.unparse(default) in ("sys.stdout", "sys.stderr"):
                        bad.append(f"{path.relative_to(ROOT)}:{default.lineno}")
    assert not bad, "default arguments bound to the import's stream (use None, look it up at the call): " + ", ".join(bad)


def test_the_zoo_tables_go_where_stdout_is_redirected():
    import contextlib
    import io

    from npu_fusion_testing.zoo import Outcome, print_details, print_table

    outcome = Outcome("llama", "LlamaForCausalLM", grads_ok=True, notes=["a note"])
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        print_table([outcome])
        print_details([outcome])
    assert "llama" in printed.getvalue() and "a note" in printed.getvalue()


# -- citations and docstrings --------------------------------------------------------------

def test_nothing_cites_a_file_outside_the_repository():
    """The ops' contracts are docs/fused-ops.md; no reference to a SPEC file, shared/ or seeds/."""
    pattern = re.compile(r"\bSPEC\b|shared/|\bseeds/")
    files = PAGES + [p for d in ("npu_fusion", "npu_fusion_testing", "tests", "benchmarks", "scripts")
                     for p in (ROOT / d).rglob("*.py")]
    hits = [f"{p.relative_to(ROOT)}:{n}: {line.strip()}" for p in files if p.name != "test_docs.py"
            for n, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert not hits, "\n".join(hits)


#: the longest first sentence a docstring may open with: two lines of a module's width
FIRST_SENTENCE_LIMIT = 240


def first_sentence(docstring: str) -> str:
    """The first paragraph's text up to its first full stop (a period then a space or the end)."""
    paragraph = " ".join(docstring.split("\n\n")[0].split())
    match = re.search(r"(?<!\be\.g)(?<!\bi\.e)\.(\s|$)", paragraph)
    return paragraph[:match.end()].strip() if match else ""


def docstrings():
    for path in sorted((ROOT / "npu_fusion").rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc:
                    yield f"{path.relative_to(ROOT)}:{getattr(node, 'name', '<module>')}", doc


def test_docstrings_open_with_one_sentence():
    """A docstring's first paragraph opens with a sentence that ends in a period, short enough to
    read as the thing's one-line contract; the rationale follows it."""
    bad = []
    for where, doc in docstrings():
        sentence = first_sentence(doc)
        if not sentence:
            bad.append(f"{where}: no sentence ends in its first paragraph: {doc.splitlines()[0]}")
        elif len(sentence) > FIRST_SENTENCE_LIMIT:
            bad.append(f"{where}: first sentence of {len(sentence)} characters: {sentence[:90]}...")
        elif re.match(r"^(``[^`]+``|[\w.-]+): ", sentence):
            bad.append(f"{where}: opens with a label, not a sentence: {sentence[:90]}")
    assert not bad, f"{len(bad)} docstrings:\n" + "\n".join(bad)
