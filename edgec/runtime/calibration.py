"""Thread count and spinning chosen by measurement on this machine, once per bundle.

ONNX Runtime's defaults (one thread per core, pool threads that spin between nodes) are not what decodes fastest
everywhere: on a busy or small machine a spinning pool waits on descheduled threads at every one of a step's
thousands of small nodes, and more threads than a model's products can use only add waits (docs/BENCHMARKS.md,
"threads"). So the runtime measures instead of guessing: ``calibrate`` loads the bundle for each candidate setting
(1, 2, 4, … threads up to the cores this process may use, each spinning and not), times decode steps on a short
prompt, and keeps the fastest. It goes over the settings twice, the second time in reverse order, and averages each
setting's two times: the machine's speed drifts while it measures (other tenants of a shared host, clock changes),
and in one pass a drift falls on whichever settings came last. On a shared 2-vCPU box one pass chose no spinning
in two calibrations of five for a bundle whose steps took 17–25 ms spinning and 21–29 ms not in the others
(docs/BENCHMARKS.md, thirty-sixth round). Mirrored, a drift that is linear in time weighs every setting alike, and
each setting's time is two measurements some seconds apart.

The result is stored in the user's cache (``$EDGEC_CACHE_DIR``, default ``~/.cache/edgec``, ``calibration/``), keyed
by the bundle's manifest (which hashes every file) and the machine (CPU model, usable cores, ONNX Runtime version),
since a bundle folder may be read-only or shared between machines. The setting is for decode steps: a bundle with
its own prompt-chunk graph reads prompts on every usable core (``Model.load``), since a prompt chunk's products are
large enough to use them — a calibration that picked 1 thread for decode would otherwise read an 8K prompt ~1.8×
slower on 2 cores.

``Model.load`` uses a stored calibration when the caller names no thread count (and, for a named thread count, the
measured spinning choice at that count); ``Model.load(calibrate=True)`` — what ``edgec run``, ``chat`` and ``serve``
do — measures first when nothing is stored. A spinning choice is still dropped at load while other programs
occupy the cores (``backend_ort.allow_spinning``): a calibration is only stored when it was measured on a machine
that was otherwise idle, and a busy moment at load is not the machine it measured.

A stored file is input from outside like any other: it is used only when it parses, names this bundle and
machine, and its setting is within this machine's cores; anything else is ignored (and replaced by the next
calibration).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from edgec.errors import one_line
from edgec.runtime.user_cache import user_cache_dir

FORMAT = 2  # 2: the mean of two mirrored passes (format 1's single pass is measured again)
MAX_FILE_BYTES = 64 * 1024
PROMPT_TOKENS = 32
WARMUP_STEPS = 3
TIMED_STEPS = 16
ROUNDS = 2  # passes over the settings, every other one in reverse order
BUSY_LIMIT = 0.5  # runnable threads of other programs above which a measurement is not stored

log = logging.getLogger("edgec.runtime")


@dataclass(frozen=True, order=True)
class Setting:
    """One way to run ONNX Runtime's intra-op pool: its thread count and whether its threads spin."""

    threads: int
    spin: bool

    @property
    def label(self) -> str:
        return f"{self.threads} thread{'s' if self.threads > 1 else ''}" + (", spinning" if self.spin else "")


@dataclass
class Calibration:
    """What was measured: decode milliseconds per step for each setting tried, and the fastest."""

    best: Setting
    step_ms: dict[Setting, float]
    machine: str
    measured_at: str = ""
    busy: float = 0.0  # runnable threads of other programs while measuring
    stored: Path | None = field(default=None, compare=False)
    passes: dict[Setting, list[float]] = field(default_factory=dict, compare=False)  # each pass's time (step_ms: mean)

    def best_at(self, threads: int) -> Setting | None:
        """The faster spinning choice measured at ``threads`` (None: that count was not measured)."""
        tried = [(ms, s) for s, ms in self.step_ms.items() if s.threads == threads]
        return min(tried)[1] if tried else None

    def to_json(self, bundle_key: str) -> dict[str, Any]:
        def row(setting: Setting, ms: float) -> dict[str, Any]:
            passes = {"passes": [round(t, 3) for t in self.passes[setting]]} if setting in self.passes else {}
            return {"threads": setting.threads, "spin": setting.spin, "ms": round(ms, 3), **passes}

        return {
            "format": FORMAT,
            "bundle": bundle_key,
            "machine": self.machine,
            "measured_at": self.measured_at,
            "busy": round(self.busy, 2),
            "best": {"threads": self.best.threads, "spin": self.best.spin},
            "step_ms": [row(s, ms) for s, ms in self.step_ms.items()],
        }


