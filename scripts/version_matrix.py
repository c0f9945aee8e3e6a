"""Build a venv per torch release, run the tests and the report in each, print the table.

    python -m scripts.version_matrix                       # the whole matrix (hours; GBs per venv)
    python -m scripts.version_matrix --torch 2.7.1 --no-torchair
    python -m scripts.version_matrix --table-from matrix.json --write-docs matrix   # into docs/compatibility.md

Per torch release: the full suite on the default torch (the one CI runs), the smoke set
(``pytest -m smoke``: the fused ops, the pass, a sample of forms, torchair with the
matching wheel where one exists, the structured trace) on the others, and ``npu-fusion
report`` (sites fused / expected). Per torch_npu release line: whether ``npu_fusion.install``
works on its torchair (the newest post release of the line, CANN stubbed) and the fused GE
nodes torchair lowers for a Llama-style block (``scripts/torchair_probe.py``), in a venv
with that line's torch.

Venvs live in ``--venvs`` (default ``~/.cache/npu_fusion/venvs``), one per torch, reused when
present. Torch releases other than the default come from the package registry as CUDA
builds (several GB with their dependencies; they run on the CPU). Each venv's installs are
constrained to its torch (``PIP_CONSTRAINT``, which also replaces a pip configuration's cap on
torch for these venvs only): unconstrained, the test extra's ``triton`` pulls the newest torch. Each venv also gets ``setuptools<81``: the torchair of
torch_npu 2.6 and 2.7.1 imports ``pkg_resources``. Versions run one after another: the
test runs are CPU-bound.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from npu_fusion_testing.generated import publishing, script_command

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_TORCH = "2.13.0"
SMOKE_TORCHES = ["2.6.0", "2.7.1", "2.10.0", "2.15.0"]
#: torch_npu release lines, each probed (newest post release) with the torch of the same version;
#: ``torch@torch_npu`` probes one exact torch_npu release (2.7.1 itself has no pass hook)
TORCHAIR_LINES = ["2.6.0", "2.7.1", "2.7.1@2.7.1", "2.8.0", "2.9.0", "2.10.0", "2.11.0", "2.12.0", "2.13.0",
                  "2.14.0"]


def venv_python(venvs: Path, torch_version: str) -> Path:
    return venvs / f"torch-{torch_version}" / "bin" / "python"


def venv_torch(python: Path) -> str:
    """The torch version the venv imports ("" when it imports none)."""
    done = subprocess.run([str(python), "-c", "import torch; print(torch.__version__)"], capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else ""


def ensure_venv(venvs: Path, torch_version: str, log) -> Path:
    """The venv's python, building the venv first when it does not import that torch.

    torch is pinned by a constraint file for both installs: without it, installing the test
    extra (its unpinned ``triton``) moves an older torch to the newest release."""
    python = venv_python(venvs, torch_version)
    if python.exists() and venv_torch(python).split("+")[0] == torch_version:
        return python
    log(f"building the venv for torch {torch_version} (downloads several GB for a CUDA build)")
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(python.parent.parent)], check=True)
    constraints = python.parent.parent / "constraints.txt"
    constraints.write_text(f"torch=={torch_version}\n")
    env = dict(os.environ, PIP_CONSTRAINT=str(constraints))  # replaces this machine's cap on torch
    pip = [str(python), "-m", "pip", "install", "-q", "--no-cache-dir"]
    subprocess.run(pip + [f"torch=={torch_version}", "setuptools<81"], check=True, env=env)
    subprocess.run(pip + ["-e", f"{ROOT}[test]"], check=True, env=env, cwd=ROOT)
    installed = venv_torch(python)
    if installed.split("+")[0] != torch_version:
        raise SystemExit(f"the venv for torch {torch_version} imports torch {installed or 'none'}")
    return python


def pytest_counts(output: str) -> dict:
    """passed/failed/skipped/error counts from pytest's last summary line."""
    lines = [line for line in output.strip().splitlines() if re.search(r"\d+ (passed|failed|error)", line)]
    counts = {}
    for number, word in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected|xfailed|xpassed)",
                                    lines[-1] if lines else ""):
        counts[word.rstrip("s") if word.startswith("error") else word] = int(number)
    return counts


def run_tests(python: Path, smoke: bool, log) -> dict:
    command = [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider"] + (["-m", "smoke"] if smoke else [])
    start = time.time()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    counts = pytest_counts(done.stdout)
    counts["minutes"] = round((time.time() - start) / 60, 1)
    counts["set"] = "smoke" if smoke else "full"
    if done.returncode not in (0, 5):
        failed = [line for line in done.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))]
        counts["failures"] = failed[:20]
    log(f"  tests ({counts['set']}): {counts}")
    return counts


