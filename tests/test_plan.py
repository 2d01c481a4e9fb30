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


def seven_b_folder(tmp_path):
    """Llama-2-7B's config beside a one-number safetensors file: a folder the planner reads, with no weights."""
    folder = tmp_path / "seven"
    folder.mkdir()
    config = json.loads((resources.files("edgec.configs") / "llama-2-7b.json").read_text())
    (folder / "config.json").write_text(json.dumps(config))
    header = json.dumps({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}).encode()
    (folder / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + b"\0\0\0\0")
    return folder


def test_build_refuses_before_any_work(tmp_path):
    """A 7B config (no real weights) for the cpu target: the planner refuses at once, nothing at -o."""
    folder = seven_b_folder(tmp_path)
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


# --- the peak of a long prompt, and the sessions' copies of the weights (issue 21, seventeenth round) ---


@pytest.mark.parametrize("kv_dtype", ["fp32", "int8"])
def test_an_end_prompt_s_temporary_state_is_planned_as_the_runtime_allocates_it(
    tiny_llama, tmp_path, monkeypatch, kv_dtype
):
    """A prompt longer than the capacity, read with `end`, first goes whole into a temporary state beside the
    slots: the planner counts the bytes the runtime allocates for it (to a spare row the fp32 slots' kernel
    writes into), and `chunk` prompts, which never hold more than the slots, none."""
    from dataclasses import replace

    from edgec.build import build
    from edgec.runtime import Model
    from tests.conftest import build_settings, pydoc_text, record_temporary_states

    out = tmp_path / "kv.edgec"
    kv = dict(kv_capacity=32, kv_dtype=kv_dtype, kv_window=8, kv_group=16)
    build(tiny_llama, out, build_settings(target="cpu", context=128, prefill_chunk=16, **kv))
    allocated = record_temporary_states(monkeypatch)
    model = Model.load(out)
    prompt = model.encode(pydoc_text()[:4000])[:127]
    assert len(prompt) == 127
    model.generate(prompt, max_new_tokens=1)
    # the planner plans a prompt as long as the context: a 127-token context here
    settings = Settings("fp32", kv_dtype, 127, capacity_fraction=32 / 127, kv_window=8, kv_group=16)
    planned = estimate(model_shape(tiny_llama), load_target("cpu"), settings)
    assert len(allocated) == 1
    assert planned.prompt_state_bytes <= allocated[0] <= planned.prompt_state_bytes * 128 / 127 + 1
    assert planned.total_bytes == (
        planned.weights_bytes + planned.kv_bytes + planned.prompt_state_bytes + planned.activation_bytes
    )
    chunked = estimate(model_shape(tiny_llama), load_target("cpu"), replace(settings, prefill_compress="chunk"))
    assert chunked.prompt_state_bytes == 0 and chunked.total_bytes < planned.total_bytes
    whole = estimate(model_shape(tiny_llama), load_target("cpu"), replace(settings, capacity_fraction=1.0))
    assert whole.prompt_state_bytes == 0  # every token has a slot: nothing to read whole first


def test_fewer_slots_with_end_prompts_never_lower_the_peak():
    """With `end` prompts, a compressed cache's peak (the whole prompt, then the slots) is above the full
    cache's in the same storage: the planner concedes fewer slots only with prompts compressed per chunk, and
    where `end` is fixed it makes no capacity concession at all and refuses with the numbers."""
    target = load_target("rtx3060-laptop")
    shape = model_shape("llama-2-7b")
    requested = Settings(weights="int4", kv="fp16", context=16384)
    conceded = plan(shape, target, requested)
    assert conceded.settings.capacity_fraction < 1 and conceded.settings.prefill_compress == "chunk"
    assert any("prompts compressed per chunk" in made for made in conceded.concessions)
    for fraction in (0.5, 0.25, 0.125):
        smaller = estimate(shape, target, Settings("int4", "int4", 16384, capacity_fraction=fraction))
        full = estimate(shape, target, Settings("int4", "int4", 16384))
        assert smaller.total_bytes > full.total_bytes and smaller.prompt_state_bytes == full.kv_bytes
    with pytest.raises(PlanError, match=r"try --context \d+") as refused:
        plan(shape, target, requested, fixed=frozenset({"prefill_compress"}))
    assert "capacity full" in str(refused.value)  # no slots were given up for nothing


