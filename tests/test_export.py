"""Tracing: one KVAttention per layer, a valid ONNX model, logits equal to transformers' on random weights."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch

from edgec.export import cache_spec_for, empty_cache, export_step
from edgec.kvcache import function as kv_function
from edgec.passes import run_passes


@pytest.fixture(scope="module")
def exported(tiny_llama):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    spec = cache_spec_for(model.config, 64)
    return export_step(model, spec), spec


def _session(model: ir.Model) -> ort.InferenceSession:
    return ort.InferenceSession(ir.serde.serialize_model(model).SerializeToString(), providers=["CPUExecutionProvider"])


def _run_chunks(sess, spec, ids: np.ndarray, chunks: list[int]) -> np.ndarray:
    """Feed ids in the given chunk sizes through the cache; logits of every position."""
    all_names = [tensor.input for tensor in spec.tensors()]
    state_by_name = dict(zip(all_names, [t.numpy() for t in empty_cache(spec)], strict=True))
    names = [i.name for i in sess.get_inputs()][3:]  # a lowering may have dropped some state (pos)
    state = [state_by_name[name] for name in names]
    start, pieces = 0, []
    for size in chunks:
        chunk = ids[start : start + size]
        feeds = {
            "input_ids": chunk[None],
            "position_ids": np.arange(start, start + size)[None],
            "logits_index": np.arange(size),
            **dict(zip(names, state, strict=True)),
        }
        logits, *state = sess.run(None, feeds)
        pieces.append(logits[0])
        start += size
    return np.concatenate(pieces)


def test_one_kv_attention_node_per_layer(exported, tiny_hf_model):
    model, _ = exported
    kv_nodes = [n for n in model.graph if n.domain == kv_function.DOMAIN and n.op_type == kv_function.OP_TYPE]
    assert len(kv_nodes) == tiny_hf_model.config.num_hidden_layers
    assert (kv_function.DOMAIN, kv_function.OP_TYPE, "") in model.functions
    assert model.opset_imports[""] >= 21
    proto = ir.serde.serialize_model(model)
    onnx.checker.check_model(proto, full_check=True)
    # the cache state is explicit graph I/O, positions included
    names = [v.name for v in model.graph.inputs]
    assert names[:3] == ["input_ids", "position_ids", "logits_index"]
    assert names[3:6] == ["cache.0.k", "cache.0.v", "cache.0.pos"]


@pytest.mark.parametrize("chunks", [[40], [16, 16, 8], [17, 1, 1, 1, 20]])
def test_logits_match_transformers(exported, tiny_hf_model, chunks):
    model, spec = exported
    ids = np.random.default_rng(0).integers(0, tiny_hf_model.config.vocab_size, 40)
    got = _run_chunks(_session(model), spec, ids, chunks)
    with torch.no_grad():
        want = tiny_hf_model(torch.tensor(ids[None])).logits[0].numpy()
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def test_cpu_passes_keep_logits(exported, tiny_hf_model, tmp_path):
    model, spec = exported
    lowered = ir.serde.deserialize_model(ir.serde.serialize_model(model))
    passes = ["fuse_projections", "transposed_weight_gemm", "skip_rms_norm", "kv_attention_gqa"]
    counts, lowered_spec = run_passes(lowered, passes, spec=spec)
    assert all("pos" not in layer.state for layer in lowered_spec.layers)  # GQA's fill implies the positions
    assert counts["kv_attention_gqa"] == tiny_hf_model.config.num_hidden_layers
    assert counts["fuse_projections"] == 2 * tiny_hf_model.config.num_hidden_layers  # qkv and gate/up
    ops = [n.op_type for n in lowered.graph]
    assert "KVAttention" not in ops and ops.count("GroupQueryAttention") == tiny_hf_model.config.num_hidden_layers
    ids = np.random.default_rng(1).integers(0, tiny_hf_model.config.vocab_size, 30)
    got = _run_chunks(_session(lowered), spec, ids, [13, 1, 16])
    with torch.no_grad():
        want = tiny_hf_model(torch.tensor(ids[None])).logits[0].numpy()
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def test_cpu_passes_on_a_fresh_export(tiny_llama):
    """Passes see the exporter's in-memory IR (not a serialized round trip), where tensors may be nameless."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    spec = cache_spec_for(model.config, 32)
    exported = export_step(model, spec)
    passes = ["fuse_projections", "transposed_weight_gemm", "skip_rms_norm", "kv_attention_gqa"]
    counts, _ = run_passes(exported, passes, spec=spec)
    assert counts["kv_attention_gqa"] == model.config.num_hidden_layers
    ops = [n.op_type for n in exported.graph]
    assert "RotaryEmbedding" not in ops and "Split" in ops  # RoPE moved into GQA; gate/up still split
    ids = np.arange(20) % model.config.vocab_size
    got = _run_chunks(_session(exported), spec, ids, [7, 1, 12])
    with torch.no_grad():
        want = model(torch.tensor(ids[None])).logits[0].numpy()
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def test_the_graph_does_not_say_where_it_was_built(exported):
    """No stack traces: the build machine's paths and edgec's line numbers would make two checkouts of one release
    build different bundles from the same inputs."""
    import edgec

    model, _ = exported
    data = ir.serde.serialize_model(model).SerializeToString()
    assert str(Path(edgec.__file__).resolve().parents[1]).encode() not in data
    assert b"pkg.torch.onnx.stack_trace" not in data
