"""An `end` prompt's temporary state (the whole prompt's k/v for the compressed layers) is numpy's memory, from the
C allocator's heap (it fills the pages loading freed, as a plain cache does), and every buffer's pages go back to the
system when it is dropped (``backend_ort._heap_buffer``): without that the allocator kept them resident (0.44 GB of
SmolLM2's process after an 8,000-token prompt). The slots are anonymous mappings of their own
(``backend_ort._own_mapping``), untouched until written."""

from __future__ import annotations

import gc
import mmap
import sys
import weakref
from pathlib import Path

import numpy as np
import pytest

from edgec.build import build
from edgec.runtime import Model, backend_ort
from tests.conftest import build_settings, pydoc_text, record_temporary_states

KV = dict(target="cpu", context=128, prefill_chunk=16, kv_capacity=40, kv_dtype="fp32", kv_window=8)


@pytest.fixture(scope="module")
def fp32_slots(tmp_path_factory, tiny_llama):
    out = tmp_path_factory.mktemp("prompt-state") / "fp32-slots.edgec"
    build(tiny_llama, out, build_settings(**KV))
    return out


def _record_state_buffers(monkeypatch) -> tuple[list[weakref.ref], dict[int, int], list[int]]:
    """From now on: the slots' own mappings (weak references), each temporary buffer (address → bytes) and the
    addresses whose pages were given back, in order."""
    mappings: list[weakref.ref] = []
    buffers: dict[int, int] = {}
    given_back: list[int] = []
    own, heap, give_back = backend_ort._own_mapping, backend_ort._heap_buffer, backend_ort._give_back_pages

    def own_recorded(array):
        copy = own(array)
        base = copy.base
        while base is not None and not isinstance(base, mmap.mmap):
            base = getattr(base, "obj", None) or getattr(base, "base", None)
        if isinstance(base, mmap.mmap):
            mappings.append(weakref.ref(base))
        return copy

    def heap_recorded(array):
        buffers[array.ctypes.data] = array.nbytes
        return heap(array)

    def give_back_recorded(address, size):
        given_back.append(address)
        return give_back(address, size)

    monkeypatch.setattr(backend_ort, "_own_mapping", own_recorded)
    monkeypatch.setattr(backend_ort, "_heap_buffer", heap_recorded)
    monkeypatch.setattr(backend_ort, "_give_back_pages", give_back_recorded)
    return mappings, buffers, given_back


def test_the_temporary_state_gives_its_pages_back_when_the_prompt_ends(fp32_slots, monkeypatch):
    mappings, buffers, given_back = _record_state_buffers(monkeypatch)
    model = Model.load(fp32_slots)
    state = model._backend.open_state()
    compressed = sum(1 for layer in model.cache_spec.layers if layer.compressed)
    per_state = compressed * len(model.cache_spec.layers[0].state)
    # the real state's slots are mappings of their own (untouched zeros, not resident until written), kept
    assert len(mappings) == per_state and not buffers
    ids = np.array(model.encode(pydoc_text()[:3000])[:100])
    state.reset()
    state.begin_prompt(len(ids))
    assert len(mappings) == per_state and len(buffers) == per_state  # the temporary state: numpy's, no mappings
    large = {address for address, size in buffers.items() if size >= 2 * mmap.PAGESIZE}
    assert large and not given_back
    for start in range(0, len(ids), 16):
        state.run(ids[start : start + 16], start, last_only=True)
    assert not given_back
    state.end_prompt(len(ids) - 1, last_chunk_start=96)
    gc.collect()
    # every buffer of more than a page gave its pages back, once, as the selection dropped it
    assert sorted(given_back) == sorted(large)
    assert all(ref() is not None for ref in mappings)  # the slots the prompt's selection was written into
    # a prompt given up before its end (reset, or a failure) gives its state back too
    given_back.clear()
    state.begin_prompt(len(ids))
    state.run(ids[:16], 0, last_only=True)
    state.reset()
    gc.collect()
    assert len(given_back) == len(large)


