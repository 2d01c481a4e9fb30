"""ONNX Runtime backend: one session, cache state kept in place between steps with IO binding.

Every cache output is bound to the very buffer of its input. That is correct because inside KVAttention the
cache inputs feed only ScatterElements, which ONNX Runtime updates in place when input and output share a
buffer (and so does GroupQueryAttention's shared past/present buffer, where the cpu target lowers to it); in
CompressedKVAttention every reader of a state input is an ancestor of the scatter that writes it.
tests/kvcache/test_function.py and test_compressed.py check each against separate buffers.

A decode step (one token) touches no Python allocation: the token, its position, its protect flag and the
logits live in numpy buffers bound once; a step writes a few numbers and reads the logits buffer.

A compressed cache whose settings say ``prefill_compress = end`` reads a prompt longer than its capacity into
a larger, temporary state (the graph's slot count is symbolic) and then keeps the best ``capacity`` slots
per head (``reference.select_slots``) — once per prompt, not per token.

Prompt chunks run on a graph of their own where the bundle has one (``prefill.onnx``), and those that only extend
the slots on ``extend.onnx`` where it has that (``PromptGraphs``; ``edgec.extend_graph``).

On a GPU provider (CUDA) the state lives in device memory (``StateDevice``): a step copies only the tokens in and
the logits out, never the cache; resetting, reading and compacting the state go through the same OrtValues.

Static-shape bundles (the CANN targets) hold two graphs over one weights file: ``model.onnx`` takes a chunk of
exactly ``static_tokens`` tokens, ``decode.onnx`` one token. ``StaticOrtStep`` pads every chunk with tokens at
position -1 (the graph makes them write nothing) and binds one set of cache buffers to both sessions.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import io
import logging
import mmap
import os
import threading
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import onnxruntime as ort

from edgec import onnx_scan
from edgec.errors import BundleError, GenerationError, one_line, runtime_load_error
from edgec.kvcache.reference import select_slots
from edgec.kvcache.spec import OBSERVE_INPUT, POSITIONS, PROTECT_INPUT, CacheSpec, StateTensor, present_name
from edgec.runtime import page_out, shared_weights
from edgec.runtime.observe import PromptObservation
from edgec.runtime.prompt_room import check_prompt_room

StateEntry = tuple[StateTensor, ort.OrtValue]  # a state tensor and the buffer holding it (host or device)
GPU_PROVIDERS = {"CUDAExecutionProvider": "cuda"}  # providers whose cache state lives in device memory


class StateDevice(NamedTuple):
    """Where a graph's cache state lives: ``cpu``, or a GPU provider's device (``cuda``, device id)."""

    kind: str = "cpu"
    index: int = 0

    @classmethod
    def for_providers(cls, providers: list[str], provider_options: dict[str, dict[str, str]] | None) -> StateDevice:
        kind = GPU_PROVIDERS.get(providers[0])
        if kind is None:
            return cls()
        device_id = (provider_options or {}).get(providers[0], {}).get("device_id", "0")
        return cls(kind, int(device_id) if str(device_id).isdigit() else 0)


def session_options(
    threads: int | None,
    spin: bool | None = None,
    initializers: dict[str, ort.OrtValue] | None = None,
    prepack: bool = True,
    priority_order: bool = False,
    memory_pattern: bool = True,
    record_assignment: bool = False,
) -> ort.SessionOptions:
    """``spin`` None: chosen by ``allow_spinning``; True/False as given (a calibration's measured choice).
    ``initializers``: weights the session uses where they lie instead of loading its own (``shared_weights``);
    ``prepack`` False: it packs no weight into a form of its own; ``priority_order``: ONNX Runtime's
    priority-based node order instead of its default (``prompt_order_by_priority``); ``memory_pattern`` False:
    no ONNX Runtime memory pattern (``PROMPT_MEMORY_PATTERN``); ``record_assignment``: ONNX Runtime records which
    provider took each node (``cpu_fallback_note`` reads it) — only worth it where a GPU provider comes first: the
    record costs memory for the session's life (SmolLM2's 1,024-fp32-slot extend graph: +2 MB)."""
    options = ort.SessionOptions()
    if priority_order:
        options.execution_order = ort.ExecutionOrder.PRIORITY_BASED
    options.enable_mem_pattern = memory_pattern
    for name, value in (initializers or {}).items():
        options.add_initializer(name, value)
    if not prepack:
        options.add_session_config_entry(*shared_weights.PREPACKING_OFF)
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if record_assignment:
        options.add_session_config_entry("session.record_ep_graph_assignment_info", "1")
    spin = allow_spinning(threads) if spin is None else spin
    options.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin else "0")
    if threads:
        options.intra_op_num_threads = threads
    return options


def allow_spinning(threads: int | None, load: float | None = None, cpus: int | None = None) -> bool:
    """Whether ONNX Runtime's pool threads should spin between nodes, chosen from what the machine is doing when
    the bundle loads. Spinning pays only where every pool thread has a core to itself: on an idle machine it is
    what makes 2 threads pay (int4 decode 0.97× onnxruntime-genai spinning, 0.66× not), while on a machine running
    other work a spinning pool waits on a descheduled thread at every one of a step's ~1,000 small nodes (2×
    slower there; docs/BENCHMARKS.md, "threads"). So: spin iff the other work running now (``busy_elsewhere``)
    plus the pool's threads fit the cores this process may use. ``EDGEC_ORT_SPIN=0|1`` still forces it."""
    forced = os.environ.get("EDGEC_ORT_SPIN")
    if forced in ("0", "1"):
        return forced == "1"
    cpus = cpus if cpus is not None else len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
    pool = threads or cpus  # ONNX Runtime's default: one thread per core
    if pool <= 1:
        return False  # no pool threads to spin
    load = busy_elsewhere() if load is None else load
    return load + pool <= cpus + 0.5


