"""``pass_overhead --against REV``'s plumbing: the export of a revision's package, the check that a
worker measures the package it was given, and the table's refusal of sides that saw different graphs.

No measurement runs here (its times would be the only output): the benchmark itself is run by hand.
"""
import argparse
import pathlib
import subprocess

import pytest

from benchmarks import before_after

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _git(*args):
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()


@pytest.fixture
def in_git_checkout():
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")


def test_export_writes_the_revision_s_package_and_names_its_commit(tmp_path, in_git_checkout):
    commit = before_after.export_package("HEAD", tmp_path / "before")
    assert commit == _git("rev-parse", "HEAD")
    exported = sorted(p.relative_to(tmp_path / "before").as_posix() for p in (tmp_path / "before").rglob("*")
                      if p.is_file())
    assert exported == sorted(_git("ls-tree", "-r", "--name-only", "HEAD", "npu_fusion").splitlines())
    assert (tmp_path / "before" / "npu_fusion" / "__init__.py").read_text() == \
        _git("show", "HEAD:npu_fusion/__init__.py") + "\n"


def test_export_of_an_unknown_revision_stops_with_git_s_reason(tmp_path, in_git_checkout):
    with pytest.raises(SystemExit, match="rev-parse"):
        before_after.export_package("no-such-revision-anywhere", tmp_path / "before")


def test_the_package_check_passes_for_the_imported_tree_and_stops_for_another(tmp_path):
    import npu_fusion

    here = pathlib.Path(npu_fusion.__file__).resolve().parent.parent
    before_after.check_package(str(here))  # has cpu_seconds, bundled and the backend
    with pytest.raises(SystemExit, match="PYTHONPATH did not win"):
        before_after.check_package(str(tmp_path))


def _row(**changes):
    row = {"layers": 2, "head_dim": 16, "hidden": 64, "nodes_before": 528, "nodes_after": 402, "sites": 18,
           "first_call_cpu": 1.0, "pass_cpu": 0.05, "fuse_joint_cpu": 0.04}
    return {**row, **changes}


def test_medians_per_side_and_runs_that_saw_another_graph_stop_the_run():
    row = before_after.median_row([_row(pass_cpu=0.05), _row(pass_cpu=0.09), _row(pass_cpu=0.06)])
    assert row["pass_cpu"] == 0.06
    with pytest.raises(SystemExit, match="disagree"):
        before_after.median_row([_row(), _row(sites=17)])


def test_the_table_refuses_sides_that_fused_different_sites(capsys):
    args = argparse.Namespace(against_commit="0" * 40, after_label="abc", repeat=1)
    before_after.print_against([(_row(pass_cpu=0.10), _row(pass_cpu=0.05))], args)
    line = capsys.readouterr().out.splitlines()[-1]
    assert "| 2 | 16 (64) | 528 (402) | 18 | 100 -> 50 ms |" in line and line.endswith("| 0.50x |")
    with pytest.raises(SystemExit, match="not the same measurement"):
        before_after.print_against([(_row(), _row(sites=17))], args)