def _resident_pages(array: np.ndarray) -> int:
    """How many of ``array``'s pages are resident (mincore; Linux)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    start = array.__array_interface__["data"][0]
    low = start - start % mmap.PAGESIZE
    pages = -(-(start + array.nbytes - low) // mmap.PAGESIZE)
    vector = (ctypes.c_ubyte * pages)()
    assert libc.mincore(low, pages * mmap.PAGESIZE, vector) == 0
    return sum(byte & 1 for byte in vector)


def _first_prompt(bundle: Path):
    """A state after one 100-token `end` prompt, and its slots' k/v arrays — which stayed untouched (not resident)
    until the prompt's selection wrote them at its end."""
    model = Model.load(bundle)
    state = model._backend.open_state()
    state.reset()
    slots = {tensor.input: value.numpy() for tensor, value in state._state if tensor.name in ("k", "v")}
    assert slots and all(_resident_pages(array) == 0 for array in slots.values())
    ids = np.array(model.encode(pydoc_text()[:3000])[:100])
    state.begin_prompt(len(ids))
    for start in range(0, len(ids), 16):
        state.run(ids[start : start + 16], start, last_only=True)
    assert all(_resident_pages(array) == 0 for array in slots.values())  # the prompt went to the temporary state
    state.end_prompt(len(ids) - 1, last_chunk_start=96)
    assert all(_resident_pages(array) > 0 for array in slots.values())
    return model, state, slots


linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore residency, MADV_REMOVE: Linux")


@linux_only
def test_the_slots_are_not_resident_until_written(fp32_slots):
    """A fresh state's slots are zero pages the process has not touched: an `end` prompt writes them only when it
    ends, and they must not count in its peak meanwhile (from the heap they came as recycled, resident pages)."""
    _first_prompt(fp32_slots)


@linux_only
def test_a_second_prompt_gives_the_first_prompts_slots_back(fp32_slots):
    """What the slots hold is dead once the next `end` prompt begins (its selection rewrites every row), so their
    pages go back to the system then: the second prompt's temporary state is not built on top of the first
    prompt's resident slots. The answers are a fresh state's."""
    model, state, slots = _first_prompt(fp32_slots)
    ids = np.array(model.encode(pydoc_text()[3000:6000])[:100])

    def answer(state) -> tuple[np.ndarray, list[int]]:
        state.reset()
        state.begin_prompt(len(ids))
        for start in range(0, len(ids), 16):
            logits = state.run(ids[start : start + 16], start, last_only=True)
        state.end_prompt(len(ids) - 1, last_chunk_start=96)
        tokens = [int(logits[-1].argmax())]
        for position in range(len(ids), len(ids) + 6):
            tokens.append(int(state.run(np.array(tokens[-1:]), position, last_only=True)[-1].argmax()))
        return logits[-1].copy(), tokens

    state.reset()
    state.begin_prompt(len(ids))
    assert all(_resident_pages(array) == 0 for array in slots.values())  # given back, the buffers still bound
    assert all(not array.any() for array in slots.values())  # and they read as zeros
    logits, tokens = answer(state)
    fresh_logits, fresh_tokens = answer(model._backend.open_state())
    np.testing.assert_array_equal(logits, fresh_logits)
    assert tokens == fresh_tokens
    assert all(_resident_pages(array) > 0 for array in slots.values())  # the second selection is in them


@linux_only
def test_pages_of_a_buffer_that_is_not_an_own_mapping_are_not_given_back():
    """``_release_pages`` gives back only shared mappings' pages (``_own_mapping``'s): on a private buffer (the
    heap, numpy's own) the system refuses, so a buffer of another kind is never zeroed under its owner."""
    import onnxruntime as ort

    array = np.full((1, 3, 64, 256), 1.5, np.float32)  # 192 KiB: numpy's own, private
    value = ort.OrtValue.ortvalue_from_numpy(array)
    assert backend_ort._release_pages(value) is False
    assert (array == 1.5).all()
    own = backend_ort._own_mapping(array)
    assert backend_ort._release_pages(ort.OrtValue.ortvalue_from_numpy(own)) is True
    assert not own.any() and (array == 1.5).all()


