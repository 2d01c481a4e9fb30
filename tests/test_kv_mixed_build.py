"""--kv-mixed end to end on a tiny model: the pass, the manifest and its schema, the bytes the manifest, the planner
and the runtime count, the runtime's prompt modes, saved prompts, and the settings a build refuses."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
from click.testing import CliRunner

from edgec.build import build
from edgec.cli import main
from edgec.kvcache.compression import Compression
from edgec.manifest_schema import manifest_errors
from edgec.runtime import Model
from edgec.runtime.prefix_cache import StateFileError
from tests.conftest import build_settings, manifest, pydoc_text
from tests.runtime.test_prefix_cache import _resign, _tamper
from tests.test_cli import assert_clean_failure

MIXED = dict(kv_capacity=40, kv_window=8, kv_group=16, kv_dtype="int4", kv_mixed="int8")


@pytest.fixture(scope="module")
def mixed_bundle(tmp_path_factory, tiny_llama):
    out = tmp_path_factory.mktemp("kv") / "mixed.edgec"
    build(tiny_llama, out, build_settings(target="cpu", context=128, prefill_chunk=16, **MIXED))
    return out


def test_mixed_bundle_end_to_end(mixed_bundle, tiny_llama, tmp_path):
    data = manifest(mixed_bundle)
    cache = data["cache"]
    assert cache["compression"]["mixed"] == "int8" and "rotation" not in cache["compression"]
    layer = cache["layers"][0]
    assert layer["state"][6:] == ["k_hi", "v_hi", "k_hi_scale", "v_hi_scale", "score_hi", "pos_hi"]
    assert manifest_errors(data) == []
    # bytes: 12 wide slots (sink 4 + window 8) at int8, 28 narrow at int4, per layer and KV head
    heads, dim, layers = layer["num_kv_heads"], layer["head_dim"], len(cache["layers"])
    wide, narrow = (2 * dim * (width + 4 / 16) for width in (1.0, 0.5))
    assert cache["kv_bytes_per_token"] == pytest.approx(layers * heads * (12 * wide + 28 * narrow) / 40)
    int4, int8 = (Compression(dtype=d, group=16).bytes_per_slot(dim) for d in ("int4", "int8"))
    assert layers * heads * int4 < cache["bytes_per_token"] < layers * heads * int8

    # the runtime allocates what the manifest counts; `end` keeps the sinks and the window wide
    model = Model.load(mixed_bundle)
    ids = model.encode(pydoc_text()[:4000])[:100]
    model.next_token_logits(ids)
    state = model._idle[-1].arrays()
    assert sum(array.nbytes for array in state.values()) == cache["total_bytes"]
    assert model.session_bytes() == cache["total_bytes"] + 4 * data["model"]["vocab_size"]
    assert state["cache.0.k_hi"].dtype == np.int8 and state["cache.0.k"].shape[2:] == (28, dim // 2)
    assert set(state["cache.0.pos_hi"][0, 0].tolist()) == {0, 1, 2, 3, *range(92, 100)}
    assert (state["cache.0.pos"] >= 0).all() and state["cache.0.pos"].max() < 92
    # `chunk` reads with the graph's demotions only: the same wide pool at the end
    chunked = Model.load(mixed_bundle, prefill_compress="chunk")
    logprobs = chunked.logprobs(ids)
    assert np.isfinite(logprobs).all() and len(logprobs) == len(ids) - 1
    chunked.next_token_logits(ids)
    assert set(chunked._idle[-1].arrays()["cache.0.pos_hi"][0, 0].tolist()) == {0, 1, 2, 3, *range(92, 100)}

    # a saved prompt restores both pools and answers as the prompt read again
    cold = list(model.generate_ids(ids[:90], max_new_tokens=8))
    model.save_state(tmp_path / "p.edgeckv", ids[:90])
    reader = Model.load(mixed_bundle)
    saved = reader.load_state(tmp_path / "p.edgeckv")
    reader._prefill = None
    assert list(reader.generate_ids(ids[:90], max_new_tokens=8, saved=saved)) == cold
    # a state file is hostile input: the wide pool's positions are checked like the narrow pool's
    damaged = tmp_path / "damaged.edgeckv"
    damaged.write_bytes((tmp_path / "p.edgeckv").read_bytes())
    _tamper(damaged, _wide_position_out_of_range)
    with pytest.raises(StateFileError, match="positions outside the saved prompt"):
        reader.load_state(damaged)

    # the planner counts the same bytes as the manifest
    from edgec.load import inspect_source
    from edgec.plan import Settings, estimate
    from edgec.targets import load_target

    settings = Settings(weights="fp32", kv="int4", context=128, capacity_fraction=40 / 128, kv_group=16)
    settings_mixed = Settings(**{**settings.__dict__, "kv_mixed": "int8", "kv_window": 8})
    shape = inspect_source(tiny_llama)["shape"]
    assert estimate(shape, load_target("cpu"), settings_mixed).kv_bytes == cache["total_bytes"]
    assert estimate(shape, load_target("cpu"), settings).kv_bytes < cache["total_bytes"]

    result = CliRunner().invoke(main, ["inspect", str(mixed_bundle)])
    assert (
        "mixed precision: 12 slots per head (sinks, window, protected) in int8, the other 28 in int4" in result.output
    )


def _wide_position_out_of_range(header, body):
    offset = 0
    for entry in header["arrays"]:
        if entry["name"].endswith(".pos_hi"):
            body[offset : offset + 8] = struct.pack("<q", 10_000)
            return _resign(header, body)
        offset += np.dtype(entry["dtype"]).itemsize * int(np.prod(entry["shape"]))
    raise AssertionError("no wide-pool positions in the state file")


def test_manifest_schema_refuses_a_bad_mixed_cache(mixed_bundle):
    data = manifest(mixed_bundle)
    for mixed, dtype, needle in [("int2", "int4", "mixed is 'int2'"), ("int8", "int8", "must be wider storage")]:
        hostile = json.loads(json.dumps(data))
        hostile["cache"]["compression"] |= {"mixed": mixed, "dtype": dtype}
        assert any(needle in error for error in manifest_errors(hostile)), (mixed, manifest_errors(hostile))
    hostile = json.loads(json.dumps(data))
    hostile["cache"]["compression"].pop("mixed")  # the layers still name the wide pool
    assert any("state must be" in error for error in manifest_errors(hostile))


@pytest.mark.parametrize(
    "args,needles",
    [
        (["--kv-dtype", "int8", "--kv-mixed", "int8"], ["--kv-mixed int8", "--kv-dtype int8 is not narrower"]),
        (["--kv-dtype", "int4", "--kv-mixed", "int2"], ["--kv-mixed", "'int2' is not one of"]),
        (["--kv-mixed", "int8"], ["--kv-mixed", "also give one of --kv-capacity"]),
        (["--kv-dtype", "int4", "--kv-mixed", "int8", "--target", "rtx3060"], ["rtx3060 reads one slot pool"]),
        (
            ["--kv-dtype", "int4", "--kv-mixed", "int8", "--target", "rtx3060", "--kv-plugin", "on"],
            ["--kv-plugin on and --kv-mixed int8"],
        ),
        (["--kv-dtype", "int4", "--kv-mixed", "fp16", "--target", "ascend-310p"], ["ascend-310p reads one slot pool"]),
        (
            ["--kv-dtype", "int4", "--kv-mixed", "int8", "--kv-capacity", "96", "--kv-recall", "1"],
            ["--kv-recall 1 with --kv-mixed int8"],
        ),
    ],
)
def test_refused_mixed_settings_are_one_line(tiny_llama, tmp_path, args, needles):
    out = tmp_path / "out.edgec"
    command = ["build", str(tiny_llama), "-o", str(out), "--context", "128", "--kv-group", "16", *args]
    result = CliRunner().invoke(main, command)
    assert_clean_failure(result, *needles)
    assert not out.exists()


def test_plan_counts_the_wide_pool_and_prints_the_flag():
    """edgec plan: the wide pool's bytes in the KV line, the flag in the build line; a plan it cannot build refused."""
    runner = CliRunner()
    base = ["plan", "smollm2-135m", "--context", "8192", "--kv", "int4"]
    mixed = runner.invoke(main, [*base, "--kv-mixed", "int8"])
    assert mixed.exit_code == 0, mixed.output
    assert "int4; sinks + window (68 slots) int8" in mixed.output
    assert "--kv-dtype int4 --kv-mixed int8" in mixed.output
    assert "--kv-mixed" not in runner.invoke(main, base).output
    assert_clean_failure(runner.invoke(main, base[:-2] + ["--kv-mixed", "int8"]), "with a narrower --kv given")
    assert_clean_failure(runner.invoke(main, [*base, "--kv-mixed", "int8", "-t", "rtx3060"]), "got rtx3060")


@pytest.mark.slow
def test_cpu_portable_builds_the_same_mixed_cache(mixed_bundle, tiny_llama, tmp_path):
    """The other ONNX Runtime CPU target: the same op body (no fused kernels), the same scores of a text."""
    out = tmp_path / "portable.edgec"
    build(tiny_llama, out, build_settings(target="cpu-portable", context=128, prefill_chunk=16, **MIXED))
    assert manifest(out)["cache"]["compression"]["mixed"] == "int8"
    ids = Model.load(mixed_bundle).encode(pydoc_text()[:4000])[:100]
    portable = Model.load(out, prefill_compress="chunk").logprobs(ids)
    np.testing.assert_allclose(portable, Model.load(mixed_bundle, prefill_compress="chunk").logprobs(ids), atol=1e-4)
