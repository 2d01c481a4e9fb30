"""benchmarks/gpu_prepare.py and gpu_check.py without a GPU: which bundles a GPU runs, one try per bundle inside the
budget, the report; the prepare step and the check end to end on a tiny model with the CUDA bundle run on ONNX
Runtime's CPU provider; the check's measurement of a TensorRT-RTX bundle through the stand-ins in tests/fakes."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import benchmark_script, make_llama_folder

try:  # the stand-ins of tensorrt_rtx and the CUDA runtime (tests/fakes), with their fixtures
    from tests.test_tensorrt_rtx_runtime import _register, fake_gpu, rtx_bundle  # noqa: F401

    HAVE_TENSORRT_RTX = True
except pytest.skip.Exception:  # that module skips itself without tensorrt-rtx (which builds the engines)
    HAVE_TENSORRT_RTX = False

ROOT = Path(__file__).resolve().parents[1]


check = benchmark_script("gpu_check")
prepare = benchmark_script("gpu_prepare")

H200 = check.Gpu("NVIDIA H200", (9, 0), 143771, "580.159.03")
RTX3060 = check.Gpu("NVIDIA GeForce RTX 3060", (8, 6), 12288)
RTX5090 = check.Gpu("NVIDIA GeForce RTX 5090", (12, 0), 32607)


def _entries() -> list:
    def entry(target, runtime, cc, model="smollm2", context=2048):
        return check.Entry(
            f"packs/{model}.{target}.tar", f"{model}.{target}.edgec", target, runtime, cc, model, context
        )

    return [
        entry("cuda", "ort-cuda", "7.5"),
        entry("rtx3060", "tensorrt-rtx", "8.6"),
        entry("rtx4090", "tensorrt-rtx", "8.9"),
        entry("rtx5090", "tensorrt-rtx", "12.0"),
        entry("cuda", "ort-cuda", "7.5", "smollm2-16k", 16384),
    ]


def test_the_prepare_plan_can_leave_the_short_bundles_out_and_add_a_compressed_one():
    """Where each call carries 64 MiB, one 16K bundle (it measures ~1K too) and a compressed-cache one are the pack."""
    names = [item["bundle"] for item in prepare.plan([], [], long=True, short=False, compressed=True)]
    assert names == ["smollm2-16k.cuda.edgec", "smollm2-16k-kv1024-int8.cuda.edgec"]
    [compressed] = [item for item in prepare.plan(["rtx3060"], [], long=False, compressed=True) if item["options"]]
    assert compressed["context"] == prepare.SHORT_CONTEXT and compressed["target"] == "cuda"
    assert compressed["options"] == ["--kv-capacity", "1024", "--kv-dtype", "int8", "--prefill-compress", "end"]
    assert [item["options"] for item in prepare.plan(["rtx3060"], [], long=True)] == [[], [], []]
    with pytest.raises(prepare.PrepareError, match="nothing to build"):
        prepare.plan([], [], long=False, short=False)


def test_the_gpu_decides_which_bundles_run():
    chosen, skipped = check.select(_entries(), H200)
    assert [e.bundle for e in chosen] == ["smollm2.cuda.edgec", "smollm2-16k.cuda.edgec"]  # ORT CUDA runs on sm90
    assert skipped["smollm2.rtx3060.edgec"] == "TensorRT-RTX does not run on sm90 (NVIDIA H200)"
    chosen, skipped = check.select(_entries(), RTX3060)
    assert [e.target for e in chosen] == ["cuda", "rtx3060", "cuda"]
    assert skipped == {
        "smollm2.rtx4090.edgec": "engine built for sm89; this GPU is sm86",
        "smollm2.rtx5090.edgec": "engine built for sm120; this GPU is sm86",
    }
    assert [e.target for e in check.select(_entries(), RTX5090)[0]] == ["cuda", "rtx5090", "cuda"]
    old = check.Gpu("Tesla P100", (6, 0), 16280)  # below the cuda target's floor, and no TensorRT-RTX
    assert check.select(_entries(), old)[0] == []


def test_a_runtime_packed_without_its_wheels_is_a_failure_that_says_why():
    cuda, rtx3060 = _entries()[:2]
    cuda = check.Entry(**{**cuda.__dict__, "wheels": True})
    rtx3060 = check.Entry(**{**rtx3060.__dict__, "wheels_problem": "pip download failed: no tensorrt-rtx wheel"})
    assert check.without_wheels([cuda, rtx3060], [cuda, rtx3060]) == {
        "smollm2.rtx3060.edgec": "the pack carries no tensorrt-rtx wheels (pip download failed: no tensorrt-rtx wheel)"
    }


def test_nvidia_smi_output_is_read():
    gpu = check.parse_nvidia_smi("NVIDIA H200, 9.0, 143771, 580.159.03\n")
    assert gpu == H200 and gpu.sm == "sm90"
    with pytest.raises(check.CheckError, match="listed no GPU"):
        check.parse_nvidia_smi("\n")


def test_one_try_per_bundle_and_the_budget_holds():
    entries = _entries()[:4]
    calls = []

    def attempt(entry, limit_s):
        calls.append((entry.target, limit_s))
        if entry.target == "cuda":
            raise RuntimeError("error: this bundle needs ...\n(second line)")
        if entry.target == "rtx3060":
            raise subprocess.TimeoutExpired("child", limit_s)
        return {"load_s": 1.0}

    started = time.monotonic()
    trials = check.run_trials(entries, attempt, budget_s=400, started=started)
    assert [t.status for t in trials] == ["failed", "failed", "ok", "ok"]  # a failure never ends the run
    assert trials[0].reason == "error: this bundle needs ... (second line)"  # one line
    assert trials[1].reason == f"timed out after {check.TRY_LIMIT_S:.0f} s"
    assert all(limit <= check.TRY_LIMIT_S for _, limit in calls)
    late = check.run_trials(entries, attempt, budget_s=400, started=started - 395)  # the budget is spent
    assert [t.status for t in late] == ["skipped"] * 4 and "budget was spent" in late[0].reason


def test_the_report_names_every_measurement_and_failure():
    entries = _entries()
    measured = {
        "load_s": 2.5,
        "vram_peak_above_baseline_mib": 812.0,
        "lengths": {
            "1024": {"prefill_tok_s": 41234.0, "decode_tok_s": 310.2},
            "16000": {"prefill_tok_s": 20000.0, "decode_tok_s": 250.0},
        },
        "logits_vs_ort_cpu": {"max_abs_diff": 0.0123, "top1_same": True},
        "cpu_nodes_note": "note: CUDAExecutionProvider left 3 node(s) of model.onnx to the CPU (Shape ×3)",
        "device_memory": {
            "used_mib": 1210.0,
            "total_mib": 143771.0,
            "nvml_used_mib": 1212.0,
            "state_bytes_taken": 3145728,
            "state_bytes_priced": 3100000,
        },
    }
    trials = [check.Trial(entries[0], "ok", result=measured), check.Trial(entries[1], "failed", "timed out after 9 s")]
    text = check.table(H200, trials)
    assert "41,234 tok/s" in text and "310 tok/s" in text and "20,000 tok/s" in text and "812" in text
    assert "0.0123 (top-1 same)" in text and "smollm2.rtx3060.edgec: failed: timed out after 9 s" in text
    assert "left 3 node(s)" in text
    assert "reads 1,210 of 143,771 MiB in use (NVML 1212.0)" in text and "took 3,145,728 bytes" in text
    record = trials[0].to_json()
    assert record["status"] == "ok" and record["backend"] == "ORT CUDA" and record["lengths"]["1024"]


@pytest.fixture(scope="module")
def long_tiny_llama(tmp_path_factory, tiny_tokenizer):
    """The tiny Llama with room for the check's ~1K prompt (its default context is 256)."""
    return make_llama_folder(
        tmp_path_factory.mktemp("tiny-long") / "tiny", tiny_tokenizer, max_position_embeddings=2048
    )