@linux_only
def test_giving_back_a_heap_buffers_pages_takes_its_whole_pages_alone():
    """``_give_back_pages`` on a live private buffer: its whole pages leave the process (not resident, zeros when
    read again); the partial pages at its ends, which the allocator's bookkeeping may share, keep their bytes."""
    page = mmap.PAGESIZE
    base = np.full(16 * page + 200, 7, np.uint8)
    start = (-base.ctypes.data) % page + 100  # 100 bytes into a page: both ends partial
    buffer = base[start : start + 10 * page]
    assert _resident_pages(buffer) == 11
    assert backend_ort._give_back_pages(buffer.ctypes.data, buffer.nbytes) is True
    assert _resident_pages(buffer) == 2  # the first and last partial pages
    first, last = page - 100, 10 * page - 100  # the whole pages: buffer[first:last]
    assert (buffer[:first] == 7).all() and (buffer[last:] == 7).all() and not buffer[first:last].any()
    assert backend_ort._give_back_pages(buffer.ctypes.data, page) is False  # no whole page inside


def test_a_heap_buffer_gives_its_pages_back_when_freed_and_a_view_never(monkeypatch):
    """The finalizer runs when the array is freed, before numpy frees its block; a view (whose pages are its
    base's, still in use) and an array of less than two pages get none."""
    given_back: list[tuple[int, int]] = []
    monkeypatch.setattr(backend_ort, "_give_back_pages", lambda address, size: given_back.append((address, size)))
    array = np.zeros((3, 4096), np.float32)
    address = array.ctypes.data
    assert backend_ort._heap_buffer(array) is array
    base = np.ones((3, 4096), np.float32)
    view = backend_ort._heap_buffer(base[1:])
    small = backend_ort._heap_buffer(np.zeros(100, np.float32))
    del view, small
    gc.collect()
    assert given_back == [] and (base == 1).all()
    del array
    gc.collect()
    assert given_back == [(address, 3 * 4096 * 4)]


@pytest.mark.parametrize("fill", [0, -1, 2.5])
def test_an_own_mapping_holds_the_arrays_values_and_is_writable(fill):
    array = np.full((1, 3, 40), fill, np.float32 if isinstance(fill, float) else np.int64)
    copy = backend_ort._own_mapping(array)
    np.testing.assert_array_equal(copy, array)
    assert copy.dtype == array.dtype and copy.flags.writeable and not np.shares_memory(copy, array)
    copy[0, 0, 0] = 7
    assert array[0, 0, 0] == fill


def test_an_empty_array_needs_no_mapping():
    array = np.zeros((1, 3, 0), np.float32)
    assert backend_ort._own_mapping(array) is array


def test_an_end_prompt_without_room_for_its_state_is_refused_at_once(fp32_slots, monkeypatch, tmp_path):
    """An `end` prompt's temporary state (its tokens' k/v for the compressed layers) is checked against the memory
    the machine has available before any of it is written: one clear line instead of the kernel's OOM killer
    minutes later. Prompts that fit the slots, and `chunk` prompts, need no such state."""
    from click.testing import CliRunner

    from edgec.cli import main
    from edgec.errors import GenerationError

    model = Model.load(fp32_slots)
    ids = model.encode(pydoc_text()[:3000])[:100]
    needed = model.cache_spec.with_capacity(100).compressed_bytes()
    monkeypatch.setattr(backend_ort, "available_memory", lambda: needed - 1)
    with pytest.raises(GenerationError, match=r"100-token prompt is read whole .* prefill_compress='chunk'"):
        model.generate(ids, max_new_tokens=1)
    assert model.generate(ids[:30], max_new_tokens=1)  # fits the 40 slots: no temporary state
    assert Model.load(fp32_slots, prefill_compress="chunk").generate(ids, max_new_tokens=1)
    monkeypatch.setattr(backend_ort, "available_memory", lambda: needed)
    assert model.generate(ids, max_new_tokens=1)  # exactly enough
    monkeypatch.setattr(backend_ort, "available_memory", lambda: None)  # no /proc/meminfo: not checked
    assert model.generate(ids, max_new_tokens=1)
    monkeypatch.setattr(backend_ort, "available_memory", lambda: 1)
    result = CliRunner().invoke(main, ["run", str(fp32_slots), "--max-new-tokens", "1", model.decode(ids)])
    assert result.exit_code != 0 and "read whole" in result.output and "Traceback" not in result.output


