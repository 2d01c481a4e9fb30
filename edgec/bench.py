"""`edgec bench`: time to first token, prefill and decode tokens/s across prompt lengths, peak RSS and KV bytes of a
bundle, alone or against other engines (edgec bundles, onnxruntime-genai model folders).

Each engine runs in a worker process of its own (``python -m edgec.bench --worker``), so its peak RSS (VmHWM: load,
the longest prompt and its decode) is its own; the workers stay loaded and the rounds alternate between them, one
request at a time, in an order that rotates each round so that no engine always runs first. Every engine gets the
same token ids. Ratios are per round (each pair ran back to back), reported as median and min–max.
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from datetime import date
from pathlib import Path
from typing import Any

import numpy as np

from edgec.errors import BundleError, EdgecError, one_line

DEFAULT_CONTEXTS = (256, 1024)
WARM_UP = (16, 4)  # prompt tokens, new tokens: first-run allocations and lazy initialisation, not measured

Progress = Callable[[str, int, int], None]


class BenchError(EdgecError):
    """Settings these engines cannot honour."""


@dataclasses.dataclass(frozen=True)
class BenchSettings:
    contexts: tuple[int, ...] | None = None  # prompt lengths; None: 256 and 1024 as far as every engine allows
    new_tokens: int = 32  # decode steps after the first token
    rounds: int = 3
    threads: int | None = None  # None: each runtime's default


# --- measuring, in the worker ---------------------------------------------------------------------------------------
def peak_rss_bytes() -> int:
    """This process's peak RSS (VmHWM: unlike ru_maxrss it is not inherited from the parent across fork/exec)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def time_bundle(model, ids: Sequence[int], new_tokens: int) -> tuple[float, int, float]:
    """(seconds to the first token, decode steps made, their seconds) of an edgec ``Model`` generating greedily
    after ``ids``: the first token, then up to ``new_tokens`` more (fewer at EOS)."""
    start = time.perf_counter()
    tokens = model.generate_ids(list(ids), max_new_tokens=new_tokens + 1)
    next(tokens)
    first = time.perf_counter()
    steps = sum(1 for _ in tokens)
    return first - start, steps, time.perf_counter() - first


def time_genai(og, model, ids: Sequence[int], new_tokens: int) -> tuple[float, int, float]:
    """The same for an onnxruntime-genai model (``og`` is the imported module)."""
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(ids) + new_tokens + 8, do_sample=False)
    generator = og.Generator(model, params)
    start = time.perf_counter()
    generator.append_tokens(np.asarray([list(ids)], dtype=np.int32))
    generator.generate_next_token()
    first = time.perf_counter()
    steps = 0
    while steps < new_tokens and not generator.is_done():
        generator.generate_next_token()
        steps += 1
    return first - start, steps, time.perf_counter() - first


def _timed(runner, ids: Sequence[int], new_tokens: int) -> tuple[float, int, float]:
    if runner.kind == "genai":
        return time_genai(runner.og, runner.model, ids, new_tokens)
    return time_bundle(runner.model, ids, new_tokens)


def worker(kind: str, path: str, threads: int) -> int:
    """Serve timing requests (one JSON line each on stdin) for one engine; replies are JSON lines on the real
    stdout (anything a library prints goes to stderr)."""
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)

    def reply(message: dict) -> None:
        replies.write(json.dumps(message) + "\n")

    from edgec.runners import BundleRunner, GenaiRunner

    try:
        runner = (BundleRunner if kind == "bundle" else GenaiRunner)(Path(path), threads or None)
        ids = list(range(1, WARM_UP[0] + 1))
        _timed(runner, ids, WARM_UP[1])
    except EdgecError as error:
        reply({"error": one_line(error, 2000)})
        return 2
    reply({"ready": True})
    for line in sys.stdin:
        request = json.loads(line)
        if request.get("quit"):
            reply({"peak_rss_bytes": peak_rss_bytes()})
            return 0
        ttft, steps, seconds = _timed(runner, request["ids"], request["new_tokens"])
        reply({"ttft_s": ttft, "steps": steps, "decode_s": seconds})
    return 0