def run_report(python: Path, log) -> dict:
    """sites fused / expected, summed over the ops, from ``npu-fusion report --json``."""
    done = subprocess.run([str(python), "-m", "npu_fusion", "report", "--json"], cwd=ROOT, capture_output=True,
                          text=True)
    try:
        report = json.loads(done.stdout)
    except json.JSONDecodeError:
        return {"exit": done.returncode, "error": done.stderr[-500:]}
    found = {"exit": done.returncode, "fused": 0, "expected": 0}
    for entry in report["ops"].values():
        found["fused"] += entry["fused"]
        found["expected"] += entry["expected"]
    log(f"  report: {found}")
    return found


def run_probe(python: Path, exact_torch_npu, log) -> dict:
    env = dict(os.environ)
    if exact_torch_npu:
        env["NPU_FUSION_TORCH_NPU_VERSION"] = exact_torch_npu
    done = subprocess.run([str(python), "-m", "scripts.torchair_probe"], cwd=ROOT,
                          capture_output=True, text=True, env=env)
    lines = done.stdout.strip().splitlines()
    try:
        found = json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        found = {"error": (done.stderr or done.stdout)[-600:]}
    log(f"  torchair: {found}")
    return found


def tests_cell(counts: dict) -> str:
    shown = ", ".join(f"{counts[k]} {k}" for k in ("passed", "failed", "error", "skipped") if counts.get(k))
    return f"{counts['set']}: {shown or 'nothing ran'} ({counts['minutes']} min)"


def torchair_cells(probe: dict) -> tuple:
    install = probe.get("install") or probe.get("error", "-")
    nodes = probe.get("ge_nodes")
    if isinstance(nodes, dict):
        nodes = ", ".join(f"{op} {count}" for op, count in nodes.items())
        if probe.get("decomposed_left"):
            nodes += f" (decomposed left: {', '.join(probe['decomposed_left'])})"
    return probe.get("torch_npu") or "-", install if install == "ok" else str(install)[:160], nodes or "-"


def print_tables(torch_rows: dict, torchair_rows: dict) -> None:
    if torch_rows:
        print("\n| torch | tests | `npu-fusion report` sites fused / expected |")
        print("|---|---|---|")
        for version, row in torch_rows.items():
            report = row["report"]
            fused = f"{report['fused']}/{report['expected']}" if "fused" in report else "error"
            fused += f" (exit {report['exit']})" if report.get("exit") else ""
            print(f"| {row.get('torch', version)} | {tests_cell(row['tests'])} | {fused} |")
    if torchair_rows:
        print("\n| torch_npu line | torchair from | `install` | backward GE nodes lowered (Llama block, a2) |")
        print("|---|---|---|---|")
        for line, probe in torchair_rows.items():
            wheel, install, nodes = torchair_cells(probe)
            print(f"| {line} | {wheel} | {install} | {nodes} |")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--venvs", type=Path, default=Path.home() / ".cache" / "npu_fusion" / "venvs")
    parser.add_argument("--torch", nargs="*", default=[DEFAULT_TORCH] + SMOKE_TORCHES,
                        help="torch releases to test (the default one gets the full suite)")
    parser.add_argument("--torchair", nargs="*", default=TORCHAIR_LINES, help="torch_npu release lines to probe")
    parser.add_argument("--no-torchair", action="store_true")
    parser.add_argument("--json", type=Path, help="also write the results here (after every row)")
    parser.add_argument("--table-from", type=Path, nargs="*", help="print the table of earlier --json files")
    parser.add_argument("--write-docs", metavar="NAME",
                        help="also write the tables into block NAME of its docs/ page (npu_fusion_testing.generated)")
    args = parser.parse_args(argv)

    def log(message):
        print(message, file=sys.stderr, flush=True)

    if args.table_from:  # runs split over several processes (or days) make one table
        merged = [json.loads(path.read_text()) for path in args.table_from]
        with publishing(args.write_docs, script_command(__file__, argv), fenced=False):
            print_tables({k: v for m in merged for k, v in m["torch"].items()},
                         {k: v for m in merged for k, v in m["torchair"].items()})
        return 0

    torch_rows, torchair_rows = {}, {}

    def save():  # after every row: a run of hours keeps what it measured if stopped
        if args.json:
            args.json.write_text(json.dumps({"torch": torch_rows, "torchair": torchair_rows}, indent=1))

    for version in args.torch:
        log(f"torch {version}")
        python = ensure_venv(args.venvs, version, log)
        torch_rows[version] = {"torch": venv_torch(python),  # what ran, read from the venv
                               "tests": run_tests(python, smoke=version != DEFAULT_TORCH, log=log),
                               "report": run_report(python, log)}
        save()
    for line in [] if args.no_torchair else args.torchair:
        log(f"torchair of torch_npu {line}")
        torch_version, _, exact = line.partition("@")
        torchair_rows[line] = run_probe(ensure_venv(args.venvs, torch_version, log), exact, log)
        save()
    with publishing(args.write_docs, script_command(__file__, argv), fenced=False):
        print_tables(torch_rows, torchair_rows)
    failed = any(row["tests"].get("failed") or row["tests"].get("error") for row in torch_rows.values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
