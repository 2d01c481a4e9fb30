"""benchmarks/decode_attention.py compares like with like: GroupQueryAttention over the slots in place and the same
attention as MatMuls give the same output and probabilities (checked before any timing, with empty slots hidden by
the bias), and a form that computed something else is refused."""

from __future__ import annotations

import pytest

from tests.conftest import benchmark_script


def test_both_forms_agree_then_are_timed():
    script = benchmark_script("decode_attention")
    results = script.compare([1], capacity=32, heads=4, kv_heads=2, dim=8, buffers=2, passes=1, rounds=2)
    row = results["rows"]["1"]
    assert set(row["us_per_call"]) == {"GroupQueryAttention", "MatMul"}
    assert all(len(values) == 2 and min(values) > 0 for values in row["us_per_call"].values())
    assert len(row["matmul_vs_kernel"]) == 2


def test_a_form_that_differs_is_refused(monkeypatch):
    script = benchmark_script("decode_attention")
    graph = script._graph

    def wrong_scale(form, heads, kv_heads, dim, rows):
        model = graph(form, heads, kv_heads, dim, rows)
        if form == "MatMul":  # the MatMuls without the 1/sqrt(d) scale: another attention
            for tensor in model.graph.initializer:
                if tensor.name == "scale":
                    tensor.float_data[:] = [1.0]
        return model

    monkeypatch.setattr(script, "_graph", wrong_scale)
    with pytest.raises(AssertionError):
        script.compare([1], capacity=32, heads=4, kv_heads=2, dim=8, buffers=1, passes=1, rounds=1)
