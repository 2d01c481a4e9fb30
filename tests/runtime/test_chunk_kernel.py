"""Prompt chunks over fp32 slots (cpu target): each compressed layer's kernel reads the k/v state where it lies
(``compressed_function._state_kernel``), and the runtime binds its presents to the state's buffers while a call
is known to fit them (``OrtCacheState._fed``) — the chunk's rows are then written in place, no row copied. The
answers must not depend on the binding: bound where the runtime proves room, left to fresh tensors, or bound
everywhere (where the kernel's output is not taken it writes one row into an empty slot or the spare row)."""

from __future__ import annotations

import collections
from functools import partial

import numpy as np
import onnx
import pytest

from edgec.build import build
from edgec.kvcache.spec import present_name
from edgec.runtime import Model
from edgec.runtime.backend_ort import OrtCacheState
from tests.conftest import build_settings, pydoc_text

# the context covers every position a session below feeds (120 prompt tokens, 3 steps, a 16-token chunk): the
# kernel rotates by tables of the context's positions and refuses one past them, as the runtime never feeds
KV = dict(target="cpu", context=160, prefill_chunk=16)
BINDING = OrtCacheState._binding  # the runtime's own, wrapped by _bindings


@pytest.fixture(scope="module")
def fp32_slots(tmp_path_factory, tiny_llama):
    """40 fp32 slots, snapkv, `end` prompts: a 120-token prompt reads into a temporary state of 120 rows."""
    out = tmp_path_factory.mktemp("chunk-kernel") / "fp32-slots.edgec"
    kv = dict(kv_capacity=40, kv_dtype="fp32", kv_policy="snapkv", kv_window=8)
    build(tiny_llama, out, build_settings(**KV, **kv))
    return out


@pytest.fixture(scope="module")
def ids(fp32_slots):
    return Model.load(fp32_slots).encode(pydoc_text()[:4000])[:120]


def _bindings(monkeypatch, mode: str) -> list[bool]:
    """Record whether each multi-token step's binding put the kernel's presents on the state; ``mode`` "proved"
    (the runtime's rule), "never" or "always" overrides the rule."""
    seen: list[bool] = []

    def binding(self, state, ids, positions, index, protect, logits, observe, graph=None, presents_in_place=True):
        if graph is not None and graph is not self.graph:  # a prompt-chunk graph's
            presents_in_place = {"proved": presents_in_place, "never": False, "always": True}[mode]
            seen.append(presents_in_place)
        return BINDING(self, state, ids, positions, index, protect, logits, observe, graph, presents_in_place)

    monkeypatch.setattr(OrtCacheState, "_binding", binding)
    return seen


def _session(bundle, ids, monkeypatch, mode: str):
    """A long prompt (temporary state), decode steps, a chunk after the prompt (the real, full state), a short
    prompt (no temporary state) and a chunk after it: every logit, and the state at the end."""
    seen = _bindings(monkeypatch, mode)
    model = Model.load(bundle)
    state = model._backend.open_state()
    rows = [model._prefill(state, ids, all_logits=True)]
    rows += [state.run(np.array([token]), len(ids) + i, True).copy()[None, -1] for i, token in enumerate(ids[:3])]
    rows.append(state.run(ids[10:26], len(ids) + 3, False))  # 16 tokens into 40 full slots: evictions
    arrays_long = state.arrays()
    rows.append(model._prefill(state, ids[:30], all_logits=True))
    rows.append(state.run(ids[40:56], 30, False))  # 30 + 16 > 40: pairs with evictions
    return np.concatenate(rows), arrays_long, state.arrays(), seen


def _assert_same_session(session, other, assert_close) -> None:
    """Two ``_session`` results: their logits, and every saved state's positions equal and its other tensors'
    filled slots by ``assert_close`` (a slot's rows beyond the filled ones are never read)."""
    assert_close(session[0], other[0])
    for saved, other_saved in ((session[1], other[1]), (session[2], other[2])):
        for name, value in saved.items():
            if name.endswith(".pos"):
                np.testing.assert_array_equal(value, other_saved[name], err_msg=name)
                continue
            filled = saved[name.rsplit(".", 1)[0] + ".pos"] >= 0
            if value.ndim == 4:
                filled = np.pad(filled, ((0, 0), (0, 0), (0, value.shape[2] - filled.shape[2])))
            assert_close(value[filled], other_saved[name][filled], err_msg=name)


