"""What a torch_npu wheel registers for torch's whole RMSNorm ops, ``aten._fused_rms_norm`` and
``aten._fused_rms_norm_backward``, read from the wheel without installing it.

Where torch_npu registered an NPU kernel for one of them, torch would route ``F.rms_norm`` to the
whole op on the NPU and AOTAutograd would keep its backward whole (docs/compatibility.md, "Whole RMSNorm ops").
A kernel registration (``TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) { m.impl("_fused_rms_norm", ...) }``
in C++, or an op-plugin yaml entry) leaves the op's name as a string of its own in the shared
library, so the reader looks at:

* the yaml files under ``torch_npu/csrc/aten/``: a line naming the op;
* every shared library: the printable strings that contain the op's name; the bare name,
  ``aten::<name>`` or a schema starting with it is a registration, anything else (a mangled
  symbol, an AOTInductor shim name) a mention;
* every Python file: the files that name the op (torch.library registrations, decomposition
  tables), and among them torchair's GE converters.

As a control, the same strings must show a registration torch_npu does make
(``native_layer_norm``): a reader that saw nothing at all would otherwise read as "no kernel".

    python -m npu_fusion_testing.torchair.whole_ops [WHEEL_OR_VERSION ...]   # JSON per wheel
"""
from __future__ import annotations

import json
import re
import sys
import zipfile
from pathlib import Path
from typing import Dict, List

OPS = ("_fused_rms_norm", "_fused_rms_norm_backward")
#: an aten op every torch_npu line registers an NPU kernel for
CONTROL = "native_layer_norm"
_PRINTABLE = re.compile(rb"[\x20-\x7e]")
#: where torchair's GE converters live in the wheel
TORCHAIR_CONVERTERS = "torch_npu/dynamo/torchair/_ge_concrete_graph/"


def strings_containing(data: bytes, needle: bytes) -> List[str]:
    """The printable strings of ``data`` (as ``strings`` cuts them) that contain ``needle``."""
    found, start = set(), data.find(needle)
    while start != -1:
        left, right = start, start + len(needle)
        while left > 0 and _PRINTABLE.match(data, left - 1):
            left -= 1
        while right < len(data) and _PRINTABLE.match(data, right):
            right += 1
        found.add(data[left:right].decode("ascii"))
        start = data.find(needle, right)
    return sorted(found)


def is_registration(text: str, op: str) -> bool:
    """The op's own name, ``aten::<op>``, or a schema or overload name starting with it."""
    for name in (op, f"aten::{op}"):
        if text == name or text.startswith((f"{name}(", f"{name}.")):
            return True
    return False


def _is_shared_library(name: str) -> bool:
    return name.endswith(".so") or ".so." in name


def read_wheel(wheel: Path) -> Dict[str, object]:
    """For each op: its registrations in the shared libraries, its yaml lines, and the Python
    files and torchair converter files naming it; the libraries' other strings naming either
    op; and whether the control registration was seen."""
    found = {op: {"registrations": [], "yaml": [], "python": [], "torchair_converters": []} for op in OPS}
    mentions, control = [], False
    with zipfile.ZipFile(wheel) as archive:
        for info in archive.infolist():
            name = info.filename
            if _is_shared_library(name):
                data = archive.read(info)
                control = control or any(is_registration(s, CONTROL) for s in strings_containing(data, CONTROL.encode()))
                for text in strings_containing(data, OPS[0].encode()):
                    ops = [op for op in OPS if is_registration(text, op)]
                    for op in ops:
                        found[op]["registrations"].append(f"{name}: {text}")
                    if not ops:
                        mentions.append(f"{name}: {text}")
            elif name.endswith((".yaml", ".py", ".pyi")):
                _read_text(name, archive.read(info).decode("utf-8", "replace"), found)
    return {"wheel": Path(wheel).name, "control_registration_seen": control, "ops": found,
            "library_mentions": mentions}


def _read_text(name: str, text: str, found) -> None:
    for op in OPS:
        if not re.search(rf"\b{op}\b", text):
            continue
        if name.endswith(".yaml"):
            found[op]["yaml"] += [f"{name}: {line.strip()}" for line in text.splitlines()
                                  if re.search(rf"\b{op}\b", line)]
        elif name.startswith(TORCHAIR_CONVERTERS):
            found[op]["torchair_converters"].append(name)
        else:
            found[op]["python"].append(name)


def main(argv: List[str]) -> int:
    from .harness import wheel_file

    for item in argv or [None]:
        wheel = Path(item) if item and item.endswith(".whl") else wheel_file(item)
        print(json.dumps(read_wheel(wheel)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
