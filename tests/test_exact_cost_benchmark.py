"""benchmarks/exact_cost.py's timing-only copies: without the split, a bundle's decode graph must compute what a bundle
built with one row of int8 activations computes; without the minima, every offsets product must be gone and the
answers must change. On the tiny GGUF that mixes every block type (tests/tiny_gguf.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.conftest import benchmark_script
from tests.tiny_gguf import write_tiny_llama_gguf

pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def bundles(tmp_path_factory, tiny_tokenizer) -> dict[str, Path]:
    from edgec.build import BuildSettings, build

    root = tmp_path_factory.mktemp("exact_cost")
    gguf_path = write_tiny_llama_gguf(root / "tiny.gguf", tiny_tokenizer)
    variants = {"split": {}, "one-row": {"split_activations": False}}
    for name, extra in variants.items():
        build(gguf_path, root / name, BuildSettings(context=128, prefill_chunk=32, weights="int4", **extra))
    return {name: root / name for name in variants}


def _first_step(bundle: Path) -> np.ndarray:
    """The logits of a first one-token step (the decode graph, where the split runs). Only the first step compares
    graphs: after it, the two bundles' caches differ by summation order (the one-row bundle sums a block's inputs
    by a product, the split one by a ReduceSum), which flips int8 roundings of later activations (~0.1 a logit)."""
    from edgec.runtime import Model

    ids = np.random.default_rng(3).integers(0, 384, 4).tolist()
    return next(iter(Model.load(bundle).iter_logits(ids, prompt_tokens=1)))[1][0]


def _ops(bundle: Path) -> list[str]:
    import onnx

    return [node.op_type for node in onnx.load(str(bundle / "model.onnx"), load_external_data=False).graph.node]


def test_without_the_split_the_graph_is_the_one_row_bundles(bundles, tmp_path):
    script = benchmark_script("exact_cost")
    copy = tmp_path / "one-row.edgec"
    dropped = script.timing_only(bundles["split"], copy, {"split"})
    assert dropped["split"] == _ops(bundles["split"]).count("MatMulNBits") > 0 and dropped["minima"] == 0
    assert _ops(copy).count("Round") == 0 and _ops(copy).count("Concat") < _ops(bundles["split"]).count("Concat")
    one_row, split, copied = _first_step(bundles["one-row"]), _first_step(bundles["split"]), _first_step(copy)
    assert np.abs(copied - one_row).max() < 1e-3  # measured 3e-5: summation order
    assert np.abs(split - one_row).max() > 1e-2  # measured 0.19: the split is what made the bundle differ


def test_without_the_minima_every_offsets_product_is_gone(bundles, tmp_path):
    script = benchmark_script("exact_cost")
    copy = tmp_path / "no-minima.edgec"
    dropped = script.timing_only(bundles["split"], copy, {"minima"})
    before, after = _ops(bundles["split"]), _ops(copy)
    assert dropped["minima"] > 0 and dropped["split"] == 0
    assert before.count("MatMul") - after.count("MatMul") == dropped["minima"]  # the offsets products
    assert after.count("Round") == before.count("Round")  # the split kept
    assert np.abs(_first_step(copy) - _first_step(bundles["split"])).max() > 1e-2


def test_both_dropped_and_the_worker_times_steps(bundles, tmp_path):
    script = benchmark_script("exact_cost")
    copy = tmp_path / "both.edgec"
    dropped = script.timing_only(bundles["split"], copy, {"split", "minima"})
    assert dropped["split"] > 0 and dropped["minima"] > 0
    assert script.step_ms(copy, threads=1, prompt=8, steps=2) > 0