def usable_cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo's first "model name"; else what ``platform`` knows)."""
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_key() -> str:
    """What a measurement depends on besides the bundle: the CPU, the cores this process may use, ONNX Runtime."""
    import onnxruntime

    return f"{cpu_model()} | {usable_cpus()} cpus | onnxruntime {onnxruntime.__version__}"


def candidates(cpus: int) -> list[Setting]:
    """1, 2, 4, … threads up to ``cpus`` (and ``cpus`` itself); each count above 1 spinning and not."""
    counts = sorted({*(1 << i for i in range(cpus.bit_length()) if 1 << i <= cpus), cpus})
    return [Setting(n, spin) for n in counts for spin in ((True, False) if n > 1 else (False,))]


def bundle_key(bundle: Path) -> str:
    """SHA-256 of the manifest: it hashes every file of the bundle, so a rebuilt bundle is measured again."""
    return hashlib.sha256((bundle / "manifest.json").read_bytes()).hexdigest()


def calibration_file(bundle_sha256: str, machine: str) -> Path:
    key = hashlib.sha256(f"{bundle_sha256}\n{machine}".encode()).hexdigest()[:40]
    return user_cache_dir() / "calibration" / f"{key}.json"


def runs_on_cpu(manifest: dict[str, Any], providers: list[str] | None = None) -> bool:
    """Whether a bundle (its manifest; ``providers``: a load's override) runs on ONNX Runtime's CPU provider — the
    only case with CPU threads to choose."""
    runtime = manifest["runtime"]
    first = (providers or runtime.get("providers") or ["CPUExecutionProvider"])[0]
    return runtime.get("library") == "onnxruntime" and first == "CPUExecutionProvider"


def stored_calibration(bundle: Path) -> Calibration | None:
    """The calibration stored for this bundle on this machine, or None (none, or a file that is not a valid one)."""
    machine, key = machine_key(), bundle_key(bundle)
    path = calibration_file(key, machine)
    try:
        if not path.is_file() or path.stat().st_size > MAX_FILE_BYTES:
            return None
        data = json.loads(path.read_text(encoding="utf-8"))
        if data.get("format") != FORMAT or data.get("bundle") != key or data.get("machine") != machine:
            return None
        cpus = usable_cpus()
        step_ms = {}
        for row in data["step_ms"]:
            setting = _setting(row, cpus)
            ms = float(row["ms"])
            if not 0 < ms < 1e7:
                return None
            step_ms[setting] = ms
        best = _setting(data["best"], cpus)
        if best not in step_ms:
            return None
        return Calibration(best, step_ms, machine, str(data.get("measured_at", "")), float(data.get("busy", 0)), path)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _setting(row: dict[str, Any], cpus: int) -> Setting:
    threads, spin = row["threads"], row["spin"]
    if type(threads) is not int or type(spin) is not bool or not 1 <= threads <= cpus:
        raise ValueError("a setting outside this machine")
    return Setting(threads, spin)