def test_available_memory_reads_meminfo():
    free = backend_ort.available_memory()
    assert free is None or 0 < free < 2**50


def test_inspect_shows_an_end_prompt_s_peak(fp32_slots):
    """`edgec inspect` says what a prompt as long as the context holds while it is read (the runtime's own sizes);
    nothing for `chunk` prompts, a cache with a slot per token, or a record it cannot read."""
    import json

    from click.testing import CliRunner

    from edgec.cli import _end_prompt_bytes, main

    result = CliRunner().invoke(main, ["inspect", str(fp32_slots)])
    needed = Model.load(fp32_slots).cache_spec.with_capacity(128).compressed_bytes()
    assert result.exit_code == 0
    assert (
        f"a prompt of 128 tokens is read whole first (prefill-compress end): {needed / 2**20:,.1f} MiB" in result.output
    )
    cache = json.loads((fp32_slots / "manifest.json").read_text())["cache"]
    assert _end_prompt_bytes(cache, 128) == needed
    assert (
        _end_prompt_bytes({**cache, "compression": {**cache["compression"], "prefill_compress": "chunk"}}, 128) is None
    )
    assert _end_prompt_bytes(cache, 40) is None  # a slot for every token
    assert _end_prompt_bytes({**cache, "layers": [{"layer": "x"}]}, 128) is None


def test_a_windowed_model_s_prompt_state_holds_its_compressed_layers_alone(tiny_gemma3, tmp_path, monkeypatch):
    """Gemma's sliding-window rings are not compressed and keep their own buffers through an `end` prompt: the
    temporary state holds the global layer alone, and ``session_bytes`` (what ``edgec serve`` admits by) prices
    exactly what the runtime allocates for it — before, it priced the rings again at the prompt's length."""
    out = tmp_path / "gemma3.kv.edgec"
    build(tiny_gemma3[0], out, build_settings(target="cpu", context=96, prefill_chunk=16, kv_capacity=40, kv_window=8))
    model = Model.load(out)
    assert [layer.compressed for layer in model.cache_spec.layers] == [False, False, True, False]
    allocated = record_temporary_states(monkeypatch)
    ids = np.random.default_rng(2).integers(0, model.vocab_size, 60).tolist()
    model.next_token_logits(ids)
    assert allocated == [model.session_bytes(prompt_tokens=60) - model.session_bytes()]
    global_layer = model.cache_spec.layers[2]
    # fp32 k and v with the kernel's spare row, fp32 scores, int64 positions
    assert allocated[0] == global_layer.num_kv_heads * (61 * 2 * global_layer.head_dim * 4 + 60 * (4 + 8))
    assert model.session_bytes(prompt_tokens=40) == model.session_bytes()  # fits the slots: read in place
    state = model._idle[-1].arrays()  # the rings read the prompt in their own buffers: its last 32 tokens
    for layer in (0, 1, 3):
        assert state[f"cache.{layer}.pos"].max() == 59 and (state[f"cache.{layer}.pos"] >= 0).sum() == 32
    assert (state["cache.2.pos"] >= 0).sum() == 40


