"""The hierarchical cache end to end on a tiny model (edgec/runtime/recall_state.py): the build flag and manifest,
the query outputs, recall = no recall while nothing is evicted, the host tier holds the exact bytes of every token
the op evicts (decode steps included), recalled slots hold those bytes, refusals and hostile manifests."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from click.testing import CliRunner

from edgec.build import build
from edgec.cli import main
from edgec.errors import BuildSettingsError, BundleError
from edgec.kvcache.spec import recall_query_name
from edgec.runtime import Model
from edgec.runtime.recall_state import RecallCacheState
from tests.conftest import build_settings, manifest, pydoc_text
from tests.hostile import copy_bundle, edit_manifest
from tests.test_cli import assert_clean_failure

CAPACITY, WINDOW, BLOCKS, BLOCK = 48, 8, 2, 4  # 8 reserved slots, 40 for the op
RECALL = dict(
    target="cpu",
    context=128,
    prefill_chunk=16,
    kv_capacity=CAPACITY,
    kv_window=WINDOW,
    kv_dtype="fp32",  # float slots: the query test below compares the op with the reference to float rounding
    kv_recall=BLOCKS,
    kv_recall_block=BLOCK,
)


@pytest.fixture(scope="module")
def recall_bundle(tmp_path_factory, tiny_llama):
    out = tmp_path_factory.mktemp("recall") / "recall.edgec"
    build(tiny_llama, out, build_settings(**RECALL))
    return out


@pytest.fixture(scope="module")
def ids(tiny_bundle):
    return Model.load(tiny_bundle).encode(pydoc_text()[:4000])[:110]


def test_bundle_records_recall_and_gives_each_layers_query(recall_bundle):
    compression = manifest(recall_bundle)["cache"]["compression"]
    assert (compression["recall"], compression["recall_block"], compression["recall_every"]) == (BLOCKS, BLOCK, 1)
    graph = onnx.load(recall_bundle / "model.onnx", load_external_data=False).graph
    outputs = {value.name for value in graph.output}
    layers = manifest(recall_bundle)["cache"]["layers"]
    assert {recall_query_name(layer["layer"]) for layer in layers if layer["compressed"]} <= outputs
    assert "recall" in CliRunner().invoke(main, ["inspect", str(recall_bundle)]).output


def test_without_eviction_recall_changes_nothing(recall_bundle):
    """Prompt + answer within the op's own slots: the reserved ones stay empty and the logits are the very same
    as the same bundle loaded without recall (its graph's query outputs then unbound)."""
    on, off = Model.load(recall_bundle), Model.load(recall_bundle, kv_recall=0)
    prompt = [int(i) for i in np.arange(1, 21)]
    assert on.generate(prompt, max_new_tokens=18) == off.generate(prompt, max_new_tokens=18)
    stream_on = [logits.copy() for _, logits in on.iter_logits(prompt + list(range(30, 48)), prompt_tokens=20)]
    stream_off = [logits.copy() for _, logits in off.iter_logits(prompt + list(range(30, 48)), prompt_tokens=20)]
    for a, b in zip(stream_on, stream_off, strict=True):
        np.testing.assert_array_equal(a, b)
    assert isinstance(on._idle[-1], RecallCacheState) and not isinstance(off._idle[-1], RecallCacheState)


def _state_views(state: RecallCacheState, layer: int) -> dict[str, np.ndarray]:
    return {name: array[0].copy() for name, array in state._views[layer].items()}


def test_every_evicted_token_is_in_the_host_tier_with_its_bytes(recall_bundle, ids):
    """A prompt longer than the capacity, then decode steps that evict: before each step the test copies the slots;
    every token the step removed from a slot (the graph's eviction, or a recall's replacement) must be in the
    host tier with exactly the bytes it had, and the reserved slots hold exactly the host tier's bytes."""
    _check_evictions(recall_bundle, ids, CAPACITY - BLOCKS * BLOCK)


@pytest.mark.slow
def test_evictions_kept_on_the_portable_body_with_int4_rotation_and_pruning(tmp_path, tiny_llama, ids):
    """The same on the cpu-portable target (the op's standard-op body), int4 slots, the rotation (the query output
    is the rotated one, as the stored keys are) and a pruning policy (adaptive: one step may empty many slots)."""
    bundle = tmp_path / "portable.edgec"
    settings = RECALL | dict(
        target="cpu-portable", kv_dtype="int4", kv_group=16, kv_rotation="hadamard", kv_policy="adaptive"
    )
    build(tiny_llama, bundle, build_settings(**settings))
    _check_evictions(bundle, ids, CAPACITY - BLOCKS * BLOCK)


def _check_evictions(bundle, ids, main: int) -> None:
    model = Model.load(bundle)
    full = Model.load(bundle, kv_capacity=128, kv_recall=0)  # nothing evicted: every prompt token's bytes
    prompt = ids[:90]
    with full._state() as reference:
        full._prefill(reference, np.asarray(prompt), all_logits=False)
        whole = reference.arrays()
    with model._state() as state:
        logits = model._prefill(state, np.asarray(prompt), all_logits=False)[-1]
        layers, tier = list(state._views), state.tier
        assert tier.length == 90 and tier.present[:, :90].all()
        for layer in layers:  # the prompt's bytes are the uncompressed run's, token for token
            rows = state.rows(layer)
            assert (whole[f"cache.{layer}.pos"][0][:, :90] == np.arange(90)).all()  # slot = position there
            for name in tier.arrays:
                np.testing.assert_array_equal(tier.arrays[name][rows, :90], whole[f"cache.{layer}.{name}"][0][:, :90])
        position, token = 90, int(np.argmax(logits))
        evicted = 0
        for _ in range(14):
            before = {layer: _state_views(state, layer) for layer in layers}
            logits = state.run(np.array([token]), position, last_only=True)
            for layer in layers:
                after, old, rows = _state_views(state, layer), before[layer], state.rows(layer)
                gone = (old["pos"] >= 0) & (old["pos"] != after["pos"])
                heads, slots = np.nonzero(gone)
                evicted += len(heads)
                for name in tier.arrays:
                    held = tier.arrays[name][rows][heads, old["pos"][heads, slots]]
                    np.testing.assert_array_equal(held, old[name][heads, slots])
                tail = after["pos"][:, main:]
                assert (tail >= 0).all() and np.isposinf(after["score"][:, main:]).all()
                for name in tier.arrays:
                    held = np.take_along_axis(tier.arrays[name][rows], tail[..., None], axis=1)
                    np.testing.assert_array_equal(after[name][:, main:], held)
                for head in range(after["pos"].shape[0]):  # every token once: no duplicate slot, none lost
                    filled = after["pos"][head][after["pos"][head] >= 0]
                    assert len(set(filled.tolist())) == len(filled)
                assert tier.present[:, : position + 1].all()
            position, token = position + 1, int(np.argmax(logits))
        assert evicted > 14 and state.recalls >= 15


def test_the_query_output_is_the_query_the_op_attends_with(recall_bundle, ids):
    """After a decode step, the reference op run on the state before it with the graph's query output (and the
    token's k, v as the step stored them) reproduces the op's slots, positions and scores: the runtime scores its
    summaries with the very query the op used, in the keys' space."""
    from edgec.kvcache import reference

    model = Model.load(recall_bundle)
    graph = onnx.load(recall_bundle / "model.onnx", load_external_data=False).graph
    scale = next(
        attribute.f
        for node in graph.node
        if node.op_type == "CompressedKVAttention"
        for attribute in node.attribute
        if attribute.name == "scale"
    )
    main = CAPACITY - BLOCKS * BLOCK
    compression = model.cache_spec.compression
    with model._state() as state:
        logits = model._prefill(state, np.asarray(ids[:90]), all_logits=False)[-1]
        position, token = 90, int(np.argmax(logits))
        for _ in range(3):
            before = {layer: _state_views(state, layer) for layer in state._views}
            logits = state.run(np.array([token]), position, last_only=True)
            for layer in state._views:
                after = _state_views(state, layer)
                slot = np.argmax(after["pos"] == position, axis=-1)  # [Hkv]: where the op put the token
                heads = np.arange(len(slot))
                new_k, new_v = after["k"][heads, slot][None, :, None], after["v"][heads, slot][None, :, None]
                query = state._queries[layer][:, :, None, :]  # [1, H, 1, D]
                old = {name: value[None] for name, value in before[layer].items()}
                _, want = reference.compressed_kv_attention(
                    query, new_k, new_v, np.array([[position]]), np.zeros((1, 1), bool), old, compression, scale
                )
                np.testing.assert_array_equal(want["pos"][0, :, :main], after["pos"][:, :main])
                np.testing.assert_allclose(want["score"][0, :, :main], after["score"][:, :main], rtol=1e-4, atol=1e-6)
            position, token = position + 1, int(np.argmax(logits))


def test_recall_applies_the_load_time_settings(recall_bundle, ids):
    model = Model.load(recall_bundle, kv_recall=1, kv_recall_block=8, kv_recall_every=3)
    assert model.cache_spec.compression.recall_slots == 8
    assert len(model.generate(ids[:90], max_new_tokens=7)) > 0
    state = model._idle[-1]
    assert state.recalls == 1 + 2  # after the prompt, then every third of the 6 decode steps


def test_refusals_and_bad_settings_are_one_line(recall_bundle, tiny_rotated_bundle, tiny_llama, tmp_path):
    assert "recall" not in manifest(tiny_rotated_bundle)["cache"]["compression"]  # off: the manifest as before
    with pytest.raises(BundleError, match="rebuild it with --kv-recall"):
        Model.load(tiny_rotated_bundle, kv_recall=1, kv_recall_block=4)
    for target, extra in (("rtx4090", []), ("cuda", []), ("rtx4090", ["--kv-plugin", "on"])):
        args = ["build", str(tiny_llama), "--target", target, "-o", str(tmp_path / f"{target}.edgec")]
        args += ["--kv-capacity", "48", "--kv-window", "8", "--kv-recall", "2", "--kv-recall-block", "4", *extra]
        assert_clean_failure(CliRunner().invoke(main, args), "--kv-recall", target)
    with pytest.raises(BuildSettingsError, match="reserves 40 of 48 slots"):
        build(tiny_llama, tmp_path / "x.edgec", build_settings(**RECALL | {"kv_recall": 10}))
    run = CliRunner().invoke(main, ["run", str(recall_bundle), "x", "--kv-recall", "12"])
    assert_clean_failure(run, "reserves 48 of 48 slots")


@pytest.mark.parametrize(
    "change,needle",
    [
        (lambda c: c.update(recall=0), "recall"),
        (lambda c: c.update(recall=-3), "recall"),
        (lambda c: c.update(recall_block=2**40), "recall_block"),
        (lambda c: c.update(recall_every="1"), "recall_every"),
        (lambda c: c.pop("recall_block"), "recall"),
        (lambda c: c.update(recall=12), "recall slots"),
        (lambda c: c.update(recall_evict=1), "recall_evict"),
    ],
)
def test_hostile_recall_fields(recall_bundle, tmp_path, change, needle):
    bundle = copy_bundle(recall_bundle, tmp_path)
    edit_manifest(bundle, lambda m: change(m["cache"]["compression"]))
    with pytest.raises(BundleError, match=needle):
        Model.load(bundle)
    assert_clean_failure(CliRunner().invoke(main, ["run", str(bundle), "x"]), needle)
