"""Compile through torchair and read back the GE graphs (``GraphDef`` protobufs) it built.

Tensors in a GE graph are named ``"<op name>:<output index>"`` in ``OpDef.input``
(``":-1"`` for a control edge); ``input_desc``/``output_desc`` carry the
IR names, dtypes and shapes (``-1`` for a symbolic dimension).
"""
from __future__ import annotations

import collections
import re
import warnings
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch

_DTYPES = {
    "DT_FLOAT": torch.float32, "DT_FLOAT16": torch.float16, "DT_BF16": torch.bfloat16,
    "DT_DOUBLE": torch.float64, "DT_INT64": torch.int64, "DT_INT32": torch.int32,
    "DT_INT8": torch.int8, "DT_UINT8": torch.uint8, "DT_BOOL": torch.bool,
}


def _proto():
    from torchair._ge_concrete_graph import ge_ir_pb2

    return ge_ir_pb2


class GeGraphView:
    def __init__(self, graph, source: str = ""):
        self.graph = graph
        self.source = source
        self.ops = list(graph.op)
        self._by_name = {op.name: op for op in self.ops}

    # -- reading -----------------------------------------------------------
    @classmethod
    def from_text(cls, text: str, source: str = "") -> "GeGraphView":
        from google.protobuf import text_format

        return cls(text_format.Parse(text, _proto().GraphDef()), source)

    @classmethod
    def from_model_bytes(cls, data: bytes, source: str = "") -> "GeGraphView":
        model = _proto().ModelDef()
        model.ParseFromString(data)
        return cls(model.graph[0], source)

    # -- ops ---------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.graph.name

    def types(self) -> collections.Counter:
        return collections.Counter(op.type for op in self.ops)

    def of_type(self, op_type: str) -> list:
        return [op for op in self.ops if op.type == op_type]

    def one(self, op_type: str):
        found = self.of_type(op_type)
        assert len(found) == 1, f"expected one {op_type} in {self.name}, found {len(found)}: {dict(self.types())}"
        return found[0]

    def op(self, name: str):
        return self._by_name[name]

    @property
    def is_backward(self) -> bool:
        """AOTAutograd names the backward graph's gradient inputs ``tangents_*``."""
        return any(op.type == "Data" and op.name.startswith("tangents") for op in self.ops)

    # -- edges -------------------------------------------------------------
    @staticmethod
    def data_inputs(op) -> List[str]:
        return [i for i in op.input if i and not i.endswith(":-1")]

    @staticmethod
    def _split(ref: str) -> Tuple[str, int]:
        name, _, index = ref.rpartition(":")
        return (name, int(index)) if name else (ref, 0)

    def producer(self, op, which) -> Tuple[object, int]:
        """(producing op, output index) of ``op``'s input ``which`` (an IR name or a position)."""
        if isinstance(which, str):
            names = self.input_names(op)
            assert which in names, f"{op.type} {op.name} has no input {which!r}; inputs {names}"
            which = names.index(which)
        name, index = self._split(self.data_inputs(op)[which])
        return self._by_name[name], index

    def consumers(self, op, output: Optional[int] = None) -> List[Tuple[object, int]]:
        """(consuming op, input position) of ``op``'s outputs (one output, or all)."""
        found = []
        for other in self.ops:
            for position, ref in enumerate(self.data_inputs(other)):
                name, index = self._split(ref)
                if name == op.name and (output is None or index == output):
                    found.append((other, position))
        return found

    def data_index(self, op) -> int:
        assert op.type in ("Data", "RefData"), f"{op.name} is a {op.type}, not a graph input"
        return op.attr["index"].i

    def source_index(self, op, which) -> int:
        """The graph-input index feeding ``op``'s input ``which`` directly."""
        producer, _ = self.producer(op, which)
        return self.data_index(producer)

    def net_outputs(self) -> List[Tuple[object, int]]:
        out = self.one("NetOutput")
        return [self.producer(out, i) for i in range(len(self.data_inputs(out)))]

    # -- descriptors ---------------------------------------------------------
    @staticmethod
    def input_names(op) -> List[str]:
        return [d.name for d in op.input_desc]

    @staticmethod
    def output_names(op) -> List[str]:
        return [d.name for d in op.output_desc]

    @staticmethod
    def torch_dtype(proto_dtype: int) -> torch.dtype:
        name = _proto().DataType.Name(proto_dtype)
        return _DTYPES[name]

    def output_dtype(self, op, index: int = 0) -> torch.dtype:
        return self.torch_dtype(op.output_desc[index].dtype)

    def input_dtype(self, op, which) -> torch.dtype:
        index = self.input_names(op).index(which) if isinstance(which, str) else which
        return self.torch_dtype(op.input_desc[index].dtype)

    def input_shape(self, op, which) -> List[int]:
        index = self.input_names(op).index(which) if isinstance(which, str) else which
        return list(op.input_desc[index].shape.dim)

    def output_meta_shape(self, op, index: int = 0) -> Optional[str]:
        """torchair's ``_meta`` note on an output: ``Tensor(dtype=..., shape=torch.Size([...]))``."""
        attr = op.output_desc[index].attr.get("_meta")
        return None if attr is None else attr.s.decode()

    def input_meta_dims(self, op, which) -> List[str]:
        """The FX (possibly symbolic) sizes of an input, from torchair's ``_meta`` note:
        ``["s0", "s1", "64"]``. (A GE shape is only set on graph inputs and constants;
        GE infers the others.)"""
        index = self.input_names(op).index(which) if isinstance(which, str) else which
        note = op.input_desc[index].attr["_meta"].s.decode()
        match = re.search(r"Size\(\[(.*?)\]\)", note)
        assert match, note
        return [d.strip() for d in match.group(1).split(",") if d.strip()]

    @staticmethod
    def attrs(op) -> Dict[str, object]:
        """Non-internal attributes (not starting with ``_``) as Python values."""
        out = {}
        for key, value in op.attr.items():
            if key.startswith("_"):
                continue
            kind = value.WhichOneof("value")
            if kind == "list":
                lst = value.list
                out[key] = list(lst.i) or list(lst.f) or [s.decode() for s in lst.s] or list(lst.b)
            elif kind == "s":
                out[key] = value.s.decode()
            else:
                out[key] = getattr(value, kind) if kind else None
        return out

    def const_value(self, op) -> torch.Tensor:
        assert op.type == "Const", f"{op.name} is a {op.type}"
        tensor = op.attr["value"].t
        dtype = self.torch_dtype(tensor.desc.dtype)
        shape = list(tensor.desc.shape.dim)
        return torch.frombuffer(bytearray(tensor.data), dtype=dtype).reshape(shape) if tensor.data else \
            torch.empty(shape, dtype=dtype)

    def __repr__(self) -> str:
        return f"GeGraphView({self.name}, {dict(self.types())})"


