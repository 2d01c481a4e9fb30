"""One Model shared by threads and by interleaved generators: every generation runs on a cache state of its own."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from edgec.runtime import Model
from tests.conftest import pydoc_text

THREADS, PER_THREAD = 8, 50


@pytest.fixture(scope="module")
def prompts(tiny_bundle) -> list[list[int]]:
    ids = Model.load(tiny_bundle).encode(pydoc_text()[:20_000])
    starts = [(i * 37) % (len(ids) - 40) for i in range(THREADS * PER_THREAD)]
    return [ids[start : start + 5 + i % 23] for i, start in enumerate(starts)]


def test_threads_share_a_model_and_get_the_single_thread_answers(tiny_bundle, prompts):
    model = Model.load(tiny_bundle, threads=1)
    alone = [model.generate(p, max_new_tokens=6 + i % 5) for i, p in enumerate(prompts)]

    def worker(first: int) -> list[str]:
        return [
            model.generate(prompts[i], max_new_tokens=6 + i % 5)
            for i in range(first * PER_THREAD, (first + 1) * PER_THREAD)
        ]

    with ThreadPoolExecutor(THREADS) as pool:
        together = [text for chunk in pool.map(worker, range(THREADS)) for text in chunk]
    assert together == alone
    assert len(model._idle) <= THREADS  # at most one cache state per generation running at once


def test_interleaved_generators_keep_their_own_state(tiny_bundle, prompts):
    model = Model.load(tiny_bundle)
    first, second = prompts[3], prompts[10]
    want = [list(model.generate_ids(p, max_new_tokens=12)) for p in (first, second)]
    a, b = model.generate_ids(first, max_new_tokens=12), model.generate_ids(second, max_new_tokens=12)
    got_a, got_b = [], []
    for token_a, token_b in zip(a, b, strict=True):  # one step of each in turn, in one thread
        got_a.append(token_a)
        got_b.append(token_b)
    assert [got_a, got_b] == want
    # and scoring in between does not disturb a paused stream
    stream = model.generate_ids(first, max_new_tokens=12)
    head = [next(stream) for _ in range(4)]
    model.logprobs(second)
    assert head + list(stream) == want[0]


def test_an_abandoned_generator_returns_its_state(tiny_bundle, prompts):
    model = Model.load(tiny_bundle)
    stream = model.generate_ids(prompts[0], max_new_tokens=20)
    next(stream)
    held = len(model._idle)
    stream.close()
    assert len(model._idle) == held + 1
