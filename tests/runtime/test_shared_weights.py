"""A bundle's step graph and prompt-chunk graph hold one copy of their float weights (``shared_weights``): both
sessions read the tensors mapped from the bundle's data file, and the prompt-chunk session packs none. The answers
must be the ones each session gives with its own loaded, packed copy; quantized weights keep ONNX Runtime's own
loading; a stored-tensor record that does not describe its bytes exactly is left to ONNX Runtime."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest

from edgec.build import build
from edgec.onnx_scan import StoredTensor, scan
from edgec.runtime import Model, shared_weights
from tests.conftest import build_settings, pydoc_text

KV = dict(target="cpu", context=128, prefill_chunk=16, kv_capacity=40, kv_dtype="fp32", kv_window=8)
PREPACKING = shared_weights.PREPACKING_OFF[0]


@pytest.fixture(scope="module")
def fp32_slots(tmp_path_factory, tiny_llama):
    """fp32 weights, 40 fp32 slots: a prompt-chunk graph (prefill.onnx) beside the step graph."""
    out = tmp_path_factory.mktemp("shared-weights") / "fp32-slots.edgec"
    build(tiny_llama, out, build_settings(**KV))
    return out


def _answers(bundle) -> tuple[np.ndarray, list[int]]:
    """Every logit of a 100-token `end` prompt (temporary state, chunks of 16), then 12 greedy tokens."""
    model = Model.load(bundle, threads=1)
    ids = model.encode(pydoc_text()[:3000])[:100]
    state = model._backend.open_state()
    logits = model._prefill(state, np.array(ids), all_logits=True)
    return logits, list(model.generate_ids(ids, max_new_tokens=12))


def _prepacking_off(session) -> bool:
    try:
        return session.get_session_options().get_session_config_entry(PREPACKING) == "1"
    except RuntimeError:  # not set: ONNX Runtime's default, packing on
        return False


def _mapping_of(address: int) -> str | None:
    """The file mapped at ``address`` in this process (Linux's /proc/self/maps), None for anonymous memory."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        span, _, _, _, _, *path = line.split(maxsplit=5)
        start, end = (int(part, 16) for part in span.split("-"))
        if start <= address < end:
            return path[0] if path else None
    return None


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads Linux's /proc/self/maps")
def test_both_sessions_read_one_mapped_copy_and_the_prompt_session_packs_none(fp32_slots):
    backend = Model.load(fp32_slots)._backend
    decode, prompt = backend.graph, backend.prefill
    stored = scan(fp32_slots / "model.onnx").stored
    assert decode.shared and decode.shared is prompt.shared
    assert set(decode.shared) == set(stored)  # every weight the two graphs store alike
    data_file = str((fp32_slots / "model.onnx.data").resolve())
    for value in decode.shared.values():  # ONNX Runtime's value lies in the mapped file itself: nothing copied
        assert _mapping_of(value.data_ptr()) == data_file
    assert _prepacking_off(prompt.session)
    assert not _prepacking_off(decode.session)


def test_the_answers_are_each_sessions_own(fp32_slots, monkeypatch):
    shared_logits, shared_tokens = _answers(fp32_slots)
    monkeypatch.setattr(shared_weights, "shared_weights", lambda folder, graphs, scans=None: {})
    own_logits, own_tokens = _answers(fp32_slots)
    assert Model.load(fp32_slots)._backend.graph.shared == {}  # the monkeypatch reached the loader
    np.testing.assert_allclose(shared_logits, own_logits, rtol=0, atol=1e-4)
    assert shared_tokens == own_tokens


def test_quantized_weights_keep_onnx_runtimes_own_loading(tmp_path, tiny_llama):
    out = tmp_path / "int4.edgec"
    build(tiny_llama, out, build_settings(**KV, weights="int4"))
    assert (out / "prefill.onnx").exists()
    assert shared_weights.shared_weights(out, ["model.onnx", "prefill.onnx"]) == {}
    backend = Model.load(out)._backend
    assert backend.graph.shared == {} and backend.prefill.shared == {}
    assert not _prepacking_off(backend.prefill.session)


def test_only_tensors_both_graphs_store_alike_are_shared(fp32_slots, tmp_path):
    """A tensor the prompt graph stores elsewhere (another offset) stays each session's own."""
    folder = tmp_path / "bundle"
    folder.mkdir()
    for name in ("model.onnx", "model.onnx.data"):
        (folder / name).write_bytes((fp32_slots / name).read_bytes())
    prompt = onnx.load(fp32_slots / "prefill.onnx", load_external_data=False)
    moved = next(t for t in prompt.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL)
    for entry in moved.external_data:
        if entry.key == "offset":
            entry.value = str(int(entry.value) + 64)
    onnx.save(prompt, folder / "prefill.onnx")
    shared = shared_weights.shared_weights(folder, ["model.onnx", "prefill.onnx"])
    assert shared and moved.name not in shared
    assert set(shared) == set(scan(folder / "model.onnx").stored) - {moved.name}


@pytest.mark.parametrize(
    "record",
    [
        StoredTensor(1, (4, 8), {"location": "w.bin", "offset": "0", "length": "64"}),  # 128 bytes described as 64
        StoredTensor(1, (4, 8), {"location": "w.bin", "offset": "4", "length": "128"}),  # not 64-byte aligned
        StoredTensor(1, (4, 8), {"location": "w.bin", "offset": "128", "length": "128"}),  # past the file's end
        StoredTensor(3, (4, 8), {"location": "w.bin", "offset": "0", "length": "32"}),  # int8: not a float weight
        StoredTensor(1, (4, 8), {"location": "w.bin", "offset": "x", "length": "128"}),  # not a number
        StoredTensor(1, (4, 8), {"location": "w.bin", "offset": "0"}),  # no length
        StoredTensor(1, (0, 8), {"location": "w.bin", "offset": "0", "length": "0"}),  # nothing to map
    ],
)
def test_a_record_that_does_not_describe_its_bytes_exactly_is_not_mapped(tmp_path, record):
    (tmp_path / "w.bin").write_bytes(np.arange(48, dtype=np.float32).tobytes())  # 192 bytes
    assert shared_weights._mapped(tmp_path, record, {}) is None


def test_a_record_that_does_is_mapped_as_its_values(tmp_path):
    values = np.arange(48, dtype=np.float32)
    (tmp_path / "w.bin").write_bytes(values.tobytes())
    record = StoredTensor(1, (2, 8), {"location": "w.bin", "offset": "64", "length": "64"})
    array = shared_weights._mapped(tmp_path, record, {})
    np.testing.assert_array_equal(array, values[16:32].reshape(2, 8))
    assert not array.flags.writeable  # ONNX Runtime reads it; nothing may write the bundle's file


def test_the_scan_reads_each_stored_initializers_type_and_shape(tmp_path):
    weight = onnx.numpy_helper.from_array(np.ones((3, 5, 7), np.float16), "weight")
    weight.data_location = onnx.TensorProto.EXTERNAL
    weight.ClearField("raw_data")
    for key, value in (("location", "w.bin"), ("offset", "0"), ("length", "210")):
        weight.external_data.add(key=key, value=value)
    inline = onnx.numpy_helper.from_array(np.ones(2, np.float32), "inline")
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("Add", ["x", "inline"], ["y"])],
        "g",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2])],
        [weight, inline],
    )
    onnx.save(onnx.helper.make_model(graph), tmp_path / "m.onnx")
    stored = scan(tmp_path / "m.onnx").stored
    assert stored == {"weight": StoredTensor(10, (3, 5, 7), {"location": "w.bin", "offset": "0", "length": "210"})}
