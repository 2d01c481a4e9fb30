"""benchmarks/prefill_alternating.py on the tiny bundles: every phase of each prompt timed, the bundles read in
alternation, ratios pooled against the first; bad arguments are one line."""

from __future__ import annotations

import numpy as np
import pytest

from edgec.build import build
from edgec.runtime import Model
from tests.conftest import benchmark_script, build_settings, pydoc_text


@pytest.fixture(scope="module")
def compressed(tmp_path_factory, tiny_llama):
    out = tmp_path_factory.mktemp("alternating") / "end.edgec"
    settings = dict(target="cpu", context=128, prefill_chunk=16, kv_capacity=24, kv_window=8, kv_dtype="int8")
    build(tiny_llama, out, build_settings(**settings, kv_group=16))
    return out


def test_phases_rounds_and_pooled_ratios(tiny_bundle, compressed):
    script = benchmark_script("prefill_alternating")
    ids = np.asarray(Model.load(tiny_bundle).encode(pydoc_text()[:3000])[:70], np.int64)
    samples = script.measure([tiny_bundle, compressed], ids, threads=1, rounds=3, calibrate=False)
    assert list(samples) == [tiny_bundle.name, compressed.name] and all(len(runs) == 3 for runs in samples.values())
    for runs in samples.values():
        for sample in runs:
            assert set(sample) == set(script.PHASES) and all(value >= 0 for value in sample.values())
            parts = sample["first step"] + sample["middle steps"] + sample["last step"] + sample["selection"]
            assert parts <= sample["total"] + 1e-6
    # 70 tokens in 16-token steps: 5 steps; only the compressed `end` prompt selects slots afterwards
    assert all(run["selection"] > 0 for run in samples[compressed.name])
    result = script.summary(samples, 1.10, 1)
    pooled = result["pooled"][compressed.name]
    totals = [
        (a["total"], b["total"]) for a, b in zip(samples[compressed.name], samples[tiny_bundle.name], strict=True)
    ]
    assert pooled["ratios"] == [round(a / b, 4) for a, b in totals]
    assert pooled["low"] <= pooled["geomean"] <= pooled["high"]


@pytest.mark.parametrize("args,message", [(["only-one"], "two or more bundles"), (["a", "b"], "not a bundle: .*/a$")])
def test_bad_arguments_are_one_line(args, message, tmp_path):
    script = benchmark_script("prefill_alternating")
    with pytest.raises(SystemExit, match=message):
        script.main(
            [str(tmp_path / name) if name != "only-one" else name for name in args]
            + ["--out", str(tmp_path / "x.json")]
        )


def test_one_row_reads_each_bundle_also_as_before(tiny_bundle):
    """``--one-row``: the same bundle a second time with a logits row for every chunk, first (ratios against it);
    the chunks before the last are timed whichever way they are fed."""
    script = benchmark_script("prefill_alternating")
    ids = np.asarray(Model.load(tiny_bundle).encode(pydoc_text()[:3000])[:70], np.int64)
    samples = script.measure([tiny_bundle], ids, threads=1, rounds=2, calibrate=False, one_row=True)
    assert list(samples) == [f"{tiny_bundle.name}, a logits row per chunk", tiny_bundle.name]
    assert all(sample["middle steps"] > 0 for runs in samples.values() for sample in runs)
    assert list(script.summary(samples, 1.10, 1)["pooled"]) == [tiny_bundle.name]
