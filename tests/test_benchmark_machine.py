"""Benchmark results name the CPU they ran on: ratios against onnxruntime-genai move with the CPU make (issue 21's
eleventh round: an Intel Xeon against the AMD EPYC boxes before it), so "x86_64, 2 cores" is not enough."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import onnxruntime

from edgec.runtime import calibration

ROOT = Path(__file__).resolve().parent.parent


def _measure():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("measure", ROOT / "benchmarks" / "measure.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_results_name_the_cpu_model_cores_and_onnxruntime(monkeypatch, tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: Example CPU 9000 @ 3.0GHz\nflags\t: sse\n")
    real_path = calibration.Path
    monkeypatch.setattr(calibration, "Path", lambda name: cpuinfo if name == "/proc/cpuinfo" else real_path(name))
    machine = _measure().machine()
    cpus = calibration.usable_cpus()
    assert machine == f"Example CPU 9000 @ 3.0GHz, {cpus} cpus, onnxruntime {onnxruntime.__version__}"
