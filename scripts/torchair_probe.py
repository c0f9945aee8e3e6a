"""One torchair through npu-fusion, for the version matrix: run inside a venv's python.

Loads the torchair of the newest torch_npu release of the installed torch's line (the
test harness: downloaded wheel, CANN stubbed), installs the pass, trains the Llama-style
block of :mod:`npu_fusion_testing.torchair.llama_block` one step through torchair and counts
the fused GE nodes in the backward graph torchair built (1 RmsNormGrad and 2
RotaryPositionEmbeddingGrad expected). Prints one JSON object.
"""
from __future__ import annotations

import json
import tempfile
import traceback
from pathlib import Path

import torch

from npu_fusion_testing.torchair import harness


def probe() -> dict:
    found = {"torch": torch.__version__, "torch_npu": None, "install": None, "ge_nodes": None}
    try:
        torchair = harness.load_torchair()
    except harness.TorchairUnavailable as error:
        found["torch_npu"] = "none published" if error.unpublished else f"unavailable: {error}"[:200]
        return found
    marker = Path(torchair.__file__).parent.parent / ".complete"
    found["torch_npu"] = marker.read_text().split("\n")[0] if marker.exists() else "?"
    import npu_fusion
    from npu_fusion_testing.torchair import llama_block as llama
    from npu_fusion_testing.torchair.ge_graph_view import GeCapture

    with tempfile.TemporaryDirectory() as tmp:
        ge = GeCapture(torchair, Path(tmp))
        try:
            npu_fusion.install(ge.config(), target="a2")
            found["install"] = "ok"
        except Exception as error:  # the matrix reports what install said
            found["install"] = f"{type(error).__name__}: {error}"[:300]
            return found
        try:
            got, eager, exact = llama.train_step(ge, install={"target": "a2"})
            llama.assert_grads_close(got, eager, exact)
            counts = ge.backward().types()
            found["ge_nodes"] = {op: counts.get(op, 0) for op in sorted(llama.FUSED)}
            found["decomposed_left"] = sorted(llama.decomposed_ops(ge.backward()))
        except Exception:
            found["ge_nodes"] = "error: " + traceback.format_exc()[-600:]
    return found


if __name__ == "__main__":
    print(json.dumps(probe()))
