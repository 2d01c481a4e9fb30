"""GPU check, run on the GPU machine from a pack made by benchmarks/gpu_prepare.py (no network needed there).

    bash gpu_check.sh                      # from the unpacked pack folder (or: python3 gpu_check.py --pack DIR)
    bash gpu_check.sh --budget 420 --out results.json

It finds the GPU (nvidia-smi), picks the bundles that GPU can run — TensorRT-RTX engines only on compute capability
7.5/8.6/8.9/12.x and only the one built for this GPU's capability; the ONNX Runtime CUDA bundles anywhere — installs
the pack's wheels into a venv of its own (pip --no-index --require-hashes), unpacks each chosen bundle (every file
checked against PACK.json), and gives each bundle one try in a child process of its own, with a time limit:
a failure is reported and the next bundle still runs. Per bundle it reports

- peak GPU memory above a baseline read before the bundle is loaded (device-wide, sampled every 20 ms by NVML),
- prefill tok/s and decode tok/s, measured separately, at ~1K and ~16K prompt tokens (where the bundle's context
  allows; 64 greedy decode steps, EOS ignored),
- the logits of the GPU run against ONNX Runtime's CPU provider on the bundle's own ONNX graph (the fp16 graph any
  engine was built from) for a short prompt: max |Δlogit| and whether the top-1 token agrees,
- the note naming nodes the CUDA provider left to the CPU, if any,
- what `edgec serve` budgets a GPU bundle by: the runtime's reading of the GPU's memory beside NVML's, and the device
  memory one more cache state takes against its price (``Model.session_bytes``),

then writes results.json and prints a table. The whole run stays inside --budget seconds (default 450: under the
8 minutes it must fit); bundles that no longer fit are reported as skipped.

Stdlib only until a child process imports the runtime, so it starts on a bare Python.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TENSORRT_RTX_CAPABILITIES = ((7, 5), (8, 6), (8, 9), (12, 0), (12, 1))  # where TensorRT-RTX runs (not sm90)
LENGTHS = (1024, 16000)  # prompt tokens: "1K" and "16K" (16000 + 64 decode steps fit a 16K context)
DECODE_STEPS = 64
SHORT_PROMPT = 32  # tokens of the logits comparison against ONNX Runtime CPU
DEFAULT_BUDGET_S = 450.0
TRY_LIMIT_S = 240.0  # one bundle's try, at most
RESERVE_S = 10.0  # kept back for writing the results


class CheckError(Exception):
    """A problem that ends the check: one `error:` line, exit 2."""


# --- the GPU and the bundles it can run -------------------------------------------------------------------------
@dataclass(frozen=True)
class Gpu:
    name: str
    capability: tuple[int, int]
    memory_mib: int
    driver: str = ""

    def to_json(self) -> dict[str, Any]:
        major, minor = self.capability
        return {"name": self.name, "compute_capability": f"{major}.{minor}", "memory_mib": self.memory_mib,
                "driver": self.driver}  # fmt: skip

    @property
    def sm(self) -> str:
        return "sm{}{}".format(*self.capability)


def parse_nvidia_smi(text: str) -> Gpu:
    """The first GPU of ``nvidia-smi --query-gpu=name,compute_cap,memory.total,driver_version
    --format=csv,noheader,nounits``."""
    for line in text.splitlines():
        fields = [part.strip() for part in line.split(",")]
        if len(fields) >= 3 and fields[0]:
            major, _, minor = fields[1].partition(".")
            driver = fields[3] if len(fields) > 3 else ""
            return Gpu(fields[0], (int(major), int(minor or 0)), int(float(fields[2])), driver)
    raise CheckError(f"nvidia-smi listed no GPU ({text.strip()[:200] or 'no output'})")


def detect_gpu() -> Gpu:
    query = "--query-gpu=name,compute_cap,memory.total,driver_version"
    try:
        done = subprocess.run(
            ["nvidia-smi", query, "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=60
        )
    except FileNotFoundError:
        raise CheckError("no NVIDIA GPU here: nvidia-smi is not installed (no NVIDIA driver)") from None
    except subprocess.TimeoutExpired:
        raise CheckError("nvidia-smi did not answer within 60 s") from None
    if done.returncode:
        raise CheckError(f"nvidia-smi failed: {(done.stderr or done.stdout).strip().splitlines()[-1:]}")
    return parse_nvidia_smi(done.stdout)


@dataclass(frozen=True)
class Entry:
    """One bundle of the pack, as PREPARED.json lists it."""

    pack: str  # the archive, relative to the pack folder
    bundle: str  # the bundle folder inside it
    target: str
    runtime: str  # ort-cuda | tensorrt-rtx
    compute_capability: str
    model: str
    context: int
    wheels: bool = False  # whether this archive carries its runtime's wheels
    wheels_problem: str = ""  # why gpu_prepare.py could not pack them, if it could not

    @property
    def capability(self) -> tuple[int, int]:
        major, _, minor = self.compute_capability.partition(".")
        return int(major), int(minor or 0)

    @property
    def backend(self) -> str:
        return "TensorRT-RTX" if self.runtime == "tensorrt-rtx" else "ORT CUDA"


def select(entries: list[Entry], gpu: Gpu) -> tuple[list[Entry], dict[str, str]]:
    """The bundles this GPU runs, and why each other one is skipped (by bundle name)."""
    chosen, skipped = [], {}
    for entry in entries:
        if entry.runtime == "tensorrt-rtx":
            if gpu.capability not in TENSORRT_RTX_CAPABILITIES:
                skipped[entry.bundle] = f"TensorRT-RTX does not run on {gpu.sm} ({gpu.name})"
            elif entry.capability != gpu.capability:
                skipped[entry.bundle] = (
                    f"engine built for sm{entry.compute_capability.replace('.', '')}; this GPU is {gpu.sm}"
                )
            else:
                chosen.append(entry)
        elif entry.runtime == "ort-cuda":
            if gpu.capability < entry.capability:
                skipped[entry.bundle] = f"target {entry.target} needs compute capability ≥ {entry.compute_capability}"
            else:
                chosen.append(entry)
        else:
            skipped[entry.bundle] = f"runtime {entry.runtime} is not a GPU runtime this check runs"
    return chosen, skipped


def without_wheels(chosen: list[Entry], entries: list[Entry]) -> dict[str, str]:
    """The chosen bundles whose runtime no pack carries wheels for (they cannot be installed here), and why."""
    carried = {entry.runtime for entry in entries if entry.wheels}
    return {
        entry.bundle: f"the pack carries no {entry.runtime} wheels ({entry.wheels_problem or 'packed without'})"
        for entry in chosen
        if entry.runtime not in carried
    }


def read_prepared(pack_dir: Path) -> tuple[dict[str, Any], list[Entry]]:
    path = pack_dir / "PREPARED.json"
    if not path.is_file():
        raise CheckError(f"{pack_dir} holds no PREPARED.json: make the pack with benchmarks/gpu_prepare.py")
    info = json.loads(path.read_text())
    return info, [Entry(**{k: item[k] for k in Entry.__dataclass_fields__ if k in item}) for item in info["packs"]]


# --- installing from the pack ------------------------------------------------------------------------------------
def _pack_info(archive: Path) -> tuple[tarfile.TarFile, dict[str, Any]]:
    tar = tarfile.open(archive, "r:")
    return tar, json.loads(tar.extractfile("PACK.json").read())


def install(pack_dir: Path, entries: list[Entry], venv: Path, python: str) -> Path:
    """A venv holding the wheels of the chosen bundles' runtimes (each wheel checked against its pack's PACK.json,
    then installed by pip from those files alone), plus the CUDA libraries' wheels if the pack has them."""
    marker = venv / "edgec-check.json"
    wheels: dict[str, str] = {}  # file name → sha256
    staging = venv.parent / "wheels"
    staging.mkdir(parents=True, exist_ok=True)
    for entry in {e.pack: e for e in entries if e.wheels}.values():
        tar, info = _pack_info(pack_dir / entry.pack)
        with tar:
            for name, record in info["files"].items():
                if name.startswith("wheels/"):
                    wheels[name[len("wheels/") :]] = record["sha256"]
                    target = staging / name[len("wheels/") :]
                    if not target.exists() or _sha256(target) != record["sha256"]:
                        with tar.extractfile(name) as source, open(target, "wb") as sink:
                            shutil.copyfileobj(source, sink, 1 << 22)
                    if _sha256(target) != record["sha256"]:
                        raise CheckError(f"{name} in {entry.pack} differs from its PACK.json: damaged pack")
    # wheels beside the packs (gpu_prepare.py): nvidia-ml-py, and with --cuda-libs the CUDA/cuDNN libraries
    extras = [pack_dir / folder / "requirements.txt" for folder in ("tools", "cuda-libs")]
    extras = [path for path in extras if path.is_file()]
    wanted = {"wheels": wheels, "extras": [str(path) for path in extras]}
    if marker.is_file() and json.loads(marker.read_text()) == wanted:
        return venv / "bin" / "python"
    if not wheels:
        raise CheckError("none of the chosen bundles' packs carries wheels: rebuild the pack with gpu_prepare.py")
    shutil.rmtree(venv, ignore_errors=True)
    _run([python, "-m", "venv", str(venv)], "creating the venv")
    requirements = venv.parent / "requirements.txt"
    lines = [f"{staging / name} --hash=sha256:{digest}" for name, digest in sorted(wheels.items())]
    for extra in extras:  # pinned the same way
        lines += [line.replace("wheels/", f"{extra.parent}/", 1) for line in extra.read_text().splitlines() if line]
    requirements.write_text("\n".join(lines) + "\n")
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-index", "--require-hashes"]
    _run([*pip, "-r", str(requirements)], "installing the pack's wheels")
    marker.write_text(json.dumps(wanted))
    return venv / "bin" / "python"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        while block := stream.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def _run(command: list[str], doing: str, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode:
        last = (done.stderr.strip() or done.stdout.strip() or "no output").splitlines()[-1]
        raise CheckError(f"{doing} failed: {last}")
    return done.stdout


def cuda_library_dirs(python_executables: list[str]) -> list[str]:
    """Folders holding CUDA libraries installed as wheels (nvidia/*/lib) in these Pythons' site-packages, and the
    system CUDA's: onnxruntime-gpu loads libcudart/libcublas/cuDNN by name, so they go on LD_LIBRARY_PATH."""
    script = (
        "import glob, json, site, sys; roots = site.getsitepackages() + [site.getusersitepackages()]; "
        "print(json.dumps(sorted({d for r in roots for d in glob.glob(r + '/nvidia/*/lib')})))"
    )
    found: list[str] = []
    for python in python_executables:
        try:
            done = subprocess.run([python, "-c", script], capture_output=True, text=True, timeout=60)
            found += [d for d in json.loads(done.stdout or "[]") if d not in found]
        except (OSError, ValueError, subprocess.TimeoutExpired):
            continue
    return found + [d for d in ("/usr/local/cuda/lib64",) if os.path.isdir(d)]


# --- one try per bundle, inside the budget -----------------------------------------------------------------------
@dataclass
class Trial:
    entry: Entry
    status: str = "skipped"  # ok | failed | skipped
    reason: str = ""
    seconds: float = 0.0
    result: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        head = {"bundle": self.entry.bundle, "target": self.entry.target, "backend": self.entry.backend}
        return head | {"model": self.entry.model, "status": self.status, "reason": self.reason,
                       "seconds": round(self.seconds, 1)} | self.result  # fmt: skip


def run_trials(entries: list[Entry], attempt, budget_s: float, started: float) -> list[Trial]:
    """``attempt(entry, limit_s)`` → result dict, raising on failure. Each bundle gets one try; a failure or a
    timeout is recorded and the next bundle still runs; a bundle the remaining budget cannot fit is skipped."""
    trials = []
    for entry in entries:
        trial = Trial(entry)
        left = budget_s - (time.monotonic() - started) - RESERVE_S
        if left < 20:
            trial.reason = f"not run: the {budget_s:.0f} s budget was spent"
        else:
            begin = time.monotonic()
            try:
                trial.result = attempt(entry, min(TRY_LIMIT_S, left))
                trial.status = "ok"
            except subprocess.TimeoutExpired as timeout:
                trial.status, trial.reason = "failed", f"timed out after {timeout.timeout:.0f} s"
            except Exception as error:  # any failure of one bundle is that bundle's result, never the end
                trial.status, trial.reason = "failed", " ".join(str(error).split())[:400] or type(error).__name__
            trial.seconds = time.monotonic() - begin
        trials.append(trial)
    return trials


def child_attempt(python: str, pack_dir: Path, work: Path, env: dict[str, str], providers: str | None = None):
    """An ``attempt`` running each bundle in a child process of ``python`` (unpacking it first, every file checked)."""

    def attempt(entry: Entry, limit_s: float) -> dict[str, Any]:
        bundle = work / "bundles" / Path(entry.pack).stem / entry.bundle
        if not (bundle / "manifest.json").is_file():
            unpack = "import sys; from edgec.pack import unpack; unpack(sys.argv[1], sys.argv[2])"
            shutil.rmtree(bundle.parent, ignore_errors=True)
            _run([python, "-c", unpack, str(pack_dir / entry.pack), str(bundle.parent)], f"unpacking {entry.pack}", env)
        out = work / "results" / f"{entry.bundle}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.unlink(missing_ok=True)
        command = [python, str(Path(__file__).resolve()), "--child", str(bundle), "--result", str(out)]
        if providers:
            command += ["--providers", providers]
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=limit_s)
        if done.returncode or not out.is_file():
            lines = [line for line in done.stderr.splitlines() if line.strip()]
            raise RuntimeError(lines[-1] if lines else f"exit code {done.returncode}")
        return json.loads(out.read_text())

    return attempt


