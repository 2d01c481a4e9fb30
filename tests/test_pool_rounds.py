"""benchmarks/pool_rounds.py: per-round pairing across kv_speed.py runs, the pooled mean and its verdicts."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import benchmark_script

ROOT = Path(__file__).resolve().parent.parent


def _run(threads: int, compressed: list[float], plain: list[float], genai_fp32: list[float]) -> dict:
    suffix = "s" if threads > 1 else ""
    rows = {
        f"edgec int4, 1024 int8 slots, {threads} thread{suffix}": {"prefill_s_all": compressed},
        f"edgec int4, full fp32 cache, {threads} thread{suffix}": {"prefill_s_all": plain},
        f"onnxruntime-genai fp32, {threads} thread{suffix}": {"prefill_s_all": genai_fp32},
    }
    return {"command": "python benchmarks/kv_speed.py", "threads": [threads], "rows": rows}


def test_rounds_pair_by_index_and_pool_across_runs():
    pool_rounds = benchmark_script("pool_rounds")
    runs = [_run(2, [33.0, 36.0], [30.0, 30.0], [33.0, 40.0]), _run(2, [31.5], [30.0], [35.0])]
    pooled = {p.label: p for p in pool_rounds.pool_runs(runs)}
    plain = pooled["compressed prefill vs edgec plain"]
    assert plain.ratios == [1.1, 1.2, 1.05]  # round i against round i, then the second run's round
    assert plain.geomean == pytest.approx(math.exp(sum(map(math.log, [1.1, 1.2, 1.05])) / 3))
    assert plain.low < plain.geomean < plain.high
    genai = pooled["compressed prefill vs genai fp32"]
    assert genai.ratios == [1.0, 0.9, 0.9]
    assert "compressed decode vs genai int4" not in pooled  # genai int4 did not run: no ratio invented


def test_verdicts_need_the_whole_interval():
    pool_rounds = benchmark_script("pool_rounds")
    target = pool_rounds.TARGETS[0]  # ≤ 1.10
    assert pool_rounds.pool([1.00, 1.01, 0.99, 1.02], target, 1).verdict == "met"
    assert pool_rounds.pool([1.20, 1.21, 1.19, 1.22], target, 1).verdict == "missed"
    assert pool_rounds.pool([1.00, 1.20, 1.05, 1.15], target, 1).verdict == "undecided"
    decode = pool_rounds.TARGETS[2]  # ≥ 3.00
    assert pool_rounds.pool([3.2, 3.3, 3.25], decode, 2).verdict == "met"
    assert pool_rounds.pool([1.7, 1.8, 1.75], decode, 2).verdict == "missed"
    assert pool_rounds.pool([1.00], target, 1).verdict == "undecided"  # one round has no spread to judge


def test_the_script_writes_a_table_json_and_plot(tmp_path):
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    first.write_text(json.dumps(_run(1, [60.0, 58.0], [56.0, 55.0], [59.0, 57.0])))
    second.write_text(json.dumps(_run(1, [57.0], [55.0], [58.0])))
    out = tmp_path / "not yet" / "pooled.json"  # a plain clone has no benchmarks/out
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "pool_rounds.py"), str(first), str(second), "--out", str(out)],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "| compressed prefill vs edgec plain (≤ 1.10×) | 1 | 3 |" in done.stdout
    assert len(json.loads(out.read_text())["pooled"]) == 3  # the decode target needs genai int4: absent
    assert out.with_suffix(".png").stat().st_size > 0


def test_unreadable_or_unpaired_files_get_one_line(tmp_path):
    script = str(ROOT / "benchmarks" / "pool_rounds.py")
    missing = subprocess.run([sys.executable, script, str(tmp_path / "nope.json")], capture_output=True, text=True)
    assert missing.returncode != 0 and "cannot read" in missing.stderr and "Traceback" not in missing.stderr
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"threads": [1], "rows": {}}))
    unpaired = subprocess.run([sys.executable, script, str(empty)], capture_output=True, text=True)
    assert unpaired.returncode != 0 and "no paired rounds" in unpaired.stderr
    uneven = tmp_path / "uneven.json"
    uneven.write_text(json.dumps(_run(2, [33.0, 36.0], [30.0], [33.0, 40.0])))
    refused = subprocess.run([sys.executable, script, str(uneven)], capture_output=True, text=True)
    assert refused.returncode != 0 and "paired rounds" in refused.stderr and "Traceback" not in refused.stderr
