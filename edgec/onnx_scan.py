"""What an ONNX file refers to, read with the standard library only (the runtime has no ``onnx`` package).

ONNX Runtime opens the files a graph's tensors name as external data wherever they point (only releases from
December 2025 refuse paths outside the model's folder, and edgec accepts 1.20), and it reads an ``EPContext``
node's cache file by path. So before a graph reaches ONNX Runtime, edgec reads the protobuf itself: every tensor
(initializers, node attributes, subgraphs, functions, training graphs), every node's domain and op type, and the
main graph's inputs and outputs. ``graph_problems`` then says what a bundle's graph may not do.

Protobuf wire format: https://protobuf.dev/programming-guides/encoding/ ; field numbers from onnx/onnx.proto3.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edgec.manifest_schema import path_problem, show

# Domains whose operators ONNX Runtime implements itself; any other node must call a function of the model
BUILTIN_DOMAINS = ("", "ai.onnx", "ai.onnx.ml", "com.microsoft")
# Ops that make ONNX Runtime read or load something by name: refused in a bundle
REFUSED_OPS = ("EPContext",)
EXTERNAL_KEYS = ("location", "offset", "length", "checksum")
# The inputs the runtime feeds besides the cache state (edgec/runtime/backend_ort.py) and the output it reads
STEP_INPUTS = ("input_ids", "position_ids", "logits_index", "protect", "observe")
LOGITS = "logits"
MAX_DEPTH = 64  # graphs nested in attributes (If/Loop bodies); real models nest a few levels
ONNX_TYPES = {"float32": 1, "uint8": 2, "int8": 3, "int64": 7, "bool": 9, "float16": 10}


class OnnxFormatError(ValueError):
    """The bytes are not a well-formed ONNX protobuf."""


@dataclass(frozen=True)
class ValueInfo:
    name: str
    elem_type: int
    dims: tuple[int | str | None, ...] | None  # a number, a symbolic name, None (unknown); None: no shape


@dataclass(frozen=True)
class StoredTensor:
    """A main-graph initializer whose bytes lie in an external file."""

    data_type: int  # onnx TensorProto.DataType
    dims: tuple[int, ...]
    entries: dict[str, str]  # location, offset, length (checked by graph_problems before a graph is opened)


@dataclass
class GraphScan:
    external: list[tuple[str, dict[str, str]]] = field(default_factory=list)  # (tensor name, its entries)
    stored: dict[str, StoredTensor] = field(default_factory=dict)  # the main graph's external initializers
    nodes: set[tuple[str, str]] = field(default_factory=set)  # (domain, op_type), nested graphs included
    top_level: dict[str, int] = field(default_factory=dict)  # "domain::op_type" (or op_type) → nodes in the graph
    functions: set[tuple[str, str]] = field(default_factory=set)  # (domain, name)
    inputs: list[ValueInfo] = field(default_factory=list)  # of the main graph
    outputs: list[ValueInfo] = field(default_factory=list)


def scan(path: Path) -> GraphScan:
    """Read ``path`` (an ONNX model) without loading any external data."""
    result = GraphScan()
    with open(path, "rb") as handle:
        if handle.seek(0, 2) == 0:
            raise OnnxFormatError("the file is empty")
        with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
            view = memoryview(data)
            try:
                _model(view, result)
            finally:
                view.release()
    return result


def graph_problems(folder: Path, manifest: dict[str, Any], scans: dict[str, GraphScan] | None = None) -> list[str]:
    """Why the bundle's ONNX graph(s) must not reach ONNX Runtime; empty when they may. ``manifest`` has passed
    ``manifest_errors`` and the file checks (its paths are listed regular files inside ``folder``). ``scans``:
    filled with each graph file's scan, for a loader that reads them again (``runtime.shared_weights``)."""
    problems = []
    files = manifest["files"]
    for key in ("file", "decode_file", "prefill_file", "extend_file"):
        name = manifest["model"].get(key)
        if name is None:
            continue
        try:
            graph = scan(folder / name)
        except (OnnxFormatError, OSError) as error:
            problems.append(f"{name} is not a readable ONNX model ({error})")
            continue
        if scans is not None:
            scans[name] = graph
        for tensor, entries in graph.external:
            problems += _external_problems(name, tensor, entries, files)
        functions = {domain for domain, _ in graph.functions}
        for domain, op_type in sorted(graph.nodes):
            if op_type in REFUSED_OPS:
                problems.append(f"{name} has a {show(op_type)} node, which loads a file by name: not allowed")
            elif domain not in BUILTIN_DOMAINS and domain not in functions:
                problems.append(
                    f"{name} uses op {show(op_type)} of the unknown domain {show(domain)} (neither ONNX, ONNX "
                    "Runtime's com.microsoft nor a function of the model): no runtime edgec targets has it"
                )
        problems += _interface_problems(name, graph, manifest)
    return problems