_GRAPH_ID = re.compile(r"dynamo_original_graph_(\d+)_")


def read_dumped_graphs(directory: Path) -> List[GeGraphView]:
    """The GE graphs torchair's ``debug.graph_dump`` (type ``txt``) wrote, oldest first."""
    found = []
    for path in Path(directory).glob("dynamo_original_graph_*.txt"):
        match = _GRAPH_ID.search(path.name)
        found.append((int(match.group(1)) if match else 0, path))
    return [GeGraphView.from_text(path.read_text(), str(path)) for _, path in sorted(found)]


class GeCapture:
    """Compile through torchair and read back the GE graphs it built."""

    def __init__(self, torchair, dump_dir: Path):
        self.torchair = torchair
        self.dump_dir = dump_dir

    def config(self, *, run_eagerly: bool = True):
        config = self.torchair.CompilerConfig()
        config.debug.graph_dump.type = "txt"
        config.debug.graph_dump.path = str(self.dump_dir)
        config.debug.run_eagerly = run_eagerly
        return config

    def compile(self, fn, *, config=None, dynamic=False, fullgraph=True, decompositions=None):
        backend = self.torchair.get_npu_backend(compiler_config=config if config is not None else self.config(),
                                                custom_decompositions=decompositions or {})
        # get_npu_backend just put a "once" filter for every UserWarning first in line; with
        # debug.run_eagerly AOTAutograd warns about the unboxed FX graph it gets back.
        warnings.filterwarnings("ignore", message="Your compiler for AOTAutograd", category=UserWarning)
        return torch.compile(fn, backend=backend, dynamic=dynamic, fullgraph=fullgraph)

    def graphs(self):
        """Every GE graph torchair built so far in this test, oldest first."""
        return read_dumped_graphs(self.dump_dir)

    def graph(self) -> GeGraphView:
        graphs = self.graphs()
        assert len(graphs) == 1, f"expected one GE graph, torchair built {len(graphs)}: {graphs}"
        return graphs[0]

    def backward(self) -> GeGraphView:
        found = [g for g in self.graphs() if g.is_backward]
        assert len(found) == 1, f"expected one backward GE graph, found {found} among {self.graphs()}"
        return found[0]

    def forward(self) -> GeGraphView:
        found = [g for g in self.graphs() if not g.is_backward]
        assert len(found) == 1, f"expected one forward GE graph, found {found} among {self.graphs()}"
        return found[0]

    @staticmethod
    def loaded():
        """The graphs torchair handed to GE (``TorchNpuGraphBase.load``), oldest first."""
        from . import cann_stub

        return [GeGraphView.from_model_bytes(data, name) for name, data, _ in cann_stub.LOADED_GRAPHS]
