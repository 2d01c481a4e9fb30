"""Aggregate decode speed of `edgec serve` at 1, 4 and 8 concurrent streams against the same requests one after
another, and what batching several sessions into one step could at most gain on this CPU.

    flock /tmp/edgec-heavy.lock python benchmarks/serve.py BUNDLE [--streams 1,4,8] [--max-tokens 64] [--json OUT]
        [--plot PNG]          (--from-json OUT --plot PNG redraws the figure from a saved report)

Starts the real server (`edgec serve BUNDLE`) on a free port and talks to it with the openai client: every request
is a streamed chat with greedy decoding; tokens are the server's usage counts. "aggregate tok/s" = all generated
tokens / wall time from the first request to the last token (prefill included; prompts are short).
The batching bound: one graph step of n tokens against n one-token steps on one cache state (a step that reads the
weights once for n tokens is what a batched decode of n sessions would cost at best; the bundle's graph takes one
sequence, so serving interleaves sessions instead).
"""

from __future__ import annotations

import argparse
import json
import platform
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

QUESTIONS = [
    "Explain what a compiler does.",
    "Give three tips for writing clear code.",
    "What is a KV cache?",
    "Describe a factory robot's daily routine.",
    "Why is the sky blue?",
    "Summarise the rules of chess.",
    "What is the capital of France and why is it famous?",
    "Write a short poem about rain.",
]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def chat(client, name: str, question: str, max_tokens: int) -> int:
    stream = client.chat.completions.create(
        model=name,
        messages=[{"role": "user", "content": question}],
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    tokens = 0
    for chunk in stream:
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return tokens


def measure(client, name: str, streams: int, max_tokens: int) -> dict:
    questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(streams)]
    started = time.perf_counter()
    one_by_one = sum(chat(client, name, q, max_tokens) for q in questions)
    sequential = time.perf_counter() - started
    started = time.perf_counter()
    with ThreadPoolExecutor(streams) as pool:
        together = sum(pool.map(lambda q: chat(client, name, q, max_tokens), questions))
    concurrent = time.perf_counter() - started
    return {
        "streams": streams,
        "tokens": together,
        "concurrent_seconds": round(concurrent, 2),
        "sequential_seconds": round(sequential, 2),
        "concurrent_tok_s": round(together / concurrent, 1),
        "sequential_tok_s": round(one_by_one / sequential, 1),
        "ratio": round((together / concurrent) / (one_by_one / sequential), 2),
    }


def batching_bound(bundle: Path, sizes=(1, 4, 8), repeats: int = 5) -> list[dict]:
    """ms per token: one step of n tokens vs n one-token steps, on a cache holding a short prompt."""
    import numpy as np

    from edgec.runtime import Model

    model = Model.load(bundle)
    state = model._backend.open_state()
    ids = np.asarray(model.encode("The quick brown fox jumps over the lazy dog. " * 4), np.int64)
    rows = []
    for n in sizes:
        best_one, best_many = float("inf"), float("inf")
        for _ in range(repeats):
            model._prefill(state, ids, all_logits=False)
            started = time.perf_counter()
            for i in range(n):
                state.run(ids[i : i + 1], len(ids) + i, last_only=True)
            best_one = min(best_one, time.perf_counter() - started)
            model._prefill(state, ids, all_logits=False)
            started = time.perf_counter()
            state.run(ids[:n], len(ids), last_only=False)
            best_many = min(best_many, time.perf_counter() - started)
        rows.append(
            {
                "tokens": n,
                "one_token_steps_ms_per_token": round(1000 * best_one / n, 2),
                "one_n_token_step_ms_per_token": round(1000 * best_many / n, 2),
                "bound": round(best_one / best_many, 2),
            }
        )
    return rows


def plot(report: dict, path: Path) -> None:
    """Aggregate tok/s, concurrent vs one after another, per number of streams."""
    from edgec.plots import _pyplot

    plt = _pyplot()
    rows = report["serve"]
    figure, axis = plt.subplots(figsize=(6, 3.6))
    x = np.arange(len(rows))
    axis.bar(x - 0.2, [r["sequential_tok_s"] for r in rows], 0.4, label="one after another")
    bars = axis.bar(x + 0.2, [r["concurrent_tok_s"] for r in rows], 0.4, label="concurrent (edgec serve)")
    axis.bar_label(bars, labels=[f"{r['ratio']:.2f}x" for r in rows])
    axis.set_xticks(x, [f"{r['streams']} stream{'s' if r['streams'] > 1 else ''}" for r in rows])
    axis.set_ylabel("generated tokens / s (all streams)")
    axis.set_ylim(0, 1.18 * max(max(r["concurrent_tok_s"], r["sequential_tok_s"]) for r in rows))
    axis.set_title(f"{report['bundle']}\n{report['machine']}, {report['date']}", fontsize=9)
    axis.legend(loc="lower right", fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("bundle", type=Path, nargs="?")
    parser.add_argument("--streams", default="1,4,8")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None)
    parser.add_argument("--from-json", type=Path, default=None)
    args = parser.parse_args()
    if args.from_json:
        plot(json.loads(args.from_json.read_text()), args.plot)
        return
    from openai import OpenAI

    port = free_port()
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "edgec.cli",
            "serve",
            str(args.bundle),
            "--port",
            str(port),
            "--max-sessions",
            "8",
            "--max-prompt-tokens",
            "256",
        ]
    )
    try:
        for _ in range(600):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1):
                    break
            except OSError:
                time.sleep(0.5)
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=600)
        name = client.models.list().data[0].id
        chat(client, name, QUESTIONS[0], 8)  # warm
        rows = []
        for streams in (int(s) for s in args.streams.split(",")):
            rows.append(measure(client, name, streams, args.max_tokens))
            print(json.dumps(rows[-1]), flush=True)
    finally:
        server.terminate()
        server.wait()
    bound = batching_bound(args.bundle)
    for row in bound:
        print(json.dumps(row), flush=True)
    report = {
        "bundle": args.bundle.name,
        "command": " ".join(sys.argv),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.machine()}, {__import__('os').cpu_count()} cores",
        "serve": rows,
        "batching_bound": bound,
    }
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    if args.plot:
        plot(report, args.plot)


if __name__ == "__main__":
    main()