def _external_problems(graph_file: str, tensor: str, entries: dict[str, str], files: dict[str, Any]) -> list[str]:
    where = f"{graph_file}: tensor {show(tensor)} stores its data"
    unknown = [key for key in entries if key not in EXTERNAL_KEYS]
    if unknown:
        return [f"{where} with unknown external-data keys {', '.join(show(key) for key in unknown)}"]
    location = entries.get("location")
    if location is None:
        return [f"{where} outside the file but names no location"]
    if problem := path_problem(location):
        return [f"{where} in {show(location)}: {problem}; a bundle's graph may only name its own files"]
    if location not in files:
        return [f"{where} in {show(location)}, which the manifest does not list"]
    try:
        offset = int(entries.get("offset", "0"))
        length = int(entries["length"]) if "length" in entries else None
    except ValueError:
        return [f"{where} at a non-numeric offset or length"]
    size = files[location]["size"]
    if offset < 0 or (length is not None and length < 0) or offset + (length or 0) > size:
        return [f"{where} at bytes {offset:,}+{length or 0:,} of {location}, which has {size:,}"]
    return []


def _interface_problems(graph_file: str, graph: GraphScan, manifest: dict[str, Any]) -> list[str]:
    """The graph's inputs and outputs against what the runtime will bind from the manifest: the cache state of
    every layer (names, element types, fixed dimensions), the step inputs and the logits."""
    from edgec.kvcache.spec import MIXED_STATE, CacheSpec

    spec = CacheSpec.from_json(manifest["cache"])
    expected: dict[str, tuple[int, tuple[int, ...]]] = {}
    outputs = {}
    for layer in spec.layers:
        # one slot is enough to learn each tensor's element type and shape; the slot dimension is the capacity
        # (a mixed cache: its wide pool's slots, fixed, and the rest)
        wide = spec.compression.hi_slots if layer.compressed else 0
        arrays = spec.empty_layer(layer, slots=wide + 1)
        for tensor in layer.tensors():
            array = arrays[tensor.name]
            slots = wide if tensor.name in MIXED_STATE else layer.capacity - wide
            shape = tuple(slots if axis == 2 else size for axis, size in enumerate(array.shape))
            expected[tensor.input] = (ONNX_TYPES.get(array.dtype.name, -1), shape)
            outputs[tensor.input] = tensor.output
    problems = []
    if manifest["format_version"] >= 2:  # v2 names every state tensor the graph carries (v1 only some)
        present = {value.name for value in graph.inputs}
        problems += [f"{graph_file} lacks the cache input {show(name)}" for name in expected if name not in present]
    graph_outputs = {value.name: value for value in graph.outputs}
    for value in graph.inputs:
        if value.name in STEP_INPUTS:
            continue
        if value.name not in expected:
            problems.append(f"{graph_file} has an input {show(value.name)} that the manifest's cache does not have")
            continue
        elem_type, shape = expected[value.name]
        if value.elem_type != elem_type or not _same_shape(value.dims, shape):
            problems.append(
                f"{graph_file} input {show(value.name)} is {_type_name(value.elem_type)} {list(value.dims or [])}, "
                f"the manifest's cache says {_type_name(elem_type)} {list(shape)}"
            )
        if outputs[value.name] not in graph_outputs:
            problems.append(f"{graph_file} has no output {show(outputs[value.name])} for its input {show(value.name)}")
    logits = graph_outputs.get(LOGITS)
    if logits is None:
        problems.append(f"{graph_file} has no {LOGITS} output")
    elif logits.dims and isinstance(logits.dims[-1], int) and logits.dims[-1] != manifest["model"]["vocab_size"]:
        problems.append(f"{graph_file} gives {logits.dims[-1]} logits, the manifest's vocab_size is different")
    return problems


