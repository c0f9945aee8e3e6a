"""A pure-Python stand-in for torchair's compiled, CANN-facing extension modules.

torchair (shipped inside the torch_npu wheel as ``torch_npu/dynamo/torchair``)
is Python except for four extension modules in ``torchair/core`` that link
against CANN's graph engine (GE) and ACL runtime:

* ``_torchair``: graph-engine session, ``TorchNpuGraphBase`` (load, compile,
  run a GE graph), the GE IR registry query and the CANN compatibility check;
* ``_npu_graph_executor``: NPU storage queries (used only with torch_npu);
* ``_npu_utils``: format casts on NPU tensors (used only with torch_npu);
* ``_abi_compat_ge_apis``: GE symbols loaded by ``_torchair``, never imported
  from Python.

This module implements the names torchair's Python code uses from them. Graph
construction (converters, GE graph passes, protobuf serialisation) stays
torchair's own code; only what would reach CANN is replaced:

* every call is recorded in :data:`CALLS`;
* ``TorchNpuGraphBase.load`` keeps the serialised GE graph it is handed (the
  exact bytes GE would receive) in :data:`LOADED_GRAPHS`;
* ``TorchNpuGraphBase.run`` raises :class:`CannUnavailableError`: a GE graph
  cannot run without CANN. Tests that must execute use torchair's
  ``config.debug.run_eagerly``, which builds the GE graph and then runs the FX
  graph eagerly.
* ``get_registered_ir_def`` answers that no GE IR registry is available, so a
  custom op without a converter fails the way it does on a host whose CANN
  lacks the op, instead of torchair trying to compile a callback library.
"""
from __future__ import annotations

import types
from typing import Any, Dict, List, Tuple

#: every stubbed call, as ``(name, args)``.
CALLS: List[Tuple[str, tuple]] = []
#: ``(graph name, serialised ge ModelDef bytes, options)`` for every load.
LOADED_GRAPHS: List[Tuple[str, bytes, Dict[str, str]]] = []
#: the SoC name ``GetSocName`` reports.
SOC_NAME = "Ascend910B1"
#: the status ``get_registered_ir_def`` reports: neither "SUCCESS" (registered)
#: nor "ERROR" (known unregistered), which torchair treats as "cannot query".
IR_REGISTRY_STATUS = "UNAVAILABLE"


class CannUnavailableError(RuntimeError):
    """Raised where torchair would need CANN to go on (running a GE graph)."""


def _record(name: str, *args: Any) -> None:
    CALLS.append((name, args))


def reset() -> None:
    CALLS.clear()
    LOADED_GRAPHS.clear()


# --------------------------------------------------------------------- _torchair

class TorchDataType:
    """The values of GE's ``ge::DataType`` for the dtypes torchair maps."""

    FLOAT32 = 0
    FLOAT16 = 1
    INT8 = 2
    INT32 = 3
    UINT8 = 4
    INT16 = 6
    UINT16 = 7
    UINT32 = 8
    INT64 = 9
    UINT64 = 10
    FLOAT64 = 11
    BOOL = 12
    COMPLEX64 = 16
    COMPLEX128 = 17
    BF16 = 27


def StupidRepeat(word, times):  # noqa: N802 (the extension's names)
    return word * times


def InitializeGraphEngine(options):  # noqa: N802
    _record("InitializeGraphEngine", dict(options))


def FinalizeGraphEngine():  # noqa: N802
    _record("FinalizeGraphEngine")


def InitDeviceStdoutChannel(device_id):  # noqa: N802
    _record("InitDeviceStdoutChannel", device_id)


def SetDebugLogPath(path):  # noqa: N802
    _record("SetDebugLogPath", path)


def GetSocName():  # noqa: N802
    return SOC_NAME


def AclmdlSetDump(path):  # noqa: N802
    _record("AclmdlSetDump", path)


def AclopStartDumpArgs(flag, path):  # noqa: N802
    _record("AclopStartDumpArgs", flag, path)


def AclopStopDumpArgs(flag):  # noqa: N802
    _record("AclopStopDumpArgs", flag)


def check_cann_compat(op_type, runtime_optional_inputs, runtime_optional_attrs):
    """Empty string: the (absent) CANN supports every optional input and attribute."""
    _record("check_cann_compat", op_type, tuple(runtime_optional_inputs), tuple(runtime_optional_attrs))
    return ""


def get_registered_ir_def(op_type):
    _record("get_registered_ir_def", op_type)
    return IR_REGISTRY_STATUS, [], [], []


def export(serialized_graph, options):
    _record("export", len(serialized_graph), dict(options))


def as_torch_tensors(shape, data_type, addresses):
    raise CannUnavailableError("torchair CANN stub: as_torch_tensors needs device memory")


class TorchNpuGraphBase:
    """Keeps what torchair hands to GE; refuses to run it."""

    def __init__(self, name=""):
        self.name = str(name)
        self.loaded = None
        self.hint_shapes = None
        _record("TorchNpuGraphBase", self.name)

    def load(self, serialized_graph, options, input_placements=(), output_dtypes=(), executor_type=0):
        _record("load", self.name, dict(options), list(input_placements), list(output_dtypes), executor_type)
        self.loaded = bytes(serialized_graph)
        LOADED_GRAPHS.append((self.name, self.loaded, dict(options)))

    def set_hint_shape(self, inputs_shape, output_shapes):
        self.hint_shapes = (inputs_shape, output_shapes)

    def compile(self):
        _record("compile", self.name)

    def auto_tune(self, args):
        raise CannUnavailableError("torchair CANN stub: auto_tune needs the graph engine")

    def run(self, args):
        raise CannUnavailableError(
            f"torchair CANN stub: GE graph {self.name!r} was built and loaded, but running it needs CANN; "
            "set config.debug.run_eagerly = True to execute the FX graph instead")

    def summary(self):
        return {}


# ---------------------------------------------------------- _npu_graph_executor

def GetNpuStorageSizes(tensor):  # noqa: N802
    raise CannUnavailableError("torchair CANN stub: NPU storage needs torch_npu")


# ------------------------------------------------------------------- _npu_utils

def NpuFormatCastViaCpu(*args, **kwargs):  # noqa: N802
    raise CannUnavailableError("torchair CANN stub: NPU format casts need torch_npu")


_TORCHAIR_NAMES = (
    "TorchDataType", "StupidRepeat", "InitializeGraphEngine", "FinalizeGraphEngine",
    "InitDeviceStdoutChannel", "SetDebugLogPath", "GetSocName", "AclmdlSetDump",
    "AclopStartDumpArgs", "AclopStopDumpArgs", "check_cann_compat", "get_registered_ir_def",
    "export", "as_torch_tensors", "TorchNpuGraphBase",
)

#: extension module (relative to the torchair package) -> names it provides.
MODULES = {
    "core._torchair": _TORCHAIR_NAMES,
    "core._npu_graph_executor": ("GetNpuStorageSizes",),
    "core._npu_utils": ("NpuFormatCastViaCpu",),
    "core._abi_compat_ge_apis": (),
}


def make_module(qualified_name: str, names) -> types.ModuleType:
    module = types.ModuleType(qualified_name, f"npu-fusion test stub for torchair's {qualified_name}")
    module.__file__ = __file__
    for name in names:
        setattr(module, name, globals()[name])
    module.CannUnavailableError = CannUnavailableError
    return module
