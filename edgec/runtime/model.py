"""``Model``: load a bundle and generate text. Imports numpy, onnxruntime and tokenizers only."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from edgec.bundle import TrustedKeys, open_bundle, upgrade_manifest
from edgec.errors import BuildSettingsError, BundleError, GenerationError, one_line, runtime_load_error
from edgec.kvcache.compression import Compression
from edgec.kvcache.spec import CacheSpec
from edgec.runtime import prefix_cache as saved_prompts
from edgec.runtime.chat import ChatFormat
from edgec.runtime.prefix_cache import SavedPrompt
from edgec.runtime.protect import Protect, protect_flags
from edgec.runtime.sampling import SeenTokens, choose_token, penalize_repeats
from edgec.runtime.step import Backend, CacheState
from edgec.runtime.tokenizer import BundleTokenizer

Prompt = str | Sequence[int]


@dataclasses.dataclass
class GenerationStats:
    """How fast one generation ran, filled in as it goes (pass one to ``generate(..., stats=...)``). Times are the
    runtime's own work (prefill, decode steps, token choice), not the caller's time between streamed pieces."""

    prompt_tokens: int = 0
    prompt_seconds: float = 0.0  # the prefill
    first_token_seconds: float = 0.0  # from the start of generation to the first token chosen
    new_tokens: int = 0
    decode_seconds: float = 0.0  # the steps after the first token (each feeds one token back)

    @property
    def prompt_tokens_per_second(self) -> float:
        return self.prompt_tokens / self.prompt_seconds if self.prompt_seconds > 0 else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        steps = self.new_tokens - 1  # the first new token comes from the prefill, not a decode step
        return steps / self.decode_seconds if steps > 0 and self.decode_seconds > 0 else 0.0

    def line(self) -> str:
        """One line for a terminal: prompt and decode speed, time to first token."""
        return (
            f"prompt {self.prompt_tokens} tokens, {self.prompt_tokens_per_second:,.1f} tok/s; "
            f"decode {self.new_tokens} tokens, {self.decode_tokens_per_second:,.1f} tok/s; "
            f"time to first token {self.first_token_seconds:.3f} s"
        )


class Model:
    """A loaded bundle.

    Threads: one ``Model`` may serve any number of threads, and any number of generators may be open at once
    (interleaved in one thread or spread over several): the weights are loaded once and shared, and every
    generation runs on a cache state of its own, taken from a pool when it starts and returned when it ends (a
    streaming generator holds one until it is exhausted or closed). Memory therefore grows with the number of
    generations running at the same moment: one cache state each (``cache_spec.total_bytes()``).

    Errors: ``BundleError`` when the bundle cannot be used (missing or damaged files, a manifest out of bounds, a
    path outside the bundle, a graph or tokenizer the runtime libraries refuse), and its subclass
    ``SignatureError`` when ``trust`` is given and the bundle is unsigned, signed by another key or changed since
    it was signed; ``KeyFileError`` (a ``ValueError``) for a trust key file that cannot be read;
    ``GenerationError`` (a ``ValueError``) for bad arguments: empty prompt, token ids outside the vocabulary, a
    prompt longer than the context, negative ``max_new_tokens``, ``temperature`` that is negative or not finite,
    ``top_p`` outside (0, 1], negative ``top_k``, ``repeat_penalty`` that is not a finite number > 0;
    ``TypeError`` for arguments of the wrong type.
    """

    def __init__(
        self,
        path: Path,
        manifest: dict[str, Any],
        threads: int | None = None,
        kv_capacity: int | None = None,
        prefill_compress: str | None = None,
        providers: list[str] | None = None,
        spin: bool | None = None,
        prompt_threads: int | None = None,
        prompt_spin: bool | None = None,
        scans: dict | None = None,
        **recall: int | None,
    ) -> None:
        self.path = path
        self.manifest = manifest = upgrade_manifest(manifest)
        spec = CacheSpec.from_json(manifest["cache"])
        self.context = int(manifest["model"]["context"])
        overrides = dict(kv_capacity=kv_capacity, prefill_compress=prefill_compress, **recall)
        self.cache_spec = _with_overrides(spec, self.context, **overrides)
        self.vocab_size = int(manifest["model"]["vocab_size"])
        run = manifest["runtime"]
        self.prefill_chunk = int(run["prefill_chunk"])
        self.default_protect = run.get("protect")
        self.eos_token_ids = set(manifest["generation"]["eos_token_ids"])
        chat = manifest["tokenizer"].get("chat_format")
        self.tokenizer = BundleTokenizer(
            path / manifest["tokenizer"]["file"],
            ChatFormat.from_json(chat) if chat else None,
            manifest["tokenizer"].get("chat_note", ""),
        )
        self._backend = _backend(
            path,
            manifest,
            self.cache_spec,
            self.vocab_size,
            threads,
            providers,
            spin,
            prompt_threads,
            prompt_spin,
            scans,
        )
        self.threads, self.spin = threads, spin  # as asked or calibrated (None: ONNX Runtime's default / the load rule)
        self.cache_spec = self._backend.spec  # a format-v1 bundle's spec, narrowed to what its graph carries
        # one cache state per running generation; idle ones are kept for the next (their buffers are reused)
        self._idle: list[CacheState] = []
        self._lock = threading.Lock()

    @property
    def providers(self) -> list[str]:
        """What runs the graph here (ONNX Runtime's execution providers, or TensorRT-RTX)."""
        return self._backend.providers

    def close(self) -> None:
        """Release the cache states and the backend now (GPU memory; a TensorRT-RTX runtime cache is saved for
        the next start). Also done when the model is garbage collected, except the runtime cache."""
        self.close_idle_states()
        self._backend.close()

    def __enter__(self) -> Model:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @contextlib.contextmanager
    def _state(self, kv_capacity: int | None = None) -> Iterator[CacheState]:
        """A cache state no other generation is using, returned to the pool afterwards. With ``kv_capacity`` a
        fresh state of that many compressed slots, dropped afterwards (its memory goes back at once)."""
        if kv_capacity is not None:
            state = self._open_state(kv_capacity)
            try:
                yield state
            finally:
                state.close()
            return
        with self._lock:
            state = self._idle.pop() if self._idle else None
        if state is None:
            state = self._backend.open_state()
        try:
            yield state
        finally:
            with self._lock:
                self._idle.append(state)

    def close_idle_states(self) -> None:
        """Free the cache states kept for reuse between generations (on a GPU their memory goes back at once); the
        next generation opens a new one."""
        with self._lock:
            idle, self._idle = self._idle, []
        for state in idle:
            state.close()

    @property
    def cache_resizable(self) -> bool:
        """Whether ``kv_capacity`` may give one generation its own slot count (a compressed cache on a backend
        whose graph takes any number of slots: ONNX Runtime's dynamic-shape one)."""
        import inspect

        open_state = self._backend.open_state
        return self.cache_spec.compression is not None and "kv_capacity" in inspect.signature(open_state).parameters

    def _open_state(self, kv_capacity: int) -> CacheState:
        self._check_kv_capacity(kv_capacity)
        try:
            return self._backend.open_state(kv_capacity)
        except TypeError:
            raise GenerationError(f"{self.providers[0]} bundles keep their built cache capacity") from None

    def _check_kv_capacity(self, kv_capacity: int) -> None:
        compression = self.cache_spec.compression
        if compression is None or not isinstance(kv_capacity, int) or isinstance(kv_capacity, bool):
            raise GenerationError("kv_capacity (an int) applies to a bundle with a compressed cache (--kv-*)")
        head_dim = next(layer.head_dim for layer in self.cache_spec.layers if layer.compressed)
        try:
            compression.override(head_dim, self.context, capacity=kv_capacity)  # checks it (room to evict)
        except BuildSettingsError as error:
            raise GenerationError(str(error)) from None

    def session_bytes(self, kv_capacity: int | None = None, prompt_tokens: int = 0) -> int:
        """Host or device bytes one generation's cache state takes (``kv_capacity`` slots, default the bundle's),
        plus the temporary state a prompt of ``prompt_tokens`` is read into (``prefill_compress = end``: the
        compressed layers at its length) and the buffers each step's inputs and logits take — as the backend
        allocates them (``Backend.state_bytes``; TensorRT-RTX keeps two device buffers per state tensor)."""
        spec = self.cache_spec if kv_capacity is None else self.cache_spec.with_capacity(kv_capacity)
        return self._backend.state_bytes(spec, prompt_tokens)

    def device_memory(self) -> tuple[int, int] | None:
        """``(free, total)`` bytes of the GPU holding this model's cache states, read now (every process's use
        counted); None where the states live in host memory."""
        return self._backend.device_memory()

    @classmethod
    def load(
        cls,
        path: str | Path,
        threads: int | None = None,
        check_hashes: bool = False,
        kv_capacity: int | None = None,
        prefill_compress: str | None = None,
        providers: list[str] | None = None,
        trust: TrustedKeys | None = None,
        kv_recall: int | None = None,
        kv_recall_block: int | None = None,
        kv_recall_every: int | None = None,
        spin: bool | None = None,
        calibrate: bool = False,
    ) -> Model:
        """Open a bundle folder. Always checked first: the manifest's schema and bounds, every listed file present
        as a regular file inside the bundle with its size, every path the manifest or the graph names is one of
        them (docs/security.md); ``check_hashes`` also checks every sha256 (slower: reads every byte).
        ``trust``: a public key file (or several, or key objects) — the bundle must carry a valid signature by one
        of them, hold exactly its listed files, and every byte must match (implies ``check_hashes``; needs
        ``pip install 'edgec[trust]'``). For a compressed cache, ``kv_capacity`` changes its slot count (the
        graph takes any: fewer slots trade quality for memory without a rebuild) and ``prefill_compress``
        (``end``/``chunk``) how long prompts are read; both default to the manifest's. ``providers`` overrides
        the ONNX Runtime execution providers the bundle names (for testing a lowering on another provider, e.g.
        a CANN bundle on the CPU). ``kv_recall`` (blocks; 0 = off), ``kv_recall_block`` and ``kv_recall_every``
        change the hierarchical cache's settings of a bundle built with ``--kv-recall`` (docs/kv-cache.md).
        Threads and spinning (ONNX Runtime bundles): ``threads`` and ``spin`` as given; what is not given comes
        from this bundle's calibration on this machine when one is stored (``calibrate=True`` measures it first
        when none is: a few seconds, once; ``edgec.runtime.calibration``), else ONNX Runtime's thread default and
        spinning chosen from the machine's load. The calibration times decode steps; a bundle with its own
        prompt-chunk graph (``prefill.onnx``) then reads prompts on every usable core (its products are large
        enough to use them) unless ``threads`` is named, which both graphs use."""
        path = Path(path)
        scans: dict = {}  # the graph files as the checks read them: the backend needs some of it again
        manifest = open_bundle(path, check_hashes=check_hashes, trust=trust, scans=scans)
        recall = dict(kv_recall=kv_recall, kv_recall_block=kv_recall_block, kv_recall_every=kv_recall_every)
        prompt: dict[str, Any] = {}
        if threads is None or spin is None:
            from edgec.runtime import calibration

            if calibration.runs_on_cpu(manifest, providers):
                named_threads, named_spin = threads, spin
                threads, spin = calibration.resolve(path, threads, spin, calibrate)
                cores = calibration.usable_cpus()
                if (
                    named_threads is None
                    and threads is not None
                    and threads < cores
                    and "prefill_file" in manifest["model"]
                ):
                    # the calibration measured decode; prompt chunks are large products that use every core
                    prompt = {"prompt_threads": cores, "prompt_spin": named_spin}
        try:
            return cls(
                path, manifest, threads, kv_capacity, prefill_compress, providers, spin, **prompt, scans=scans, **recall
            )
        except MemoryError:
            raise BundleError(f"{path} needs more memory than this machine can give (its cache or logits)") from None
        except Exception as error:
            if (failure := runtime_load_error(path, error)) is None:
                raise
            raise failure from None

    # --- prompts -----------------------------------------------------------------------------------------
    def set_chat_format(self, chat_format: ChatFormat) -> None:
        """Replace the bundle's chat format (or give one to a base model's bundle, which has none) for every later
        ``chat=True`` / ``messages=`` call. ``edgec.chat_template.chat_format_from_template`` derives one from a
        Jinja chat template where jinja2 is installed; ``special_tokens()`` gives it ``bos_token``/``eos_token``."""
        if not isinstance(chat_format, ChatFormat):
            raise TypeError(f"chat_format must be a ChatFormat, not {type(chat_format).__name__}")
        self.tokenizer.chat_format = chat_format
        self.tokenizer.chat_note = "set by the caller"

    def special_tokens(self) -> dict[str, str]:
        """The text of the bundle's BOS and first EOS token ("" when it has none), as chat templates name them."""
        generation = self.manifest["generation"]
        ids = {"bos_token": generation.get("bos_token_id"), "eos_token": (generation["eos_token_ids"] or [None])[0]}
        return {name: "" if i is None else self.tokenizer.token_strings([i])[0] for name, i in ids.items()}

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids)

    def _prompt_ids(self, prompt: Prompt | None, messages: list[dict] | None, chat: bool) -> np.ndarray:
        if messages is not None:
            if prompt is not None:
                raise GenerationError("pass either a prompt or messages, not both")
            ids = self.tokenizer.encode_chat(messages)
        elif isinstance(prompt, str):
            if chat:
                ids = self.tokenizer.encode_chat([{"role": "user", "content": prompt}])
            else:
                ids = self.tokenizer.encode(prompt)
        elif prompt is None:
            raise GenerationError("give a prompt (text or token ids) or messages")
        else:
            ids = self._check_ids(prompt)
        if len(ids) == 0:
            raise GenerationError("the prompt is empty")
        if len(ids) > self.context:
            raise GenerationError(
                f"the prompt has {len(ids)} tokens but this bundle's context is {self.context}; "
                "shorten it or rebuild with a larger --context"
            )
        return np.asarray(ids, dtype=np.int64)

    def _check_ids(self, ids: Sequence[int]) -> list[int]:
        if isinstance(ids, np.ndarray):
            if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
                raise TypeError("token ids must be a 1-D sequence of ints")
            ids = ids.tolist()
        if not isinstance(ids, Sequence) or isinstance(ids, (str, bytes)):
            raise TypeError(f"prompt must be a str or a sequence of token ids, not {type(ids).__name__}")
        if not all(isinstance(i, (int, np.integer)) and not isinstance(i, bool) for i in ids):
            raise TypeError("token ids must be ints")
        ids = [int(i) for i in ids]
        if ids and not 0 <= min(ids) <= max(ids) < self.vocab_size:
            raise GenerationError(f"token ids must lie in [0, {self.vocab_size}); got {min(ids)}..{max(ids)}")
        return ids

    # --- running -----------------------------------------------------------------------------------------
    def _chunks(self, length: int, compression: Compression | None = None) -> list[tuple[int, int]]:
        """(start, end) of each prefill step. The short piece goes first so that the last chunk is full: a
        compressed cache judges the prompt by its last queries, which should be many. A compressed cache that
        selects between chunks takes at most its capacity per step (``compression``: a state's own settings)."""
        size = self.prefill_chunk
        compression = compression or self.cache_spec.compression
        if compression and compression.prefill_compress == "chunk":
            size = min(size, compression.capacity)
        first = length % size or size
        return [(0, first)] + [(start, start + size) for start in range(first, length, size)]

    def _prefill(
        self, state: CacheState, ids: np.ndarray, all_logits: bool, flags: np.ndarray | None = None, reduce=None
    ) -> np.ndarray:
        """Feed the prompt in chunks through the real cache path; logits of the last (or every) position.
        ``flags``: per prompt token, never evict it (compressed caches). ``reduce(start, logits)`` turns each
        chunk's logits into something smaller as they come (a long text's logits would not fit in memory)."""
        state.reset()
        state.begin_prompt(len(ids))
        pieces = []
        start = 0
        for start, end in self._chunks(len(ids), getattr(state, "compression", None)):
            chunk_flags = None if flags is None else flags[start:end]
            if not all_logits and reduce is None and end < len(ids) and hasattr(state, "feed"):
                state.feed(ids[start:end], start, protect=chunk_flags)  # logits nobody reads: none computed
                continue
            logits = state.run(ids[start:end], start, last_only=not all_logits, protect=chunk_flags)
            if reduce is not None:
                pieces.append(reduce(start, logits))
            elif all_logits or end == len(ids):
                pieces.append(logits.copy() if end - start == 1 else logits)  # a one-token result is a reused buffer
        state.end_prompt(len(ids) - 1, last_chunk_start=start)
        return np.concatenate(pieces) if all_logits else pieces[-1]

    def _protect_flags(self, protect: Protect, ids: np.ndarray) -> np.ndarray | None:
        compression = self.cache_spec.compression
        if protect is None:
            protect = self.default_protect
        if compression is None or protect is None:
            return None
        return protect_flags(protect, ids, self.tokenizer.token_strings, compression.max_protected)

    def continuation_logprobs(
        self, context: Sequence[int], continuation: Sequence[int], protect: Protect = None, with_top1: bool = False
    ) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
        """log P(continuation[i] | context + continuation[:i]) for each i: the context is read as a prompt
        (and compressed as the bundle's settings say), then the continuation is scored in steps through the
        cache that the context left — how an answer is judged against a long document. ``with_top1`` also
        returns the most likely token at each step (greedy decoding would produce the continuation exactly
        when they all match)."""
        context_ids = self._prompt_ids(context, None, False)
        continuation_ids = np.asarray(self._check_ids(continuation), dtype=np.int64)
        if len(continuation_ids) == 0 or len(context_ids) + len(continuation_ids) > self.context:
            raise GenerationError(f"need 1 to {self.context - len(context_ids)} continuation tokens")
        flags = self._protect_flags(protect, context_ids)
        size = self.prefill_chunk
        if self.cache_spec.compression:
            size = min(size, self.cache_spec.compression.capacity)
        with self._state() as state:
            rows = [self._prefill(state, context_ids, all_logits=False, flags=flags)[-1].copy()]
            position = len(context_ids)
            for start in range(0, len(continuation_ids) - 1, size):
                piece = continuation_ids[start : min(start + size, len(continuation_ids) - 1)]
                rows.append(state.run(piece, position, last_only=False).copy())
                position += len(piece)
        logits = np.concatenate([row.reshape(-1, row.shape[-1]) for row in rows])
        scores = _log_softmax_at(logits, continuation_ids)
        return (scores, logits.argmax(axis=-1)) if with_top1 else scores

    def next_token_logits(self, prompt: Prompt, protect: Protect = None) -> np.ndarray:
        """Logits [vocab] for the token after ``prompt`` (text or ids), through the same path as ``generate``."""
        ids = self._prompt_ids(prompt, None, False)
        flags = self._protect_flags(protect, ids)
        with self._state() as state:
            return self._prefill(state, ids, all_logits=False, flags=flags)[-1].copy()

    def logprobs(self, token_ids: Sequence[int], protect: Protect = None) -> np.ndarray:
        """log P(token_ids[i+1] | token_ids[:i+1]) for each i, as the runtime computes it (float64, length n-1).
        With a compressed cache each chunk sees the cache as deployment would at that point."""
        ids = self._prompt_ids(token_ids, None, False) if not isinstance(token_ids, str) else None
        if ids is None:
            raise TypeError("logprobs takes token ids; use model.encode(text) first")
        if len(ids) < 2:
            raise GenerationError("logprobs needs at least two tokens")
        flags = self._protect_flags(protect, ids)
        targets = np.append(ids[1:], 0)  # the last position predicts nothing we know

        def chunk_logprobs(start: int, logits: np.ndarray) -> np.ndarray:
            return _log_softmax_at(logits, targets[start : start + len(logits)])

        with self._state() as state:
            return self._prefill(state, ids, all_logits=True, flags=flags, reduce=chunk_logprobs)[:-1]

    def iter_logits(
        self, token_ids: Sequence[int], prompt_tokens: int | None = None, protect: Protect = None
    ) -> Iterator[tuple[int, np.ndarray]]:
        """The logits of every position of ``token_ids``, piece by piece as ``(first position, logits [n, vocab])``,
        through the real cache path: the first ``prompt_tokens`` (default: all) are read as a prompt (in prefill
        chunks, compressed as the bundle's settings say), then every later token is fed as one decode step, the
        way generation feeds the tokens it makes (so a compressed cache evicts and quantizes as it would while
        generating). Holds a cache state until the iterator is exhausted or closed."""
        if isinstance(token_ids, str):
            raise TypeError("iter_logits takes token ids; use model.encode(text) first")
        ids = self._prompt_ids(token_ids, None, False)
        prompt = len(ids) if prompt_tokens is None else prompt_tokens
        if not isinstance(prompt, int) or isinstance(prompt, bool) or not 1 <= prompt <= len(ids):
            raise GenerationError(f"prompt_tokens must lie in [1, {len(ids)}], got {prompt_tokens!r}")
        flags = self._protect_flags(protect, ids[:prompt])
        return self._logit_stream(ids, prompt, flags)

    def _logit_stream(self, ids: np.ndarray, prompt: int, flags: np.ndarray | None) -> Iterator[tuple[int, np.ndarray]]:
        with self._state() as state:
            state.reset()
            state.begin_prompt(prompt)
            start = 0
            for start, end in self._chunks(prompt):
                chunk_flags = None if flags is None else flags[start:end]
                logits = state.run(ids[start:end], start, last_only=False, protect=chunk_flags)
                yield start, logits.copy() if end - start == 1 else logits  # a one-token result is a reused buffer
            state.end_prompt(prompt - 1, last_chunk_start=start)
            for position in range(prompt, len(ids)):
                yield position, state.run(ids[position : position + 1], position, last_only=True).copy()

    def generate_ids(
        self,
        prompt: Prompt | None = None,
        *,
        messages: list[dict] | None = None,
        chat: bool = False,
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        protect: Protect = None,
        repeat_penalty: float = 1.0,
        stats: GenerationStats | None = None,
        kv_capacity: int | None = None,
        saved: SavedPrompt | None = None,
        prefix_cache: str | Path | None = None,
    ) -> Iterator[int]:
        """Yield new token ids one by one (greedy when temperature is 0); stops at EOS, after
        ``max_new_tokens`` or when the context is full. ``protect`` (a compressed cache only): prompt token
        indices, a predicate over token strings, or heuristics ``"numbers,names"`` — never evicted.
        ``repeat_penalty`` > 1 makes every token already in the prompt or the output less likely (1 = off; the
        Hugging Face rule: positive logits divided by it, negative ones multiplied). ``stats``: filled in with
        token counts and timings as the generation runs. ``kv_capacity``: a compressed cache's slot count for
        this generation alone (a fresh state, freed when it ends; ``session_bytes`` gives its size). ``saved``
        (``load_state``): a prompt read earlier that this one starts with — its state is restored and only the rest
        is read. ``prefix_cache``: a folder of saved prompts; the longest that this prompt starts with is used, and
        this prompt's state is saved there (prefix_cache.py)."""
        _check_sampling(max_new_tokens, temperature, top_k, top_p, seed)
        _check_repeat_penalty(repeat_penalty)
        ids = self._prompt_ids(prompt, messages, chat)
        flags = self._protect_flags(protect, ids)  # bad protect arguments fail here, not at the first next()
        if saved is not None and not isinstance(saved, SavedPrompt):
            raise TypeError(f"saved must be a SavedPrompt (Model.load_state), not {type(saved).__name__}")
        if saved is not None and not self._starts_with(ids, flags, saved):
            raise GenerationError("the saved prompt is not the start of this prompt (or was read with other protect)")
        folder = None if prefix_cache is None else Path(prefix_cache)
        sampling = (temperature, top_k, top_p, float(repeat_penalty))
        if kv_capacity is not None:
            self._check_kv_capacity(kv_capacity)  # a capacity that cannot work fails here, not at the first next()
        reading = (saved, folder)
        stats = stats or GenerationStats()
        return self._token_stream(ids, max_new_tokens, sampling, seed, flags, stats, kv_capacity, reading)

    def _token_stream(
        self,
        ids,
        max_new_tokens,
        sampling,
        seed,
        flags,
        stats: GenerationStats,
        kv_capacity: int | None = None,
        reading=(None, None),
    ) -> Iterator[int]:
        if max_new_tokens == 0:
            return
        temperature, top_k, top_p, repeat_penalty = sampling
        rng = np.random.default_rng(seed)
        seen = SeenTokens(ids, self.vocab_size, max_new_tokens) if repeat_penalty != 1.0 else None

        def choose(logits: np.ndarray) -> int:
            if seen is not None:
                logits = penalize_repeats(logits, seen.ids, repeat_penalty)
            token = choose_token(logits, temperature, top_k, top_p, rng)
            if seen is not None:
                seen.add(token)
            return token

        stats.prompt_tokens, stats.new_tokens, stats.decode_seconds = len(ids), 0, 0.0
        started = time.perf_counter()
        with self._state(kv_capacity) as state:  # held until the generator is exhausted or closed
            logits = self._read_prompt(state, ids, flags, *reading)
            stats.prompt_seconds = time.perf_counter() - started
            token = choose(logits)
            stats.first_token_seconds, stats.new_tokens = time.perf_counter() - started, 1
            position = len(ids)
            step = np.empty(1, np.int64)
            for produced in range(1, max_new_tokens + 1):
                yield token
                if token in self.eos_token_ids or produced == max_new_tokens or position >= self.context:
                    return
                # only the runtime's own work is timed, not the caller's between two tokens
                step_started = time.perf_counter()
                step[0] = token
                logits = state.run(step, position, last_only=True)[-1]
                position += 1
                token = choose(logits)
                stats.decode_seconds += time.perf_counter() - step_started
                stats.new_tokens += 1

    # --- saved prompts (prefix_cache.py) --------------------------------------------------------------------
    def save_state(self, path: str | Path, prompt: Prompt, *, protect: Protect = None) -> None:
        """Read ``prompt`` (text or ids) as generation would and write the cache state it leaves, with the logits
        of its last position, to the file ``path``; ``load_state`` gives it back to this bundle (same cache
        settings) in a later process."""
        ids = self._prompt_ids(prompt, None, False)
        flags = self._protect_flags(protect, ids)
        with self._state() as state:
            logits = self._prefill(state, ids, all_logits=False, flags=flags)[-1]
            saved = SavedPrompt(ids, self._flag_array(ids, flags), state.arrays(), logits.astype(np.float32))
        saved_prompts.write_state(Path(path), self._cache_identity(), saved)

    def load_state(self, path: str | Path) -> SavedPrompt:
        """A prompt ``save_state`` wrote for this bundle and cache setting, checked (``StateFileError`` when it is
        not one); pass it to ``generate``/``generate_ids`` as ``saved=``."""
        template = {tensor.input: array for tensor, array in self.cache_spec.empty_state()}
        expected = saved_prompts.expected_arrays(template)
        return saved_prompts.read_state(Path(path), self._cache_identity(), expected, self.context, self.vocab_size)

    def _cache_identity(self) -> str:
        if not hasattr(self, "_identity"):
            manifest_bytes = (self.path / "manifest.json").read_bytes()
            self._identity = saved_prompts.cache_identity(manifest_bytes, self.cache_spec.to_json())
        return self._identity

    @staticmethod
    def _flag_array(ids: np.ndarray, flags: np.ndarray | None) -> np.ndarray:
        return np.zeros(len(ids), bool) if flags is None else np.asarray(flags, bool)

    def _starts_with(self, ids: np.ndarray, flags: np.ndarray | None, saved: SavedPrompt) -> bool:
        count = len(saved.ids)
        return count <= len(ids) and bool(
            np.array_equal(saved.ids, ids[:count]) and np.array_equal(saved.flags, self._flag_array(ids, flags)[:count])
        )

    def _read_prompt(
        self, state: CacheState, ids: np.ndarray, flags: np.ndarray | None, saved: SavedPrompt | None, folder
    ) -> np.ndarray:
        """The logits after the prompt, with the state holding it: read whole, or restored from a saved prompt
        (and the rest read on top, in steps of at most the capacity); saved into ``folder`` when given."""
        keys = None
        if folder is not None:
            keys = saved_prompts.prefix_keys(self._cache_identity(), ids, self._flag_array(ids, flags))
            if saved is None and (found := saved_prompts.find_prefix(folder, keys)):
                saved = self.load_state(found[1])
                if not self._starts_with(ids, flags, saved):
                    raise saved_prompts.StateFileError(f"{one_line(found[1])} does not hold the prompt its name says")
        if saved is None:
            logits = self._prefill(state, ids, all_logits=False, flags=flags)[-1]
        else:
            state.restore(saved.arrays)
            logits = saved.logits
            size = self.prefill_chunk
            if self.cache_spec.compression:
                size = min(size, self.cache_spec.compression.capacity)
            for start in range(len(saved.ids), len(ids), size):
                chunk_flags = None if flags is None else flags[start : start + size]
                if start + size < len(ids) and hasattr(state, "feed"):  # not the last chunk: no logits needed
                    state.feed(ids[start : start + size], start, protect=chunk_flags)
                    continue
                logits = state.run(ids[start : start + size], start, last_only=True, protect=chunk_flags)[-1]
        if keys is not None and (saved is None or len(saved.ids) < len(ids)):
            logits = logits.astype(np.float32)  # a copy: a one-token step's logits are a reused buffer
            folder.mkdir(parents=True, exist_ok=True)
            entry = SavedPrompt(ids, self._flag_array(ids, flags), state.arrays(), logits)
            saved_prompts.write_state(folder / (keys[-1] + saved_prompts.SUFFIX), self._cache_identity(), entry)
        return logits

    def generate(
        self,
        prompt: Prompt | None = None,
        *,
        messages: list[dict] | None = None,
        chat: bool = False,
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop: Sequence[str] | str | None = None,
        stream: bool = False,
        protect: Protect = None,
        repeat_penalty: float = 1.0,
        stats: GenerationStats | None = None,
        saved: SavedPrompt | None = None,
        prefix_cache: str | Path | None = None,
    ) -> str | Iterator[str]:
        """Generate text. ``prompt`` is text or token ids; ``messages`` (or ``chat=True`` with a text prompt)
        applies the bundle's chat format. ``stop`` strings end generation (not included in the result; no token
        is computed after one appears). With ``stream=True`` returns an iterator of text pieces as they decode.
        ``repeat_penalty``, ``stats``, ``saved`` and ``prefix_cache`` as in ``generate_ids``."""
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if not all(isinstance(s, str) and s for s in stops):
            raise GenerationError("stop must be a non-empty string or a list of them")
        tokens = self.generate_ids(
            prompt,
            messages=messages,
            chat=chat,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            seed=seed,
            protect=protect,
            repeat_penalty=repeat_penalty,
            stats=stats,
            saved=saved,
            prefix_cache=prefix_cache,
        )
        pieces = _cut_at_stops(self.tokenizer.stream(t for t in tokens if t not in self.eos_token_ids), stops)
        return pieces if stream else "".join(pieces)


