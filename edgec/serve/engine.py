"""One thread that advances every running session by one token in turn, on one loaded ``Model``.

Each session is a ``Model.generate_ids`` generator (a cache state of its own, at the capacity the scheduler gave
it); the engine calls ``next`` on each in round-robin, so all streams progress together and the weights are
read by one step at a time (on a CPU, steps of different sessions in parallel threads only compete for the same
cores: docs/serving.md). Text, the end and errors go back to the asyncio side through ``loop.call_soon_threadsafe``.
A cancelled session is closed at its next turn: its generator ends, its state is freed, then ``on_end`` runs.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from edgec.errors import EdgecError, one_line
from edgec.runtime.model import GenerationStats, Model, _cut_at_stops


@dataclasses.dataclass
class Request:
    """What one generation asks for, prompt already tokenized."""

    ids: list[int]
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()


class Session:
    """One running generation. Its events (``("text", str)``, ``("end", finish_reason)``, ``("error", message)``)
    arrive on ``events``, an asyncio queue of the loop that made it."""

    def __init__(
        self,
        model: Model,
        request: Request,
        capacity: int | None,
        loop: Any,
        on_end: Callable,
        on_prompt_read: Callable | None = None,
    ) -> None:
        import asyncio

        self.request, self.capacity, self.loop, self.on_end = request, capacity, loop, on_end
        self.on_prompt_read = on_prompt_read
        self.events: asyncio.Queue = asyncio.Queue()
        self.stats = GenerationStats()
        self.started = time.perf_counter()
        self.first_token_at: float | None = None
        self.outcome = "completed"  # or "cancelled" (the client left first), "failed"
        self._cancelled = threading.Event()
        self._eos = model.eos_token_ids
        self._last_token: int | None = None
        self._tokens_done = False
        tokens = model.generate_ids(
            request.ids,
            max_new_tokens=request.max_tokens,
            temperature=request.temperature,
            top_p=request.top_p,
            seed=request.seed,
            stats=self.stats,
            kv_capacity=capacity,
        )
        self._tokens = tokens
        self._pieces = _cut_at_stops(model.tokenizer.stream(self._watch(tokens)), list(request.stop))

    def _watch(self, tokens: Iterator[int]) -> Iterator[int]:
        for token in tokens:
            self._last_token = token
            if token not in self._eos:
                yield token
        self._tokens_done = True

    def cancel(self) -> None:
        """Stop at the next turn (thread-safe; the client went away)."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def finish_reason(self) -> str:
        """``stop`` at EOS or a stop string, ``length`` at max_tokens or the end of the context."""
        if not self._tokens_done or self._last_token in self._eos:
            return "stop"  # the pieces ended before the tokens did: a stop string
        return "length"

    def _send(self, *event: Any) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)

    def step(self) -> bool:
        """Advance by one piece of text; False when this session is over (its state is then freed)."""
        if self.cancelled:
            self.outcome = "cancelled"
            self._close()
            return False
        try:
            piece = next(self._pieces)
        except StopIteration:
            self._close()
            self._send("end", self.finish_reason())
            return False
        except Exception as error:  # noqa: BLE001  (a bug in one session must not stop the others)
            if not isinstance(error, (EdgecError, ValueError)):
                logging.getLogger("edgec.serve").exception("session failed")
            self.outcome = "failed"
            self._close()
            self._send("error", one_line(error))
            return False
        if self.first_token_at is None:  # the first turn read the prompt
            self.first_token_at = time.perf_counter()
            if self.on_prompt_read is not None:
                self.on_prompt_read(self)
        if piece:
            self._send("text", piece)
        return True

    def _close(self) -> None:
        self._pieces.close()
        self._tokens.close()  # returns (frees) the cache state now, not when garbage collected
        self.on_end(self)


class Engine:
    """The decode loop: a daemon thread serving every admitted session in turn."""

    def __init__(self) -> None:
        self._incoming: queue.SimpleQueue[Session | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="edgec-engine", daemon=True)
        self._thread.start()

    def add(self, session: Session) -> None:
        self._incoming.put(session)

    def stop(self) -> None:
        self._incoming.put(None)
        self._thread.join(timeout=10)

    def _run(self) -> None:
        active: list[Session] = []
        while True:
            try:
                while True:  # block only when nothing is running
                    session = self._incoming.get(block=not active)
                    if session is None:
                        for running in active:
                            running.cancel()
                            running.step()
                        return
                    active.append(session)
            except queue.Empty:
                pass
            active = [session for session in active if session.step()]
