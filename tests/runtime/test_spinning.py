"""ONNX Runtime's pool spins only where the machine has a core for each pool thread (chosen when a bundle loads)."""

from __future__ import annotations

import pytest

from edgec.runtime import backend_ort
from edgec.runtime.backend_ort import allow_spinning, busy_elsewhere, session_options


@pytest.fixture(autouse=True)
def _no_override(monkeypatch):
    monkeypatch.delenv("EDGEC_ORT_SPIN", raising=False)


@pytest.mark.parametrize(
    "threads,load,cpus,spin",
    [
        (2, 0.0, 2, True),  # idle: both pool threads have a core
        (2, 1.0, 2, False),  # one core busy elsewhere: a spinning pool would wait on a descheduled thread
        (2, 0.4, 2, True),  # a little noise is not a busy core
        (None, 0.0, 4, True),  # ONNX Runtime's default pool: one thread per core
        (None, 2.0, 4, False),
        (2, 2.0, 4, True),  # enough idle cores for the pool
        (1, 0.0, 2, False),  # one thread: no pool threads to spin
    ],
)
def test_spinning_follows_the_idle_cores(threads, load, cpus, spin):
    assert allow_spinning(threads, load=load, cpus=cpus) is spin


def test_the_environment_still_forces_it(monkeypatch):
    monkeypatch.setenv("EDGEC_ORT_SPIN", "0")
    assert allow_spinning(2, load=0.0, cpus=2) is False
    monkeypatch.setenv("EDGEC_ORT_SPIN", "1")
    assert allow_spinning(2, load=5.0, cpus=2) is True


def test_busy_elsewhere_reads_this_machine():
    busy = busy_elsewhere(samples=3, interval=0.001)
    assert 0.0 <= busy < 10_000


@pytest.mark.parametrize("busy,expected", [(0.0, "1"), (3.0, "0")])
def test_session_options_carry_the_choice(monkeypatch, busy, expected):
    monkeypatch.setattr(backend_ort, "busy_elsewhere", lambda: busy)
    monkeypatch.setattr(backend_ort.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    options = session_options(2)
    assert options.get_session_config_entry("session.intra_op.allow_spinning") == expected