@pytest.mark.slow  # ~20 s: the default tier's budget; the script's pieces are tested above
def test_prepare_then_check_end_to_end_on_the_cpu(long_tiny_llama, tmp_path):
    """The prepare step builds and packs (here without wheels: this Python has the runtime), then the check reads
    the pack on a pretend H200, unpacks the bundle (every file checked) and measures it in a child process — the
    CUDA bundle's graph on ONNX Runtime's CPU provider, standing in for the GPU."""
    out, bundles = tmp_path / "pack", tmp_path / "bundles"
    argv = ["--out", str(out), "--bundles", str(bundles), "--rtx", "", "--no-long", "--no-wheels"]
    assert prepare.main([*argv, "--short-model", str(long_tiny_llama)]) == 0
    info = json.loads((out / "PREPARED.json").read_text())
    assert [(p["target"], p["runtime"], p["wheels"]) for p in info["packs"]] == [("cuda", "ort-cuda", False)]
    assert (out / "gpu_check.sh").is_file() and (out / "gpu_check.py").is_file()
    done = subprocess.run(
        [
            sys.executable,
            str(out / "gpu_check.py"),
            "--gpu",
            "NVIDIA H200, 9.0, 143771",
            "--no-install",
            "--providers",
            "CPUExecutionProvider",
            "--budget",
            "300",
        ],
        capture_output=True,
        text=True,
        timeout=400,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((out / "check" / "results.json").read_text())
    [result] = report["results"]
    assert result["status"] == "ok" and result["providers"] == ["CPUExecutionProvider"]
    assert set(result["lengths"]) == {"1024"}  # 16000 does not fit a 2K context
    assert result["lengths"]["1024"]["prefill_tok_s"] > 0 and result["lengths"]["1024"]["decode_tok_s"] > 0
    assert result["logits_vs_ort_cpu"] == {"prompt_tokens": 32, "max_abs_diff": 0.0, "top1_same": True}
    assert result["vram_peak_above_baseline_mib"] is None  # no GPU to read here: said, not made up
    assert result["device_memory"] is None  # the CPU provider's states live in host memory
    assert report["total_s"] < report["budget_s"] and "smollm2-2k.cuda.edgec" in done.stdout


def test_the_check_without_a_gpu_is_one_error_line(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--pack", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and done.stderr.strip() == (
        "error: no NVIDIA GPU here: nvidia-smi is not installed (no NVIDIA driver)"
    )


@pytest.mark.skipif(not HAVE_TENSORRT_RTX, reason="tensorrt-rtx builds the engines (pip install 'edgec[tensorrt-rtx]')")
def test_a_tensorrt_rtx_bundle_is_measured_through_the_stand_ins(rtx_bundle, fake_gpu, monkeypatch):
    """The child's measurement of a TensorRT-RTX bundle: the engine (tests/fakes) against ONNX Runtime CPU on the
    bundle's own fp16 graph — the same numbers, since the stand-in runs that graph."""
    _register(rtx_bundle)
    monkeypatch.setattr(check, "LENGTHS", (48,))
    monkeypatch.setattr(check, "DECODE_STEPS", 8)
    result = check.measure(rtx_bundle)
    assert result["providers"] == ["TensorRT-RTX"]
    assert set(result["lengths"]) == {"48"} and result["lengths"]["48"]["decode_tokens"] == 8
    assert result["logits_vs_ort_cpu"]["max_abs_diff"] == 0.0 and result["logits_vs_ort_cpu"]["top1_same"]
    # what edgec serve budgets by: one more state takes exactly its price on the (fake) device
    memory = result["device_memory"]
    assert memory["state_bytes_taken"] == memory["state_bytes_priced"] > 0 and memory["total_mib"] > 0


@pytest.mark.slow  # pip installs every wheel into a fresh venv: the slow tier
def test_the_check_installs_its_venv_from_the_packs_wheels_alone(tiny_bundle, tmp_path):
    """The wheels come out of the pack (each checked against PACK.json) and pip installs them with --no-index and
    --require-hashes; a second run finds the venv made and keeps it. (The cpu bundle's pack: its wheels are this
    machine's; the GPU packs' are the same mechanism with onnxruntime-gpu.)"""
    from edgec.pack import pack

    (tmp_path / "packs").mkdir()
    pack(tiny_bundle, tmp_path / "packs" / "tiny.tar", wheels=True)
    entry = check.Entry("packs/tiny.tar", "tiny.cpu.edgec", "cpu", "ort-cpu", "0.0", "tiny", 128, wheels=True)
    venv = tmp_path / "check" / "venv"
    python = check.install(tmp_path, [entry], venv, sys.executable)
    where = subprocess.run(
        [str(python), "-c", "import edgec.runtime, onnxruntime; print(onnxruntime.__file__)"],
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin"},
    )
    assert where.returncode == 0 and where.stdout.startswith(str(venv)), where.stderr
    made = (venv / "edgec-check.json").stat().st_mtime_ns
    assert check.install(tmp_path, [entry], venv, sys.executable) == python
    assert (venv / "edgec-check.json").stat().st_mtime_ns == made  # not installed twice
    with pytest.raises(check.CheckError, match="carries wheels"):
        check.install(tmp_path, [check.Entry("packs/tiny.tar", "x", "cpu", "ort-cpu", "0.0", "t", 1)], venv, "python3")
