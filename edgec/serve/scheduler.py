"""Admission of served sessions into a memory budget (no web framework here: asyncio only).

Every session holds one cache state, whose size the bundle's ``CacheSpec`` gives exactly (``Model.session_bytes``):
a compressed cache is a fixed number of slots, so the server knows before it starts a request what it will cost.
The budget is ``--memory`` minus what the loaded model already takes (its weights, the runtime's buffers and the
activations of the largest step, measured once at start: ``ServerMemory``). A new request gets, in order:

1. the bundle's cache capacity, when it fits beside the sessions already running;
2. else half, then a quarter of it (a compressed cache only): the largest that fits. A quarter is the floor: it is
   the planner's last capacity step before it touches the storage dtype (edgec/plan.py), and SmolLM2 at a quarter
   of its context with int8 slots loses 1.7 % perplexity (docs/BENCHMARKS.md) — below that quality falls faster,
   and it never goes below what the op needs to evict (sinks + recent window + 1);
3. else a place in a bounded queue, first come first served, admitted as running sessions end;
4. else ``Busy`` (the server answers 429 with Retry-After).

A request that could not run even alone at the floor is refused at once (``TooLarge``: 400).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import math
from collections.abc import Callable

from edgec.errors import EdgecError

CAPACITY_STEPS = (1, 2, 4)  # the bundle's capacity divided by these, largest first; the last is the floor


class Busy(EdgecError):
    """Every session slot and queue place is taken; try again after ``retry_after`` seconds."""

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class TooLarge(EdgecError):
    """The request needs more memory than the whole budget, even at the smallest cache."""


@dataclasses.dataclass
class Ticket:
    """An admitted session: the cache capacity it runs with (None = the bundle's) and the bytes it holds (less
    once its prompt is read: ``Scheduler.settle``)."""

    capacity: int | None
    bytes: int
    reduced: bool  # a smaller cache than the bundle's, because memory was short


def capacity_steps(capacity: int | None, minimum: int) -> list[int | None]:
    """The capacities a session may get, largest first: the bundle's (None), then halves down to the floor.
    ``capacity`` None (a plain cache) cannot shrink."""
    if capacity is None:
        return [None]
    smaller = [capacity // step for step in CAPACITY_STEPS[1:] if capacity // step >= minimum]
    return [None, *sorted(set(smaller) - {capacity}, reverse=True)]


class Scheduler:
    """Admits sessions into ``budget`` bytes (at most ``max_sessions`` at once), queues up to ``queue_size`` more.
    ``session_bytes(capacity, prompt_tokens)`` prices a session. Used from one event loop; ``release`` may be
    called from another thread through ``loop.call_soon_threadsafe``."""

    def __init__(
        self,
        budget: int,
        max_sessions: int,
        queue_size: int,
        capacities: list[int | None],
        session_bytes: Callable[[int | None, int], int],
    ) -> None:
        self.budget, self.max_sessions, self.queue_size = budget, max_sessions, queue_size
        self.capacities, self.session_bytes = capacities, session_bytes
        self.in_use = 0
        self.active = 0
        self._waiting: collections.deque[tuple[int, asyncio.Future]] = collections.deque()
        self._durations: collections.deque[float] = collections.deque(maxlen=32)

    @property
    def queued(self) -> int:
        return len(self._waiting)

    def _fit(self, prompt_tokens: int) -> Ticket | None:
        if self.active >= self.max_sessions:
            return None
        for capacity in self.capacities:
            need = self.session_bytes(capacity, prompt_tokens)
            if self.in_use + need <= self.budget:
                return Ticket(capacity, need, reduced=capacity is not None)
        return None

    def _take(self, ticket: Ticket) -> Ticket:
        self.in_use += ticket.bytes
        self.active += 1
        return ticket

    async def admit(self, prompt_tokens: int) -> Ticket:
        """A ticket now, or after waiting in the queue; ``Busy`` when the queue is full, ``TooLarge`` when the
        request could never fit. Cancelling the wait leaves the queue."""
        floor = self.session_bytes(self.capacities[-1], prompt_tokens)
        if floor > self.budget:
            raise TooLarge(
                f"this request needs {floor / 2**20:.1f} MiB of cache (a {prompt_tokens}-token prompt) but the "
                f"server's whole cache budget is {self.budget / 2**20:.1f} MiB; shorten the prompt"
            )
        if not self._waiting and (ticket := self._fit(prompt_tokens)):
            return self._take(ticket)
        if len(self._waiting) >= self.queue_size:
            raise Busy(
                f"all {self.max_sessions} sessions and {self.queue_size} queue places are taken or memory is full "
                f"({self.in_use / 2**20:.1f} of {self.budget / 2**20:.1f} MiB of cache in use)",
                self.retry_after(),
            )
        future = asyncio.get_running_loop().create_future()
        entry = (prompt_tokens, future)
        self._waiting.append(entry)
        try:
            return await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self.release(future.result(), 0.0)  # admitted just as the client left
            elif entry in self._waiting:
                self._waiting.remove(entry)
            raise

    def settle(self, ticket: Ticket, steady: int) -> None:
        """A session's prompt is read: from now on it holds only ``steady`` bytes (its state; the larger one a
        long prompt was read into is freed), so the queue may move."""
        if steady < ticket.bytes:
            self.in_use -= ticket.bytes - steady
            ticket.bytes = steady
            self._admit_waiting()

    def release(self, ticket: Ticket, seconds: float) -> None:
        """A session ended (its state is freed): admit from the queue head while they fit."""
        self.in_use -= ticket.bytes
        self.active -= 1
        if seconds > 0:
            self._durations.append(seconds)
        self._admit_waiting()

    def _admit_waiting(self) -> None:
        while self._waiting:
            prompt_tokens, future = self._waiting[0]
            if future.done():  # its client left
                self._waiting.popleft()
                continue
            ticket = self._fit(prompt_tokens)
            if ticket is None:
                break
            self._waiting.popleft()
            future.set_result(self._take(ticket))

    def retry_after(self) -> int:
        """Seconds until a place is likely free: the mean length of recent sessions, times the queue's rounds."""
        mean = sum(self._durations) / len(self._durations) if self._durations else 1.0
        rounds = 1 + len(self._waiting) / max(1, self.max_sessions)
        return max(1, math.ceil(mean * rounds))
