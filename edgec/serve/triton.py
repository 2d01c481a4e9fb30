"""Triton Inference Server: a model repository a stock tritonserver loads (``export_repository``), the
tritonserver that PyTriton's wheel ships started on it (``stock_tritonserver``), and ``edgec serve --triton``
(``serve_triton``: both at once). The model streams: its config is decoupled, one response per text
piece, the last flagged final (Triton's ``generate_stream`` endpoint turns them into server-sent events).

Inputs and outputs follow the names Triton's LLM backends use: ``text_input`` (string), optional ``max_tokens``
(int32), ``temperature`` and ``top_p`` (fp32), ``seed`` (int64); ``text_output`` (string).
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from edgec.errors import BuildSettingsError

INPUTS = (("text_input", "TYPE_STRING", False), ("max_tokens", "TYPE_INT32", True))
INPUTS += (("temperature", "TYPE_FP32", True), ("top_p", "TYPE_FP32", True), ("seed", "TYPE_INT64", True))

CONFIG = """\
name: "{name}"
backend: "python"
max_batch_size: 0
model_transaction_policy {{ decoupled: true }}
{inputs}
output [ {{ name: "text_output" data_type: TYPE_STRING dims: [ 1 ] }} ]
instance_group [ {{ count: {instances} kind: KIND_CPU }} ]
parameters {{ key: "python_path" value: {{ string_value: "{python_path}" }} }}
"""

MODEL_PY = '''\
"""Triton Python-backend model written by `edgec export triton`: runs the edgec runtime on bundle/ beside it.
Each request streams (decoupled): one response per text piece, then the final flag. Requests run in threads
of their own on one loaded Model (thread-safe: one cache state per generation)."""

import json
import sys
import threading
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils


def _scalar(request, name, default):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return default
    value = tensor.as_numpy().reshape(-1)[0]
    return value.item() if hasattr(value, "item") else value  # strings arrive as bytes


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        python_path = config.get("parameters", {}).get("python_path", {}).get("string_value", "")
        for path in reversed([p for p in python_path.split(":") if p and p not in sys.path]):
            sys.path.insert(0, path)  # where edgec and its runtime libraries are installed
        from edgec.runtime import Model

        self.model = Model.load(Path(__file__).resolve().parent / "bundle")

    def execute(self, requests):
        for request in requests:
            threading.Thread(target=self._generate, args=(request,), daemon=True).start()
        return None

    def _generate(self, request):
        sender = request.get_response_sender()
        try:
            prompt = _scalar(request, "text_input", b"")
            prompt = prompt.decode() if isinstance(prompt, bytes) else str(prompt)
            pieces = self.model.generate(
                prompt,
                stream=True,
                max_new_tokens=int(_scalar(request, "max_tokens", 128)),
                temperature=float(_scalar(request, "temperature", 0.0)),
                top_p=float(_scalar(request, "top_p", 1.0)),
                seed=int(_scalar(request, "seed", 0)) or None,
            )
            cancelled = getattr(request, "is_cancelled", lambda: False)  # the client left (Triton >= 23.10)
            for piece in pieces:
                if cancelled():
                    pieces.close()  # frees the cache state now
                    break
                text = pb_utils.Tensor("text_output", np.array([piece.encode()], dtype=np.object_))
                sender.send(pb_utils.InferenceResponse(output_tensors=[text]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        except Exception as error:  # the client gets the message, the model keeps serving
            sender.send(
                pb_utils.InferenceResponse(error=pb_utils.TritonError(str(error))),
                flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
            )

    def finalize(self):
        self.model.close()
'''


def default_python_path(python: Path | None = None, numpy_1: bool = False) -> str:
    """Where the model finds edgec and its runtime libraries (the Triton Python stub starts without them): edgec's
    own folder, then the site-packages of ``python`` (default: this interpreter)."""
    edgec_root = str(Path(__file__).resolve().parents[2])
    return ":".join(dict.fromkeys([edgec_root, *model_environment(python, numpy_1)]))


def model_environment(python: Path | None, numpy_1: bool) -> list[str]:
    """The site-packages of the Python whose environment the Triton Python backend runs the model in. ``numpy_1``:
    the backend stub in PyTriton's 0.7.0 wheel is built against numpy 1 and garbles string tensors under numpy 2,
    so with that server the environment needs numpy < 2 (plus edgec's runtime: onnxruntime, tokenizers)."""
    import json
    import subprocess

    if python is None:
        python = Path(sys.executable)
    probe = "import json, site, numpy; print(json.dumps([numpy.__version__, site.getsitepackages()]))"
    try:
        found = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, timeout=60)
        numpy_version, packages = json.loads(found.stdout)
    except (OSError, ValueError, subprocess.SubprocessError):
        raise BuildSettingsError(f"--python {python}: not a Python with numpy installed") from None
    if numpy_1 and int(numpy_version.split(".")[0]) >= 2:
        raise BuildSettingsError(
            f"--python {python} has numpy {numpy_version}; Triton's Python backend (PyTriton's wheel) needs numpy < 2 "
            "in the model's environment: give --python a venv with pip install 'numpy<2' onnxruntime tokenizers"
        )
    return packages