# --- inside the child: measure one bundle ------------------------------------------------------------------------
class VramSampler:
    """Device-wide used memory, sampled every 20 ms in a thread (NVML, else nvidia-smi); peak minus a baseline read
    before anything is loaded. Device-wide: another process's memory on the same GPU would count too."""

    def __init__(self) -> None:
        self.read, self.interval = self._reader()
        self.baseline = min(self.read() for _ in range(3)) if self.read else None
        self.peak = self.baseline
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        if self.read:
            self._thread.start()

    @staticmethod
    def _reader():
        try:
            import pynvml

            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(int(os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]))
            return (lambda: pynvml.nvmlDeviceGetMemoryInfo(handle).used / 2**20), 0.02
        except Exception:  # no NVML binding or no GPU: nvidia-smi, if there is one (a process per read: slower)
            if shutil.which("nvidia-smi") is None:
                return None, 0.0
            query = ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"]
            return (lambda: float(subprocess.run(query, capture_output=True, text=True).stdout.split()[0])), 0.2

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, self.read())

    def above_baseline(self) -> float | None:
        self._stop.set()
        if self.read is None:
            return None
        self.peak = max(self.peak, self.read())
        return round(self.peak - self.baseline, 1)


def measure(bundle: Path, providers: list[str] | None = None) -> dict[str, Any]:
    """Everything the table shows for one bundle (run in its own process: a fresh GPU context, a clean baseline)."""
    sampler = VramSampler()  # before the runtime (and its CUDA context) exists
    import logging

    import numpy as np

    from edgec.runtime import Model
    from edgec.runtime.backend_ort import open_backend

    notes: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: notes.append(record.getMessage())
    logging.getLogger("edgec.runtime").addHandler(handler)
    begin = time.perf_counter()
    model = Model.load(bundle, providers=providers)
    result: dict[str, Any] = {"load_s": round(time.perf_counter() - begin, 2), "providers": model.providers}
    ids = np.asarray(model.encode(_text()[:300_000]), np.int64)
    while len(ids) < max(LENGTHS) + DECODE_STEPS:  # a long enough prompt from the same text, repeated
        ids = np.concatenate([ids, ids])
    state = model._backend.open_state()  # the runtime's step interface (edgec/runtime/step.py)
    _prefill(model, state, ids[:64])  # warm-up: kernel selection, TensorRT-RTX's JIT, ORT's arena
    _decode(state, ids[:64], 8)
    result["lengths"] = {}
    for length in LENGTHS:
        if length + DECODE_STEPS > model.context:
            continue
        prompt = ids[:length]
        begin = time.perf_counter()
        logits = _prefill(model, state, prompt)
        prefill_s = time.perf_counter() - begin
        begin = time.perf_counter()
        _decode(state, prompt, DECODE_STEPS, logits)
        decode_s = time.perf_counter() - begin
        result["lengths"][str(length)] = {
            "prefill_tokens": length,
            "prefill_s": round(prefill_s, 3),
            "prefill_tok_s": round(length / prefill_s, 1),
            "decode_tokens": DECODE_STEPS,
            "decode_tok_s": round(DECODE_STEPS / decode_s, 1),
        }
    short = ids[:SHORT_PROMPT]
    got = _prefill(model, state, short).astype(np.float32)
    result["device_memory"] = device_memory_check(model, sampler)
    state.close()
    result["vram_baseline_mib"] = None if sampler.baseline is None else round(sampler.baseline, 1)
    result["vram_peak_above_baseline_mib"] = sampler.above_baseline()
    model.close()
    manifest = model.manifest  # the same graph on ONNX Runtime's CPU provider (what any engine was built from)
    cpu = open_backend(bundle, manifest["model"], model.cache_spec, model.prefill_chunk, ["CPUExecutionProvider"])
    want = _prefill(model, cpu.open_state(), short).astype(np.float32)
    result["logits_vs_ort_cpu"] = {
        "prompt_tokens": len(short),
        "max_abs_diff": float(np.abs(got - want).max()),
        "top1_same": bool(got.argmax() == want.argmax()),
    }
    result["cpu_nodes_note"] = notes[0] if notes else None
    return result