# --- the engines, as the parent sees them ---------------------------------------------------------------------------
@dataclasses.dataclass
class Engine:
    path: Path
    name: str
    kind: str  # bundle | genai
    context: int
    vocab_size: int
    kv_bytes: Callable[[int], int | None]  # bytes the cache holds for that many tokens
    allocated_bytes: int | None  # what the runtime allocates for its cache (None: not known here)


def _bundle_engine(path: Path, name: str) -> Engine:
    from edgec.bundle import open_bundle, upgrade_manifest
    from edgec.kvcache.spec import CacheSpec

    manifest = upgrade_manifest(open_bundle(path))
    spec = CacheSpec.from_json(manifest["cache"])
    return Engine(
        path=path,
        name=name,
        kind="bundle",
        context=int(manifest["model"]["context"]),
        vocab_size=int(manifest["model"]["vocab_size"]),
        kv_bytes=spec.bytes_for,
        allocated_bytes=spec.total_bytes(),
    )


def _genai_kv_bytes_per_token(path: Path, decoder: dict) -> int | None:
    """k + v bytes per token of a genai model's cache: its shape from genai_config.json, its element type from the
    graph's first past-key input (None when either cannot be read)."""
    try:
        import onnx

        graph = onnx.load(str(path / decoder["filename"]), load_external_data=False).graph
        key = next(i for i in graph.input if "past" in i.name and "key" in i.name)
        itemsize = onnx.helper.tensor_dtype_to_np_dtype(key.type.tensor_type.elem_type).itemsize
        heads = decoder.get("num_key_value_heads") or decoder["num_attention_heads"]
        return int(2 * decoder["num_hidden_layers"] * heads * decoder["head_size"] * itemsize)
    except Exception:  # a layout this does not know: the bytes are reported as unknown, the timing still runs
        return None


def _genai_engine(path: Path, name: str) -> Engine:
    from edgec.runners import genai_config, require_genai

    require_genai(path)
    config = genai_config(path)
    per_token = _genai_kv_bytes_per_token(path, config.get("decoder", {}))
    return Engine(
        path=path,
        name=name,
        kind="genai",
        context=int(config.get("context_length", 0)),
        vocab_size=int(config.get("vocab_size", 0)),
        kv_bytes=(lambda tokens: per_token * tokens) if per_token else (lambda tokens: None),
        allocated_bytes=None,  # genai sizes its cache per generation (max_length)
    )


def open_engine(path: Path, name: str, first: bool) -> Engine:
    from edgec.runners import kind_of

    kind = kind_of(path)
    if kind == "bundle":
        return _bundle_engine(path, name)
    if kind == "genai" and not first:
        return _genai_engine(path, name)
    what = "an onnxruntime-genai folder" if kind == "genai" else "a model source"
    where = "BUNDLE must be an edgec bundle" if first else "--vs takes an edgec bundle or an onnxruntime-genai folder"
    raise BundleError(f"{one_line(path)} is {what}: {where}")