def busy_elsewhere(samples: int = 5, interval: float = 0.002) -> float:
    """How many threads of other programs are running now: the kernel's count of runnable threads
    (/proc/loadavg), less this one, averaged over ``samples`` looks (~0.01 s in all). Unlike the load
    average it does not remember this program's own work of the last minutes. 0 where there is no /proc."""
    import time

    counts = []
    for _ in range(samples):
        try:
            running = Path("/proc/loadavg").read_text().split()[3].split("/")[0]
        except (OSError, IndexError):
            return 0.0
        counts.append(max(int(running) - 1, 0))
        time.sleep(interval)
    return sum(counts) / len(counts)


class OrtGraph:
    """One ONNX Runtime session over a step graph, checked against the cache spec it must carry."""

    def __init__(
        self,
        model_path: Path,
        spec: CacheSpec,
        providers: list[str],
        threads: int | None,
        provider_options: dict[str, dict[str, str]] | None,
        exact: bool,
        spin: bool | None = None,
        initializers: dict[str, ort.OrtValue] | None = None,
        prepack: bool = True,
        priority_order: bool = False,
        memory_pattern: bool = True,
    ) -> None:
        """``initializers`` / ``prepack`` / ``priority_order`` / ``memory_pattern``: as ``session_options`` takes
        them (the session keeps the initializers)."""
        per_provider = [(provider_options or {}).get(name, {}) for name in providers]
        self.device = StateDevice.for_providers(providers, provider_options)
        if providers[0] == "CUDAExecutionProvider":
            check_cuda_can_start()
        record = providers[0] != "CPUExecutionProvider"  # what cpu_fallback_note reads
        options = session_options(threads, spin, initializers, prepack, priority_order, memory_pattern, record)
        self.session = ort.InferenceSession(
            str(model_path), options, providers=providers, provider_options=per_provider
        )
        self.shared = initializers or {}  # ONNX Runtime reads these buffers for the session's whole life
        if providers[0] not in self.session.get_providers():  # ONNX Runtime logs why, then runs on the CPU
            raise BundleError(
                f"ONNX Runtime could not start its {providers[0]} here (its own message above says why); "
                "this bundle does not run on the CPU instead"
            )
        if note := cpu_fallback_note(self.session, providers[0], model_path.name):
            logging.getLogger("edgec.runtime").warning(note)  # shown by default; an embedding program may route it
        inputs = {value.name for value in self.session.get_inputs()}
        outputs = {value.name for value in self.session.get_outputs()}
        if not exact:  # a format-v1 manifest: its state is what the graph has (v1 recorded it only in part)
            spec = spec.keeping(inputs)
        if problem := spec.mismatch(inputs, outputs):
            raise BundleError(f"{model_path.name} does not carry the cache state its manifest names ({problem})")
        self.spec = spec
        self.observes = OBSERVE_INPUT in inputs  # graphs built before the input existed always observe
        self.presents = _kernel_presents(outputs, spec)  # state input → the kernel's present bound beside it
        logits_type = next(o.type for o in self.session.get_outputs() if o.name == "logits")
        self.logits_dtype = np.float16 if logits_type == "tensor(float16)" else np.float32


def _allocate(
    spec: CacheSpec,
    device: StateDevice,
    compressed_slots: int | None = None,
    temporary: bool = False,
    compressed_only: bool = False,
) -> list[StateEntry]:
    """Fresh state on ``device`` (a GPU copy is made once here; steps then update it in place there).
    ``temporary`` (a long prompt's state, dropped when the prompt ends); ``compressed_only``: the compressed layers'
    tensors alone (the others keep their buffers through a prompt). On the CPU:
    - the compressed layers' slots are host buffers of their own mappings (``_own_mapping``), so that their zeros
      stay untouched — not resident — until written. From the heap they came as recycled pages, resident from the
      start, and an `end` prompt writes them only at its end: 13–47 MB of SmolLM2's 8K-prompt peak, run to run;
    - a temporary state is numpy's, from the C allocator, as a plain cache is: it fills the heap pages that loading
      freed (~35 MiB of SmolLM2's 8K-prompt peak; in mappings of its own it could not), and each buffer's pages go
      back to the system the moment it is dropped (``_heap_buffer``), not kept by the allocator for reuse
      (docs/BENCHMARKS.md, thirty-sixth round)."""
    compressed = {layer.layer for layer in spec.layers if layer.compressed}

    def value(tensor: StateTensor, array: np.ndarray) -> ort.OrtValue:
        if device.kind == "cpu" and temporary:
            array = _heap_buffer(array)
        elif device.kind == "cpu" and tensor.layer in compressed:
            array = _own_mapping(array)
        return ort.OrtValue.ortvalue_from_numpy(array, device.kind, device.index)

    return [(tensor, value(tensor, array)) for tensor, array in spec.empty_state(compressed_slots, compressed_only)]


def available_memory() -> int | None:
    """Bytes the system can give without swapping (/proc/meminfo's MemAvailable); None where it cannot say."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _check_room(spec: CacheSpec, length: int) -> None:
    """Host memory for an `end` prompt's temporary state (edgec/runtime/prompt_room.py)."""
    check_prompt_room(length, spec.end_prompt_bytes(length), available_memory(), "this machine has available")