def test_a_refusal_names_chunk_prompts_when_they_would_fit():
    everything = frozenset({"weights", "kv", "prefill_chunk", "capacity", "prefill_compress"})
    settings = Settings("int4", "int4", 16384, capacity_fraction=0.25, prefill_chunk=128)
    with pytest.raises(PlanError, match=r"prompt read whole takes \d+\.\d+ GiB .* try --prefill-compress chunk"):
        plan(model_shape("llama-2-7b"), load_target("rtx3060-laptop"), settings, fixed=everything)


def test_cli_plan_takes_the_prompt_mode_and_its_build_line_carries_it():
    runner = CliRunner()
    chunked = runner.invoke(main, ["plan", "llama-2-7b", "--target", "rtx3060-laptop", "--context", "16384"])
    assert chunked.exit_code == 0 and "--prefill-compress chunk" in chunked.output.splitlines()[-1]
    whole = runner.invoke(
        main, ["plan", "llama-2-7b", "--target", "rtx3060-laptop", "--context", "16384", "--prefill-compress", "end"]
    )
    assert whole.exit_code == 2 and "GiB usable" in whole.stderr and "Traceback" not in whole.output
    small = runner.invoke(main, ["plan", "smollm2-135m", "--target", "cpu", "--context", "8192", "--kv", "int8"])
    assert small.exit_code == 0 and "prompt state" not in small.output  # every token has a slot


@pytest.mark.parametrize(
    ("target", "weights", "kv", "fraction", "split", "copies"),
    [
        ("cpu", "fp32", "fp32", 1.0, True, 1),  # one graph
        ("cpu", "int4", "fp32", 1.0, True, 2),  # split products: prefill.onnx at fp32 activations
        ("cpu", "int4", "fp32", 1.0, False, 1),  # one row of int8 activations: one graph
        ("cpu", "fp32", "fp32", 0.25, False, 2),  # fp32 slots read in place: a prompt-chunk graph
        ("cpu", "fp32", "int8", 0.25, False, 1),
        ("cpu-portable", "fp32", "fp32", 0.25, False, 1),  # no GroupQueryAttention
        ("rtx3060", "int4", "fp16", 0.25, True, 1),  # an engine
        ("ascend-910b", "fp16", "fp16", 1.0, False, 2),  # two static graphs
    ],
)
def test_weights_are_counted_once_per_session_that_holds_them(target, weights, kv, fraction, split, copies):
    chosen = load_target(target)
    settings = Settings(weights, kv, 4096, capacity_fraction=fraction, split_activations=split)
    one = estimate(model_shape("llama-2-7b"), chosen, settings)
    assert one.weight_copies == copies
    alone = estimate(
        model_shape("llama-2-7b"), chosen, Settings(weights, kv, 4096, capacity_fraction=fraction, prompt_graph=False)
    )
    assert one.weights_bytes == alone.weights_bytes * (copies if not chosen.static_shapes else 1)


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"weights": "int4"},  # from a folder: one row of int8 activations, no prompt graph
        {"weights": "int4", "split_activations": True},
        {"kv_capacity": 32, "kv_dtype": "fp32", "kv_window": 8},
        {"kv_capacity": 32, "kv_dtype": "int8", "kv_window": 8, "kv_group": 16},
    ],
)
def test_the_build_plans_the_sessions_it_writes(tiny_llama, tmp_path, extra):
    """The planner's weight copies at build time follow the graphs the build writes (prefill.onnx or not)."""
    from edgec.build import build, memory_settings, plan_build, splits_activations
    from edgec.plan import count_weight_copies
    from tests.conftest import build_settings

    settings = build_settings(target="cpu", context=128, prefill_chunk=16, **extra)
    shape = model_shape(tiny_llama)
    built = plan_build(settings, shape, shape.max_context, "folder")
    kv_dtype = built.kv.dtype if built.kv else "fp32"
    planned = memory_settings(built, kv_dtype, splits_activations(built, settings, "folder"))
    out = tmp_path / "b.edgec"
    build(tiny_llama, out, settings)
    assert count_weight_copies(built.target, planned) == (2 if (out / "prefill.onnx").exists() else 1)


