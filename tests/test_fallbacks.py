"""Every fallback fails closed and says so.

No NPU exists here, so torch_npu and torchair are simulated at the import boundary: a
finder on ``sys.meta_path`` serves a stand-in ``torch_npu`` (its import raising, or
putting a ``torch.npu`` whose device query raises or names a chip) and a stand-in
``torchair`` package. The code under test (target detection, the backend's host check,
the NPU kernel and GE converter registration) runs as it is.
"""
import importlib.abc
import importlib.machinery
import sys
import types
import warnings

import pytest
import torch

from npu_fusion import fallback
from npu_fusion.fallback import FallbackWarning
from npu_fusion.lowering import FUSED_OPS, ge_converters, npu
from npu_fusion.lowering.registrar import CUSTOM_OPS
from npu_fusion.plugin import backend, targets
from npu_fusion_testing.capture import compile_and_compare

pytestmark = pytest.mark.smoke  # in the version matrix's smoke set: fallbacks


class _StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves the stand-in modules named in ``behaviours`` (name -> a function run as the
    module executes: it raises, as a broken import does, or sets the module up)."""

    def __init__(self, behaviours):
        self.behaviours = behaviours

    def find_spec(self, name, path=None, target=None):
        if name not in self.behaviours:
            return None
        return importlib.machinery.ModuleSpec(name, self, origin=f"/stand-in/{name}/__init__.py")

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        module.__file__ = module.__spec__.origin
        self.behaviours[module.__name__](module)


@pytest.fixture
def stand_ins(monkeypatch):
    """``stand_ins(torch_npu=..., torchair=...)``: serve those modules for this test only;
    target detection and the warnings start afresh."""
    def install(**behaviours):
        for name in behaviours:
            monkeypatch.delitem(sys.modules, name, raising=False)
        monkeypatch.setattr(sys, "meta_path", [_StandInFinder(behaviours)] + sys.meta_path)

    targets.detect_target.cache_clear()
    fallback.forget_warnings()
    yield install
    targets.detect_target.cache_clear()
    fallback.forget_warnings()
    for name in ("torch_npu", "torchair"):  # what the stand-in finder loaded goes with it
        module = sys.modules.get(name)
        if module is not None and str(getattr(module, "__file__", "")).startswith("/stand-in/"):
            del sys.modules[name]


def raising(error):
    def run(_module):
        raise error
    return run


def npu_device(monkeypatch, available=True, name=None, error=None):
    """A torch_npu whose import puts ``torch.npu`` in place, as the real one does; ``available``
    or ``error``, an exception, is what its availability or device name query raises."""
    def is_available():
        if isinstance(available, Exception):
            raise available
        return available

    def get_device_name(*_):
        if error is not None:
            raise error
        return name

    def run(_module):
        monkeypatch.setattr(torch, "npu", types.SimpleNamespace(is_available=is_available,
                                                                get_device_name=get_device_name), raising=False)
    return run


def only_warning(caught):
    found = [w for w in caught if issubclass(w.category, FallbackWarning)]
    assert len(found) == 1, [str(w.message) for w in caught]
    return str(found[0].message)


def test_no_torch_npu_is_generic_without_a_warning():
    targets.detect_target.cache_clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert targets.detect_target() == "generic"
    assert not [w for w in caught if issubclass(w.category, FallbackWarning)]


def test_detection_error_takes_the_common_target_and_warns(stand_ins):
    stand_ins(torch_npu=raising(OSError("libascendcl.so: cannot open shared object file")))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert targets.detect_target() == targets.FALLBACK_TARGET == "common"
    message = only_warning(caught)
    assert "OSError: libascendcl.so: cannot open shared object file" in message and "target=" in message


def test_device_query_error_takes_the_common_target_and_warns(stand_ins, monkeypatch):
    stand_ins(torch_npu=npu_device(monkeypatch, error=RuntimeError("device 0 lost")))
    with pytest.warns(FallbackWarning, match="RuntimeError: device 0 lost"):
        assert targets.detect_target() == "common"


def test_unknown_device_name_takes_the_common_target_and_warns(stand_ins, monkeypatch):
    stand_ins(torch_npu=npu_device(monkeypatch, name="Ascend310P3"))
    with pytest.warns(FallbackWarning, match="'Ascend310P3' is none of the chips"):
        assert targets.detect_target() == "common"


@pytest.mark.parametrize("name, target", [("Ascend910B2", "a2"), ("Ascend910_9391", "a3"), ("Ascend950PR", "950")])
def test_known_device_name_is_detected_without_a_warning(stand_ins, monkeypatch, name, target):
    stand_ins(torch_npu=npu_device(monkeypatch, name=name))
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        assert targets.detect_target() == target


def test_npu_without_a_device_is_generic(stand_ins, monkeypatch):
    stand_ins(torch_npu=npu_device(monkeypatch, available=False))
    assert targets.detect_target() == "generic"


def test_a_fallback_warns_once_per_process(stand_ins, monkeypatch):
    stand_ins(torch_npu=npu_device(monkeypatch, name="Ascend310P3"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert [targets.target_from_device_name("Ascend310P3") for _ in range(3)] == ["common"] * 3
    only_warning(caught)


def test_common_target_fuses_only_what_every_chip_runs(stand_ins, monkeypatch):
    """target='auto' after a failed detection: RoPE (mode 0, within A2/A3's limits) and RMSNorm
    (every chip runs RmsNorm and RmsNormGrad in these dtypes) fuse; gradients right."""
    from npu_fusion.models import bundled

    stand_ins(torch_npu=raising(OSError("no CANN")))
    model = bundled("llama", num_layers=1)
    ids = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    with pytest.warns(FallbackWarning, match="OSError: no CANN"):
        capture = compile_and_compare(lambda: model.loss(ids), [], list(model.parameters()), target="auto")
    (result,) = capture.results
    assert result.target == "common"
    for op in model.expected_sites:  # the backward ops
        assert result.fused(op) == model.expected_sites[op], result.misses
    assert not [m for m in result.misses if m.op in model.expected_sites]


def test_backend_host_check_error_warns_and_takes_the_cpu_path(stand_ins, monkeypatch):
    stand_ins(torch_npu=npu_device(monkeypatch, available=RuntimeError("drv error 507033")),
              torchair=lambda module: None)
    with pytest.warns(FallbackWarning, match="RuntimeError: drv error 507033.*compiles for the CPU"):
        assert backend._on_npu_host() is False


def test_npu_kernels_failing_to_import_warn(stand_ins):
    stand_ins(torch_npu=raising(ImportError("libhccl.so: cannot open shared object file")))
    with pytest.warns(FallbackWarning, match="NPU eager kernels.*ImportError: libhccl.so.*reference kernels"):
        assert npu.register(FUSED_OPS, CUSTOM_OPS) is False


def test_npu_kernels_failing_to_register_warn(stand_ins):
    """torch_npu imports but torch has no ``npu`` device (it did not rename PrivateUse1):
    registering the kernels raises, nothing is registered, and it warns."""
    stand_ins(torch_npu=lambda module: None)
    with pytest.warns(FallbackWarning, match="NPU eager kernels of the fused ops were not registered \\(RuntimeError: .*npu"):
        assert npu.register(FUSED_OPS, CUSTOM_OPS) is False


def test_ge_converters_failing_to_register_warn(stand_ins, monkeypatch):
    """A torchair whose API lacks what the converters import: nothing registered, a warning."""
    monkeypatch.setattr(ge_converters, "_REGISTERED", False)  # as in a process that has not registered yet
    stand_ins(torchair=lambda module: None)
    with pytest.warns(FallbackWarning, match="GE converters.*ImportError: cannot import name"):
        assert ge_converters.register() is False
    assert not ge_converters.registered()
