"""Benchmark results name the CPU they ran on: ratios against onnxruntime-genai move with the CPU make (issue 21's
eleventh round: an Intel Xeon against the AMD EPYC boxes before it), so "x86_64, 2 cores" is not enough."""

from __future__ import annotations

import onnxruntime

from edgec.runtime import calibration
from tests.conftest import benchmark_script


def test_results_name_the_cpu_model_cores_and_onnxruntime(monkeypatch, tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: Example CPU 9000 @ 3.0GHz\nflags\t: sse\n")
    real_path = calibration.Path
    monkeypatch.setattr(calibration, "Path", lambda name: cpuinfo if name == "/proc/cpuinfo" else real_path(name))
    machine = benchmark_script("measure").machine()
    cpus = calibration.usable_cpus()
    assert machine == f"Example CPU 9000 @ 3.0GHz, {cpus} cpus, onnxruntime {onnxruntime.__version__}"


def test_eval_and_bench_reports_name_the_cpu_model_too(monkeypatch, tmp_path):
    from edgec import evaluate, plots

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: Example CPU 9000 @ 3.0GHz\n")
    real_path = calibration.Path
    monkeypatch.setattr(calibration, "Path", lambda name: cpuinfo if name == "/proc/cpuinfo" else real_path(name))
    machine = evaluate.machine()
    assert machine["cpu"] == "Example CPU 9000 @ 3.0GHz" and machine["cores"] == calibration.usable_cpus()
    caption = plots._caption({"machine": machine, "date": "2026-12-03"})
    assert caption.startswith(f"Example CPU 9000 @ 3.0GHz, {machine['cores']} cores")
    # a report written before the CPU model was recorded still gets a caption
    older = {key: value for key, value in machine.items() if key != "cpu"}
    assert plots._caption({"machine": older, "date": "2026-12-01"}).startswith(machine["platform"])


def test_without_a_cpuinfo_the_cpu_is_what_platform_knows(monkeypatch):
    def missing(name):
        raise OSError(name)

    monkeypatch.setattr(calibration, "Path", missing)
    assert calibration.cpu_model()  # platform.processor() or platform.machine(): never empty on a real machine