def _prompt_session_ops(bundle, monkeypatch, tmp_path, ids) -> list[str]:
    """The op types ONNX Runtime ran in the prompt-chunk session, in its order (its profiler on)."""
    import json

    import onnxruntime as ort

    class Profiling(ort.SessionOptions):
        def __init__(self) -> None:
            super().__init__()
            self.enable_profiling = True
            self.profile_file_prefix = str(tmp_path / "prompt")

    monkeypatch.setattr(backend_ort.ort, "SessionOptions", Profiling)
    model = Model.load(bundle)
    model.generate(ids, max_new_tokens=1)
    events = json.loads(Path(model._backend.prefill.session.end_profiling()).read_text())
    return [e["args"]["op_name"] for e in events if e.get("cat") == "Node" and "op_name" in e.get("args", {})]


def _assert_same_answers(model: Model, other: Model, ids: list[int]) -> None:
    """Two loads of one bundle read ``ids`` into the same state with the same logits, and generate the same tokens."""
    states = [one._backend.open_state() for one in (model, other)]
    logits = [model._prefill(state, np.asarray(ids), all_logits=False) for state in states]
    np.testing.assert_array_equal(logits[0], logits[1])
    arrays = [state.arrays() for state in states]
    assert all(np.array_equal(arrays[0][name], arrays[1][name]) for name in arrays[0])
    assert model.generate(ids, max_new_tokens=8) == other.generate(ids, max_new_tokens=8)


def test_an_fp32_slot_prompt_writes_each_layer_s_state_before_the_next_layer(fp32_slots, monkeypatch, tmp_path):
    """Over fp32 slots the prompt-chunk session runs in ONNX Runtime's priority-based order, in which each layer
    writes its new k/v rows (the ScatterND after the op's branches) right after its attention — in the default
    order every layer's rows waited for the last layer, alive through the whole chunk (SmolLM2 8K: 219 → 155 MiB
    of working memory a chunk, docs/BENCHMARKS.md). Same state and tokens as in the default order."""
    model = Model.load(fp32_slots)
    assert backend_ort.prompt_order_by_priority(model.cache_spec)
    session = model._backend.prefill.session
    assert session.get_session_options().execution_order == backend_ort.ort.ExecutionOrder.PRIORITY_BASED
    ids = model.encode(pydoc_text()[:3000])[:100]  # longer than the 40 slots: an `end` prompt, 16-token chunks
    ops = _prompt_session_ops(fp32_slots, monkeypatch, tmp_path, ids)
    attention = [i for i, op in enumerate(ops) if op == "GroupQueryAttention"]
    assert len(attention) == 7 * len(model.cache_spec.layers)  # 100 tokens: 7 chunks
    # the state writes after each layer's attention, up to the next layer's (or the end): the same for every
    # layer; in the default order the first layer's waited for the last ([2, 6, 2, 6, ...] here)
    writes = [ops[a:b].count("ScatterND") for a, b in zip(attention, [*attention[1:], len(ops)], strict=True)]
    assert writes[0] >= 2 and set(writes) == {writes[0]}, writes
    monkeypatch.setattr(backend_ort, "prompt_order_by_priority", lambda spec: False)
    default = Model.load(fp32_slots)
    assert default._backend.prefill.session.get_session_options().execution_order.name == "DEFAULT"
    _assert_same_answers(model, default, ids)


def test_the_prompt_session_plans_no_memory_pattern_and_answers_as_with_one(fp32_slots, monkeypatch):
    """The prompt-chunk session runs without ONNX Runtime's memory pattern (``PROMPT_MEMORY_PATTERN``: ~15 MB of
    SmolLM2's 8K-prompt peak, docs/BENCHMARKS.md); the one-token session keeps its. With or without it, the same
    state, logits and tokens."""
    model = Model.load(fp32_slots)
    assert model._backend.prefill.session.get_session_options().enable_mem_pattern is False
    assert model._backend.graph.session.get_session_options().enable_mem_pattern is True
    monkeypatch.setattr(backend_ort, "PROMPT_MEMORY_PATTERN", True)
    patterned = Model.load(fp32_slots)
    assert patterned._backend.prefill.session.get_session_options().enable_mem_pattern is True
    ids = model.encode(pydoc_text()[:3000])[:100]  # an `end` prompt of 7 chunks, then steps over the 40 slots
    _assert_same_answers(model, patterned, ids)


