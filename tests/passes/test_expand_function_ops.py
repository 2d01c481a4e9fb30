"""expand_function_ops: RMSNormalization-23 and RotaryEmbedding-23 become their ONNX function bodies (older ops),
with the same results, and no zero-size Split is left for runtimes without empty tensors."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import onnxruntime as ort

from edgec.export import cache_spec_for, empty_cache, export_step
from edgec.passes import run_passes


def _run(model: ir.Model, feeds: dict) -> list[np.ndarray]:
    proto = ir.serde.serialize_model(model).SerializeToString()
    return ort.InferenceSession(proto, providers=["CPUExecutionProvider"]).run(None, feeds)


def test_expansion_keeps_the_results(tiny_hf_model):
    spec = cache_spec_for(tiny_hf_model.config, 32)
    model = export_step(tiny_hf_model, spec)
    names = [value.name for value in model.graph.inputs]
    ids = np.random.default_rng(0).integers(0, tiny_hf_model.config.vocab_size, (1, 5))
    caches = [tensor.numpy() for tensor in empty_cache(spec)]
    feeds = dict(zip(names, [ids, np.arange(5)[None], np.arange(5), *caches], strict=True))
    before = _run(model, feeds)
    counts, _ = run_passes(model, ["expand_function_ops"])
    assert counts == {"expand_function_ops": 2 * 2 + 1 + 2 * 2}  # norms per layer + final norm, q and k rotaries
    ops = [node.op_type for node in model.graph]
    assert "RMSNormalization" not in ops and "RotaryEmbedding" not in ops
    for node in model.graph:
        if node.op_type == "Split" and len(node.inputs) > 1 and node.inputs[1].const_value is not None:
            assert 0 not in node.inputs[1].const_value.numpy().tolist()
    for got, want in zip(_run(model, feeds), before, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