def test_a_build_whose_end_prompts_cannot_fit_refuses_and_names_chunk_prompts(tmp_path):
    """A 7B config (no real weights) with a quarter of int4 slots on a 5.5 GiB laptop: the slots fit, a 4K prompt
    read whole first does not — refused before any work, naming the prompt mode that fits."""
    folder = seven_b_folder(tmp_path)
    out = tmp_path / "b.edgec"
    words = ["build", str(folder), "-o", str(out), "--target", "rtx3060-laptop", "--context", "4096"]
    words += ["--weights", "int4", "--kv-capacity", "1024", "--kv-dtype", "int4", "--prefill-chunk", "128"]
    # 4.18 GiB usable: the weights and slots take 3.82 GiB, a 4096-token prompt read whole 0.67 GiB more
    result = CliRunner().invoke(main, [*words, "--memory", "5.5GiB"])
    assert result.exit_code == 2 and "try --prefill-compress chunk" in result.stderr, result.output
    assert "Traceback" not in result.output and not out.exists()
    chunked = CliRunner().invoke(main, [*words, "--memory", "5.5GiB", "--prefill-compress", "chunk"])
    assert "GiB usable" not in chunked.stderr  # past the plan (this folder has no tokenizer to build with)


def test_a_tied_float_table_counts_twice_in_one_cpu_session():
    """The embedding's Gather reads the tied table as stored while the lm_head's product packs its own copy
    (Gemma-3-270m fp32 measured 2.27 GB at 32K against 1.73 GB planned without it); quantized tables and a
    second session (every weight already twice) add nothing."""
    from edgec.plan import ModelShape

    config = {
        "num_hidden_layers": 4,
        "hidden_size": 640,
        "intermediate_size": 2048,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 256,
        "vocab_size": 262144,
    }
    tied = ModelShape.from_config({**config, "tie_word_embeddings": True}, "tied")
    untied = ModelShape.from_config(config, "untied")
    cpu = load_target("cpu")
    table = 262144 * 640 * 4
    plain = Settings("fp32", "fp32", 4096)
    assert estimate(tied, cpu, plain).weights_bytes == tied.parameters() * 4 + table
    assert estimate(untied, cpu, plain).weights_bytes == untied.parameters() * 4
    two = Settings("fp32", "fp32", 4096, capacity_fraction=0.5)  # fp32 slots: a prompt-chunk graph
    assert estimate(tied, cpu, two).weights_bytes == 2 * tied.parameters() * 4
    quantized = Settings("int4", "fp32", 4096, split_activations=False)
    assert estimate(tied, cpu, quantized).weights_bytes == int(tied.parameters() * (0.5 + 2.5 / 32))
    assert estimate(tied, load_target("rtx3060"), Settings("fp16", "fp16", 4096)).weights_bytes == tied.parameters() * 2


def test_slots_stored_narrower_than_float_cost_their_dequantized_copies_at_the_attention():
    """An `end` prompt over int8 slots dequantizes each layer's attended past (the whole prompt) to float32 and the
    attention kernel writes its presents beside it: two float copies of k and v that fp32 slots (read in place) and
    a plain cache do not make. Measured peaks were planned at 0.83 of measured without it (docs/planner.md)."""
    shape, cpu = model_shape("smollm2-135m"), load_target("cpu")

    def activations(kv: str, compress: str = "end") -> int:
        settings = Settings("int4", kv, 8000, capacity_fraction=1024 / 8000, prefill_compress=compress)
        return estimate(shape, cpu, settings).activation_bytes

    per_token = 2 * shape.kv_heads * shape.head_dim * (4 + 4)  # k and v, dequantized and present, float32
    scores = 4 * 512 * shape.heads * (8000 - 1024)  # the chunk's scores span the whole prompt, not the slots
    assert activations("int8") - activations("fp32") == 8000 * per_token
    assert activations("int8", "chunk") - activations("fp32", "chunk") == 1024 * per_token  # only the slots
    assert activations("int8") - activations("int8", "chunk") == 6976 * per_token + scores


def test_engines_that_compile_the_op_are_not_charged_the_dequantized_copies():
    import dataclasses

    shape, rtx = model_shape("smollm2-135m"), load_target("rtx3060")
    as_gqa = dataclasses.replace(rtx, abilities=dataclasses.replace(rtx.abilities, attention="gqa"))
    settings = Settings("int4", "int8", 8000, capacity_fraction=1024 / 8000)
    charged = estimate(shape, as_gqa, settings).activation_bytes - estimate(shape, rtx, settings).activation_bytes
    assert charged == 8000 * 2 * shape.kv_heads * shape.head_dim * (4 + 2)  # float32 copies, fp16 presents
