"""benchmarks/product_forms.py's prompt-chunk table: every product of a SmolLM2 layer at the cpu target's chunk
rows, each form timed and the exact ones checked against a float64 product of the same weights."""

from __future__ import annotations

import math

from targets import load_target
from tests.conftest import benchmark_script


def test_chunk_rows_are_the_cpu_targets():
    # the script reads the file itself (its folder's targets.py shadows the package); the project's loader checks it
    script = benchmark_script("product_forms")
    assert script.chunk_rows() == load_target("cpu").defaults["prefill_chunk"]


def test_every_layer_product_timed_and_the_exact_forms_exact():
    script = benchmark_script("product_forms")
    table = script.chunk_products(threads=1, repeats=1, rows=8)
    assert list(table) == ["qkv", "o", "gate-up", "down"]
    for forms in table.values():
        assert list(forms) == list(script.CHUNK_FORMS)
        assert all(ms > 0 for ms, _ in forms.values())
        # every form but level 1 alone carries the Q4_1 weight whole (level 1 alone leaves the minima out: cost only)
        for form in ("fp32 MatMul", "+ Q4_1 minima as offsets", "Q4_1 minima as float zero points"):
            assert forms[form][1] < 1e-3, form
        assert math.isnan(forms["MatMulNBits level 1"][1])


def test_decode_products_are_the_exact_imports_form():
    """The bundle's 4-bit products carry no zero points (with them ONNX Runtime times another kernel for one row),
    and the split's two rows are stacked as the batch."""
    script = benchmark_script("product_forms")
    nodes, inputs, _, _ = script.decode_graph(2)
    assert len(nodes) == len(script.DECODE_SHAPES) + 1
    assert all(len(node.input) == 3 for node in nodes)  # codes and steps
    bits = [attribute.i for node in nodes for attribute in node.attribute if attribute.name == "bits"]
    assert bits.count(8) == 1 and bits.count(4) == len(nodes) - 1  # the 8-bit lm_head
    assert all([dim.dim_value for dim in value.type.tensor_type.shape.dim][:2] == [2, 1] for value in inputs)
    assert script.decode_rows(1, threads=1, repeats=1) > 0
