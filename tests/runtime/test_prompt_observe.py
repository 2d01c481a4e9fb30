"""The compressed op's ``observe`` input as the runtime feeds it (edgec/runtime/observe.py): where the policy's
prompt update replaces every score and the prompt fits the state it is read into, only the chunk holding the
prompt's last token observes — and the cache ends the prompt exactly as if every chunk had observed."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from edgec.build import build
from edgec.kvcache.spec import OBSERVE_INPUT
from edgec.runtime import Model
from edgec.runtime.backend_ort import OrtCacheState
from edgec.runtime.observe import PromptObservation
from tests.conftest import build_settings, pydoc_text
from tests.hostile import copy_bundle, rehash

KV = dict(target="cpu", context=128, prefill_chunk=16, kv_window=8, kv_group=16, kv_dtype="int8", kv_capacity=24)


def _build(tmp_path_factory, tiny_llama, name: str, **kv) -> Path:
    out = tmp_path_factory.mktemp("observe") / f"{name}.edgec"
    build(tiny_llama, out, build_settings(**(KV | kv)))
    return out


@pytest.fixture(scope="module")
def snapkv_end(tmp_path_factory, tiny_llama):
    return _build(tmp_path_factory, tiny_llama, "snapkv-end", kv_policy="snapkv")


@pytest.fixture(scope="module")
def snapkv_chunk(tmp_path_factory, tiny_llama):
    return _build(tmp_path_factory, tiny_llama, "snapkv-chunk", kv_policy="snapkv", prefill_compress="chunk")


@pytest.fixture(scope="module")
def h2o_end(tmp_path_factory, tiny_llama):
    return _build(tmp_path_factory, tiny_llama, "h2o-end", kv_policy="h2o")


@pytest.fixture(scope="module")
def ids(tiny_bundle):
    return Model.load(tiny_bundle).encode(pydoc_text()[:4000])[:70]


@pytest.fixture
def fed(monkeypatch) -> list[bool]:
    """The ``observe`` value bound for every multi-token call, in order."""
    calls: list[bool] = []
    original = OrtCacheState._binding

    def spy(self, state, ids, positions, index, protect, logits, observe, *rest):
        binding = original(self, state, ids, positions, index, protect, logits, observe, *rest)
        if ids.shape[-1] > 1:
            calls.append(bool(observe[0]))
        return binding

    monkeypatch.setattr(OrtCacheState, "_binding", spy)
    return calls


def _always_observe(monkeypatch) -> None:
    monkeypatch.setattr(PromptObservation, "begin", lambda self, compression, length: None)


def _prompt(model: Model, ids: list[int]) -> tuple[list[int], dict[str, np.ndarray]]:
    """Ten greedy tokens after the prompt, and the cache state right after the prompt."""
    with model._state() as state:
        model._prefill(state, np.asarray(ids, np.int64), all_logits=False)
        after_prompt = state.arrays()
    return list(model.generate_ids(list(ids), max_new_tokens=10)), after_prompt


@pytest.mark.parametrize("length,expected", [(70, [False] * 4 + [True]), (20, [False, True])])
def test_only_the_last_chunk_observes(snapkv_end, ids, fed, length, expected):
    """An `end` prompt longer than the capacity (read into a temporary state) and one that fits the slots: 16-token
    chunks, the short piece first; the graph takes the input."""
    model = Model.load(snapkv_end)
    assert model._backend.graph.observes
    with model._state() as state:
        model._prefill(state, np.asarray(ids[:length], np.int64), all_logits=False)
    assert fed == expected
    fed.clear()
    list(model.generate_ids(list(ids[:3]), max_new_tokens=2))  # a one-chunk prompt observes
    assert fed == [True]


def test_every_chunk_observes_where_a_chunk_may_evict(snapkv_chunk, h2o_end, ids, fed):
    """A `chunk` prompt longer than the capacity evicts between chunks, and h2o accumulates over every chunk:
    each chunk's observation counts, so every chunk observes (a `chunk` prompt that fits does not)."""
    for bundle, length, expected in ((snapkv_chunk, 70, [True] * 5), (h2o_end, 70, [True] * 5)):
        fed.clear()
        model = Model.load(bundle)
        with model._state() as state:
            model._prefill(state, np.asarray(ids[:length], np.int64), all_logits=False)
        assert fed == expected
    fed.clear()
    model = Model.load(snapkv_chunk)
    with model._state() as state:
        model._prefill(state, np.asarray(ids[:20], np.int64), all_logits=False)
    assert fed == [False, True]


@pytest.mark.parametrize("bundle,length", [("snapkv_end", 70), ("snapkv_end", 20), ("snapkv_chunk", 20)])
def test_skipping_observation_changes_nothing(request, monkeypatch, ids, bundle, length):
    """The state right after the prompt (every byte, slot and score) and the tokens generated after it are those of
    a runtime whose every chunk observes."""
    model = Model.load(request.getfixturevalue(bundle))
    tokens, state = _prompt(model, ids[:length])
    _always_observe(monkeypatch)
    want_tokens, want_state = _prompt(Model.load(request.getfixturevalue(bundle)), ids[:length])
    assert tokens == want_tokens
    assert state.keys() == want_state.keys()
    for name, value in want_state.items():
        np.testing.assert_array_equal(state[name], value, err_msg=name)


def _without_observe(model_path) -> None:
    """The graph as edgec built it before the input existed: no ``observe`` input, an op that always observes."""
    model = onnx.load(str(model_path), load_external_data=False)
    graph = model.graph
    graph.input.remove(next(value for value in graph.input if value.name == OBSERVE_INPUT))
    for node in graph.node:
        if node.input and node.input[-1] == OBSERVE_INPUT:
            node.input.pop()
    for function in model.functions:
        if OBSERVE_INPUT in function.input:
            function.input.remove(OBSERVE_INPUT)
            always = helper.make_tensor("always", TensorProto.BOOL, [1], [True])
            function.node.insert(0, helper.make_node("Constant", [], [OBSERVE_INPUT], value=always))
    onnx.save(model, str(model_path))


def test_a_graph_without_the_input_still_runs(snapkv_end, ids, tmp_path, fed):
    """Bundles built before the input existed: the runtime binds only what the graph takes, same answers."""
    old = copy_bundle(snapkv_end, tmp_path)
    _without_observe(old / "model.onnx")
    rehash(old, "model.onnx")
    model = Model.load(old)
    assert not model._backend.graph.observes
    assert _prompt(model, ids)[0] == _prompt(Model.load(snapkv_end), ids)[0]