def calibrate(
    bundle: str | Path,
    settings: list[Setting] | None = None,
    steps: int = TIMED_STEPS,
    store: bool = True,
    report: Callable[[Setting, float], None] | None = None,
    measure: Callable[[Path, Setting, int], float] | None = None,
    rounds: int = ROUNDS,
) -> Calibration:
    """Measure decode milliseconds per step for each setting (default: ``candidates`` for this machine's cores)
    and keep the fastest; stored for the next load unless other programs kept the cores busy meanwhile (then
    it is used for this load only) or ``store`` is False. ``rounds`` passes over the settings, every other one in
    reverse order; a setting's time is the mean of its passes. ``report(setting, ms)`` is called after each
    measurement."""
    from edgec.runtime.backend_ort import busy_elsewhere

    bundle = Path(bundle)
    settings = settings or candidates(usable_cpus())
    measure = measure or decode_step_ms
    busy = [busy_elsewhere()]
    passes: dict[Setting, list[float]] = {setting: [] for setting in settings}
    for round_index in range(max(1, rounds)):
        for setting in settings if round_index % 2 == 0 else settings[::-1]:
            passes[setting].append(measure(bundle, setting, steps))
            busy.append(busy_elsewhere())
            if report:
                report(setting, passes[setting][-1])
    step_ms = {setting: statistics.fmean(times) for setting, times in passes.items()}
    best = min(step_ms, key=lambda s: (step_ms[s], s.threads, s.spin))  # a tie goes to fewer threads
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    result = Calibration(best, step_ms, machine_key(), stamp, max(busy), passes=passes)
    if store and result.busy <= BUSY_LIMIT:
        key = bundle_key(bundle)
        path = calibration_file(key, result.machine)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            temporary = path.with_suffix(f".tmp{os.getpid()}")
            temporary.write_text(json.dumps(result.to_json(key), indent=1), encoding="utf-8")
            os.replace(temporary, path)
            result.stored = path
        except OSError as error:  # a read-only home: the measurement still serves this load
            log.warning("calibration not stored (%s): %s", path.parent, error.strerror or error)
    return result


def decode_step_ms(bundle: Path, setting: Setting, steps: int = TIMED_STEPS) -> float:
    """Median wall milliseconds of one decode step on a fresh load with ``setting``, after a short prompt."""
    from edgec.runtime.model import Model

    with Model.load(bundle, threads=setting.threads, spin=setting.spin) as model:
        vocab = model.vocab_size
        total = max(3, min(PROMPT_TOKENS + WARMUP_STEPS + steps, model.context))  # a short context: fewer steps
        prompt = max(1, min(PROMPT_TOKENS, total // 4))
        steps = min(steps, total - prompt - 1)
        ids = [(7 + 31 * i) % vocab for i in range(total)]  # content is irrelevant
        stream = model.iter_logits(ids, prompt_tokens=prompt)
        times = []
        try:
            for position, _ in stream:
                times.append(time.perf_counter())
                if position + 1 >= len(ids):
                    break
        finally:
            stream.close()
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)][-steps:]
    return 1000 * statistics.median(gaps)


def resolve(
    bundle: Path, threads: int | None, spin: bool | None, calibrate_missing: bool
) -> tuple[int | None, bool | None]:
    """The thread count and spinning a load uses: what the caller named; else the stored calibration's (measured
    first when ``calibrate_missing``); else (None, None): ONNX Runtime's thread default and the load rule. A
    calibrated "spin" still yields to other programs busy at this load (``allow_spinning``)."""
    from edgec.runtime.backend_ort import allow_spinning

    if spin is not None and threads is not None:
        return threads, spin
    found = stored_calibration(bundle)
    if found is None and calibrate_missing:
        log.info("measuring threads and spinning for this bundle on this machine (once)")
        try:
            found = calibrate(bundle)
        except Exception as error:  # a measurement that cannot run must not stop the load: the old defaults then
            log.warning("calibration failed (%s): ONNX Runtime's thread default", one_line(error))
            found = None
    if found is None:
        return threads, spin
    chosen = found.best if threads is None else found.best_at(threads)
    if chosen is None:  # a thread count the calibration did not try (more than the cores)
        return threads, spin
    if spin is None and os.environ.get("EDGEC_ORT_SPIN") not in ("0", "1"):  # the variable still forces it
        spin = chosen.spin and allow_spinning(chosen.threads)
    return chosen.threads, spin