def _own_mapping(array: np.ndarray) -> np.ndarray:
    """``array`` copied into an anonymous mapping of its own, whose pages are faulted in only as they are written
    and go back to the system the moment the array is freed."""
    if array.nbytes == 0:
        return array
    copy = np.frombuffer(mmap.mmap(-1, array.nbytes), array.dtype).reshape(array.shape)
    # a fresh state array holds one value throughout (CacheSpec.empty_layer: zeros, positions -1), and the mapping
    # starts zero-filled: untouched pages cost nothing until the prompt writes them. Only the first value is read —
    # scanning the zeros for a non-zero one (``array.any()``) faulted in every page of SmolLM2's 8K-token k/v: 46 ms
    fill = array.reshape(-1)[0]
    if fill:
        copy.fill(fill)
    return copy


def _heap_buffer(array: np.ndarray) -> np.ndarray:
    """``array`` itself (numpy's memory, from the C allocator), set to give its pages back to the system when it is
    freed (``_give_back_pages``, run by a finalizer before numpy frees the block). A freed heap block otherwise
    stays resident with the allocator for reuse: an `end` prompt's temporary state (the whole prompt's k/v) stayed
    resident after the prompt, 0.44 GB of SmolLM2's process after 8,000 tokens (the sixteenth round). Only an
    array that owns its memory: a view's pages are its base's, still in use."""
    if array.flags.owndata and array.nbytes >= 2 * mmap.PAGESIZE:
        weakref.finalize(array, _give_back_pages, array.ctypes.data, array.nbytes).atexit = False
    return array


