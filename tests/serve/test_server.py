"""The real server on a free port, talked to with the openai client."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.conftest import pydoc_text
from tests.serve.conftest import CONTEXT

CHATS = [
    [{"role": "user", "content": text}]
    for text in (
        "What does a compiler do?",
        "List three colours.",
        "def f(x): return",
        "The keyword lambda",
        "Explain the with statement.",
        "Numbers: 1, 2, 3,",
        "class A:",
        "import sys; print(",
    )
]


def streamed_chat(client, name: str, messages, max_tokens: int = 24, times: list | None = None) -> tuple[str, str]:
    """The streamed text and finish reason; ``times`` gets the arrival time of each piece of text."""
    text, finish = [], None
    stream = client.chat.completions.create(
        model=name, messages=messages, max_tokens=max_tokens, temperature=0, stream=True
    )
    for chunk in stream:
        if chunk.choices:
            text.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
            if times is not None and chunk.choices[0].delta.content:
                times.append(time.monotonic())
    return "".join(text), finish


def name_of(server) -> str:
    return server.client().models.list().data[0].id


def test_concurrent_streams_equal_the_same_chats_one_at_a_time(server):
    client, name = server.client(), name_of(server)
    alone = [streamed_chat(client, name, chat) for chat in CHATS]
    started = threading.Barrier(len(CHATS))

    times = [[] for _ in CHATS]

    def together(i):
        started.wait()
        return streamed_chat(client, name, CHATS[i], times=times[i])

    with ThreadPoolExecutor(len(CHATS)) as pool:
        concurrent = list(pool.map(together, range(len(CHATS))))
    assert concurrent == alone
    assert len({text for text, _ in alone}) > 1 and all(text for text, _ in alone)
    # and they progressed together: most streams had text before the first of them ended
    first_end = min(t[-1] for t in times)
    assert sum(t[0] < first_end for t in times) >= len(CHATS) // 2
    assert server.metric("edgec_sessions_total", 'capacity="full"') == 2 * len(CHATS)


def test_completion_usage_stop_and_seed(server):
    client, name = server.client(), name_of(server)
    whole = client.completions.create(model=name, prompt="The keyword lambda", max_tokens=12, temperature=0)
    text = whole.choices[0].text
    assert whole.usage.completion_tokens == 12 and whole.choices[0].finish_reason == "length"
    streamed = client.completions.create(
        model=name,
        prompt="The keyword lambda",
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens > 0
    assert chunks[-1].usage.completion_tokens == 12
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    cut = client.completions.create(model=name, prompt="The keyword lambda", max_tokens=12, temperature=0, stop=stop)
    assert cut.choices[0].text == text[: text.index(stop)] and cut.choices[0].finish_reason == "stop"
    sampled = [
        client.completions.create(model=name, prompt="Hello", max_tokens=8, temperature=1.0, top_p=0.9, seed=s)
        .choices[0]
        .text
        for s in (7, 7, 8)
    ]
    assert sampled[0] == sampled[1] != sampled[2]


def test_a_prompt_longer_than_the_context_is_a_400(server):
    import openai

    client, name = server.client(), name_of(server)
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model=name, prompt=pydoc_text()[:60_000], max_tokens=4)
    assert f"context is {CONTEXT} tokens" in str(error.value)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="Hi", max_tokens=4)


def test_a_cancelled_stream_frees_its_session(server):
    client, name = server.client(), name_of(server)
    before = server.metric("edgec_requests_total", 'outcome="cancelled"')
    stream = client.completions.create(
        model=name, prompt="The keyword lambda", max_tokens=3000, temperature=0, stream=True
    )
    pieces = [next(iter(stream)).choices[0].text for _ in range(3)]
    assert server.health()["active_sessions"] == 1 and server.health()["kv_bytes_in_use"] > 0
    stream.close()  # the client goes away mid-stream
    deadline = time.monotonic() + 10
    while server.health()["active_sessions"] and time.monotonic() < deadline:
        time.sleep(0.05)
    health = server.health()
    assert health["active_sessions"] == 0 and health["kv_bytes_in_use"] == 0
    assert server.metric("edgec_requests_total", 'outcome="cancelled"') == before + 1
    assert len(pieces) == 3


def test_a_busy_port_is_one_error_line(server, serve_bundle):
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "edgec.cli", "serve", str(serve_bundle), "--port", str(server.port)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        f"error: cannot listen on 127.0.0.1:{server.port}: Address already in use"
    ]
