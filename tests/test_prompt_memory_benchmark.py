"""benchmarks/prompt_memory.py on the tiny bundles: each run in a process of its own, one row per prompt chunk,
the runtime's prompt order against ONNX Runtime's default, and the PNG; bad arguments are one line."""

from __future__ import annotations

import json

import pytest

from edgec.build import build
from tests.conftest import benchmark_script, build_settings


@pytest.fixture(scope="module")
def fp32_slots(tmp_path_factory, tiny_llama):
    out = tmp_path_factory.mktemp("prompt-memory") / "fp32-slots.edgec"
    settings = dict(target="cpu", context=128, prefill_chunk=16, kv_capacity=40, kv_window=8, kv_dtype="fp32")
    build(tiny_llama, out, build_settings(**settings))
    return out


def test_every_chunk_measured_in_both_orders(tiny_bundle, fp32_slots, tmp_path):
    script = benchmark_script("prompt_memory")
    out = tmp_path / "memory.json"
    script.main([str(tiny_bundle), str(fp32_slots), "--prompt", "70", "--threads", "1", "--rounds", "1",
                 "--out", str(out)])  # fmt: skip
    result = json.loads(out.read_text())
    assert list(result["runs"]) == [
        f"{tiny_bundle.name} (runtime order)",
        f"{tiny_bundle.name} (default order)",
        f"{fp32_slots.name} (runtime order)",
        f"{fp32_slots.name} (default order)",
    ]
    for (one,) in result["runs"].values():
        assert [row[0] for row in one["chunks"]] == [6, 22, 38, 54, 70]  # the short piece first, then 16 a chunk
        assert all(0 < row[1] <= row[2] + 1e-3 for row in one["chunks"])  # resident ≤ the chunk's peak
        assert one["peak_gib"] >= max(row[2] for row in one["chunks"]) and one["loaded_gib"] > 0
        assert isinstance(one["peak_per_chunk"], bool)
        # resident memory split by kind: anonymous + shared + file pages make up VmRSS (KiB rounding aside)
        for row in one["chunks"]:
            assert len(row) == 6 and abs(sum(row[3:]) - row[1]) < 1e-3
        assert list(one["stages"]) == ["loaded", "opened", "begun", "last chunk", "selected"]
        for stage in one["stages"].values():
            assert abs(stage["RssAnon"] + stage["RssShmem"] + stage["RssFile"] - stage["VmRSS"]) < 1e-3
    # an `end` prompt's temporary state is anonymous memory (numpy's, from the heap), as the plain bundle's cache
    # is; the shared pages are the slots' own mappings alone, written by the selection
    slots = result["runs"][f"{fp32_slots.name} (runtime order)"][0]["stages"]
    plain = result["runs"][f"{tiny_bundle.name} (runtime order)"][0]["stages"]
    assert slots["last chunk"]["RssShmem"] <= slots["selected"]["RssShmem"]
    last_row = result["runs"][f"{fp32_slots.name} (runtime order)"][0]["chunks"][-1]
    assert last_row[3:] == [slots["last chunk"][kind] for kind in ("RssAnon", "RssShmem", "RssFile")]
    assert plain["last chunk"]["RssShmem"] == plain["loaded"]["RssShmem"]
    summary = result["summary"][f"{fp32_slots.name} (runtime order)"]
    assert summary["stages"]["last chunk"] == slots["last chunk"]  # one run: its own values
    table = script.stage_table(result["summary"])
    assert "| last chunk |" in table and "RssShmem" in table
    assert out.with_suffix(".png").stat().st_size > 10_000


def test_prompts_read_one_after_another_in_one_process(fp32_slots, tmp_path):
    """``--prompts 2``: each process reads the prompt twice on one state, as a chat or a server would; each
    prompt's peak is reported, and the rows and stages are the second prompt's."""
    script = benchmark_script("prompt_memory")
    out = tmp_path / "memory.json"
    script.main([str(fp32_slots), "--prompt", "70", "--threads", "1", "--rounds", "1", "--orders", "runtime",
                 "--prompts", "2", "--out", str(out)])  # fmt: skip
    result = json.loads(out.read_text())
    (one,) = result["runs"][f"{fp32_slots.name} (runtime order)"]
    assert result["prompts"] == 2 and len(one["prompt_peaks_gib"]) == 2
    assert one["peak_gib"] == max(one["prompt_peaks_gib"]) and all(peak > 0 for peak in one["prompt_peaks_gib"])
    assert [row[0] for row in one["chunks"]] == [6, 22, 38, 54, 70]  # one prompt's chunks, not both
    assert result["summary"][f"{fp32_slots.name} (runtime order)"]["prompt_peaks_gib"] == one["prompt_peaks_gib"]


@pytest.mark.parametrize(
    "args,message",
    [
        (["nowhere"], "not a bundle: .*nowhere$"),
        (["--prompt", "1"], "--prompt must be"),
        (["--prompts", "0"], "--prompts ≥ 1"),
    ],
)
def test_bad_arguments_are_one_line(args, message, tmp_path):
    script = benchmark_script("prompt_memory")
    argv = [str(tmp_path / a) if a == "nowhere" else a for a in args]
    with pytest.raises(SystemExit, match=message):
        script.main([*argv, "--out", str(tmp_path / "x.json")])


def test_a_kernel_that_refuses_the_peak_reset_is_reported(monkeypatch):
    """Where /proc/self/clear_refs cannot be written (some sandboxes) the run goes on and says so: each chunk's
    "peak" is then the process's peak up to it."""
    script = benchmark_script("prompt_memory")

    def refuse(self, text):
        raise PermissionError("clear_refs")

    monkeypatch.setattr(script.Path, "write_text", refuse)
    assert script._reset_peak() is False
