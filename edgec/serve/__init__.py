"""``edgec serve``: one bundle behind the OpenAI API (``app``), many sessions on one set of weights (``engine``),
admitted into a memory budget (``scheduler``, ``memory``); and beyond one machine, Triton Inference Server
(``triton``: PyTriton, and a model repository a stock tritonserver loads). docs/serving.md tells the whole story.
Needs ``pip install 'edgec[serve]'`` (for Triton also ``pip install --no-deps nvidia-pytriton==0.7.0``)."""

from __future__ import annotations

from pathlib import Path

from edgec.errors import BuildSettingsError, EdgecError

EXTRAS = {
    "serve": ("fastapi", "uvicorn", "sse_starlette", "prometheus_client", "psutil"),
    "triton": ("pytriton",),
}
# how to install each extra: nvidia-pytriton without its dependencies (only its tritonserver is used; its client
# pins numpy < 2)
INSTALL = {
    "serve": "pip install 'edgec[serve]'",
    "triton": "pip install 'edgec[serve]' && pip install --no-deps nvidia-pytriton==0.7.0",
}


def require(extra: str) -> None:
    """An EdgecError naming the extra to install when one of its modules is missing."""
    import importlib.util

    missing = [name for name in EXTRAS[extra] if importlib.util.find_spec(name) is None]
    if missing:
        raise EdgecError(f"edgec serve needs {missing[0]}: {INSTALL[extra]}")


def load_server(
    bundle: Path,
    max_sessions: int = 8,
    memory: int | None = None,
    queue_size: int = 16,
    threads: int | None = None,
    max_prompt_tokens: int | None = None,
    echo=None,
):
    """Load the bundle, measure it and build the ``app.Server`` (no socket yet). ``max_prompt_tokens``: the longest
    prompt served (default: the context less one token); the warm-up reads one that long to measure memory."""
    from edgec.runtime import Model
    from edgec.serve.app import Server
    from edgec.serve.memory import measure
    from edgec.serve.scheduler import capacity_steps

    if max_sessions < 1 or queue_size < 0:
        raise BuildSettingsError("--max-sessions must be ≥ 1 and --queue ≥ 0")
    model = Model.load(bundle, threads=threads, calibrate=True)
    compression = model.cache_spec.compression
    minimum = compression.sink + compression.window + 1 if compression else 0
    capacities = capacity_steps(compression.capacity if model.cache_resizable else None, minimum)
    longest = model.context - 1 if max_prompt_tokens is None else max_prompt_tokens
    if not 1 <= longest < model.context:
        raise BuildSettingsError(f"--max-prompt-tokens must lie in [1, {model.context - 1}] (the bundle's context)")
    if echo is not None:
        echo(f"measuring: reading one {longest}-token prompt (the longest served; --max-prompt-tokens)")
    server_memory = measure(model, memory, model.session_bytes(capacities[-1], 1), longest)
    name = Path(bundle).name.removesuffix(".edgec")
    return Server(model, name, server_memory, max_sessions, queue_size, capacities, longest)


def start_line(server, host: str, port: int) -> str:
    """What ``edgec serve`` says once it is measured: where, what the model takes, the sessions' budget (GPU memory
    for a GPU bundle, with what the GPU has in use), and the admission limits."""
    memory, scheduler = server.memory, server.scheduler
    budget = memory.session_budget
    room = "no --memory limit" if budget is None else f"{budget / 2**20:,.0f} MiB for sessions' caches"
    if memory.budget_on == "gpu":
        room = (
            f"{budget / 2**20:,.0f} MiB of GPU memory for sessions' caches, {memory.device_used / 2**20:,.0f} of "
            f"{memory.device_total / 2**20:,.0f} MiB in use on the GPU after the warm-up"
        )
    sizes = ", ".join("full" if c is None else str(c) for c in scheduler.capacities)
    return (
        f"serving {server.name} at http://{host}:{port}/v1 (model {memory.model_bytes / 2**20:,.0f} MiB resident; "
        f"{room}; up to {scheduler.max_sessions} sessions, cache capacities {sizes}; queue {scheduler.queue_size})"
    )


def _check_address(host: str, port: int) -> None:
    import socket

    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            sock.bind((host, port))
    except OSError as error:
        raise BuildSettingsError(f"cannot listen on {host}:{port}: {error.strerror or error}") from None


def serve(
    bundle: Path,
    host: str = "127.0.0.1",
    port: int = 8000,
    max_sessions: int = 8,
    memory: int | None = None,
    queue_size: int = 16,
    threads: int | None = None,
    echo=print,
    max_prompt_tokens: int | None = None,
) -> None:
    """Serve ``bundle`` over HTTP until interrupted."""
    import uvicorn

    from edgec.serve.app import create_app

    _check_address(host, port)  # before the model loads: a busy port is one error line, not a late log
    server = load_server(bundle, max_sessions, memory, queue_size, threads, max_prompt_tokens, echo)
    echo(start_line(server, host, port))
    uvicorn.run(create_app(server), host=host, port=port, log_level="warning")