def _give_back_pages(address: int, size: int) -> bool:
    """``madvise(MADV_DONTNEED)`` over the whole pages inside a private buffer about to be freed: the system takes
    them back (read again they would be zeros) and the allocator keeps the address range for its next block. The
    partial pages at either end are left: the allocator's own bookkeeping may share them. False where the system
    does not offer it."""
    advice = getattr(mmap, "MADV_DONTNEED", None)
    low = -(-address // mmap.PAGESIZE) * mmap.PAGESIZE
    high = (address + size) // mmap.PAGESIZE * mmap.PAGESIZE
    if advice is None or high <= low or (madvise := page_out.madvise()) is None:
        return False
    return madvise(low, high - low, advice) == 0


def _release_pages(value: ort.OrtValue) -> bool:
    """Give the pages of a host buffer made by ``_own_mapping`` back to the system, keeping its address (bindings to
    it stay valid); it reads as zeros afterwards. ``MADV_REMOVE``: those mappings are shared anonymous ones, whose
    pages ``MADV_DONTNEED`` would leave resident. False where the system does not offer it (nothing changes)."""
    advice = getattr(mmap, "MADV_REMOVE", None)  # Linux
    size = value.numpy().nbytes
    if advice is None or size == 0 or (madvise := page_out.madvise()) is None:
        return False
    return madvise(value.data_ptr(), size, advice) == 0


def _kernel_presents(outputs: set[str], spec: CacheSpec) -> dict[str, str]:
    """State input → the graph output bound to its buffer beside ``new_…``: GroupQueryAttention's present of a
    compressed layer's k/v — in a decode graph built with ``decode_kernel`` gqa (``expose_decode_present``), or
    in a prompt-chunk graph over fp32 slots (``expose_chunk_present``); none for other graphs."""
    if spec.compression is None:
        return {}
    presents = {}
    for layer in spec.layers:
        for name in ("k", "v") if layer.compressed else ():
            if (present := present_name(layer.layer, name)) in outputs:
                presents[StateTensor(layer.layer, name).input] = present
    return presents


def _rows_of(selected: np.ndarray, shape: list[int]) -> np.ndarray:
    """A selected state tensor in its buffer's shape: k/v buffers may carry spare rows after the slots
    (``Compression.spare_rows``), which keep zeros (never read: the kernel writes the token there first)."""
    if list(selected.shape) == list(shape):
        return np.ascontiguousarray(selected)
    padded = np.zeros(shape, selected.dtype)
    padded[:, :, : selected.shape[2]] = selected
    return padded


def _state_bytes(spec: CacheSpec, prompt_tokens: int, vocab_size: int) -> int:
    """One buffer per state tensor, updated in place (the temporary `end` prompt state likewise), and the logits
    row a decode step returns."""
    return spec.total_bytes() + spec.end_prompt_bytes(prompt_tokens) + 4 * vocab_size


class PromptGraphs:
    """A bundle's prompt-chunk graphs: the general one (``prefill.onnx``: any multi-token call) and, where the
    bundle has it, the extend graph (``extend.onnx``, ``edgec.extend_graph``: calls that only extend the slots).
    With an extend graph, only it is opened at load; the general one opens at the first call that needs it and
    from then on runs every call, the extend graph dropped (one prompt-chunk session resident at a time: each packs
    its own copy of the 4-bit weights). ``open_general``: opens the general graph (an ``OrtGraph``)."""

    def __init__(self, open_general: Callable[[], OrtGraph], extend: OrtGraph | None = None) -> None:
        self._open_general = open_general
        self._general: OrtGraph | None = None
        self.extend = extend
        self._lock = threading.Lock()  # served streams share one backend: the general graph opens once
        if extend is None:
            self.general()

    @property
    def opened_general(self) -> bool:
        return self._general is not None

    def general(self) -> OrtGraph:
        """The general graph, opened now if it was not. The extend graph is dropped first, so that the general
        session is built in the memory the extend session held rather than beside it (SmolLM2, 1,024 fp32 slots:
        the process's peak at that call 0.95 GiB the other way round, 0.66 when it was never opened)."""
        with self._lock:
            if self._general is None:
                self.extend = None
                self._general = self._open_general()
            return self._general

    def for_call(self, extends: bool) -> OrtGraph:
        """The graph a multi-token call runs on: the extend graph where it has one and ``extends`` (the call only
        extends the slots, ``OrtCacheState._extends``), else the general one. (No reference to the extend graph
        is held here while the general one opens.)"""
        if extends and self.extend is not None:
            return self.extend
        return self.general()


class OrtBackend:
    """A dynamic-shape bundle: one session (more where the bundle has prompt-chunk graphs, ``prompts``: then
    multi-token steps run on them); each cache state binds its own buffers to them."""

    def __init__(self, graph: OrtGraph, vocab_size: int, max_tokens: int, prompts: PromptGraphs | None = None) -> None:
        self.graph, self.spec, self.vocab_size, self.max_tokens = graph, graph.spec, vocab_size, max_tokens
        self.prompts = prompts
        self.no_logits_rows = False  # the graphs take an empty logits_index (the manifest's model.no_logits_rows)
        if self.spec.compression is not None and self.spec.compression.recall:
            from edgec.runtime.recall_state import check_recall_graph

            check_recall_graph(graph, self.spec)

    @property
    def providers(self) -> list[str]:
        return self.graph.session.get_providers()

    @property
    def prefill(self) -> OrtGraph | None:
        """The prompt-chunk graph a prompt's chunks run on now: the extend graph while there is one, else the
        general one (None: the bundle has neither; multi-token steps run on ``graph``)."""
        if self.prompts is None:
            return None
        return self.prompts.extend or self.prompts.general()

    def state_bytes(self, spec: CacheSpec, prompt_tokens: int = 0) -> int:
        return _state_bytes(spec, prompt_tokens, self.vocab_size)

    def device_memory(self) -> tuple[int, int] | None:
        return _device_memory(self.graph.device)

    def open_state(self, kv_capacity: int | None = None) -> OrtCacheState:
        """A new state; ``kv_capacity``: a compressed cache's slot count for this state alone (the graph takes
        any), e.g. a smaller one for a served session when memory is short."""
        spec = self.spec.with_capacity(kv_capacity) if kv_capacity is not None else None
        if self.spec.compression is not None and self.spec.compression.recall:  # the hierarchical cache
            from edgec.runtime.recall_state import RecallCacheState

            return RecallCacheState(self.graph, self.vocab_size, spec=spec, prompts=self.prompts)
        state = OrtCacheState(self.graph, self.vocab_size, spec=spec, prompts=self.prompts)
        state.no_logits_rows = self.no_logits_rows
        return state

    def close(self) -> None:
        """Nothing to keep: ONNX Runtime frees the session with the last reference."""


NO_ROWS = np.zeros(0, np.int64)  # a logits_index asking for no rows (read-only: never written)
NO_ROWS.flags.writeable = False


class OrtCacheState:
    """One cache state on a session: tokens at explicit positions in, logits out, state updated in place."""

    no_logits_rows = False  # set by OrtBackend.open_state from the manifest (``feed``)

    def __init__(
        self,
        graph: OrtGraph,
        vocab_size: int,
        shared_state: list[StateEntry] | None = None,
        spec: CacheSpec | None = None,
        prompts: PromptGraphs | None = None,
    ) -> None:
        self.graph = graph
        self.session = graph.session
        self._prompts = prompts  # the graphs multi-token steps run on (None: this one)
        self.spec = spec or graph.spec  # a compressed cache's slot count may differ per state (open_state)
        self.compression = self.spec.compression
        self._protected = self.spec.protected
        self._observation = PromptObservation()
        # a second graph over the same cache (static-shape bundles) binds the same buffers
        self._state = shared_state if shared_state is not None else _allocate(self.spec, graph.device)
        self._active = self._state  # the state multi-token steps run on (a larger one while reading a prompt)
        # one-token step buffers, bound once
        self._token = np.zeros((1, 1), np.int64)
        self._position = np.zeros((1, 1), np.int64)
        self._last = np.zeros(1, np.int64)
        self._protect_one = np.zeros((1, 1), bool)
        self._observe_one = np.ones(1, bool)  # one token always observes
        self._logits_dtype = graph.logits_dtype
        self._logits = np.zeros((1, 1, vocab_size), self._logits_dtype)
        # tokens written into the state multi-token steps run on since it was last empty (None: not known). The
        # filled slots never reach past it (each call fills at most its T tokens' slots, lowest empty first), so
        # while it plus a call's T fits the k/v buffer, the chunk kernel's write lands in empty rows and its present
        # may be bound to the buffer (_binding); else it is left to a fresh tensor
        self._fed: int | None = 0
        # the newest position written since the state was last empty (-1: none yet), which an extending call's
        # positions must follow (_extends); None exactly when ``_fed`` is (set together everywhere)
        self._newest: int | None = -1
        # the compressed layers: their slots bound an extending call (a sliding-window ring is not the op's), and an
        # `end` prompt's temporary state holds them alone
        self._compressed_layers = frozenset(layer.layer for layer in self.spec.layers if layer.compressed)
        self._decode = self._binding(
            self._state, self._token, self._position, self._last, self._protect_one, self._logits, self._observe_one
        )

    def _binding(
        self, state, ids, positions, index, protect, logits, observe, graph=None, presents_in_place: bool = True
    ) -> ort.IOBinding:
        graph = graph or self.graph
        binding = graph.session.io_binding()
        presents = graph.presents if presents_in_place else {}
        for tensor, value in state:
            binding.bind_ortvalue_input(tensor.input, value)
            binding.bind_ortvalue_output(tensor.output, value)
            if tensor.input in presents:  # the kernel's present is the state's own buffer: nothing is copied
                binding.bind_ortvalue_output(presents[tensor.input], value)
        feeds = {"input_ids": ids, "position_ids": positions, "logits_index": index}
        if self._protected:
            feeds[PROTECT_INPUT] = protect
            if graph.observes:
                feeds[OBSERVE_INPUT] = observe
        # the binding holds only the native values: the numpy buffers they wrap must outlive it, so it keeps them
        binding.keep_alive = [*feeds.values(), logits]
        for name, array in feeds.items():
            binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(array))
        binding.bind_ortvalue_output("logits", ort.OrtValue.ortvalue_from_numpy(logits))
        return binding

    def arrays(self) -> dict[str, np.ndarray]:
        return {tensor.input: np.array(value.numpy(), copy=True) for tensor, value in self._state}

    def close(self) -> None:
        """Its buffers (host or device OrtValues) are freed with the last reference."""

    def reset(self) -> None:
        """Empty every slot. Only positions need clearing: an empty slot (pos -1) is masked, never scored or
        kept, and whatever finite values it holds are overwritten when it is filled."""
        self._active = self._state
        self._fed, self._newest = 0, -1
        self._observation.end()
        for tensor, value in self._state:
            if tensor.name in POSITIONS:  # a mixed cache's wide pool has its own
                value.update_inplace(np.full(value.shape(), -1, np.int64))

    def restore(self, arrays: dict[str, np.ndarray]) -> None:
        """Set every state tensor to a saved value (``arrays()``'s names and shapes)."""
        self._active = self._state
        self._fed = self._newest = None  # whatever the saved state holds
        for tensor, value in self._state:
            value.update_inplace(np.ascontiguousarray(arrays[tensor.input]))

    # --- reading a long prompt into a compressed cache ------------------------------------------------------
    def begin_prompt(self, length: int) -> None:
        """Before a prompt of ``length`` tokens: with ``prefill_compress = end`` and a prompt longer than the
        compressed capacity, read it into a temporary state large enough to hold it whole."""
        compression = self.compression
        whole = compression and compression.prefill_compress == "end" and length > compression.capacity
        if whole and self.graph.device.kind == "cpu":
            _check_room(self.spec, length)  # before any of it is written: one line, not the kernel's OOM killer
        self._observation.begin(compression, length)
        if whole:
            # only the compressed layers get larger buffers; the others (sliding-window rings) keep their own
            device = self.graph.device
            try:
                temporary = _allocate(self.spec, device, length, temporary=True, compressed_only=True)
            except Exception as error:  # ONNX Runtime's device allocation failed (host pages were checked above)
                if device.kind == "cpu":
                    raise
                raise GenerationError(
                    f"no {device.kind} memory for a {length}-token prompt's temporary state "
                    f"({self.spec.end_prompt_bytes(length) / 2**30:.2f} GiB; {one_line(error, 200)}): load with "
                    "prefill_compress='chunk' (edgec run --prefill-compress chunk) or give fewer tokens"
                ) from None
            larger = {entry[0]: entry for entry in temporary}
            self._active = [larger.get(entry[0], entry) for entry in self._state]
            self._fed, self._newest = 0, -1
            if device.kind == "cpu":
                # what the slots hold is dead from here (end_prompt rewrites every row of them): their pages go back
                # now, or a second prompt's temporary state is built on top of the first prompt's resident slots
                # (SmolLM2, 1,024 fp32 slots, 8K prompts: +45 MiB at every prompt after the first)
                for tensor, value in self._state:
                    if tensor in larger and tensor.name in ("k", "v"):
                        _release_pages(value)

    def end_prompt(self, newest: int, last_chunk_start: int | None = None) -> None:
        """After the prompt: keep the best ``capacity`` slots of the temporary state in the real one
        (``last_chunk_start``: the first position of the last step, whose scores the op already pooled)."""
        self._observation.end()
        if self._active is self._state:
            return
        temporary: dict[int, list[StateEntry]] = {}
        for tensor, value in self._active:
            if tensor.layer in self._compressed_layers:
                temporary.setdefault(tensor.layer, []).append((tensor, value))
        real: dict[int, list[StateEntry]] = {}
        for tensor, value in self._state:
            real.setdefault(tensor.layer, []).append((tensor, value))
        self._active = self._state
        self._fed = self._newest = None  # the kept slots, up to the capacity
        # a layer at a time, its temporary buffers dropped (their pages given back: _heap_buffer) once its slots are
        # written, so the temporary state and the real one are never resident whole together. The entries must
        # outlive every read: ``OrtValue.numpy()`` is a view that does not keep the buffer (freed, it would read
        # zeros or the allocator's next block)
        for layer in list(temporary):
            entries = temporary.pop(layer)
            state = {tensor.name: value.numpy() for tensor, value in entries}
            kept = select_slots(state, self.compression, newest, self.compression.capacity, last_chunk_start)
            for tensor, value in real[layer]:
                value.update_inplace(_rows_of(kept[tensor.name], value.shape()))
            del state, kept, entries

    def feed(self, ids: np.ndarray, start: int, protect: np.ndarray | None = None) -> None:
        """``run`` for a chunk whose logits nobody reads (a prompt's chunk before its last): where the graph takes
        an empty ``logits_index`` (``no_logits_rows``) it computes none — the lm_head reads its whole weight even
        for one row (Gemma-3-270m: 25–35 ms a chunk); else one row, as ``run`` would."""
        if not self.no_logits_rows or len(ids) < 2:
            self.run(ids, start, last_only=True, protect=protect)
            return
        self.run_positions(ids, np.arange(start, start + len(ids), dtype=np.int64), NO_ROWS, protect)

    def run(self, ids: np.ndarray, start: int, last_only: bool, protect: np.ndarray | None = None) -> np.ndarray:
        count = len(ids)
        if count == 1 and self._active is self._state:
            self._token[0, 0] = ids[0]
            self._position[0, 0] = start
            self._protect_one[0, 0] = bool(protect[0]) if protect is not None else False
            self.session.run_with_iobinding(self._decode)
            if self._fed is not None:
                self._fed += 1
                self._newest = max(self._newest, start)
            return self._logits[0]
        index = np.array([count - 1], np.int64) if last_only else np.arange(count, dtype=np.int64)
        positions = np.arange(start, start + count, dtype=np.int64)
        return self.run_positions(ids, positions, index, protect)

    def run_positions(
        self, ids: np.ndarray, positions: np.ndarray, index: np.ndarray, protect: np.ndarray | None = None
    ) -> np.ndarray:
        """Feed ``ids`` at explicit ``positions`` (-1 = padding, static graphs only); logits [len(index), V]."""
        count = len(ids)
        logits = np.empty((1, len(index), self._logits.shape[-1]), self._logits_dtype)
        flags = np.zeros((1, count), bool) if protect is None else np.asarray(protect, bool).reshape(1, count)
        ids = np.ascontiguousarray(ids, np.int64).reshape(1, count)
        positions = np.ascontiguousarray(positions, np.int64).reshape(1, count)
        index = np.ascontiguousarray(index, np.int64)
        newest = int(positions.max())
        observe = np.array([self._observation.observes(newest)])
        graph = self.graph
        in_place = True  # a decode graph's presents are always the state's (its kernel writes the spare row)
        if count > 1 and self._prompts is not None:
            graph = self._prompts.for_call(self._prompts.extend is not None and self._extends(positions[0]))
            in_place = self._fed is not None and self._fed + count <= self._chunk_rows(graph)
        binding = self._binding(self._active, ids, positions, index, flags, logits, observe, graph, in_place)
        graph.session.run_with_iobinding(binding)
        if self._fed is not None:
            self._fed += count
            self._newest = max(self._newest, newest)
        return logits[0]

    def _chunk_rows(self, graph: OrtGraph) -> int:
        """The fewest rows of the k/v buffers whose chunk-kernel presents ``graph`` exposes, in the state
        multi-token steps run on (0 when it exposes none)."""
        presents = graph.presents
        return min((value.shape()[2] for tensor, value in self._active if tensor.input in presents), default=0)

    def _extends(self, positions: np.ndarray) -> bool:
        """Whether a call at ``positions`` (more than one) only extends the slots, as the extend graph requires
        (``edgec.extend_graph``): its tokens fit the slots after the ``_fed`` tokens written since the state was
        last empty — so every call since then fitted too, and as each fills the lowest empty slots first, no slot
        below a filled one is empty — and its positions increase and follow every position written (``_newest``).
        A restored state or one whose prompt was selected (``_fed`` None) is never proved."""
        if self._fed is None or positions[0] <= self._newest:
            return False
        slots = min(
            (
                value.shape()[2]
                for tensor, value in self._active
                if tensor.name in POSITIONS and tensor.layer in self._compressed_layers
            ),
            default=0,
        )
        return self._fed + len(positions) <= slots and bool(np.all(positions[1:] > positions[:-1]))


