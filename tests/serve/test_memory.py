"""An over-budget burst: smaller caches first, then the queue, then 429 — and the server's resident memory never
above --memory. Also the scheduler's rules alone, and one generation's own cache capacity in the runtime."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from edgec.runtime import Model
from edgec.serve.memory import HEADROOM
from edgec.serve.scheduler import Busy, Scheduler, TooLarge, capacity_steps
from tests.conftest import pydoc_text
from tests.serve.conftest import CONTEXT, running_server


def test_over_budget_burst_gets_smaller_caches_then_a_queue_then_429(serve_bundle, server):
    import openai

    model = Model.load(serve_bundle)
    full, quarter = model.session_bytes(), model.session_bytes(CONTEXT // 4)
    burst = 9
    samples, stop = [], threading.Event()
    with _server_with_budget(serve_bundle, server, full, quarter) as (small, budget, limit):
        assert burst * full > 3 * budget  # the burst could never run at full capacity here
        client, name = small.client(), "wide"

        def watch():
            while not stop.is_set():
                health = small.health()
                samples.append((health["queued"], health["kv_bytes_in_use"], health["capacities"]))
                time.sleep(0.01)

        def ask(i: int) -> str:
            try:
                text = client.completions.create(model=name, prompt=f"Item {i}:", max_tokens=200, temperature=0)
                return "ok" if text.choices[0].text is not None else "empty"
            except openai.RateLimitError as error:
                assert int(error.response.headers["retry-after"]) >= 1
                return "429"

        watcher = threading.Thread(target=watch)
        watcher.start()
        with ThreadPoolExecutor(burst) as pool:
            outcomes = list(pool.map(ask, range(burst)))
        stop.set()
        watcher.join()
        peak = small.peak_rss()
        reduced = sum(small.metric("edgec_sessions_total", f'capacity="{CONTEXT // d}"') for d in (2, 4))
        admitted_full = small.metric("edgec_sessions_total", 'capacity="full"')
    assert outcomes.count("429") >= 1 and outcomes.count("ok") == burst - outcomes.count("429")
    assert reduced >= 1 and admitted_full >= 2  # full caches while they fit, then smaller ones
    assert max(queued for queued, _, _ in samples) >= 1  # some waited in the queue
    assert max(in_use for _, in_use, _ in samples) <= budget
    assert peak <= limit, f"peak resident {peak / 2**20:.1f} MiB above --memory {limit / 2**20:.1f} MiB"


@contextlib.contextmanager
def _server_with_budget(bundle, server, full: int, quarter: int, tries: int = 3):
    """A server whose session budget holds two full caches and a quarter one beside them, never three full ones.

    The budget is ``--memory`` less what the server measures itself resident after loading, and two processes'
    measurements differ by a few MiB (the allocator, a busy machine), about a quarter cache: aimed at the middle of
    the band from another server's measurement, then corrected by this one's own until it lands in the band."""
    low, high = 2 * full + quarter, 3 * full
    model_bytes = server.health()["memory"]["model_bytes"]
    for _ in range(tries):
        limit = model_bytes + HEADROOM + (low + high) // 2
        with running_server(bundle, "--memory", str(limit), "--max-sessions", "8", "--queue", "2") as small:
            memory = small.health()["memory"]
            if low <= memory["session_budget"] < high:
                yield small, memory["session_budget"], limit
                return
            model_bytes = memory["model_bytes"]
    raise AssertionError(f"no server with a session budget in [{low}, {high}) bytes in {tries} tries")


@pytest.mark.slow
def test_memory_too_small_for_one_session_is_one_error_line(serve_bundle, tmp_path):
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "edgec.cli", "serve", str(serve_bundle), "--memory", "64MiB"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and done.stderr.startswith("error: --memory 64 MiB is too small")
    assert "Traceback" not in done.stderr


def run(coroutine):
    return asyncio.run(coroutine)


def test_scheduler_full_then_smaller_then_queue_then_busy():
    sizes = {None: 100, 50: 50, 25: 25}
    scheduler = Scheduler(
        230, max_sessions=8, queue_size=1, capacities=[None, 50, 25], session_bytes=lambda c, n: sizes[c]
    )

    async def scenario():
        first, second = await scheduler.admit(1), await scheduler.admit(1)
        third = await scheduler.admit(1)  # 30 left: a quarter cache
        assert (first.capacity, second.capacity, third.capacity) == (None, None, 25) and third.reduced
        waiting = asyncio.ensure_future(scheduler.admit(1))  # 5 left: queued
        await asyncio.sleep(0)
        assert scheduler.queued == 1 and not waiting.done()
        with pytest.raises(Busy) as busy:
            await scheduler.admit(1)
        assert busy.value.retry_after >= 1
        scheduler.release(first, 2.0)  # 105 free: the queued one gets a full cache
        assert (await waiting).capacity is None and scheduler.queued == 0 and scheduler.in_use == 225
        with pytest.raises(TooLarge):
            await Scheduler(20, 8, 1, [None, 50, 25], lambda c, n: sizes[c]).admit(1)
        # a long prompt holds a larger state until it is read; then the queue moves
        sizes[None] = 100
        long = Scheduler(150, 8, 1, [None], lambda c, n: 100 if n < 10 else 140)
        reading = await long.admit(20)
        after = asyncio.ensure_future(long.admit(1))
        await asyncio.sleep(0)
        assert not after.done()
        long.settle(reading, 40)
        assert (await after).bytes == 100 and long.in_use == 140
        # a waiting client that leaves gives its place up
        leaving = asyncio.ensure_future(scheduler.admit(1))
        await asyncio.sleep(0)
        leaving.cancel()
        await asyncio.sleep(0)
        assert scheduler.queued == 0

    run(scenario())
    assert capacity_steps(4096, 97) == [None, 2048, 1024]
    assert capacity_steps(256, 97) == [None, 128]  # never below sinks + window + 1
    assert capacity_steps(None, 0) == [None]  # a plain cache cannot shrink


def test_one_generation_gets_its_own_capacity(serve_bundle):
    """generate_ids(kv_capacity=N) decodes exactly as a model loaded with kv_capacity=N, beside full-size ones."""
    shared = Model.load(serve_bundle)
    prompt = shared.encode(pydoc_text()[:9000])[:700]  # longer than 512 slots: eviction decides the answer
    small = list(Model.load(serve_bundle, kv_capacity=512).generate_ids(prompt, max_new_tokens=12))
    full = list(shared.generate_ids(prompt, max_new_tokens=12))
    assert small != full  # the capacity matters for this prompt, so the comparison below can fail
    assert list(shared.generate_ids(prompt, max_new_tokens=12, kv_capacity=512)) == small
    assert list(shared.generate_ids(prompt, max_new_tokens=12)) == full
    assert shared.session_bytes(512) < shared.session_bytes() // 3
    with pytest.raises(ValueError, match="no room to evict"):
        shared.generate_ids(prompt, kv_capacity=8)


def test_a_gpu_bundle_budgets_the_gpu():
    """Where the sessions' states live on a GPU, the budget is GPU memory: --memory (or, without it, the GPU's total)
    less what is in use on it after the warm-up, never more than the GPU has free; host memory is not budgeted."""
    from edgec.serve.memory import ServerMemory

    host = ServerMemory(limit=1000 * 2**20, model_bytes=300 * 2**20, weights_bytes=100 * 2**20)
    assert host.budget_on == "host" and host.session_budget == 700 * 2**20 - HEADROOM
    gpu = ServerMemory(None, 300 * 2**20, 100 * 2**20, device_total=8192 * 2**20, device_used=1500 * 2**20)
    assert gpu.budget_on == "gpu" and gpu.session_budget == (8192 - 1500) * 2**20 - HEADROOM  # all that is free
    assert dataclasses_replace(gpu, limit=4096 * 2**20).session_budget == (4096 - 1500) * 2**20 - HEADROOM
    assert dataclasses_replace(gpu, limit=10**12).session_budget == gpu.session_budget  # not past the GPU's free
    assert gpu.to_json()["budget_on"] == "gpu" and gpu.to_json()["device_used"] == 1500 * 2**20


def dataclasses_replace(memory, **changes):
    import dataclasses

    return dataclasses.replace(memory, **changes)


class _StubModel:
    """What ``measure`` asks a model: a generation to warm up, the manifest's files, the GPU's memory."""

    manifest = {"files": {"model.onnx": {"size": 10 * 2**20}, "tokenizer.json": {"size": 1}}}

    def __init__(self, device):
        self.device, self.warmed = device, 0

    def generate_ids(self, ids, max_new_tokens):
        self.warmed = len(ids)
        yield 1

    def device_memory(self):
        return self.device

    def close_idle_states(self):
        pass


def test_measure_reads_the_gpu_after_the_warm_up_and_says_when_one_session_cannot_fit():
    from edgec.errors import BuildSettingsError
    from edgec.serve.memory import measure

    gib = 2**30
    model = _StubModel((6 * gib, 8 * gib))
    memory = measure(model, None, 64 * 2**20, prompt_tokens=100)
    assert model.warmed == 100 and memory.device_used == 2 * gib and memory.session_budget == 6 * gib - HEADROOM
    with pytest.raises(BuildSettingsError) as small:
        measure(_StubModel((6 * gib, 8 * gib)), 2 * gib + 64 * 2**20, 64 * 2**20, prompt_tokens=1)
    message = str(small.value)
    assert message.startswith("--memory 2112 MiB is too small: the GPU holds this bundle's sessions and has 2048 MiB")
    assert message.endswith(f"give at least {2048 + HEADROOM // 2**20 + 64} MiB") and "\n" not in message
    with pytest.raises(BuildSettingsError, match=r"^the GPU has 40 MiB free after loading the model \(8152 of 8192"):
        measure(_StubModel((40 * 2**20, 8 * gib)), None, 64 * 2**20, prompt_tokens=1)
    assert measure(_StubModel(None), None, 64 * 2**20, prompt_tokens=1).budget_on == "host"


def test_the_start_line_names_the_budget_and_where_it_lies():
    from types import SimpleNamespace

    from edgec.serve import start_line
    from edgec.serve.memory import ServerMemory

    scheduler = SimpleNamespace(capacities=[None, 1024, 512], max_sessions=4, queue_size=2)
    host = SimpleNamespace(name="smol", scheduler=scheduler, memory=ServerMemory(2 * 2**30, 600 * 2**20, 100 * 2**20))
    line = start_line(host, "127.0.0.1", 8000)
    assert line == (
        "serving smol at http://127.0.0.1:8000/v1 (model 600 MiB resident; 1,416 MiB for sessions' caches; up to 4 "
        "sessions, cache capacities full, 1024, 512; queue 2)"
    )
    gpu = SimpleNamespace(name="smol", scheduler=scheduler, memory=ServerMemory(None, 300 * 2**20, 1, 8 * 2**30, 2**30))
    assert "7,136 MiB of GPU memory for sessions' caches, 1,024 of 8,192 MiB in use on the GPU" in start_line(
        gpu, "0.0.0.0", 80
    )
    unlimited = SimpleNamespace(name="smol", scheduler=scheduler, memory=ServerMemory(None, 300 * 2**20, 1))
    assert "; no --memory limit;" in start_line(unlimited, "h", 1)
