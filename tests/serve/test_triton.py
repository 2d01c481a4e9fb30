"""Triton Inference Server: the tritonserver binary from PyTriton's wheel loads `edgec export triton`'s repository
and streams a completion (decoupled responses, the generate_stream endpoint); `edgec serve --triton` does the same
through PyTriton."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from edgec.runtime import Model
from tests.serve import conftest
from tests.serve.conftest import free_port

if importlib.util.find_spec("pytriton") is None:  # installed --no-deps: never imported, only its tritonserver used
    pytest.skip("nvidia-pytriton is not installed (scripts/setup.sh installs it)", allow_module_level=True)

# the model's environment for the wheel's tritonserver (numpy < 2 for its backend stub), made by scripts/setup.sh
TRITON_PYTHON = Path(__file__).resolve().parents[2] / ".venv-triton" / "bin" / "python"
needs_triton_python = pytest.mark.skipif(
    not TRITON_PYTHON.exists(), reason="no .venv-triton (scripts/setup.sh makes it: numpy < 2 + edgec's runtime)"
)


def wait_ready(port: int, model: str, process: subprocess.Popen, log) -> None:
    conftest.wait_ready(f"http://127.0.0.1:{port}/v2/models/{model}/ready", process, log, "tritonserver")


def stream(port: int, model: str, prompt: str, max_tokens: int) -> list[str]:
    body = json.dumps({"text_input": prompt, "max_tokens": max_tokens}).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v2/models/{model}/generate_stream",
        data=body,
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        lines = response.read().decode().splitlines()
    events = [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: ")]
    assert not [e for e in events if "error" in e], events
    return [event["text_output"] for event in events]


def export(bundle, repo, *options: str):
    from click.testing import CliRunner

    from edgec.cli import main

    return CliRunner().invoke(main, ["export", "triton", str(bundle), "-o", str(repo), *options])


def test_export_writes_a_triton_model_repository(tiny_bundle, tmp_path):
    done = export(tiny_bundle, tmp_path / "repo", "--model-name", "tiny", "--instances", "2")
    assert done.exit_code == 0, done.output
    folder = tmp_path / "repo" / "tiny"
    config = (folder / "config.pbtxt").read_text()
    for line in ('name: "tiny"', 'backend: "python"', "decoupled: true", "count: 2 kind: KIND_CPU"):
        assert line in config
    assert 'name: "text_input" data_type: TYPE_STRING' in config and 'name: "text_output"' in config
    assert (folder / "1" / "bundle" / "manifest.json").read_bytes() == (tiny_bundle / "manifest.json").read_bytes()
    compile((folder / "1" / "model.py").read_text(), "model.py", "exec")
    again = export(tiny_bundle, tmp_path / "repo", "--model-name", "tiny")
    assert again.exit_code == 2 and "exists" in again.stderr
    assert sorted(p.name for p in (tmp_path / "repo").iterdir()) == ["tiny"]  # no temporary folder left


@needs_triton_python
@pytest.mark.slow  # a tritonserver start; `test_export_writes_a_triton_model_repository` checks the files
def test_stock_tritonserver_streams_from_the_exported_repository(tiny_bundle, tmp_path):
    from edgec.serve.triton import stock_tritonserver

    done = export(tiny_bundle, tmp_path / "repo", "--model-name", "tiny", "--python", str(TRITON_PYTHON))
    assert done.exit_code == 0, done.output
    http, grpc, metrics = free_port(), free_port(), free_port()
    argv, env = stock_tritonserver(tmp_path / "repo", tmp_path / "work", http, grpc, metrics, TRITON_PYTHON)
    log_path = tmp_path / "triton.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_ready(http, "tiny", process, log_path.read_text)
        pieces = stream(http, "tiny", "The keyword lambda", 12)
    finally:
        process.terminate()
        process.wait(timeout=60)
    want = Model.load(tiny_bundle).generate("The keyword lambda", max_new_tokens=12)
    assert len(pieces) > 1 and "".join(pieces) == want  # streamed piece by piece, the runtime's own answer


@needs_triton_python
@pytest.mark.slow  # the same model.py and tritonserver as the test above, started by the command
def test_edgec_serve_triton_streams(tiny_bundle, tmp_path):
    port = free_port()
    while port + 2 > 65535:
        port = free_port()
    log_path = tmp_path / "serve.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "edgec.cli",
                "serve",
                str(tiny_bundle),
                "--triton",
                "--port",
                str(port),
                "--model-name",
                "tiny",
                "--python",
                str(TRITON_PYTHON),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_ready(port, "tiny", process, log_path.read_text)
        pieces = stream(port, "tiny", "The keyword lambda", 12)
    finally:
        process.terminate()
        process.wait(timeout=60)
    assert len(pieces) > 1 and "".join(pieces) == Model.load(tiny_bundle).generate(
        "The keyword lambda", max_new_tokens=12
    )


def test_the_wheels_tritonserver_refuses_a_numpy_2_environment():
    """The backend stub of PyTriton's wheel garbles string tensors under numpy 2: one clear line, not a dead stub."""
    import numpy

    from edgec.errors import BuildSettingsError
    from edgec.serve.triton import model_environment

    if int(numpy.__version__.split(".")[0]) < 2:
        pytest.skip("this environment has numpy < 2")
    with pytest.raises(BuildSettingsError, match="numpy < 2"):
        model_environment(Path(sys.executable), numpy_1=True)
    assert model_environment(Path(sys.executable), numpy_1=False)  # a repository for another tritonserver
