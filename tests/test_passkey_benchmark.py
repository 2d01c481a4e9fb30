"""benchmarks/passkey.py --compare-builds: the ratios of its table (per-trial, over the prompts both engines read)
and one whole run over tiny bundles — the uncompressed one and a compressed build, each in a worker of its own."""

from __future__ import annotations

import json
import math

import pytest

from edgec.build import build
from tests.conftest import benchmark_script, build_settings


def _records(prefills: dict[tuple[int, float, int], float], misses: tuple = ()) -> list[dict]:
    return [
        {"length": trial[0], "depth": trial[1], "key": trial[2], "prefill_s": seconds, "success": trial not in misses}
        for trial, seconds in prefills.items()
    ]


def test_ratios_are_per_trial_over_the_prompts_both_read():
    passkey = benchmark_script("passkey")
    a, b, c = (32000, 0.1, 86555), (32000, 0.5, 67325), (32000, 0.9, 56001)
    results = {
        passkey.UNCOMPRESSED: (_records({a: 80.0, b: 90.0, c: 100.0}), 2.0, None),
        "edgec, --kv-capacity 2048": (_records({a: 88.0, b: 81.0, c: 100.0}, misses=(a,)), 2.5, None),
        "torch": (_records({a: 400.0, b: 450.0}), 8.0, None),  # PyTorch ran two of the three prompts
    }
    rows = {row["engine"]: row for row in passkey.compare_rows(results)}
    compressed = rows["edgec, --kv-capacity 2048"]
    assert compressed["passkeys"] == "2/3" and compressed["prefill_s"] == 88.0
    assert compressed["prefill_vs_uncompressed"] == pytest.approx((1.1 * 0.9 * 1.0) ** (1 / 3), abs=1e-3)
    # against PyTorch only over a and b: not the ratio of the medians (88 / 425)
    assert compressed["prefill_vs_torch"] == pytest.approx(math.sqrt(88 / 400 * 81 / 450), abs=1e-3)
    assert compressed["rss_vs_uncompressed"] == 1.25 and compressed["rss_vs_torch"] == pytest.approx(0.312, abs=1e-3)
    assert rows[passkey.UNCOMPRESSED]["prefill_vs_uncompressed"] == 1.0
    torch = rows["PyTorch fp32 (transformers)"]
    assert torch["prefill_vs_torch"] == 1.0 and torch["passkeys"] == "2/2" and torch["prefill_vs_uncompressed"] == 5.0

    del results["torch"]  # no PyTorch run, and a worker that reported no peak: no ratio, not a number made up
    results[passkey.UNCOMPRESSED] = (results[passkey.UNCOMPRESSED][0], float("nan"), None)
    rows = {row["engine"]: row for row in passkey.compare_rows(results)}
    assert rows["edgec, --kv-capacity 2048"]["prefill_vs_torch"] is None
    assert rows["edgec, --kv-capacity 2048"]["rss_vs_uncompressed"] is None
    assert "| — |" in passkey.compare_table(list(rows.values()))

    # a time that rounded to 0 (a tiny test bundle's prompt) is left out of the ratio, not a log of 0
    results["edgec, --kv-capacity 2048"] = (_records({a: 0.0, b: 81.0, c: 100.0}), 2.5, None)
    rows = {row["engine"]: row for row in passkey.compare_rows(results)}
    assert rows["edgec, --kv-capacity 2048"]["prefill_vs_uncompressed"] == pytest.approx(math.sqrt(0.9), abs=1e-3)

    # a tiny bundle's median prompt of a few milliseconds keeps 4 decimals (2 made it 0 in CI)
    results["edgec, --kv-capacity 2048"] = (_records({a: 0.0041, b: 0.00431, c: 0.0046}), 2.5, None)
    rows = {row["engine"]: row for row in passkey.compare_rows(results)}
    assert rows["edgec, --kv-capacity 2048"]["prefill_s"] == 0.0043


@pytest.fixture(scope="module")
def bundles(tmp_path_factory, tiny_llama):
    """Uncompressed and compressed, with room for the passkey prompt's ~170 tokens of frame (the tiny tokenizer)."""
    folder = tmp_path_factory.mktemp("passkey")
    made = {}
    for name, compressed in (("plain", {}), ("compressed", dict(kv_capacity=120, kv_window=8))):
        made[name] = folder / f"{name}.edgec"
        build(tiny_llama, made[name], build_settings(target="cpu", context=256, prefill_chunk=64, **compressed))
    return made


def test_one_run_over_both_builds(bundles, tmp_path, monkeypatch):
    passkey = benchmark_script("passkey")
    built = []

    def build_bundle(context, options):  # the tiny bundles stand in for the Gemma builds
        built.append((context, options))
        return bundles["compressed" if options else "plain"]

    monkeypatch.setattr(passkey, "build_bundle", build_bundle)
    monkeypatch.setattr(passkey.models, "OUT", tmp_path)
    passkey.main(["--lengths", "220", "--depths", "0.3", "0.7", "--trials", "2", "--context", "256",
                  "--compare-builds", "--kv-capacity 120 --kv-window 8"])  # fmt: skip
    assert built == [(256, []), (256, ["--kv-capacity", "120", "--kv-window", "8"])]
    report = json.loads((tmp_path / "passkey-compare-256.json").read_text())
    assert [row["engine"] for row in report["rows"]] == [passkey.UNCOMPRESSED, "edgec, --kv-capacity 120 --kv-window 8"]
    for row in report["rows"]:
        records = report["engines"][row["engine"]]["records"]
        assert [(r["tokens"], r["depth"]) for r in records] == [(220, 0.3), (220, 0.7)]  # the same prompts each
        assert row["prefill_s"] > 0 and row["peak_rss_gb"] > 0 and row["prefill_vs_torch"] is None
    assert report["rows"][0]["prefill_vs_uncompressed"] == 1.0
    assert (tmp_path / "passkey-compare-256.png").stat().st_size > 10_000


def test_an_empty_build_is_one_line(monkeypatch, tmp_path):
    passkey = benchmark_script("passkey")
    monkeypatch.setattr(passkey.models, "OUT", tmp_path)
    with pytest.raises(SystemExit, match="empty set of build options"):
        passkey.main(["--compare-builds", "  "])
    with pytest.raises(SystemExit, match="separate runs"):
        passkey.main(["--compare-builds", "--kv-capacity 8", "--compare-recall", "--kv-recall", "2"])
