"""The wheel reader behind the table of docs/compatibility.md of what each torch_npu line registers for the whole
RMSNorm ops (``npu_fusion_testing.torchair.whole_ops``): on a made-up wheel it must see each kind
of entry, and the default line's wheel must register no NPU kernel and no torchair converter for
either op (else the rewrite of ``aten._fused_rms_norm_backward`` is live on that line, and the
page is wrong)."""
from __future__ import annotations

import zipfile

import pytest

from npu_fusion_testing.torchair import harness
from npu_fusion_testing.torchair.whole_ops import OPS, read_wheel

FORWARD, BACKWARD = OPS


def test_reader_sees_each_kind_of_entry(tmp_path):
    wheel = tmp_path / "torch_npu-0.0-py3-none-any.whl"
    library = (b"\x7fELF\x00native_layer_norm\x01_fused_rms_norm\x00aten::_fused_rms_norm_backward(Tensor grad_out)"
               b"\x02_ZN2at25compositeimplicitautograd15_fused_rms_normEv\x00")
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("torch_npu/lib/libtorch_npu.so", library)
        archive.writestr("torch_npu/csrc/aten/npu_native_functions.yaml",
                         "- func: npu_rms_norm(Tensor self)\n- func: _fused_rms_norm_backward(Tensor grad_out)\n")
        archive.writestr("torch_npu/dynamo/torchair/_ge_concrete_graph/ge_converter/aten/rms.py",
                         "@register_fx_node_ge_converter(torch.ops.aten._fused_rms_norm.default)\n")
        archive.writestr("torch_npu/_inductor/decomposition.py", "keep(aten._fused_rms_norm_backward)\n")
    report = read_wheel(wheel)
    ops = report["ops"]
    assert report["control_registration_seen"]
    assert ops[FORWARD]["registrations"] == ["torch_npu/lib/libtorch_npu.so: _fused_rms_norm"]
    assert ops[BACKWARD]["registrations"] == [
        "torch_npu/lib/libtorch_npu.so: aten::_fused_rms_norm_backward(Tensor grad_out)"]
    assert [len(ops[op]["yaml"]) for op in OPS] == [0, 1]
    assert ops[FORWARD]["torchair_converters"] and not ops[BACKWARD]["torchair_converters"]
    assert ops[BACKWARD]["python"] == ["torch_npu/_inductor/decomposition.py"] and not ops[FORWARD]["python"]
    assert report["library_mentions"] == [
        "torch_npu/lib/libtorch_npu.so: _ZN2at25compositeimplicitautograd15_fused_rms_normEv"]


def test_reader_without_the_control_says_so(tmp_path):
    wheel = tmp_path / "torch_npu-0.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("torch_npu/lib/libtorch_npu.so", b"\x00native_layer_norm_backward_helper\x00")
    assert not read_wheel(wheel)["control_registration_seen"]


def test_default_line_registers_no_whole_rms_norm_kernel():
    try:
        wheel = harness.wheel_file()
    except harness.TorchairUnavailable as error:
        if error.offline or error.unpublished:
            pytest.skip(f"no torch_npu wheel for this torch: {error}")
        raise
    report = read_wheel(wheel)
    assert report["control_registration_seen"], report
    for op in OPS:
        found = report["ops"][op]
        assert found["registrations"] == [] and found["yaml"] == [] and found["torchair_converters"] == [], report
        assert all(path.startswith("torch_npu/_inductor/") for path in found["python"]), report