def export_repository(
    bundle: Path,
    output: Path,
    model_name: str | None = None,
    instances: int = 1,
    python: Path | None = None,
    numpy_1: bool = False,
) -> Path:
    """Write ``output/<name>/config.pbtxt`` and ``output/<name>/1/`` (model.py + a copy of the bundle); returns
    the model folder. Written into a temporary folder and renamed into place."""
    from edgec.bundle import open_bundle

    bundle, output = Path(bundle), Path(output)
    open_bundle(bundle)  # a damaged bundle fails here, not when Triton loads it
    name = model_name or bundle.name.removesuffix(".edgec")
    if not name.replace("-", "").replace("_", "").replace(".", "").isalnum():
        raise BuildSettingsError(f"--model-name {name!r}: use letters, digits, '-', '_' or '.'")
    if instances < 1:
        raise BuildSettingsError("--instances must be ≥ 1")
    folder = output / name
    if folder.exists():
        raise BuildSettingsError(f"{folder} exists; remove it or choose another -o / --model-name")
    output.mkdir(parents=True, exist_ok=True)
    temporary = output / f".{name}.tmp-{os.getpid()}"
    shutil.rmtree(temporary, ignore_errors=True)
    try:
        shutil.copytree(bundle, temporary / "1" / "bundle")
        (temporary / "1" / "model.py").write_text(MODEL_PY)
        inputs = "\n".join(
            f'input [ {{ name: "{n}" data_type: {t} dims: [ 1 ] optional: {str(o).lower()} }} ]' for n, t, o in INPUTS
        )
        config = CONFIG.format(
            name=name, inputs=inputs, instances=instances, python_path=default_python_path(python, numpy_1)
        )
        (temporary / "config.pbtxt").write_text(config)
        temporary.rename(folder)
    finally:
        shutil.rmtree(temporary, ignore_errors=True)
    return folder


def pytriton_root() -> Path:
    """The installed ``pytriton`` package's folder, found without importing it: only its tritonserver binary and
    stubs are used, so the wheel is installed ``--no-deps`` (its Python client pins numpy < 2, which edgec's build
    tools outgrew) and its ``__init__`` (which imports that client) must not run."""
    import importlib.util

    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise BuildSettingsError(
            "Triton Inference Server needs the tritonserver that nvidia-pytriton's wheel ships: "
            "pip install --no-deps nvidia-pytriton==0.7.0"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def stock_tritonserver(
    repository: Path, workdir: Path, http_port: int, grpc_port: int, metrics_port: int, python: Path | None = None
):
    """(argv, env) that start the tritonserver binary PyTriton's wheel ships, unmodified, on ``repository``:
    its distribution copied to ``workdir`` with the Python-backend stub for this interpreter (what PyTriton
    itself does before it starts the server)."""
    root = pytriton_root()
    server = Path(workdir) / "tritonserver"
    shutil.copytree(root / "tritonserver", server, ignore=shutil.ignore_patterns("python_backend_stubs"))
    version = f"{sys.version_info[0]}.{sys.version_info[1]}"
    stub = root / "tritonserver" / "python_backend_stubs" / version / "triton_python_backend_stub"
    shutil.copy(stub, server / "backends" / "python" / "triton_python_backend_stub")
    env = dict(os.environ)
    libs = root.parent / "nvidia_pytriton.libs"  # where the wheel puts the server's shared libraries
    env["LD_LIBRARY_PATH"] = ":".join(filter(None, [env.get("LD_LIBRARY_PATH"), str(libs)]))
    env["PATH"] = f"{Path(python or sys.executable).parent}:{env['PATH']}"  # the stub's Python environment
    argv = [
        str(server / "bin" / "tritonserver"),
        f"--model-repository={repository}",
        f"--backend-directory={server / 'backends'}",
        f"--http-port={http_port}",
        f"--grpc-port={grpc_port}",
        f"--metrics-port={metrics_port}",
        "--disable-auto-complete-config",
    ]
    return argv, env


def serve_triton(
    bundle: Path,
    host: str,
    port: int,
    model_name: str | None,
    instances: int,
    echo=print,
    python: Path | None = None,
) -> None:
    """``edgec serve --triton``: the bundle exported into a temporary repository and served by the tritonserver
    of PyTriton's wheel (HTTP on ``port``, gRPC on port + 1, metrics on port + 2) until interrupted.

    PyTriton's own Python binding (``Triton.bind``) runs its proxy model inside the Python-backend stub, whose
    embedded libpython must match this interpreter's standard library to the patch release (on a pyenv 3.11.7 it
    fails with ``'_thread.RLock' object has no attribute '_recursion_count'``); the exported model needs no such
    match, so both ``--triton`` and a Triton deployment run the very same model.py."""
    import signal
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory(prefix="edgec-triton-") as work:
        folder = export_repository(bundle, Path(work) / "repo", model_name, instances, python, numpy_1=True)
        argv, env = stock_tritonserver(Path(work) / "repo", Path(work), port, port + 1, port + 2, python)
        argv.append(f"--http-address={host}")
        echo(
            f"serving {folder.name} through Triton at http://{host}:{port} "
            f"(POST /v2/models/{folder.name}/generate_stream; gRPC on {port + 1}, metrics on {port + 2})"
        )
        process = subprocess.Popen(argv, env=env)
        signal.signal(signal.SIGTERM, lambda *_: process.terminate())
        try:
            process.wait()
        except KeyboardInterrupt:
            process.terminate()
            process.wait()