class StaticOrtBackend:
    """A static-shape bundle's two graphs: ``decode`` for one token, ``prefill`` for chunks padded to ``tokens``;
    a cache state binds one set of buffers to both. (Static targets keep an uncompressed cache.)"""

    def __init__(self, prefill: OrtGraph, decode: OrtGraph, vocab_size: int, tokens: int) -> None:
        self.prefill, self.decode, self.vocab_size, self.max_tokens = prefill, decode, vocab_size, tokens
        self.spec = prefill.spec

    @property
    def providers(self) -> list[str]:
        return self.prefill.session.get_providers()

    def state_bytes(self, spec: CacheSpec, prompt_tokens: int = 0) -> int:
        return _state_bytes(spec, prompt_tokens, self.vocab_size)

    def device_memory(self) -> tuple[int, int] | None:
        return _device_memory(self.prefill.device)

    def open_state(self) -> StaticOrtCacheState:
        prefill = OrtCacheState(self.prefill, self.vocab_size)
        decode = OrtCacheState(self.decode, self.vocab_size, shared_state=prefill._state)
        return StaticOrtCacheState(prefill, decode, self.max_tokens)

    def close(self) -> None:
        """Nothing to keep: ONNX Runtime frees the sessions with the last reference."""


class StaticOrtCacheState:
    def __init__(self, prefill: OrtCacheState, decode: OrtCacheState, tokens: int) -> None:
        self.prefill, self.decode, self.tokens = prefill, decode, tokens

    def arrays(self) -> dict[str, np.ndarray]:
        return self.decode.arrays()

    def close(self) -> None:
        """Host buffers: freed with the last reference."""

    def reset(self) -> None:
        self.decode.reset()  # the cache buffers are shared: one reset empties both

    def restore(self, arrays: dict[str, np.ndarray]) -> None:
        self.decode.restore(arrays)  # shared buffers, as for reset

    def begin_prompt(self, length: int) -> None:
        pass

    def end_prompt(self, newest: int, last_chunk_start: int | None = None) -> None:
        pass

    def run(self, ids: np.ndarray, start: int, last_only: bool, protect: np.ndarray | None = None) -> np.ndarray:
        if len(ids) == 1:
            return self.decode.run(ids, start, last_only)
        pieces = []
        for offset in range(0, len(ids), self.tokens):
            real = ids[offset : offset + self.tokens]
            count = len(real)
            padded = np.zeros(self.tokens, np.int64)
            padded[:count] = real
            positions = np.full(self.tokens, -1, np.int64)
            positions[:count] = np.arange(start + offset, start + offset + count)
            # every row's logits are computed (the graph's shape is fixed); pads repeat the last real row
            index = np.minimum(np.arange(self.tokens, dtype=np.int64), count - 1)
            pieces.append(self.prefill.run_positions(padded, positions, index)[:count])
        logits = np.concatenate(pieces)
        return logits[-1:] if last_only else logits