def test_the_prompt_graph_exposes_each_layers_kernel_over_the_state(fp32_slots):
    graph = onnx.load(fp32_slots / "prefill.onnx", load_external_data=False).graph
    inputs = {value.name for value in graph.input}
    layers = sum(1 for name in inputs if name.endswith(".pos"))
    producers = {output: node for node in graph.node for output in node.output}
    for layer in range(layers):
        for index, name in ((1, "k"), (2, "v")):
            kernel = producers[present_name(layer, name)]
            assert kernel.op_type == "GroupQueryAttention" and kernel.output[index] == present_name(layer, name)
            assert kernel.input[index + 2] == f"cache.{layer}.{name}"  # the state input itself: no copy, no slice
    assert not any(node.op_type == "GroupQueryAttention" and "state_kernel" not in node.name for node in graph.node)


def test_binding_the_presents_changes_no_answer(fp32_slots, ids, monkeypatch):
    proved = _session(fp32_slots, ids, monkeypatch, "proved")
    never = _session(fp32_slots, ids, monkeypatch, "never")
    everywhere = _session(fp32_slots, ids, monkeypatch, "always")
    for other in (never, everywhere):
        _assert_same_session(proved, other, np.testing.assert_array_equal)
    # the rule: in place for the long prompt's 8 chunks (120 rows) and the short prompt's 2 (no temporary state:
    # 40 + 1 rows), never once the state's contents are unknown (after the long prompt's selection); the chunk
    # after the short prompt (30 + 16 > 41 rows) is not proved either
    assert proved[3] == [True] * 8 + [False] + [True] * 2 + [False]


def test_a_state_that_was_restored_is_not_bound(fp32_slots, ids):
    model = Model.load(fp32_slots)
    state = model._backend.open_state()
    model._prefill(state, ids[:20], all_logits=False)
    assert state._fed == 20
    saved = state.arrays()
    state.restore(saved)
    assert state._fed is None
    state.reset()
    assert state._fed == 0


def test_the_rule_matters_where_the_buffers_have_no_spare_row(tiny_rotated_bundle, ids, monkeypatch):
    """fp32 slots with a rotation, compressed between chunks: no one-token kernel, so k/v hold exactly the 40
    slots. There the kernel's present bound to a full buffer cannot take even its one row (ONNX Runtime refuses
    the shape, loudly), which is why the runtime binds only what it proved fits; with that rule the answers
    equal the unbound ones."""
    compression = Model.load(tiny_rotated_bundle).cache_spec.compression
    assert compression.decode_kernel == "none" and compression.prefill_compress == "chunk"
    proved = _session(tiny_rotated_bundle, ids, monkeypatch, "proved")
    never = _session(tiny_rotated_bundle, ids, monkeypatch, "never")
    np.testing.assert_array_equal(proved[0], never[0])
    # chunks of 8, 16, 16 fill the 40 rows in place; the five after them evict (not bound), as does the chunk
    # after the prompt; the short prompt's 14 + 16 fit, the chunk after it (30 + 16) does not
    assert proved[3] == [True] * 3 + [False] * 5 + [False] + [True] * 2 + [False]
    with pytest.raises(Exception, match="GroupQueryAttention"):
        _session(tiny_rotated_bundle, ids, monkeypatch, "always")


@pytest.fixture(scope="module")
def fp32_slots_unfolded(tmp_path_factory, tiny_llama):
    """The same bundle with the model's RoPE left outside each chunk kernel (``prefill_graph.CHUNK_ROTARY`` off)."""
    from edgec import prefill_graph

    out = tmp_path_factory.mktemp("chunk-kernel") / "fp32-slots-unfolded.edgec"
    kv = dict(kv_capacity=40, kv_dtype="fp32", kv_policy="snapkv", kv_window=8)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(prefill_graph, "CHUNK_ROTARY", False)
        build(tiny_llama, out, build_settings(**KV, **kv))
    return out


def _rotary_nodes(graph: onnx.GraphProto, depth: int = 0) -> list[int]:
    """The depth (0: the main graph) of every RotaryEmbedding in ``graph`` and its If branches."""
    found = []
    for node in graph.node:
        found += [depth] if node.op_type == "RotaryEmbedding" else []
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                found += _rotary_nodes(attribute.g, depth + 1)
    return found


