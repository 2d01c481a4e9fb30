"""A prompt's chunks before its last compute no logits (``OrtCacheState.feed`` with an empty ``logits_index``)
where the build found the graph's logits path keeps zero rows (``edgec/logits_rows.py``, manifest
``model.no_logits_rows``): the state and the last chunk's logits are those of one row per chunk."""

from __future__ import annotations

import json
import shutil

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest

from edgec.build import build
from edgec.logits_rows import takes_no_rows
from edgec.runtime import Model, backend_ort
from tests.conftest import build_settings, pydoc_text

KINDS = {
    "fp32": {},
    "fp32-slots": {"kv_capacity": 40, "kv_dtype": "fp32", "kv_window": 8},  # a prompt-chunk graph, in place
    "int8-slots": {"kv_capacity": 40, "kv_dtype": "int8", "kv_window": 8, "kv_group": 16},
    "int4-split": {"weights": "int4", "split_activations": True},  # prefill.onnx at fp32 activations
    "portable": {"target": "cpu-portable"},  # the attention function's body, no fused kernels
}


@pytest.fixture(scope="module")
def bundles(tmp_path_factory, tiny_llama):
    root = tmp_path_factory.mktemp("no-logits-rows")
    for name, extra in KINDS.items():
        build(
            tiny_llama, root / name, build_settings(**{"target": "cpu", "context": 256, "prefill_chunk": 16, **extra})
        )
    return {name: root / name for name in KINDS}


def _prompt(model: Model, length: int = 150) -> np.ndarray:
    return np.array(model.encode(pydoc_text()[:6000])[:length])


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_chunks_before_the_last_ask_for_no_logits_and_change_nothing(bundles, kind, monkeypatch):
    manifest = json.loads((bundles[kind] / "manifest.json").read_text())
    assert manifest["model"]["no_logits_rows"] is True
    rows = []
    run_positions = backend_ort.OrtCacheState.run_positions

    def recorded(self, ids, positions, index, protect=None):
        rows.append(len(index))
        return run_positions(self, ids, positions, index, protect)

    monkeypatch.setattr(backend_ort.OrtCacheState, "run_positions", recorded)
    model = Model.load(bundles[kind])
    ids = _prompt(model)
    state = model._backend.open_state()
    state.no_logits_rows = False
    one_row = model._prefill(state, ids, all_logits=False).copy()
    one_row_state = {name: array.copy() for name, array in state.arrays().items()}
    assert rows and all(count == 1 for count in rows)
    rows.clear()
    state.no_logits_rows = True
    none = model._prefill(state, ids, all_logits=False).copy()
    assert rows[:-1] and all(count == 0 for count in rows[:-1]) and rows[-1] == 1  # only the last chunk has logits
    np.testing.assert_array_equal(none, one_row)
    for name, array in state.arrays().items():
        np.testing.assert_array_equal(array, one_row_state[name], err_msg=name)
    # and what a user gets: the same greedy answer as a bundle that computes a row per chunk
    assert model.generate(ids.tolist(), max_new_tokens=6) == _without_flag(bundles[kind], ids)


def _without_flag(bundle, ids) -> str:
    model = Model.load(bundle)
    model._backend.no_logits_rows = False
    return model.generate(ids.tolist(), max_new_tokens=6)


def test_a_bundle_without_the_flag_still_computes_one_row(bundles, tmp_path, monkeypatch):
    """Bundles built before the check (or whose graphs fail it) keep one row per chunk: an empty index is never
    sent to a graph not known to take it."""
    old = tmp_path / "old.edgec"
    shutil.copytree(bundles["fp32"], old)
    manifest = json.loads((old / "manifest.json").read_text())
    del manifest["model"]["no_logits_rows"]
    (old / "manifest.json").write_text(json.dumps(manifest))
    rows = []
    run_positions = backend_ort.OrtCacheState.run_positions
    monkeypatch.setattr(
        backend_ort.OrtCacheState,
        "run_positions",
        lambda self, ids, positions, index, protect=None: (
            rows.append(len(index)) or run_positions(self, ids, positions, index, protect)
        ),
    )
    model = Model.load(old)
    model.generate(_prompt(model).tolist(), max_new_tokens=1)
    assert rows and 0 not in rows


def test_the_check_refuses_the_reshape_that_fails_on_zero_rows(bundles, tmp_path):
    """The Gemm lm_head's reshape back to [B, rows, vocab] from the input's own shape: without ``allowzero`` a 0
    there means "copy the input's dimension" and ONNX Runtime fails on an empty index — the check says so; with
    it the graph returns [1, 0, vocab]."""
    model = ir.load(bundles["fp32"] / "model.onnx")
    assert takes_no_rows(model)
    reshapes = [node for node in model.graph if node.op_type == "Reshape" and "allowzero" in node.attributes]
    assert reshapes  # the lm_head's (passes/transposed_weight_gemm.py)
    run = _runner(bundles["fp32"])
    assert run(bundles["fp32"] / "model.onnx").shape[:2] == (1, 0)
    for node in reshapes:
        del node.attributes["allowzero"]
    assert not takes_no_rows(model)
    broken = bundles["fp32"] / "broken.onnx"
    ir.save(model, broken)
    try:
        with pytest.raises(Exception, match="(?i)reshape"):
            run(broken)
    finally:
        broken.unlink()


def _runner(bundle):
    """One 4-token step with an empty logits_index on a graph of ``bundle`` (its cache state zero-filled)."""
    spec = Model.load(bundle).cache_spec

    def run(path):
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        feeds = {"input_ids": np.arange(4, dtype=np.int64)[None], "position_ids": np.arange(4, dtype=np.int64)[None]}
        feeds["logits_index"] = np.zeros(0, np.int64)
        for tensor, array in spec.empty_state():
            feeds[tensor.input] = array
        inputs = {value.name for value in session.get_inputs()}
        return session.run(["logits"], {name: value for name, value in feeds.items() if name in inputs})[0]

    return run


def test_the_walk_stops_at_subgraphs_and_computed_shapes():
    graph_text = """
    <ir_version: 8, opset_import: ["" : 18]>
    g (int64[N] logits_index, float[1, T, 8] hidden, int64[2] shape) => (float[1, M, 8] logits) {
        rows = Gather <axis = 1> (hidden, logits_index)
        flat = Reshape (rows, shape)
        logits = Identity (flat)
    }
    """
    computed = ir.from_proto(onnx.parser.parse_model(graph_text))
    assert not takes_no_rows(computed)  # the shape is an input: a 0 in it would be copied
    allowed = ir.from_proto(onnx.parser.parse_model(graph_text.replace("Reshape (", "Reshape <allowzero = 1> (")))
    assert takes_no_rows(allowed)
    no_index = ir.from_proto(onnx.parser.parse_model(graph_text.replace("logits_index", "picked")))
    assert not takes_no_rows(no_index)


def test_a_manifest_flag_that_is_not_a_boolean_is_refused(bundles, tmp_path):
    from edgec.errors import BundleError

    bad = tmp_path / "bad.edgec"
    shutil.copytree(bundles["fp32"], bad)
    manifest = json.loads((bad / "manifest.json").read_text())
    manifest["model"]["no_logits_rows"] = "yes"
    (bad / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match="no_logits_rows"):
        Model.load(bad)