@pytest.mark.parametrize(
    "policy,prefill", [("h2o", "end"), ("tova", "end"), ("streaming", "end"), ("adaptive", "end"), ("snapkv", "chunk")]
)
def test_every_policy_reads_its_state_before_the_priority_order_writes_it(
    tiny_llama, tmp_path, monkeypatch, policy, prefill
):
    """The state outputs are bound to the state inputs' buffers (written in place), so a node reading an input
    after the writer ran would read the chunk's own writes. ONNX Runtime's default order ran every write after the
    last layer; in priority order each layer writes right after its attention. For every policy and both prompt
    modes the state and logits are the default order's, protected tokens included."""
    out = tmp_path / f"{policy}-{prefill}.edgec"
    build(tiny_llama, out, build_settings(**KV, kv_policy=policy, prefill_compress=prefill))
    model = Model.load(out)
    assert model._backend.prefill.session.get_session_options().execution_order.name == "PRIORITY_BASED"
    ids = np.asarray(model.encode(pydoc_text()[:3000])[:100])
    flags = np.zeros(len(ids), bool)
    flags[10:14] = True  # never evicted
    monkeypatch.setattr(backend_ort, "prompt_order_by_priority", lambda spec: False)
    default = Model.load(out)
    runs = []
    for one in (model, default):
        state = one._backend.open_state()
        logits = one._prefill(state, ids, all_logits=True, flags=flags)
        steps = [state.run(np.array([token]), len(ids) + i, True)[-1].copy() for i, token in enumerate(ids[:3])]
        runs.append((logits, np.stack(steps), state.arrays()))
    np.testing.assert_array_equal(runs[0][0], runs[1][0])
    np.testing.assert_array_equal(runs[0][1], runs[1][1])
    for name, value in runs[0][2].items():
        np.testing.assert_array_equal(value, runs[1][2][name], err_msg=name)


def test_int8_slots_and_plain_prompts_keep_onnx_runtime_s_default_order(tiny_llama, tiny_bundle, tmp_path):
    """Priority order dequantizes every layer's int8 past at the start of a chunk (those nodes need only the
    state): SmolLM2 8K 225 → 533 MiB. Int8 slots and uncompressed caches keep the default order."""
    out = tmp_path / "int8.edgec"
    build(tiny_llama, out, build_settings(**{**KV, "kv_dtype": "int8", "kv_group": 16}))
    for bundle in (out, tiny_bundle):
        model = Model.load(bundle)
        assert not backend_ort.prompt_order_by_priority(model.cache_spec)
        for graph in (model._backend.graph, model._backend.prefill):
            if graph is not None:
                assert graph.session.get_session_options().execution_order.name == "DEFAULT"


@pytest.mark.parametrize(("dtype", "mixed"), [("fp32", "none"), ("int8", "none"), ("int4", "int8"), ("fp8", "fp16")])
def test_fresh_state_arrays_hold_one_value_throughout(dtype, mixed):
    """``_own_mapping`` reads a fresh state array's first value alone (a scan of the zeros faulted in every page of
    a long prompt's k/v): every array ``CacheSpec.empty_layer`` makes must be that value throughout."""
    from edgec.kvcache.compression import Compression
    from edgec.kvcache.spec import CacheSpec, LayerCache, compressed_state

    compression = Compression(capacity=40, dtype=dtype, mixed=mixed, window=8, sink=4)
    layers = (
        LayerCache(0, 2, 16, 40, compressed=True, state=compressed_state(compression)),
        LayerCache(1, 2, 16, 64),
    )
    spec = CacheSpec(layers, compression=compression)
    arrays = [array for _, array in spec.empty_state(compressed_slots=96)]
    assert sum(array.size for array in arrays) > 0
    for array in (array for array in arrays if array.size):
        copy = backend_ort._own_mapping(array)
        np.testing.assert_array_equal(copy, array)
        assert (array == array.reshape(-1)[0]).all()
