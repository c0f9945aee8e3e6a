"""Whether each torch_npu line registers an NPU kernel for torch's whole RMSNorm ops
(``aten._fused_rms_norm``, ``aten._fused_rms_norm_backward``), read from the wheels by
``npu_fusion_testing.torchair.whole_ops`` (never installed; downloaded once into
``~/.cache/npu_fusion/wheels``), printed as the table of docs/compatibility.md.

    python -m scripts.whole_rms_norm_registrations            # every line of check_npu_contracts.LINES
    python -m scripts.whole_rms_norm_registrations 2.13.0     # some lines
    python -m scripts.whole_rms_norm_registrations --write-docs whole-ops   # and into docs/compatibility.md
Exit status 1 when a wheel's control registration (``native_layer_norm``) was not seen.
"""
from __future__ import annotations

import sys

from npu_fusion_testing.generated import pop_write_docs, publishing, script_command
from npu_fusion_testing.torchair.harness import wheel_file
from npu_fusion_testing.torchair.whole_ops import OPS, read_wheel
from scripts.check_npu_contracts import LINES


def readable(text: str) -> str:
    """A mangled C++ name (``_ZN2at25compositeimplicitautograd15_fused_rms_norm...``) as its
    qualified name (``at::compositeimplicitautograd::_fused_rms_norm``); anything else as it is."""
    if not text.startswith("_ZN"):
        return text
    parts, rest = [], text[3:]
    while rest[:1].isdigit():
        digits = len(rest) - len(rest.lstrip("0123456789"))
        size = int(rest[:digits])
        parts.append(rest[digits:digits + size])
        rest = rest[digits + size:]
    return "::".join(parts) + " (C++ symbol)"


def cell(entries) -> str:
    return "none" if not entries else "; ".join(f"`{readable(e.split(': ', 1)[-1])}`" for e in entries)


def row(line: str, report: dict) -> str:
    ops = report["ops"]
    kernels = " / ".join(cell(ops[op]["registrations"] + ops[op]["yaml"]) for op in OPS)
    converters = cell(sorted({c for op in OPS for c in ops[op]["torchair_converters"]}))
    python = cell(sorted({p for op in OPS for p in ops[op]["python"]}))
    mentions = cell(report["library_mentions"])
    return f"| {line} | {kernels} | {converters} | {python} | {mentions} |"


def main(argv) -> int:
    write_docs, lines = pop_write_docs(argv)
    with publishing(write_docs, script_command(__file__, argv), fenced=False):
        return print_rows(lines or LINES)


def print_rows(lines) -> int:
    print("| torch_npu | NPU kernel for `_fused_rms_norm` / `_fused_rms_norm_backward` | torchair converter "
          "| Python files naming them | other library strings naming them |")
    print("|---|---|---|---|---|")
    failed = False
    for line in lines:
        report = read_wheel(wheel_file(line))
        failed |= not report["control_registration_seen"]
        print(row(line, report), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
