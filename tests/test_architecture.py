"""The package's shape: modules of one concern, layers that import only downwards, no harness in it.

``lowering/`` (what a fused op is) sits under ``patterns/`` (the rules), which sits under
``plugin/`` (the hooks); ``measure/`` and ``report/`` are applications above them. Read from the
sources with ``ast``, so a function-level import counts too.
"""
import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "npu_fusion"
#: the most lines a module of one concern may hold
MOST_LINES = 600
#: each layer, and the layers above it that it must never import
ABOVE = {
    "lowering": ("patterns", "plugin", "measure", "report"),
    "patterns": ("plugin", "measure", "report"),
    "plugin": ("measure", "report"),
}


def _modules(root: pathlib.Path):
    return sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)


def _imported(path: pathlib.Path):
    """The absolute names a module imports (relative imports resolved against its package)."""
    package = path.relative_to(ROOT).with_suffix("").parts[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else ()
            module = ".".join((*base, *(node.module.split(".") if node.module else ())))
            yield module
            yield from (f"{module}.{alias.name}" for alias in node.names)


def test_no_module_is_longer_than_one_concern():
    long = {str(p.relative_to(ROOT)): n for p in _modules(PACKAGE) if (n := len(p.read_text().splitlines())) > MOST_LINES}
    assert not long, f"modules over {MOST_LINES} lines (split them by concern): {long}"


@pytest.mark.parametrize("layer", sorted(ABOVE))
def test_a_layer_imports_no_layer_above_it(layer):
    bad = []
    for path in _modules(PACKAGE / layer):
        for name in _imported(path):
            parts = name.split(".")
            if parts[0] == "npu_fusion" and len(parts) > 1 and parts[1] in ABOVE[layer]:
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not bad, "\n".join(bad)


def test_the_package_never_imports_the_test_harness():
    bad = [f"{p.relative_to(ROOT)} imports {name}" for p in _modules(PACKAGE) for name in _imported(p)
           if name.split(".")[0] == "npu_fusion_testing"]
    assert not bad, "\n".join(bad)


def test_benchmarks_and_scripts_do_not_edit_sys_path():
    bad = [str(p.relative_to(ROOT)) for d in ("benchmarks", "scripts") for p in _modules(ROOT / d)
           if "sys.path" in p.read_text()]
    assert not bad, f"run them as modules from the repository root instead: {bad}"