# ONNX Runtime's memory pattern for a prompt-chunk graph on the CPU: off. A pattern (one block for a run's
# intermediates, planned from an earlier run of the same input shapes) buys a prompt chunk nothing — its
# intermediates' sizes change with the past it attends to — and keeps ~15 MB more resident: SmolLM2 int4, 8K prompt,
# 2 threads, peak 0.998 → 0.984 GiB with 1,024 fp32 slots and 0.870 → 0.853 with the plain cache, the prompt's time
# unchanged (docs/BENCHMARKS.md, twenty-sixth round). A one-token step keeps it (the same shapes every step), and so
# does a GPU session (not measured there).
PROMPT_MEMORY_PATTERN = False


def prompt_order_by_priority(spec: CacheSpec) -> bool:
    """Whether a prompt-chunk graph runs in ONNX Runtime's priority-based node order: over fp32 slots read in place
    (``decode_kernel`` gqa). Its default order (a walk back from the graph's outputs) writes every layer's new k/v
    rows into the state only after the last layer, so each layer's rows and slot indices stay alive through the
    whole chunk; in priority order each layer writes its rows right after its attention. SmolLM2 int4, 1,024 fp32
    slots, 8K prompt: the prompt session's working memory 219 → 155 MiB a chunk (the plain bundle's: 166), its
    arena 346 → 218 MiB, the process's peak ~0.06 GiB lower, prompt time unchanged. Not for int8 slots: there it
    dequantizes every layer's past at the start of the chunk (those nodes need only the state), 225 → 533 MiB
    (docs/BENCHMARKS.md, eighteenth round)."""
    compression = spec.compression
    return compression is not None and compression.decode_kernel == "gqa"