def _log_softmax_at(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """log softmax(logits[i])[targets[i]] per row, float64, without a float64 copy of every logit."""
    logits = logits.astype(np.float32, copy=False)
    peak = logits.max(axis=-1, keepdims=True)
    total = np.exp(logits - peak).sum(axis=-1, dtype=np.float64)
    picked = logits[np.arange(len(targets)), targets].astype(np.float64)
    return picked - peak[:, 0].astype(np.float64) - np.log(total)


def _with_overrides(spec: CacheSpec, context: int, **overrides: Any) -> CacheSpec:
    """The bundle's cache with the settings ``Model.load`` may change (keyword names as ``--kv-*`` flags:
    ``kv_capacity``, ``prefill_compress``; ``Compression.override`` says which may change and checks them)."""
    changes = {Compression.parameters()[key]: value for key, value in overrides.items() if value is not None}
    if not changes:
        return spec
    if spec.compression is None:
        raise BundleError("kv_capacity/prefill_compress apply to a compressed cache; this bundle has none (--kv-*)")
    head_dim = next(layer.head_dim for layer in spec.layers if layer.compressed)
    try:
        compression = spec.compression.override(head_dim, context, **changes)
    except BuildSettingsError as error:
        raise GenerationError(str(error)) from None
    return dataclasses.replace(spec.with_capacity(compression.capacity), compression=compression)


# the extra to install for each ONNX Runtime execution provider a bundle may name
PROVIDER_EXTRAS = {
    "CUDAExecutionProvider": "cuda",
    "CANNExecutionProvider": "cann",
    "OpenVINOExecutionProvider": "openvino",
}


def _backend(
    path: Path,
    manifest: dict[str, Any],
    spec: CacheSpec,
    vocab_size: int,
    threads: int | None,
    providers: list[str] | None = None,
    spin: bool | None = None,
    prompt_threads: int | None = None,
    prompt_spin: bool | None = None,
    scans: dict | None = None,
) -> Backend:
    """The backend the manifest names; a missing library or provider is an error naming the extra — never a
    silent fallback to another device. ``providers`` (an explicit override) replaces the manifest's; ``scans``:
    the graph files as ``open_bundle`` read them."""
    runtime = manifest["runtime"]
    exact = manifest["format_version"] >= 2
    if (
        spec.compression is not None
        and spec.compression.recall
        and (runtime["library"] != "onnxruntime" or "decode_file" in manifest["model"])
    ):
        raise BundleError("recall (--kv-recall) runs on ONNX Runtime's dynamic-shape bundles only; not on this one")
    if runtime["library"] == "tensorrt_rtx":
        if not exact:
            raise BundleError(f"{path} is a format-v1 TensorRT-RTX bundle, which never loaded: rebuild it")
        from edgec.runtime.backend_trt import TrtBackend

        engine_sha256 = manifest["files"][runtime["engine"]]["sha256"]
        return TrtBackend(path, runtime, spec, vocab_size, engine_sha256)
    try:
        import onnxruntime
    except ImportError:
        raise BundleError(f"this bundle runs on ONNX Runtime: {install_hint(runtime)}") from None

    from edgec.runtime.backend_ort import open_backend

    providers = providers or runtime.get("providers") or ["CPUExecutionProvider"]
    missing = [p for p in providers if p not in onnxruntime.get_available_providers()]
    if missing:
        raise BundleError(
            f"this bundle needs ONNX Runtime's {missing[0]}, which is not installed here: "
            f"{install_hint({'providers': missing})} (on a machine with that device)"
        )
    return open_backend(
        path,
        manifest["model"],
        spec,
        int(runtime["prefill_chunk"]),
        providers,
        runtime.get("provider_options"),
        threads,
        exact,
        spin,
        prompt_threads,
        prompt_spin,
        scans,
    )


def runtime_extra(runtime: dict[str, Any]) -> str:
    """The edgec extra that installs what a bundle's runtime section asks for (``edgec pack --wheels`` packs it)."""
    if runtime.get("library") == "tensorrt_rtx":
        return "tensorrt-rtx"
    return PROVIDER_EXTRAS.get((runtime.get("providers") or ["CPUExecutionProvider"])[0], "runtime")


def install_hint(runtime: dict[str, Any]) -> str:
    """The pip command that installs what a bundle's runtime section asks for."""
    return f"pip install 'edgec[{runtime_extra(runtime)}]'"


def _check_sampling(max_new_tokens, temperature, top_k, top_p, seed) -> None:
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool):
        raise TypeError("max_new_tokens must be an int")
    if max_new_tokens < 0:
        raise GenerationError(f"max_new_tokens must be ≥ 0, got {max_new_tokens}")
    if not isinstance(temperature, (int, float)) or isinstance(temperature, bool):
        raise TypeError("temperature must be a number")
    if not math.isfinite(temperature) or temperature < 0:
        raise GenerationError(f"temperature must be finite and ≥ 0, got {temperature}")
    if not isinstance(top_k, int) or isinstance(top_k, bool):
        raise TypeError("top_k must be an int")
    if top_k < 0:
        raise GenerationError(f"top_k must be ≥ 0 (0 = off), got {top_k}")
    if not isinstance(top_p, (int, float)) or isinstance(top_p, bool):
        raise TypeError("top_p must be a number")
    if not 0 < top_p <= 1:
        raise GenerationError(f"top_p must lie in (0, 1], got {top_p}")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or seed < 0):
        raise GenerationError("seed must be a non-negative int or None")


def _check_repeat_penalty(repeat_penalty) -> None:
    if not isinstance(repeat_penalty, (int, float)) or isinstance(repeat_penalty, bool):
        raise TypeError("repeat_penalty must be a number")
    if not (math.isfinite(repeat_penalty) and repeat_penalty > 0):
        raise GenerationError(f"repeat_penalty must be a finite number > 0 (1 = off), got {repeat_penalty}")


def _cut_at_stops(pieces: Iterator[str], stops: list[str]) -> Iterator[str]:
    """Pass text through until a stop string appears; hold back just enough to never emit part of one."""
    if not stops:
        yield from pieces
        return
    hold = max(len(s) for s in stops) - 1
    pending = ""
    for piece in pieces:  # pending never grows past the longest stop plus one piece: O(1) work per token
        pending += piece
        hits = [pending.find(s) for s in stops if s in pending]
        if hits:
            yield pending[: min(hits)]
            return
        if len(pending) > hold:
            cut = len(pending) - hold
            yield pending[:cut]
            pending = pending[cut:]
    yield pending
