"""One copy of the weights for a bundle's two CPU sessions (the step graph and the prompt-chunk graph).

Each ONNX Runtime session loads its own copy of every initializer and packs its own copy of every fp32 MatMul/
Gemm weight. A bundle with a prompt-chunk graph (``prefill.onnx``: a compressed cache over fp32 slots) therefore
held its weights twice over: Gemma-3-270m with fp32 weights peaked at 4.04 GB reading a 32K prompt, against the
plain bundle's 2.26 GB (docs/BENCHMARKS.md, sixteenth round). So where both graphs read the same stored float
tensors, they are mapped once from the bundle's data file and handed to both sessions
(``SessionOptions.add_initializer``: ONNX Runtime uses the buffer as it is), and the prompt-chunk session packs
nothing: its products have hundreds of rows, so packing the weight on the fly per call costs little, while the
one-token step graph keeps its packed weights (unpacked one-row products are 1.6-2x slower here).

Not for quantized weights (MatMulNBits and its kin): there each graph's kernel packs its own form of the codes
anyway (the prompt graph runs them at fp32 activations), so keeping the mapped originals only adds to what the
sessions hold — measured: more memory and slower prompts. Those bundles keep ONNX Runtime's own loading.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from edgec.onnx_scan import GraphScan, StoredTensor, scan

# float element types shared (onnx TensorProto.DataType → numpy)
FLOAT_TYPES = {1: np.float32, 10: np.float16, 11: np.float64}
# ops whose weights each session packs into a form of its own: with any of them the sessions do not share
PACKED_OWN_FORM = {"MatMulNBits", "GatherBlockQuantized", "DequantizeLinear", "MatMulInteger", "DynamicQuantizeMatMul"}
PREPACKING_OFF = ("session.disable_prepacking", "1")  # the prompt-chunk session's config entry
ALIGNMENT = 64  # bytes: a tensor mapped at a less aligned offset is left to ONNX Runtime's own loading


def shared_weights(folder: Path, graphs: list[str], scans: dict[str, GraphScan] | None = None) -> dict[str, np.ndarray]:
    """Read-only arrays over the bundle's data files for every float initializer that each of ``graphs`` (file
    names in ``folder``) stores externally at the same place; empty when a graph has quantized weights or
    none are common. The locations were checked by ``onnx_scan.graph_problems`` when the bundle opened;
    ``scans``: its scans of the graph files (a graph missing there is read here)."""
    read = [(scans or {}).get(name) or scan(folder / name) for name in graphs]
    if packs_own_forms(read):
        return {}
    first, *others = (one.stored for one in read)
    files: dict[str, np.memmap] = {}
    shared = {}
    for name, tensor in first.items():
        if any(other.get(name) != tensor for other in others):
            continue
        array = _mapped(folder, tensor, files)
        if array is not None:
            shared[name] = array
    return shared


def packs_own_forms(scans: list[GraphScan]) -> bool:
    """Whether any of these graphs has weights its kernels pack into forms of their own (``PACKED_OWN_FORM``)."""
    return any(op_type in PACKED_OWN_FORM for one in scans for _, op_type in one.nodes)


def _mapped(folder: Path, tensor: StoredTensor, files: dict[str, np.memmap]) -> np.ndarray | None:
    """The tensor's bytes as an array over its mapped file; None where its record does not describe them
    exactly (ONNX Runtime then loads it, and reports what is wrong)."""
    dtype = FLOAT_TYPES.get(tensor.data_type)
    if dtype is None:
        return None
    try:
        offset = int(tensor.entries.get("offset", "0"))
        length = int(tensor.entries["length"])
    except (KeyError, ValueError):
        return None
    size = math.prod(tensor.dims) * np.dtype(dtype).itemsize
    if length != size or size == 0 or offset % ALIGNMENT:
        return None
    location = tensor.entries["location"]
    if location not in files:
        files[location] = np.memmap(folder / location, dtype=np.uint8, mode="r")
    data = files[location]
    if offset + length > len(data):
        return None
    return data[offset : offset + length].view(dtype).reshape(tensor.dims)