def _type_name(elem_type: int) -> str:
    return next((name for name, number in ONNX_TYPES.items() if number == elem_type), f"ONNX type {elem_type}")


def _same_shape(dims: tuple[int | str | None, ...] | None, shape: tuple[int, ...]) -> bool:
    if dims is None:
        return True
    if len(dims) != len(shape):
        return False
    return all(not isinstance(dim, int) or dim == size for dim, size in zip(dims, shape, strict=True))


# --- the protobuf wire format ---------------------------------------------------------------------------------
def _varint(data: memoryview, position: int, end: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if position >= end or shift > 63:
            raise OnnxFormatError("a truncated or overlong number")
        byte = data[position]
        position += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, position
        shift += 7


def _fields(data: memoryview, start: int, end: int):
    """(field number, wire type, value) of each field in ``data[start:end]``; a length-delimited value is its
    (start, end)."""
    position = start
    while position < end:
        key, position = _varint(data, position, end)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, position = _varint(data, position, end)
        elif wire == 1:
            value, position = position, position + 8
        elif wire == 5:
            value, position = position, position + 4
        elif wire == 2:
            length, position = _varint(data, position, end)
            value, position = (position, position + length), position + length
        else:
            raise OnnxFormatError(f"unsupported protobuf wire type {wire}")
        if position > end:
            raise OnnxFormatError("a field runs past the end of its message")
        yield number, wire, value


def _text(data: memoryview, span: Any) -> str:
    if not isinstance(span, tuple):
        raise OnnxFormatError("a string field is not length-delimited")
    try:
        return bytes(data[span[0] : span[1]]).decode()
    except UnicodeDecodeError:
        raise OnnxFormatError("a string field is not UTF-8") from None


def _number(wire: int, value: Any) -> int:
    if wire != 0:
        raise OnnxFormatError("a number field is not a varint")
    return value


def _span(span: Any) -> tuple[int, int]:
    if not isinstance(span, tuple):
        raise OnnxFormatError("a message field is not length-delimited")
    return span


def _model(data: memoryview, result: GraphScan) -> None:
    for number, _, value in _fields(data, 0, len(data)):
        if number == 7:  # graph
            _graph(data, _span(value), result, 0, main=True)
        elif number == 25:  # functions
            _function(data, _span(value), result)
        elif number == 20:  # training_info: initialization (1) and algorithm (2) graphs
            for inner, _, graph in _fields(data, *_span(value)):
                if inner in (1, 2):
                    _graph(data, _span(graph), result, 1)


def _graph(data: memoryview, span: tuple[int, int], result: GraphScan, depth: int, main: bool = False) -> None:
    if depth > MAX_DEPTH:
        raise OnnxFormatError(f"graphs nested more than {MAX_DEPTH} deep")
    for number, _, value in _fields(data, *span):
        if number == 1:  # node
            domain, op_type = _node(data, _span(value), result, depth)
            if main:
                kind = f"{domain}::{op_type}" if domain else op_type
                result.top_level[kind] = result.top_level.get(kind, 0) + 1
        elif number == 5:  # initializer
            _tensor(data, _span(value), result, main)
        elif number == 15:  # sparse_initializer: values (1), indices (2)
            _sparse(data, _span(value), result)
        elif main and number == 11:
            result.inputs.append(_value_info(data, _span(value)))
        elif main and number == 12:
            result.outputs.append(_value_info(data, _span(value)))


def _node(data: memoryview, span: tuple[int, int], result: GraphScan, depth: int) -> tuple[str, str]:
    domain = op_type = ""
    for number, _, value in _fields(data, *span):
        if number == 4:
            op_type = _text(data, value)
        elif number == 7:
            domain = _text(data, value)
        elif number == 5:  # attribute
            _attribute(data, _span(value), result, depth)
    result.nodes.add((domain, op_type))
    return domain, op_type


def _attribute(data: memoryview, span: tuple[int, int], result: GraphScan, depth: int) -> None:
    for number, _, value in _fields(data, *span):
        if number in (5, 10):  # t, tensors
            _tensor(data, _span(value), result)
        elif number in (6, 11):  # g, graphs
            _graph(data, _span(value), result, depth + 1)
        elif number in (22, 23):  # sparse_tensor, sparse_tensors
            _sparse(data, _span(value), result)


def _function(data: memoryview, span: tuple[int, int], result: GraphScan) -> None:
    name = domain = ""
    for number, _, value in _fields(data, *span):
        if number == 1:
            name = _text(data, value)
        elif number == 10:
            domain = _text(data, value)
        elif number == 7:  # node
            _node(data, _span(value), result, 1)
        elif number == 11:  # attribute_proto: default attribute values
            _attribute(data, _span(value), result, 1)
    result.functions.add((domain, name))


def _sparse(data: memoryview, span: tuple[int, int], result: GraphScan) -> None:
    for number, _, value in _fields(data, *span):
        if number in (1, 2):
            _tensor(data, _span(value), result)


def _tensor(data: memoryview, span: tuple[int, int], result: GraphScan, main: bool = False) -> None:
    name = ""
    entries: dict[str, str] = {}
    external = False
    data_type = 0
    dims: list[int] = []
    for number, wire, value in _fields(data, *span):
        if number == 1:  # dims: repeated int64, packed or not
            if wire == 2:
                start, end = _span(value)
                while start < end:
                    dim, start = _varint(data, start, end)
                    dims.append(dim)
            else:
                dims.append(_number(wire, value))
        elif number == 2:
            data_type = _number(wire, value)
        elif number == 8:
            name = _text(data, value)
        elif number == 14:  # data_location: 1 = EXTERNAL
            external = _number(wire, value) == 1
        elif number == 13:  # external_data: StringStringEntryProto (key 1, value 2)
            key = text = ""
            for inner, _, part in _fields(data, *_span(value)):
                if inner == 1:
                    key = _text(data, part)
                elif inner == 2:
                    text = _text(data, part)
            entries[key] = text
    if external or entries:
        result.external.append((name, entries))
        if main and external:
            result.stored[name] = StoredTensor(data_type, tuple(dims), entries)


def _value_info(data: memoryview, span: tuple[int, int]) -> ValueInfo:
    name, elem_type, dims = "", 0, None
    for number, _, value in _fields(data, *span):
        if number == 1:
            name = _text(data, value)
        elif number == 2:  # TypeProto → tensor_type (1) → elem_type (1), shape (2) → dim (1)
            for kind, _, tensor_type in _fields(data, *_span(value)):
                if kind != 1:
                    continue
                for inner, wire, part in _fields(data, *_span(tensor_type)):
                    if inner == 1:
                        elem_type = _number(wire, part)
                    elif inner == 2:
                        dims = tuple(_dim(data, _span(dim)) for n, _, dim in _fields(data, *_span(part)) if n == 1)
    return ValueInfo(name, elem_type, dims)


def _dim(data: memoryview, span: tuple[int, int]) -> int | str | None:
    for number, wire, value in _fields(data, *span):
        if number == 1:
            return _number(wire, value)
        if number == 2:
            return _text(data, value)
    return None