def open_backend(
    folder: Path,
    model: dict[str, Any],
    spec: CacheSpec,
    prefill_chunk: int,
    providers: list[str],
    provider_options: dict[str, dict[str, str]] | None = None,
    threads: int | None = None,
    exact: bool = True,
    spin: bool | None = None,
    prompt_threads: int | None = None,
    prompt_spin: bool | None = None,
    scans: dict | None = None,
) -> OrtBackend | StaticOrtBackend:
    """The backend for a bundle's ``model`` section (its manifest entry): one dynamic graph, or two static ones.
    ``exact``: the spec names every state tensor the graph has (format v2); False narrows it to the graph's.
    ``prompt_threads`` / ``prompt_spin``: the prompt-chunk graph's own setting (``prefill_file``), where it has
    one; by default the decode graph's. ``scans``: the graph files as ``open_bundle`` read them (else read here)."""
    vocab = int(model["vocab_size"])
    on_cpu = providers[0] == "CPUExecutionProvider"
    shared = {}
    prompt_files = [model[key] for key in ("prefill_file", "extend_file") if key in model]
    if prompt_files and "decode_file" not in model and on_cpu:
        arrays = shared_weights.shared_weights(folder, [model["file"], *prompt_files], scans)
        shared = {name: ort.OrtValue.ortvalue_from_numpy(array) for name, array in arrays.items()}
    graph_files = [model[key] for key in ("file", "prefill_file", "extend_file", "decode_file") if key in model]
    # a quantized bundle's mapped weights, once its kernels packed their own forms: the pages go back (page_out)
    settle = None
    if on_cpu and not shared and _packs_own_forms(folder, graph_files, scans):
        settle = functools.partial(page_out.page_out_mapped_files, folder)
    first = OrtGraph(folder / model["file"], spec, providers, threads, provider_options, exact, spin, shared)
    if "decode_file" not in model:
        prompts = None
        if "prefill_file" in model:
            chunk_threads, chunk_spin = (prompt_threads, prompt_spin) if prompt_threads else (threads, spin)
            prompt_graph = functools.partial(
                OrtGraph,
                spec=spec,
                providers=providers,
                threads=chunk_threads,
                provider_options=provider_options,
                exact=exact,
                spin=chunk_spin,
                initializers=shared,
                prepack=not shared,  # the mapped weights stay unpacked there (shared_weights: why)
                priority_order=prompt_order_by_priority(spec),
                memory_pattern=PROMPT_MEMORY_PATTERN or not on_cpu,
            )
            extend = prompt_graph(folder / model["extend_file"]) if "extend_file" in model else None
            general = functools.partial(_open_general, prompt_graph, folder / model["prefill_file"], settle)
            prompts = PromptGraphs(general, extend)
        if settle is not None:
            settle()
        backend = OrtBackend(first, vocab, prefill_chunk, prompts)
        backend.no_logits_rows = model.get("no_logits_rows") is True
        return backend
    decode = OrtGraph(folder / model["decode_file"], spec, providers, threads, provider_options, exact, spin)
    if settle is not None:
        settle()
    return StaticOrtBackend(first, decode, vocab, int(model["static_tokens"]))