def test_the_kernel_applies_rope_to_the_packed_projection(fp32_slots, fp32_slots_unfolded):
    """fold_chunk_rotary: each kernel reads the model's packed q/k/v projection and rotates it itself; the model's
    RotaryEmbeddings run only inside the branch that judges a call (none in an appending chunk's path)."""
    graph = onnx.load(fp32_slots / "prefill.onnx", load_external_data=False).graph
    layers = sum(1 for value in graph.input if value.name.endswith(".pos"))
    kernels = [node for node in graph.node if node.op_type == "GroupQueryAttention"]
    assert len(kernels) == layers
    for kernel in kernels:
        attributes = {attribute.name: attribute for attribute in kernel.attribute}
        assert attributes["do_rotary"].i == 1 and kernel.input[1] == kernel.input[2] == ""
        assert kernel.input[7].startswith("chunk_rope") and kernel.input[9]  # tables, explicit positions
    tables = {tensor.name: tensor.dims for tensor in graph.initializer if tensor.name.startswith("chunk_rope")}
    assert tables and all(dims[0] == KV["context"] + 1 for dims in tables.values())
    assert _rotary_nodes(graph) == [1] * 2 * layers  # q and k per layer, in the top If's judged branch
    assert {node.op_type for node in graph.node}.isdisjoint({"RotaryEmbedding", "Transpose"})
    unfolded = onnx.load(fp32_slots_unfolded / "prefill.onnx", load_external_data=False).graph
    assert _rotary_nodes(unfolded).count(0) == 2 * layers


def _defined_names(graph: onnx.GraphProto) -> list[str]:
    """Every name a node output defines in ``graph`` and its subgraphs (nested ones too)."""
    names = []
    for node in graph.node:
        names += [name for name in node.output if name]
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                names += _defined_names(attribute.g)
    return names


def test_every_value_the_folding_makes_has_a_name_of_its_own(fp32_slots):
    """The folding inserts nodes into the main graph and into each layer's appending branch, whose graphs name
    them alike (val_0, ...); it renames every value it made, so no name is defined twice across the model's graphs
    (ONNX requires it, and a branch's name equal to an outer value's would shadow it)."""
    graph = onnx.load(fp32_slots / "prefill.onnx", load_external_data=False).graph
    names = _defined_names(graph) + [value.name for value in graph.input] + [t.name for t in graph.initializer]
    repeated = [name for name, count in collections.Counter(names).items() if count > 1]
    assert not repeated
    assert any(name.startswith("chunk_rotary_") for name in names)


@pytest.mark.parametrize("mode", ["proved", "never"])
def test_folding_rope_into_the_kernel_changes_no_answer(fp32_slots, fp32_slots_unfolded, ids, monkeypatch, mode):
    """Every logit and state tensor of a session (a long prompt through the temporary state, decode steps, chunks
    with evictions, a short prompt) equal with RoPE in the kernel and outside it, the presents bound in place or
    not: an appending chunk's k/v rows are the kernel's present rows, a judged call rotates q/k in its branch."""
    folded = _session(fp32_slots, ids, monkeypatch, mode)
    unfolded = _session(fp32_slots_unfolded, ids, monkeypatch, mode)
    assert folded[1].keys() == unfolded[1].keys() and folded[2].keys() == unfolded[2].keys()
    _assert_same_session(folded, unfolded, partial(np.testing.assert_allclose, rtol=0, atol=1e-5))


def test_an_appending_chunk_runs_no_ordering_chain_and_one_index(fp32_slots):
    """The appending branch takes the kernel's output from before the If, so its writes wait for nothing (no
    ``_after`` chain: ReduceMax/IsNaN over the output); its one ScatterND index is an output of the If, which the
    k/v scatters after it read — no second index computed in the main graph."""
    graph = onnx.load(fp32_slots / "prefill.onnx", load_external_data=False).graph
    switches = [node for node in graph.node if node.op_type == "If"]
    appending = [branch.g for node in switches for branch in node.attribute if branch.g.name == "append_chunk"]
    assert len(appending) == sum(1 for value in graph.input if value.name.endswith(".pos"))
    for branch in appending:
        assert not {"IsNaN", "ReduceMax"} & {node.op_type for node in branch.node}
    outputs = {output: node for node in switches for output in node.output}
    for node in graph.node:
        if node.op_type == "ScatterND" and node.input[0].endswith((".k", ".v")):
            assert node.input[1] in outputs, node.name  # the index comes straight from the If
