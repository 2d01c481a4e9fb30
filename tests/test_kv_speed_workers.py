"""benchmarks/kv_speed.py's timing workers: one runtime per process, driven a line at a time."""

from __future__ import annotations

import io
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import BENCHMARKS, benchmark_script


class _Counting:
    """A runner whose answers depend on what it was sent: prefill = tokens, decode = new tokens × 10."""

    def run(self, ids: list[int], new_tokens: int) -> tuple[float, float]:
        return float(len(ids)), float(new_tokens * 10)


def test_serve_answers_ready_then_each_request_in_order():
    kv_speed = benchmark_script("kv_speed")
    answers = io.StringIO()
    kv_speed.serve(_Counting(), io.StringIO("[[1, 2, 3], 4]\n[[5], 2]\n"), answers)
    assert answers.getvalue().splitlines() == ['"ready"', "[3.0, 40.0]", "[1.0, 20.0]"]


def _fake_worker(tmp_path: Path, body: str) -> list[str]:
    script = tmp_path / "fake_worker.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import sys
            sys.path.insert(0, {str(BENCHMARKS)!r})
            import kv_speed
            channel = kv_speed.answers_channel()
            print("a library writing to stdout")  # must not reach the protocol
            """
        )
        + textwrap.dedent(body)
    )
    return [sys.executable, str(script)]


def test_a_worker_process_answers_through_its_own_channel(tmp_path):
    kv_speed = benchmark_script("kv_speed")
    body = """
    class Counting:
        def run(self, ids, new_tokens):
            print("more library chatter")
            return float(len(ids)), float(new_tokens * 10)
    kv_speed.serve(Counting(), sys.stdin, channel)
    """
    worker = kv_speed.WorkerRunner("counting", _fake_worker(tmp_path, body))
    try:
        assert worker.run(list(range(8)), 3) == (8.0, 30.0)
        assert worker.run([1], 64) == (1.0, 640.0)
    finally:
        worker.close()
    assert worker.process.returncode == 0


def test_a_worker_that_dies_is_named(tmp_path):
    kv_speed = benchmark_script("kv_speed")
    body = """
    print('"ready"', file=channel, flush=True)
    sys.stdin.readline()
    sys.exit(3)
    """
    worker = kv_speed.WorkerRunner("dying", _fake_worker(tmp_path, body))
    with pytest.raises(RuntimeError, match="dying: the worker exited with status 3"):
        worker.run([1, 2], 4)