def _packs_own_forms(folder: Path, graph_files: list[str], scans: dict | None) -> bool:
    """Whether any of the bundle's graphs has weights its kernels pack into forms of their own (``page_out``)."""
    read = [(scans or {}).get(name) or onnx_scan.scan(folder / name) for name in graph_files]
    return shared_weights.packs_own_forms(read)


def _open_general(
    prompt_graph: Callable[[Path], OrtGraph], path: Path, settle: Callable[[], Any] | None = None
) -> OrtGraph:
    """The general prompt-chunk graph, opened when the first call needs it (``PromptGraphs``): ONNX Runtime's
    failure there is one line, as at load. ``settle``: run once it is open (``page_out``)."""
    try:
        graph = prompt_graph(path)
        if settle is not None:
            settle()
        return graph
    except MemoryError:
        raise GenerationError(f"no memory left to open {path.name}, the graph this call needs") from None
    except Exception as error:
        if (failure := runtime_load_error(path, error)) is None:
            raise
        raise failure from None


def check_cuda_can_start() -> None:
    """Before ONNX Runtime tries its CUDA provider: one line naming what is missing — no NVIDIA driver or GPU, or a
    CUDA library the provider loads. (ONNX Runtime itself would log a few lines and quietly run on the CPU.) The
    CUDA and cuDNN libraries may come as wheels (onnxruntime-gpu[cuda,cudnn]): ONNX Runtime's ``preload_dlls``
    loads those, and reports each required library it cannot load."""
    if problem := cuda_driver_problem():
        raise BundleError(f"this bundle runs on an NVIDIA GPU (ONNX Runtime's CUDAExecutionProvider): {problem}")
    preload = getattr(ort, "preload_dlls", None)  # onnxruntime-gpu ≥ 1.21
    if preload is None:
        return
    report = io.StringIO()
    with contextlib.redirect_stdout(report):
        preload()
    if failed := [line for line in report.getvalue().splitlines() if line.startswith("Failed to load ")]:
        library = failed[0][len("Failed to load ") :].split(":")[0]
        raise BundleError(
            f"ONNX Runtime's CUDAExecutionProvider needs {library}, which cannot be loaded here "
            f"({len(failed)} CUDA librar{'y' if len(failed) == 1 else 'ies'} missing): install the CUDA and cuDNN "
            f"versions onnxruntime-gpu {ort.__version__} was built for, or pip install 'onnxruntime-gpu[cuda,cudnn]'"
        )


def cuda_driver_problem(load=ctypes.CDLL) -> str | None:
    """None when the NVIDIA driver is present and sees a GPU; otherwise what is wrong, in words."""
    try:
        driver = load("libcuda.so.1")
    except OSError:
        return "no NVIDIA driver here (libcuda.so.1 cannot be loaded)"
    status = driver.cuInit(0)
    if status != 0:
        return f"the NVIDIA driver finds no usable GPU (cuInit returned CUDA error {status})"
    count = ctypes.c_int(0)
    if driver.cuDeviceGetCount(ctypes.byref(count)) != 0 or count.value < 1:
        return "the NVIDIA driver reports no GPU"
    return None


def _device_memory(device: StateDevice) -> tuple[int, int] | None:
    return cuda_memory(device.index) if device.kind == "cuda" else None


def cuda_memory(device_index: int = 0, load=ctypes.CDLL) -> tuple[int, int] | None:
    """``(free, total)`` bytes of a CUDA device, through the driver API in the context ONNX Runtime's CUDA provider
    runs in (the device's primary context, as the CUDA runtime uses it: retained here, not created); None when the
    driver cannot say. ONNX Runtime itself does not report a device's free memory."""
    try:
        driver = load("libcuda.so.1")
        device, context = ctypes.c_int(0), ctypes.c_void_p()
        if driver.cuInit(0) or driver.cuDeviceGet(ctypes.byref(device), ctypes.c_int(device_index)):
            return None
        if driver.cuDevicePrimaryCtxRetain(ctypes.byref(context), device):
            return None
        try:
            if driver.cuCtxPushCurrent_v2(context):
                return None
            free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
            status = driver.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total))
            driver.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))
            return None if status else (int(free.value), int(total.value))
        finally:
            driver.cuDevicePrimaryCtxRelease_v2(device)
    except (OSError, AttributeError):  # no driver, or one without these entry points
        return None


def cpu_fallback_note(session: ort.InferenceSession, provider: str, graph: str) -> str | None:
    """One line when ``provider`` (not the CPU) left nodes of ``graph`` to ONNX Runtime's CPU provider, naming the
    op types; None when it took every node or the installed ONNX Runtime cannot say (< 1.23)."""
    if provider == "CPUExecutionProvider" or not hasattr(session, "get_provider_graph_assignment_info"):
        return None
    on_cpu: dict[str, int] = {}
    for subgraph in session.get_provider_graph_assignment_info():
        if subgraph.ep_name == "CPUExecutionProvider":
            for node in subgraph.get_nodes():
                on_cpu[node.op_type] = on_cpu.get(node.op_type, 0) + 1
    if not on_cpu:
        return None
    kinds = ", ".join(f"{op} ×{count}" for op, count in sorted(on_cpu.items(), key=lambda item: -item[1]))
    return f"note: {provider} left {sum(on_cpu.values())} node(s) of {graph} to the CPU ({kinds})"
