"""Targets and the memory planner: every target file is valid; plans fit or refuse with numbers, before work."""

from __future__ import annotations

import json
import time
from importlib import resources

import pytest
from click.testing import CliRunner

from edgec.cli import main
from edgec.errors import BuildSettingsError
from edgec.plan import PlanError, Settings, estimate, model_shape, plan
from edgec.targets import available_targets, load_target, parse_target

EXPECTED_TARGETS = {
    "cpu",
    "cpu-portable",
    "openvino-ipc",
    "rtx3060",
    "rtx3060-laptop",
    "rtx4090",
    "rtx5090",
    "a10",
    "l40s",
    "jetson-orin",
    "ascend-910b",
    "ascend-310p",
}


def test_every_target_file_is_valid():
    assert EXPECTED_TARGETS <= set(available_targets())
    for name in available_targets():
        target = load_target(name)
        assert target.usable_bytes > 0
        assert ("fp8" in target.dtypes) == (name in {"rtx4090", "rtx5090", "l40s"})
    assert load_target("jetson-orin").runtime == "ort-cuda"  # TensorRT-RTX has no sm87


def test_bad_target_data_is_named():
    good = dict(
        name="x",
        description="d",
        device="gpu",
        runtime="tensorrt-rtx",
        compute_capability="8.6",
        memory_bytes=2**33,
        usable_fraction=0.9,
        dtypes=["fp16"],
    )
    parse_target("x", good)
    with pytest.raises(BuildSettingsError, match="fp8 needs compute capability"):
        parse_target("x", {**good, "dtypes": ["fp16", "fp8"]})
    with pytest.raises(BuildSettingsError, match="lacks the key 'runtime'"):
        parse_target("x", {k: v for k, v in good.items() if k != "runtime"})
    with pytest.raises(BuildSettingsError, match="differs from the file name"):
        parse_target("y", good)
    with pytest.raises(BuildSettingsError, match="needs compute_capability"):
        parse_target("x", {k: v for k, v in good.items() if k != "compute_capability"})


@pytest.mark.parametrize("target", sorted(EXPECTED_TARGETS))
def test_smollm2_fits_everywhere_without_concessions(target):
    chosen = load_target(target)
    shape = model_shape("smollm2-135m")
    settings = Settings(weights=chosen.defaults["weights"], kv=chosen.defaults["kv"], context=8192)
    result = plan(shape, chosen, settings)
    assert result.fits and result.concessions == ()


def test_smollm2_gguf_config_matches_the_bundled_one(smollm2_path):
    assert model_shape(smollm2_path).parameters() == model_shape("smollm2-135m").parameters()


@pytest.mark.parametrize("model", ["llama-2-7b", "llama-3-8b"])
def test_a_7b_with_16k_on_a_6gb_laptop(model):
    """The seed's claim: a 7B model with a 16K context on a 6 GB RTX 3060 — holds only with concessions."""
    target = load_target("rtx3060-laptop")
    shape = model_shape(model)
    requested = Settings(weights="int4", kv="fp16", context=16384)
    assert not estimate(shape, target, requested).fits  # int4 weights alone are not enough
    result = plan(shape, target, requested)
    assert result.fits and result.total_bytes <= target.usable_bytes
    assert result.settings.weights == "int4" and result.settings.capacity_fraction < 1
    assert result.settings.context == 16384


def test_impossible_plans_refuse_with_numbers(tmp_path):
    big = json.loads(
        json.dumps(
            {
                "model_type": "llama",
                "hidden_size": 8192,
                "intermediate_size": 28672,
                "num_hidden_layers": 80,
                "num_attention_heads": 64,
                "num_key_value_heads": 8,
                "vocab_size": 128256,
                "max_position_embeddings": 8192,
            }
        )
    )
    (tmp_path / "config.json").write_text(json.dumps(big))
    with pytest.raises(PlanError, match=r"needs \d+\.\d+ GiB .* rtx3060-laptop has 4.60 GiB usable"):
        plan(model_shape(tmp_path), load_target("rtx3060-laptop"), Settings(weights="int4", kv="fp16", context=8192))
    everything = frozenset({"weights", "kv", "prefill_chunk", "capacity"})
    with pytest.raises(PlanError, match="choose a larger target or a smaller model"):
        plan(
            model_shape("llama-2-7b"),
            load_target("cpu"),
            Settings(weights="fp32", kv="fp32", context=4096),
            fixed=everything,
        )
    with pytest.raises(PlanError, match=r"try --context \d+"):
        plan(
            model_shape("smollm2-135m"),
            load_target("cpu"),
            Settings(weights="fp32", kv="fp32", context=10**6),
            fixed=everything,
        )