class Worker:
    """One engine's worker process."""

    def __init__(self, engine: Engine, threads: int | None) -> None:
        self.engine = engine
        self.log = tempfile.TemporaryFile(mode="w+")
        command = [sys.executable, "-m", "edgec.bench", "--worker", engine.kind, str(engine.path), str(threads or 0)]
        self.process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True, bufsize=1
        )
        try:
            self._receive()  # ready, or the reason it is not
        except EdgecError:
            self.log.close()
            raise

    def _receive(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            self.process.wait()
            self.log.seek(0)
            last = [text for text in self.log.read().splitlines() if text.strip()][-1:] or ["no output"]
            raise BenchError(
                f"{self.engine.name}: its worker ended (exit {self.process.returncode}): {one_line(last[0])}"
            )
        message = json.loads(line)
        if "error" in message:
            self.process.wait()
            raise EdgecError(f"{self.engine.name}: {message['error']}")
        return message

    def ask(self, request: dict) -> dict:
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        return self._receive()

    def close(self) -> int | None:
        """End the worker; its peak RSS in bytes (None when it had already ended)."""
        peak = None
        if self.process.poll() is None:
            try:
                peak = self.ask({"quit": True})["peak_rss_bytes"]
            except (EdgecError, OSError, ValueError):
                pass
            self.process.wait(timeout=60)
        self.log.close()
        return peak


# --- the benchmark --------------------------------------------------------------------------------------------------
def _unique_names(paths: Sequence[Path]) -> list[str]:
    names = [Path(p).name or str(p) for p in paths]
    return [name if names.count(name) == 1 else f"{name}#{i + 1}" for i, name in enumerate(names)]


def resolve_contexts(settings: BenchSettings, engines: list[Engine]) -> tuple[int, ...]:
    """The prompt lengths: each must leave room for the decode steps in every engine's context; the default ones
    that do not are left out (the largest that fits, where none does)."""
    room = min(engine.context for engine in engines) - settings.new_tokens - 1
    if room < 1:
        raise BenchError(
            f"--new-tokens {settings.new_tokens} leaves no room for a prompt in a "
            f"{room + settings.new_tokens + 1}-token context"
        )
    if settings.contexts is None:
        return tuple(n for n in DEFAULT_CONTEXTS if n <= room) or (room,)
    for engine in engines:
        for n in settings.contexts:
            if n + settings.new_tokens + 1 > engine.context:
                raise BenchError(
                    f"--contexts {n} is beyond the capacity of {one_line(engine.name)}: its context is "
                    f"{engine.context} tokens, and {n} + {settings.new_tokens + 1} new tokens would not fit"
                )
    return tuple(sorted(set(settings.contexts)))


def prompt_ids(bundle: Path, text: str, length: int) -> list[int]:
    from edgec.bundle import listed_file, read_manifest
    from edgec.runtime.tokenizer import BundleTokenizer

    tokenizer = BundleTokenizer(listed_file(bundle, read_manifest(bundle)["tokenizer"]["file"]), None)
    ids = tokenizer.encode(text)
    if len(ids) < length:
        raise BenchError(f"the text has {len(ids)} tokens; --contexts {length} needs that many: give a longer --text")
    return ids[:length]


def default_text() -> str:
    """Python's own documentation (pydoc_data, in every CPython): long, and always there."""
    from pydoc_data.topics import topics

    return "\n".join(topics[key] for key in sorted(topics))


def spread(values: Sequence[float]) -> dict[str, Any]:
    array = np.asarray(values, dtype=np.float64)
    q1, median, q3 = np.percentile(array, [25, 50, 75])
    return {
        "median": float(median),
        "min": float(array.min()),
        "max": float(array.max()),
        "iqr": [float(q1), float(q3)],
        "all": [float(v) for v in array],
    }


def bench(
    bundle: Path,
    vs: Sequence[Path] = (),
    settings: BenchSettings = BenchSettings(),
    text: str | None = None,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Measure ``bundle`` (and each of ``vs``) round by round; the report as a dict that serialises to JSON."""
    from edgec.evaluate import machine

    progress = progress or (lambda task, done, total: None)
    if settings.rounds < 1 or settings.new_tokens < 1:
        raise BenchError("--rounds and --new-tokens must be at least 1")
    paths = [Path(bundle), *map(Path, vs)]
    engines = [open_engine(p, n, i == 0) for i, (p, n) in enumerate(zip(paths, _unique_names(paths), strict=True))]
    for engine in engines[1:]:
        if engine.vocab_size != engines[0].vocab_size:
            raise BenchError(
                f"{one_line(engine.name)} has a vocabulary of {engine.vocab_size} tokens and "
                f"{one_line(engines[0].name)} {engines[0].vocab_size}: "
                "every engine is fed the same token ids, so compare builds of one model"
            )
    contexts = resolve_contexts(settings, engines)
    ids = prompt_ids(engines[0].path, text if text is not None else default_text(), max(contexts))
    workers: list[Worker] = []
    samples = {e.name: {n: [] for n in contexts} for e in engines}
    try:
        for index, engine in enumerate(engines):
            progress("loading", index, len(engines))
            workers.append(Worker(engine, settings.threads))
        progress("loading", len(engines), len(engines))
        total, done = settings.rounds * len(contexts) * len(workers), 0
        for round_index in range(settings.rounds):
            order = workers[round_index % len(workers) :] + workers[: round_index % len(workers)]
            for n in contexts:
                for worker in order:
                    progress("rounds", done, total)
                    samples[worker.engine.name][n].append(
                        worker.ask({"ids": ids[:n], "new_tokens": settings.new_tokens})
                    )
                    done += 1
        progress("rounds", total, total)
    finally:
        peaks = {worker.engine.name: worker.close() for worker in workers}
    return _report(engines, contexts, samples, peaks, settings, machine())


def _report(engines, contexts, samples, peaks, settings: BenchSettings, machine: dict) -> dict[str, Any]:
    def rates(name: str, n: int) -> dict[str, list[float]]:
        runs = samples[name][n]
        return {
            "ttft_s": [r["ttft_s"] for r in runs],
            "prefill_tok_s": [n / r["ttft_s"] for r in runs],
            "decode_tok_s": [
                r["steps"] / r["decode_s"] if r["steps"] and r["decode_s"] > 0 else float("nan") for r in runs
            ],
            "decode_steps": [r["steps"] for r in runs],
        }

    report: dict[str, Any] = {
        "date": date.today().isoformat(),
        "machine": machine,
        "threads": settings.threads,
        "rounds": settings.rounds,
        "new_tokens": settings.new_tokens,
        "contexts": list(contexts),
        "engines": [],
        "ratios": {},
    }
    for engine in engines:
        results = {}
        for n in contexts:
            measured = rates(engine.name, n)
            results[str(n)] = {key: spread(values) for key, values in measured.items() if key != "decode_steps"}
            results[str(n)]["decode_steps"] = measured["decode_steps"]
            results[str(n)]["kv_bytes"] = engine.kv_bytes(n + settings.new_tokens + 1)
        report["engines"].append(
            {
                "name": engine.name,
                "path": str(engine.path),
                "kind": engine.kind,
                "context": engine.context,
                "peak_rss_bytes": peaks.get(engine.name),
                "kv_allocated_bytes": engine.allocated_bytes,
                "results": results,
            }
        )
    first = engines[0].name
    for engine in engines[1:]:
        per_context = {}
        for n in contexts:
            ours, theirs = rates(first, n), rates(engine.name, n)
            per_context[str(n)] = {
                key: spread([a / b for a, b in zip(ours[key], theirs[key], strict=True)])
                for key in ("decode_tok_s", "prefill_tok_s")
            }
        report["ratios"][engine.name] = per_context
    return report


def summary(report: dict[str, Any]) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, columns, rows) for the terminal: one row per engine and prompt length, then the ratios."""
    from edgec.evaluate import size

    columns = ["engine", "prompt", "TTFT s", "prefill tok/s", "decode tok/s", "KV bytes", "peak RSS"]
    rows = []
    for engine in report["engines"]:
        for n in report["contexts"]:
            result = engine["results"][str(n)]
            kv = result["kv_bytes"]
            peak = engine["peak_rss_bytes"]
            rows.append(
                [
                    engine["name"],
                    str(n),
                    _median_range(result["ttft_s"], 3),
                    _median_range(result["prefill_tok_s"], 0),
                    _median_range(result["decode_tok_s"], 1),
                    size(kv) if kv is not None else "?",
                    size(peak) if peak else "?",
                ]
            )
    sections = [(f"speed: median (min–max) over {report['rounds']} alternating rounds", columns, rows)]
    if report["ratios"]:
        first = report["engines"][0]["name"]
        ratio_rows = [
            [
                name,
                str(n),
                _median_range(per[str(n)]["decode_tok_s"], 3, "×"),
                _median_range(per[str(n)]["prefill_tok_s"], 3, "×"),
            ]
            for name, per in report["ratios"].items()
            for n in report["contexts"]
        ]
        title = f"{first} ÷ each other engine, per round: median (min–max); > 1 means {first} is faster"
        sections.append((title, ["vs", "prompt", "decode", "prefill"], ratio_rows))
    return sections


def _median_range(stats: dict, digits: int, unit: str = "") -> str:
    return f"{stats['median']:.{digits}f}{unit} ({stats['min']:.{digits}f}–{stats['max']:.{digits}f})"


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--worker":
        sys.exit(worker(sys.argv[2], sys.argv[3], int(sys.argv[4])))
    sys.exit("usage: python -m edgec.bench --worker bundle|genai PATH THREADS (edgec bench runs it)")
