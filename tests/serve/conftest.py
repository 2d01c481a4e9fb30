"""A served bundle whose cache states are large enough to matter (tens of MiB each) and a running server."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import build_settings, make_llama_folder

pytest.importorskip("fastapi")
pytest.importorskip("openai")

CONTEXT = 2048  # compressed fp32 slots: 2 KV heads × 128 channels × 4 layers ≈ 8 KiB a slot, 17 MiB a session


@pytest.fixture(scope="session")
def serve_bundle(tmp_path_factory, tiny_tokenizer) -> Path:
    from edgec.build import build

    folder = make_llama_folder(
        tmp_path_factory.mktemp("serve") / "wide-llama",
        tiny_tokenizer,
        seed=3,
        hidden_size=256,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=CONTEXT,
    )
    out = tmp_path_factory.mktemp("bundles") / "wide.edgec"
    build(folder, out, build_settings(target="cpu", context=CONTEXT, prefill_chunk=256, kv_capacity=CONTEXT))
    return out


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Running:
    def __init__(self, process: subprocess.Popen, port: int) -> None:
        self.process, self.port = process, port
        self.url = f"http://127.0.0.1:{port}"

    def client(self, **options):
        from openai import OpenAI

        return OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, **options)

    def get(self, path: str) -> str:
        with urllib.request.urlopen(self.url + path, timeout=10) as response:
            return response.read().decode()

    def health(self) -> dict:
        return json.loads(self.get("/health"))

    def metric(self, name: str, labels: str = "") -> float:
        """A sample's value from /metrics (0 when absent)."""
        key = name + ("{" + labels + "}" if labels else "")
        for line in self.get("/metrics").splitlines():
            if line.rsplit(" ", 1)[0] == key:
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    def peak_rss(self) -> int:
        """The server process's peak resident memory (VmHWM), bytes."""
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmHWM")


def wait_ready(url: str, process: subprocess.Popen, log, what: str = "edgec serve", seconds: float = 120) -> None:
    """Poll ``url`` until it answers; fail with the process's output (``log()``) if it exits or never answers."""
    deadline = time.monotonic() + seconds
    while True:
        if process.poll() is not None:
            raise AssertionError(f"{what} exited: {log()}")
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(url, timeout=1):
                return
        assert time.monotonic() < deadline, f"{what} did not start: {log()}"
        time.sleep(0.1)


@contextlib.contextmanager
def running_server(bundle: Path, *options: str):
    port = free_port()
    command = [sys.executable, "-m", "edgec.cli", "serve", str(bundle), "--port", str(port), "--threads", "1"]
    env = dict(os.environ, EDGEC_ORT_SPIN="0")
    process = subprocess.Popen([*command, *options], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        wait_ready(f"http://127.0.0.1:{port}/health", process, lambda: process.stdout.read().decode())
        yield Running(process, port)
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()


@pytest.fixture(scope="module")
def server(serve_bundle):
    with running_server(serve_bundle, "--max-sessions", "8") as running:
        yield running