def test_build_refuses_before_any_work(tmp_path):
    """A 7B config (no real weights) for the cpu target: the planner refuses at once, nothing at -o."""
    folder = tmp_path / "seven"
    folder.mkdir()
    config = json.loads((resources.files("edgec.configs") / "llama-2-7b.json").read_text())
    (folder / "config.json").write_text(json.dumps(config))
    header = json.dumps({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}).encode()
    (folder / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + b"\0\0\0\0")
    out = tmp_path / "b.edgec"
    start = time.perf_counter()
    result = CliRunner().invoke(main, ["build", str(folder), "-o", str(out), "--context", "4096"])
    assert result.exit_code == 2 and "GiB usable" in result.stderr and "larger target" in result.stderr
    assert time.perf_counter() - start < 10 and not out.exists()


def test_cli_plan_targets_and_unbuildable(tiny_llama, tmp_path):
    runner = CliRunner()
    result = runner.invoke(main, ["plan", "llama-3-8b", "--target", "rtx3060-laptop", "--context", "16384"])
    assert result.exit_code == 0, result.output
    assert "fits" in result.output and "concessions made:" in result.output and "beyond the 8192" in result.output
    listing = runner.invoke(main, ["targets"])
    assert listing.exit_code == 0 and "ascend-910b" in listing.output and "rtx3060-laptop" in listing.output
    wrong = runner.invoke(main, ["plan", "llama-2-7b", "--target", "rtx3060", "--weights", "fp8"])
    assert wrong.exit_code == 2 and "rtx3060 has no fp8" in wrong.stderr
    unknown = runner.invoke(main, ["plan", "no-such-model", "--target", "cpu"])
    assert unknown.exit_code == 2 and "llama-2-7b" in unknown.stderr
    npu = runner.invoke(main, ["build", str(tiny_llama), "--target", "jetson-orin", "-o", str(tmp_path / "x")])
    assert npu.exit_code == 2 and "not built yet" in npu.stderr and not (tmp_path / "x").exists()


def test_sliding_window_layers_are_rings_in_the_plan():
    """Gemma 3: 5 of every 6 layers hold a ring of window + prefill chunk slots, not the whole context (the
    measured 32K cache of Gemma-3-270m is 223 MiB; planning every layer at 32K said 1.3 GiB)."""
    from edgec.plan import ModelShape

    config = {
        "num_hidden_layers": 18,
        "hidden_size": 640,
        "intermediate_size": 2048,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 256,
        "vocab_size": 262144,
        "tie_word_embeddings": True,
        "sliding_window": 512,
        "sliding_window_pattern": 6,
    }
    gemma = ModelShape.from_config(config, "gemma-3-270m")
    assert gemma.windows.count(0) == 3 and gemma.windows.count(512) == 15
    everything_global = ModelShape.from_config({**config, "sliding_window": 0}, "all-global")
    settings = Settings(weights="fp32", kv="fp32", context=32768)
    target = load_target("cpu")
    kv = estimate(gemma, target, settings).kv_bytes
    assert kv == 3 * 32768 * 2 * 256 * 4 + 15 * 1024 * (2 * 256 * 4 + 8)
    assert estimate(everything_global, target, settings).kv_bytes > 5 * kv


@pytest.mark.parametrize("kv_dtype", ["int8", "int4"])
def test_the_plan_sizes_a_compressed_cache_as_the_bundle_does(tiny_llama, tmp_path, kv_dtype):
    """One memory model: the planner's KV bytes for a compressed cache equal what the built bundle's CacheSpec
    reports (capacity × cache.bytes_per_token), so `edgec plan` and the bundle cannot disagree."""
    from edgec.build import build
    from tests.conftest import build_settings

    out = tmp_path / "kv.edgec"
    build(
        tiny_llama,
        out,
        build_settings(
            target="cpu", context=128, prefill_chunk=16, kv_capacity=32, kv_window=8, kv_group=16, kv_dtype=kv_dtype
        ),
    )
    cache = json.loads((out / "manifest.json").read_text())["cache"]
    planned = estimate(
        model_shape(tiny_llama),
        load_target("cpu"),
        Settings("fp32", kv_dtype, 128, capacity_fraction=32 / 128, kv_group=16),
    )
    assert planned.kv_bytes == 32 * cache["bytes_per_token"]
