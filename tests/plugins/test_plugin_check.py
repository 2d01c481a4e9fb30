"""benchmarks/plugin_check.py without a GPU: when it skips, the comparison it reports, and (slow) a whole run on a
standard/plugin pair through the fake TensorRT-RTX, CUDA runtime and driver."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from tests.conftest import benchmark_script

check = benchmark_script("plugin_check")


def test_it_skips_without_a_gpu_that_runs_tensorrt_rtx(monkeypatch, capsys, tmp_path):
    assert check.skip_reason(None) == "no NVIDIA GPU here (nvidia-smi finds none)"
    assert "sm90" in check.skip_reason(("NVIDIA H200", (9, 0)))
    assert check.skip_reason(("NVIDIA GeForce RTX 3060", (8, 6))) is None
    monkeypatch.setattr(check, "gpu_capability", lambda: ("NVIDIA H200", (9, 0)))
    assert check.main(["run", str(tmp_path)]) == 0
    assert capsys.readouterr().out.startswith("skipped: TensorRT-RTX does not run on sm90")


def test_agreement_counts_steps_and_the_largest_difference():
    standard = [np.array([0.0, 1.0, 2.0]), np.array([3.0, 0.0, 0.0])]
    plugin = [np.array([0.0, 1.5, 2.0]), np.array([0.0, 3.5, 0.0])]
    assert check.agreement(standard, plugin) == {"max_abs_logit_delta": 3.5, "top1_agree": 1, "steps": 2}


@pytest.mark.slow
def test_a_whole_run_on_the_fake_gpu(plugin_bundle, standard_bundle, fake_gpu, tmp_path, monkeypatch):
    """The pair (the plugin bundle and the same build without it) through the fakes, at lengths a tiny model
    takes: decode speeds of both, their ratio, and logits that agree."""
    from tests.conftest import manifest
    from tests.plugins.conftest import register_plugin_bundle
    from tests.test_tensorrt_rtx_runtime import _register

    pair = tmp_path / "pair"
    pair.mkdir()
    shutil.copytree(plugin_bundle, pair / "plugin.edgec")
    shutil.copytree(standard_bundle, pair / "standard.edgec")
    standard = manifest(pair / "standard.edgec")  # --kv-plugin off: the bundle as before, nothing of the plugin
    assert "kv_plugin" not in standard["build_settings"] and "plugin" not in standard["runtime"]
    assert not [name for name in standard["files"] if name.startswith("plugin/")]
    register_plugin_bundle(pair / "plugin.edgec")
    _register(pair / "standard.edgec")
    monkeypatch.setattr(check, "LENGTHS", (24, 60))
    monkeypatch.setattr(check, "DECODE_STEPS", 4)
    monkeypatch.setattr(check, "ROUNDS", 1)
    result = check.run(pair)
    assert set(result["decode_tok_s"]) == {"standard", "plugin"}
    assert all(speed > 0 for by in result["decode_tok_s"].values() for speed in by.values())
    assert set(result["ratio"]) == {"24", "60"}
    assert result["logits"]["steps"] == check.FORCED_STEPS
    assert result["logits"]["top1_agree"] == check.FORCED_STEPS and result["logits"]["max_abs_logit_delta"] < 5e-2
    assert "plugin/std" in check.table(result)
