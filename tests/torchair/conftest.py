"""Fixtures for compiling through torchair's real Python sources, with CANN stubbed.

* ``torchair``: the ``torchair`` package unpacked from the torch_npu wheel
  matching the installed torch (downloaded once and cached, see
  :mod:`npu_fusion_testing.torchair.harness`), its CANN extension modules replaced by
  :mod:`npu_fusion_testing.torchair.cann_stub`; the npu-fusion GE converters registered. Skips only when
  the package index cannot be reached or has no torch_npu for this torch (a torch
  newer than every torch_npu release).
* ``ge``: compiles functions with ``torchair.get_npu_backend`` and returns the
  GE graphs torchair built (:class:`GeCapture`).

How the GE graph is intercepted: the configs made by ``ge.config()`` set
torchair's ``debug.graph_dump`` (type ``txt``: the ``GraphDef`` protobuf in
text form, written as soon as torchair has converted an FX graph) and
``debug.run_eagerly`` (torchair builds the full GE graph, then runs the FX graph
eagerly, here on CPU with the fused ops' reference kernels, so a forward pass
yields real values and its backward graph gets compiled too).
``ge.graphs()`` parses the dumps. With ``run_eagerly=False`` torchair instead
hands the graph to GE, which the stub records (``ge.loaded()``) and refuses to
run (:class:`npu_fusion_testing.torchair.cann_stub.CannUnavailableError`).
"""
from __future__ import annotations

import sys

import pytest
import torch

from npu_fusion_testing.torchair import cann_stub, harness
from npu_fusion_testing.torchair.ge_graph_view import GeCapture


@pytest.fixture(scope="session")
def torchair():
    try:
        module = harness.load_torchair()
    except harness.TorchairUnavailable as error:
        if error.offline:
            pytest.skip(f"torchair tests need the torch_npu wheel and the package index is unreachable: {error}")
        if error.unpublished:
            pytest.skip(f"no torch_npu release matches torch {torch.__version__} yet: {error}")
        raise
    from npu_fusion.lowering import ge_converters

    assert ge_converters.register(), "npu_fusion's GE converters did not register with torchair"
    return module


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    cann_stub.reset()
    compat_ir = sys.modules.get("torchair._ge_concrete_graph.compat_ir")
    if compat_ir is not None:  # torchair caches the CANN compatibility answers
        compat_ir.is_cann_compat.cache_clear()
    yield
    torch._dynamo.reset()


@pytest.fixture
def ge(torchair, tmp_path) -> GeCapture:
    return GeCapture(torchair, tmp_path / "ge_graphs")