def device_memory_check(model, sampler: VramSampler) -> dict[str, Any] | None:
    """What `edgec serve` budgets a GPU bundle by, on the real GPU: the runtime's reading of the GPU
    (``Model.device_memory``: cudaMemGetInfo, or the driver in the CUDA provider's context) beside NVML's, and the
    device memory one more cache state takes against its price (``Model.session_bytes``). None on host states."""
    before = model.device_memory()
    if before is None:
        return None
    extra = model._backend.open_state()
    after = model.device_memory()
    extra.close()
    nvml_used = sampler.read() if sampler.read else None
    return {
        "free_mib": round(before[0] / 2**20, 1),
        "total_mib": round(before[1] / 2**20, 1),
        "used_mib": round((before[1] - before[0]) / 2**20, 1),
        "nvml_used_mib": None if nvml_used is None else round(nvml_used, 1),
        "state_bytes_taken": int(before[0] - after[0]) if after is not None else None,
        "state_bytes_priced": int(model.session_bytes()),
    }


def _text() -> str:
    from pydoc_data.topics import topics  # in every CPython: the same text on every machine

    return "\n".join(topics[key] for key in sorted(topics))


def _prefill(model, state, ids):
    """The prompt in the bundle's prefill chunks through the real cache path; the last position's logits."""
    state.reset()
    state.begin_prompt(len(ids))
    start = 0
    for start, end in model._chunks(len(ids)):
        logits = state.run(ids[start:end], start, last_only=True)
    state.end_prompt(len(ids) - 1, last_chunk_start=start)
    return logits[-1].copy()


