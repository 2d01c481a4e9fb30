"""The extend graph (``edgec.extend_graph``): prompt chunks that only extend the slots run on ``extend.onnx``, the
prompt-chunk graph without the fallback attention and the pairing; every other multi-token call on the general
graph, opened the first time one comes. The answers and the state must be exactly those of the general graph
alone, and the runtime must never send a call that does not only extend the slots to the extend graph."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import onnx
import pytest

from edgec.build import build
from edgec.errors import BuildError, BundleError
from edgec.extend_graph import (
    EXTEND_FILE,
    extend_graph_applies,
    keep_extending_branches,
    take_judged_branches,
    write_extend_graph,
)
from edgec.kvcache.compressed_function import APPEND_OR_JUDGE, EXTEND_CHOICES, EXTENDS_AND_FITS
from edgec.runtime import Model
from edgec.runtime.backend_ort import OrtCacheState, PromptGraphs
from tests.conftest import build_settings, pydoc_text

KV = dict(target="cpu", context=160, prefill_chunk=16)


@pytest.fixture(scope="module")
def fp32_slots(tmp_path_factory, tiny_llama):
    """40 fp32 slots, snapkv, `end` prompts (tests/runtime/test_chunk_kernel.py's bundle)."""
    out = tmp_path_factory.mktemp("extend") / "fp32-slots.edgec"
    build(tiny_llama, out, build_settings(**KV, kv_capacity=40, kv_dtype="fp32", kv_policy="snapkv", kv_window=8))
    return out


@pytest.fixture(scope="module")
def ids(fp32_slots):
    return Model.load(fp32_slots).encode(pydoc_text()[:4000])[:120]


def _branch_names(graph: onnx.GraphProto) -> set[str]:
    names = set()
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                names |= {attribute.g.name} | _branch_names(attribute.g)
    return names


def _count_nodes(graph: onnx.GraphProto) -> int:
    return sum(
        1 + sum(_count_nodes(a.g) for a in node.attribute if a.type == onnx.AttributeProto.GRAPH) for node in graph.node
    )


def test_the_bundle_lists_an_extend_graph_without_the_branches_an_extending_call_never_takes(fp32_slots):
    manifest = json.loads((fp32_slots / "manifest.json").read_text())
    assert manifest["model"]["extend_file"] == EXTEND_FILE and EXTEND_FILE in manifest["files"]
    general = onnx.load(fp32_slots / "prefill.onnx", load_external_data=False).graph
    extend = onnx.load(fp32_slots / EXTEND_FILE, load_external_data=False).graph
    layers = manifest["model"]["num_layers"]
    for kept, left in (*EXTEND_CHOICES, APPEND_OR_JUDGE):
        assert {kept, left} <= _branch_names(general)
        assert left not in _branch_names(extend) and kept not in _branch_names(extend)  # inlined: no If left
    assert _count_nodes(extend) < _count_nodes(general)
    # the same interface, and the weights are the general graph's (references into one data file)
    assert [v.name for v in extend.input] == [v.name for v in general.input]
    assert [v.name for v in extend.output] == [v.name for v in general.output]
    assert {t.name for t in extend.initializer} <= {t.name for t in general.initializer}
    again = onnx.load(fp32_slots / "prefill.onnx", load_external_data=False)
    assert keep_extending_branches(again.graph) == 2 * layers
    assert take_judged_branches(again.graph) == layers


def _named(graph: onnx.GraphProto, part: str) -> list[onnx.NodeProto]:
    return [node for node in graph.node if part in node.name]


def test_the_extend_graph_holds_the_runtime_s_proof_instead_of_each_layer_s_test(fp32_slots):
    """The test that a call extends the slots and fits after them is a constant True there, and the nodes that
    only it read are gone; the general graph keeps it."""
    layers = json.loads((fp32_slots / "manifest.json").read_text())["model"]["num_layers"]
    general = onnx.load(fp32_slots / "prefill.onnx", load_external_data=False).graph
    extend = onnx.load(fp32_slots / EXTEND_FILE, load_external_data=False).graph
    assert [node.op_type for node in _named(general, EXTENDS_AND_FITS)] == ["And"] * layers
    proofs = _named(extend, EXTENDS_AND_FITS)
    assert [node.op_type for node in proofs] == ["Constant"] * layers
    assert all(onnx.numpy_helper.to_array(node.attribute[0].t) == np.True_ for node in proofs)
    # what computed the test: the slots' positions compared with the call's, read by nothing else
    tested = {node.input[0] for node in _named(general, EXTENDS_AND_FITS)}
    made = {output for node in extend.node for output in node.output}
    assert not tested & made
    assert sum(node.op_type == "GreaterOrEqual" for node in extend.node) == layers  # `filled`, still read
    assert sum(node.op_type == "Less" for node in general.node) > sum(node.op_type == "Less" for node in extend.node)


def test_a_body_without_the_named_test_is_a_build_error(fp32_slots, tmp_path):
    spec = Model.load(fp32_slots).cache_spec
    folder = tmp_path / "bundle"
    folder.mkdir()
    model = onnx.load(fp32_slots / "prefill.onnx", load_external_data=False)
    for node in _named(model.graph, EXTENDS_AND_FITS)[:1]:
        node.name = "renamed"
    onnx.save(model, folder / "prefill.onnx")
    with pytest.raises(BuildError, match=r"found \d+ of the \d+ tests that a call extends the slots"):
        write_extend_graph(folder, "prefill.onnx", spec)
    assert not (folder / EXTEND_FILE).exists()


def test_a_body_without_the_choice_to_append_is_a_build_error(fp32_slots, tmp_path):
    spec = Model.load(fp32_slots).cache_spec
    folder = tmp_path / "bundle"
    folder.mkdir()
    model = onnx.load(fp32_slots / "prefill.onnx", load_external_data=False)
    switch = next(node for node in model.graph.node if node.op_type == "If" and "judged_chunk" in str(node.attribute))
    next(attribute for attribute in switch.attribute if attribute.name == "else_branch").g.name = "renamed"
    onnx.save(model, folder / "prefill.onnx")
    with pytest.raises(BuildError, match=r"found \d+ of the \d+ choices between appending and the whole call"):
        write_extend_graph(folder, "prefill.onnx", spec)
    assert not (folder / EXTEND_FILE).exists()


@pytest.mark.parametrize("observes", [False, True])
def test_every_extending_call_takes_the_whole_call_s_branch_with_the_appending_values(
    fp32_slots, ids, monkeypatch, observes
):
    """The extend graph has no If between appending and the whole call (``take_judged_branches``): an unobserved
    call, which the general graph appends, must leave the same values there too — every score included, which an
    `end` prompt's observing last chunk would replace before anything read it. Protected tokens (+inf) and a
    state whose slots already hold some."""
    protect = np.zeros(36, bool)
    protect[[2, 7, 25]] = True

    def calls(extends: bool):
        model = Model.load(fp32_slots)
        state = model._backend.open_state()
        monkeypatch.setattr(state._observation, "observes", lambda newest: observes)
        with monkeypatch.context() as patched:
            if not extends:
                patched.setattr(OrtCacheState, "_extends", lambda self, positions: False)
            rows = [state.run(ids[:20], 0, False, protect[:20]), state.run(ids[20:36], 20, False, protect[20:])]
        return np.concatenate(rows), state.arrays(), model._backend.prompts.opened_general

    seen = _record(monkeypatch)
    logits, arrays, opened = calls(extends=True)
    assert seen == ["extend"] * 2 and not opened
    general_logits, general_arrays, _ = calls(extends=False)
    assert seen[2:] == ["general"] * 2
    np.testing.assert_array_equal(logits, general_logits)
    assert set(arrays) == set(general_arrays)
    scores = [value for name, value in arrays.items() if name.endswith("score")]
    assert scores and all(np.isposinf(score).any() for score in scores)  # the protected tokens' +inf are there
    for name, value in arrays.items():
        np.testing.assert_array_equal(value, general_arrays[name], err_msg=name)


def test_which_caches_get_one(fp32_slots):
    spec = Model.load(fp32_slots).cache_spec
    assert extend_graph_applies(spec)
    compression = spec.compression
    for changed in (
        dict(policy="h2o"),  # an observing call reads the whole score matrix, not the kernel's output
        dict(dtype="int8"),  # no kernel over the slots
        dict(recall=2),
    ):
        other = dataclasses.replace(spec, compression=dataclasses.replace(compression, **changed))
        assert not extend_graph_applies(other), changed
    windowed = [dataclasses.replace(layer, window=8) if layer.compressed else layer for layer in spec.layers]
    assert not extend_graph_applies(dataclasses.replace(spec, layers=windowed))
    assert not extend_graph_applies(dataclasses.replace(spec, compression=None))


def _record(monkeypatch) -> list[str]:
    """Which graph each multi-token call runs on: "extend" or "general"."""
    seen: list[str] = []
    for_call = PromptGraphs.for_call

    def recorded(self, extends):
        graph = for_call(self, extends)
        seen.append("extend" if graph is self.extend else "general")
        return graph

    monkeypatch.setattr(PromptGraphs, "for_call", recorded)
    return seen


def _session(bundle, ids):
    """A long prompt (temporary state), decode steps, a chunk into the full slots (evictions), a short prompt and
    a chunk after it: every logit, the state after each part, whether the general graph was open after each."""
    model = Model.load(bundle)
    prompts = model._backend.prompts
    state = model._backend.open_state()
    rows = [model._prefill(state, ids, all_logits=True)]
    opened = [prompts.opened_general]
    rows += [state.run(np.array([token]), len(ids) + i, True).copy()[None, -1] for i, token in enumerate(ids[:3])]
    rows.append(state.run(ids[10:26], len(ids) + 3, False))  # 16 tokens into 40 full slots: evictions
    opened.append(prompts.opened_general)
    saved = [state.arrays()]
    rows.append(model._prefill(state, ids[:30], all_logits=True))
    rows.append(state.run(ids[40:56], 30, False))  # 30 + 16 > 40: pairs with evictions
    saved.append(state.arrays())
    return np.concatenate(rows), saved, opened


def test_extending_calls_answer_as_the_general_graph_does_which_opens_only_when_needed(fp32_slots, ids, monkeypatch):
    seen = _record(monkeypatch)
    logits, saved, opened = _session(fp32_slots, ids)
    # the long prompt's 8 chunks extend its temporary state; the chunk into full slots opens the general graph,
    # which then runs every call (the extend graph dropped)
    assert seen == ["extend"] * 8 + ["general"] * 4 and opened == [False, True]
    monkeypatch.setattr(OrtCacheState, "_extends", lambda self, positions: False)
    seen.clear()
    general_logits, general_saved, _ = _session(fp32_slots, ids)
    assert seen == ["general"] * 12
    np.testing.assert_array_equal(logits, general_logits)
    for state, other in zip(saved, general_saved, strict=True):
        for name, value in state.items():
            np.testing.assert_array_equal(value, other[name], err_msg=name)


def _turns(bundle, ids):
    """A prompt within the slots, a decode step, a chunk that still fits, a chunk that does not."""
    model = Model.load(bundle)
    state = model._backend.open_state()
    rows = [model._prefill(state, ids[:20], all_logits=True)]  # 20 of 40 slots: no temporary state
    rows.append(state.run(np.array([ids[20]]), 20, True).copy()[None, -1])
    rows.append(state.run(ids[21:37], 21, False))  # 21 + 16 ≤ 40, after every position: extends
    opened = model._backend.prompts.opened_general
    rows.append(state.run(ids[37:41], 37, False))  # 37 + 4 > 40 slots: the general graph
    return np.concatenate(rows), state.arrays(), opened, model._backend.prompts.opened_general


def test_a_later_turn_within_the_slots_still_extends(fp32_slots, ids, monkeypatch):
    seen = _record(monkeypatch)
    logits, saved, opened_before, opened_after = _turns(fp32_slots, ids)
    assert seen == ["extend"] * 3 + ["general"] and (opened_before, opened_after) == (False, True)
    monkeypatch.setattr(OrtCacheState, "_extends", lambda self, positions: False)
    general_logits, general_saved, _, _ = _turns(fp32_slots, ids)
    np.testing.assert_array_equal(logits, general_logits)
    for name, value in saved.items():
        np.testing.assert_array_equal(value, general_saved[name], err_msg=name)


@pytest.mark.parametrize(
    "case",
    ["before the newest", "not increasing", "too many", "restored", "after an end prompt"],
)
def test_a_call_that_does_not_only_extend_goes_to_the_general_graph(fp32_slots, ids, case):
    model = Model.load(fp32_slots)
    state = model._backend.open_state()
    model._prefill(state, ids[:20], all_logits=False)  # positions 0..19 in 20 of 40 slots
    positions = {
        "before the newest": np.arange(15, 19),
        "not increasing": np.array([25, 24, 26]),
        "too many": np.arange(20, 41),
    }.get(case, np.arange(20, 24))
    if case == "restored":
        state.restore(state.arrays())
    if case == "after an end prompt":
        model._prefill(state, ids[:60], all_logits=False)  # 60 > 40: read whole, then the best 40 kept
    assert not state._extends(positions)
    assert state._extends(np.arange(20, 24)) is (case in ("before the newest", "not increasing", "too many"))


def test_the_general_graph_failing_to_open_is_one_line(fp32_slots, ids, tmp_path):
    import shutil

    copy = tmp_path / "bundle.edgec"
    shutil.copytree(fp32_slots, copy)
    model = Model.load(copy)
    state = model._backend.open_state()
    model._prefill(state, ids[:20], all_logits=False)
    (copy / "prefill.onnx").write_bytes(b"not a graph")  # changed after it was checked at load
    with pytest.raises(BundleError, match="ONNX Runtime cannot load .*prefill.onnx") as caught:
        state.run(ids[20:60], 20, False)  # 20 + 40 > 40 slots
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("policy", ["tova", "streaming", "h2o"])
def test_other_policies(tiny_llama, tmp_path, policy, monkeypatch):
    """Where the policy scores prompt chunks from their last queries (or not at all) the bundle has an extend
    graph and a long prompt answers as on the general graph alone; h2o's observing call reads its whole score
    matrix, so its bundle has none."""
    out = tmp_path / f"{policy}.edgec"
    build(tiny_llama, out, build_settings(**KV, kv_capacity=40, kv_dtype="fp32", kv_policy=policy, kv_window=8))
    model = Model.load(out)
    assert (model._backend.prompts.extend is not None) is (policy != "h2o")
    assert (out / EXTEND_FILE).exists() is (policy != "h2o")
    ids = model.encode(pydoc_text()[:4000])[:100]
    tokens = model.generate(ids, max_new_tokens=6)
    logits = model._prefill(model._backend.open_state(), ids, all_logits=True)
    monkeypatch.setattr(OrtCacheState, "_extends", lambda self, positions: False)
    general = Model.load(out)
    assert general.generate(ids, max_new_tokens=6) == tokens
    np.testing.assert_array_equal(general._prefill(general._backend.open_state(), ids, all_logits=True), logits)


def test_prompts_read_from_the_start_never_open_the_general_graph(fp32_slots, ids):
    """``edgec run`` and ``edgec chat`` (each turn reads the whole conversation again): every prompt starts from an
    empty state, so every chunk extends."""
    model = Model.load(fp32_slots)
    first = model.generate(ids[:100], max_new_tokens=5)
    turn = [*ids[:100], *model.encode(first), *ids[100:120]]
    assert model.generate(turn, max_new_tokens=5) and not model._backend.prompts.opened_general


def test_a_windowed_model_s_rings_do_not_limit_extending(tiny_gemma3, tmp_path, monkeypatch):
    """Gemma-3's sliding-window layers keep rings of their own (not the compressed op): only the compressed layers'
    slots bound an extending call, so a prompt longer than the window still runs on the extend graph alone."""
    out = tmp_path / "gemma.edgec"
    settings = dict(target="cpu", context=96, prefill_chunk=16, kv_capacity=40, kv_dtype="fp32", kv_window=8)
    build(tiny_gemma3[0], out, build_settings(**settings))
    model = Model.load(out)
    assert model._backend.prompts.extend is not None
    ids = model.encode(pydoc_text()[:4000])[:80]  # > the 16-token window, > the 40 slots: an `end` prompt
    logits = model._prefill(model._backend.open_state(), ids, all_logits=True)
    tokens = model.generate(ids, max_new_tokens=5)
    assert not model._backend.prompts.opened_general
    monkeypatch.setattr(OrtCacheState, "_extends", lambda self, positions: False)
    general = Model.load(out)
    np.testing.assert_array_equal(general._prefill(general._backend.open_state(), ids, all_logits=True), logits)
    assert general.generate(ids, max_new_tokens=5) == tokens