def _decode(state, prompt, steps: int, logits=None) -> None:
    import numpy as np

    token = np.zeros(1, np.int64)
    token[0] = int(logits.argmax()) if logits is not None else int(prompt[-1])
    for position in range(len(prompt), len(prompt) + steps):
        token[0] = int(state.run(token, position, last_only=True)[-1].argmax())  # greedy; EOS ignored


# --- the report --------------------------------------------------------------------------------------------------
def table(gpu: Gpu, trials: list[Trial]) -> str:
    head = ("bundle", "backend", "status", "load s", "VRAM +MiB", "1K prefill", "1K decode", "16K prefill",
            "16K decode", "max|Δlogit| vs ORT CPU")  # fmt: skip
    rows = [head]
    for trial in trials:
        r = trial.result
        speeds = [_speed(r, length, kind) for length in LENGTHS for kind in ("prefill", "decode")]
        logits = r.get("logits_vs_ort_cpu")
        same = logits and ("same" if logits["top1_same"] else "DIFFERS")
        compared = f"{logits['max_abs_diff']:.3g} (top-1 {same})" if logits else "—"
        vram = r.get("vram_peak_above_baseline_mib")
        load = f"{r['load_s']:.1f}" if "load_s" in r else "—"
        vram_text = f"{vram:,.0f}" if vram is not None else "—"
        rows.append((trial.entry.bundle, trial.entry.backend, trial.status, load, vram_text, *speeds, compared))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = [f"GPU: {gpu.name} ({gpu.sm}, {gpu.memory_mib:,} MiB, driver {gpu.driver})"]
    for index, row in enumerate(rows):
        lines.append("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())
        if index == 0:
            lines.append("  ".join("-" * width for width in widths))
    lines += [f"{t.entry.bundle}: {t.status}: {t.reason}" for t in trials if t.reason]
    lines += [f"{t.entry.bundle}: {t.result['cpu_nodes_note']}" for t in trials if t.result.get("cpu_nodes_note")]
    for trial in trials:
        if memory := trial.result.get("device_memory"):
            lines.append(
                f"{trial.entry.bundle}: the runtime reads {memory['used_mib']:,.0f} of {memory['total_mib']:,.0f} MiB "
                f"in use (NVML {memory['nvml_used_mib']}); one more cache state took {memory['state_bytes_taken']:,} "
                f"bytes of the GPU, priced {memory['state_bytes_priced']:,} (edgec serve's budget)"
            )
    return "\n".join(lines)


def _speed(result: dict[str, Any], length: int, kind: str) -> str:
    value = result.get("lengths", {}).get(str(length), {}).get(f"{kind}_tok_s")
    return f"{value:,.0f} tok/s" if value is not None else "—"


def _default_pack() -> Path:
    """The folder gpu_prepare.py copied this script into, or (run from the repository) benchmarks/out/gpu-pack."""
    here = Path(__file__).resolve().parent
    return here if (here / "PREPARED.json").is_file() else here / "out" / "gpu-pack"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pack", type=Path, default=_default_pack(), help="the pack folder gpu_prepare.py made")
    parser.add_argument("--work", type=Path, default=None, help="where the venv, bundles and results go")
    parser.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S, help="seconds for the whole run")
    parser.add_argument("--out", type=Path, default=None, help="results JSON [default: WORK/results.json]")
    parser.add_argument("--gpu", default=None, help="'NAME,CC,MiB' instead of asking nvidia-smi (dry runs)")
    parser.add_argument("--no-install", action="store_true", help="use this Python (edgec installed) as it is")
    parser.add_argument("--providers", default=None, help="child: ONNX Runtime providers instead of the bundle's")
    parser.add_argument("--child", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:  # one bundle's try, in its own process
        providers = args.providers.split(",") if args.providers else None
        args.result.write_text(json.dumps(measure(args.child, providers), indent=2))
        return 0
    started = time.monotonic()
    try:
        gpu = parse_nvidia_smi(args.gpu) if args.gpu else detect_gpu()
        info, entries = read_prepared(args.pack)
        chosen, skipped = select(entries, gpu)
        unready: dict[str, str] = {}  # chosen, but failed before their try
        work = args.work or args.pack / "check"
        work.mkdir(parents=True, exist_ok=True)
        print(f"GPU: {gpu.name}, {gpu.sm}; running {len(chosen)} of {len(entries)} bundles")
        for bundle, reason in skipped.items():
            print(f"  skip {bundle}: {reason}")
        if not args.no_install:
            unready = without_wheels(chosen, entries)
            chosen = [entry for entry in chosen if entry.bundle not in unready]
        installed = args.no_install or not chosen
        python = sys.executable if installed else str(install(args.pack, chosen, work / "venv", sys.executable))
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        libraries = cuda_library_dirs([python, "python3", "/usr/bin/python3"])
        env["LD_LIBRARY_PATH"] = ":".join([*libraries, env.get("LD_LIBRARY_PATH", "")]).strip(":")
        attempt = child_attempt(python, args.pack, work, env, args.providers)
        trials = run_trials(chosen, attempt, args.budget, started)
    except CheckError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    not_ready = [Trial(entry, "failed", unready[entry.bundle]) for entry in entries if entry.bundle in unready]
    skipped_trials = [Trial(entry, reason=skipped[entry.bundle]) for entry in entries if entry.bundle in skipped]
    trials += not_ready
    all_trials = trials + skipped_trials
    total = time.monotonic() - started
    report = {
        "gpu": gpu.to_json(),
        "prepared": {key: info.get(key) for key in ("made", "edgec_version", "python", "platform")},
        "budget_s": args.budget,
        "total_s": round(total, 1),
        "results": [trial.to_json() for trial in all_trials],
    }
    out = args.out or work / "results.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(table(gpu, all_trials))
    print(f"total {total:.0f} s (budget {args.budget:.0f} s); results: {out}")
    return 0 if all(t.status != "failed" for t in trials) else 1


if __name__ == "__main__":
    sys.exit(main())
