"""`edgec eval`: how good bundles are, measured through the runtime on a text the user gives.

Metrics (each selectable by name):

- ``perplexity`` — exp(mean NLL) over windows of each chosen length taken one after another from the start of the
  text (``Model.logprobs``: the prompt path, in prefill chunks), per window and pooled;
- ``passkey`` — a 5-digit key hidden at a relative depth of the text, asked for at the end; a trial succeeds when
  the greedy continuation (8 tokens) contains the key; accuracy per (length, depth) cell;
- ``agreement`` — greedy continuations of a few prompts from the text against a reference: the fraction of
  identical tokens, position by position, and where each first diverges;
- ``consistency`` — one prompt generated ``runs`` times: the same tokens each time, and the same logits (teacher
  forced over prompt + answer) bitwise or by how much;
- ``error_curve`` — per position of a long teacher-forced stretch of the text, KL(reference ‖ bundle) of the
  next-token distributions, max |Δlogit| and top-1 agreement. The first tokens are read as a prompt and every later
  one as a decode step, so a compressed cache evicts and quantizes exactly as while generating: the numerical error
  accumulation curve.

The reference (``agreement``, ``error_curve``, and a baseline perplexity) is another bundle or the source model (a
Hugging Face folder or GGUF run by transformers + torch, imported only then). Every check of the settings against
the bundles, the reference and the text happens before a metric runs.
"""

from __future__ import annotations

import dataclasses
import math
import os
import platform
from collections.abc import Callable, Iterator, Sequence
from datetime import date
from pathlib import Path
from typing import Any

import numpy as np

from edgec.errors import BundleError, EdgecError, one_line

METRICS = ("perplexity", "passkey", "agreement", "consistency", "error_curve")
NEEDS_REFERENCE = ("agreement", "error_curve")

# the passkey prompt (as benchmarks/passkey.py has always built it)
INTRO = (
    "There is an important piece of information hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about the important information there.\n\n"
)
NEEDLE = "\nThe pass key is {key}. Remember it. {key} is the pass key.\n"
QUESTION = "\n\nWhat is the pass key? The pass key is"
PASSKEY_NEW_TOKENS = 8
PROMPT_TOKENS = 64  # agreement and consistency prompts: this many tokens of the text
CURVE_PROMPT = 16  # error curve: tokens read as a prompt before the decode steps
DEFAULT_WINDOWS = (512, 1024)
DEFAULT_PASSKEY_LENGTHS = (512, 1024, 2048)
DEFAULT_CURVE_TOKENS = 1024

Progress = Callable[[str, int, int], None]  # (task, done, total)


@dataclasses.dataclass(frozen=True)
class EvalSettings:
    metrics: tuple[str, ...] = METRICS
    windows: tuple[int, ...] | None = None  # perplexity window lengths; None: 512 and 1024 as far as contexts allow
    window_count: int = 2  # windows per length
    lengths: tuple[int, ...] | None = None  # passkey lengths; None: 512/1024/2048 as far as every context allows
    depths: tuple[float, ...] = (0.1, 0.5, 0.9)
    trials: int = 1  # passkey trials per cell
    seed: int = 0
    prompts: int = 3  # agreement prompts
    new_tokens: int = 32  # agreement and consistency
    runs: int = 3  # consistency
    curve_tokens: int | None = None  # None: 1024 as far as every context and the text allow
    threads: int | None = None


class EvalError(EdgecError):
    """Settings that these bundles, this reference or this text cannot honour."""


def check_metrics(metrics: Sequence[str], reference: Path | None, explicit: bool) -> tuple[str, ...]:
    """The metrics to run: unknown names are an error; those that need a reference are an error when asked for
    by name without one, and left out (with the rest kept) when they were not named."""
    unknown = [m for m in metrics if m not in METRICS]
    if unknown:
        raise EvalError(f"unknown metric {one_line(unknown[0])!r} in --only; the metrics are {', '.join(METRICS)}")
    if reference is None:
        missing = [m for m in metrics if m in NEEDS_REFERENCE]
        if missing and explicit:
            raise EvalError(f"{missing[0]} compares with a reference: give --reference MODEL_OR_BUNDLE")
        metrics = [m for m in metrics if m not in NEEDS_REFERENCE]
    return tuple(dict.fromkeys(metrics))


def read_text(path: Path) -> str:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        reason = error.strerror if isinstance(error, OSError) and error.strerror else type(error).__name__
        raise EvalError(f"cannot read the text {one_line(path)}: {reason}") from None
    if not text.strip():
        raise EvalError(f"the text {one_line(path)} is empty")
    return text


# --- what each bundle needs, checked before anything runs ------------------------------------------------------------
@dataclasses.dataclass
class Subject:
    """One bundle to evaluate: its manifest, its tokenizer's view of the text, and the sizes settings are held to."""

    path: Path
    name: str
    manifest: dict[str, Any]
    context: int
    vocab_size: int
    ids: list[int]  # the text, as the bundle's tokenizer encodes it (special tokens as it adds them)
    plain_ids: list[int]  # the text without special tokens (passkey filler)
    head: list[int]  # the passkey intro as a prompt starts (BOS where the tokenizer adds one)
    fixed: dict[str, list[int]]  # passkey question and a sample needle


def open_subject(path: Path, text: str, name: str) -> Subject:
    from edgec.bundle import listed_file, open_bundle, upgrade_manifest
    from edgec.runtime.tokenizer import BundleTokenizer

    if not Path(path).is_dir():
        raise BundleError(f"{one_line(path)} is not a folder (an edgec bundle)")
    manifest = upgrade_manifest(open_bundle(path))
    tokenizer = BundleTokenizer(listed_file(Path(path), manifest["tokenizer"]["file"]), None)
    return Subject(
        path=Path(path),
        name=name,
        manifest=manifest,
        context=int(manifest["model"]["context"]),
        vocab_size=int(manifest["model"]["vocab_size"]),
        ids=tokenizer.encode(text),
        plain_ids=tokenizer.encode(text, add_special_tokens=False),
        head=tokenizer.encode(INTRO),
        fixed={
            "needle": tokenizer.encode(NEEDLE.format(key=12345), add_special_tokens=False),
            "question": tokenizer.encode(QUESTION, add_special_tokens=False),
        },
    )


def resolve(settings: EvalSettings, subjects: list[Subject], reference_context: int | None) -> EvalSettings:
    """Fill in the defaults that depend on the bundles (passkey lengths, curve length) and check every setting
    against every bundle and the text; an error names the setting, the bundle and what would fit."""
    contexts = [s.context for s in subjects] + ([reference_context] if reference_context else [])
    smallest = min(contexts)
    windows = settings.windows
    if windows is None:
        windows = tuple(n for n in DEFAULT_WINDOWS if n <= smallest) or (smallest,)
    lengths = settings.lengths
    if lengths is None:
        lengths = tuple(n for n in DEFAULT_PASSKEY_LENGTHS if n <= smallest) or (smallest,)
    curve = settings.curve_tokens
    if curve is None:
        curve = min([DEFAULT_CURVE_TOKENS, smallest] + [len(s.ids) for s in subjects])
    settings = dataclasses.replace(settings, windows=tuple(windows), lengths=tuple(lengths), curve_tokens=curve)
    for subject in subjects:
        _check_subject(settings, subject, reference_context)
    return settings


def _beyond(flag: str, value: int, subject_name: str, context: int) -> EvalError:
    return EvalError(f"{flag} {value} is beyond the context of {subject_name} ({context} tokens)")


def _check_subject(settings: EvalSettings, subject: Subject, reference_context: int | None) -> None:
    name, metrics, have = one_line(subject.name), settings.metrics, len(subject.ids)

    def fits(flag: str, tokens: int) -> None:
        if tokens > subject.context:
            raise _beyond(flag, tokens, name, subject.context)
        if reference_context is not None and tokens > reference_context and flag != "--lengths":
            raise _beyond(flag, tokens, "the reference", reference_context)

    def enough(needed: int, what: str) -> None:
        if needed > have:
            raise EvalError(
                f"the text is too short: {what} needs {needed} tokens and it has {have} (as {name} encodes it); "
                "give a longer --text or ask for less"
            )

    if "perplexity" in metrics:
        for length in settings.windows:
            fits("--windows", length)
        longest = max(settings.windows)
        enough(longest * settings.window_count, f"--windows {longest} × {settings.window_count} windows")
    if "passkey" in metrics:
        fixed = len(subject.head) + len(subject.fixed["needle"]) + len(subject.fixed["question"])
        for length in settings.lengths:
            fits("--lengths", length)
            if length - fixed < 1:
                raise EvalError(
                    f"passkey length {length} leaves no room for text: the intro, key and question take {fixed} "
                    f"tokens of {name}"
                )
        enough(max(settings.lengths), f"passkey length {max(settings.lengths)}")
    if "agreement" in metrics or "consistency" in metrics:
        fits("--new-tokens", PROMPT_TOKENS + settings.new_tokens)
        enough(PROMPT_TOKENS * (settings.prompts if "agreement" in metrics else 1), "the prompts")
    if "error_curve" in metrics:
        fits("--curve-tokens", settings.curve_tokens)
        if settings.curve_tokens <= CURVE_PROMPT:
            raise EvalError(f"--curve-tokens must be more than the {CURVE_PROMPT} tokens read as a prompt")
        enough(settings.curve_tokens, f"--curve-tokens {settings.curve_tokens}")


# --- the metrics ----------------------------------------------------------------------------------------------------
def window_perplexity(logprobs: Callable[[list[int]], np.ndarray], ids: Sequence[int], length: int, count: int):
    """Perplexity over ``count`` windows of ``length`` tokens, one after another from ids[0], each scored on its
    own: per window, and pooled (exp of the mean NLL over every scored token)."""
    scores = [np.asarray(logprobs(list(ids[i * length : (i + 1) * length]))) for i in range(count)]
    pooled = np.concatenate(scores)
    return {
        "perplexity": float(np.exp(-pooled.mean())),
        "per_window": [float(np.exp(-s.mean())) for s in scores],
        "mean_nll": float(-pooled.mean()),
        "tokens_scored": int(len(pooled)),
    }


def perplexity(runner, subject: Subject, settings: EvalSettings, progress: Progress) -> dict:
    results = {}
    for done, length in enumerate(settings.windows):
        progress(f"perplexity {subject.name}", done, len(settings.windows))
        results[str(length)] = window_perplexity(runner.logprobs, subject.ids, length, settings.window_count)
    progress(f"perplexity {subject.name}", len(settings.windows), len(settings.windows))
    out: dict[str, Any] = {"window_count": settings.window_count, "windows": results}
    compression = subject.manifest["cache"].get("compression")
    if compression and compression["prefill_compress"] == "end" and max(settings.windows) > compression["capacity"]:
        out["note"] = (
            "prefill-compress end reads a window whole before it compresses, so this perplexity does not see the "
            "compressed cache (the error curve and passkey do)"
        )
    return out


def passkey_ids(head: list[int], filler: Sequence[int], needle: list[int], question: list[int], length: int, depth):
    """head + filler[:a] + needle + filler[a:b] + question, ``length`` tokens, the needle at relative ``depth``."""
    room = length - len(head) - len(needle) - len(question)
    if room < 1 or room > len(filler):
        raise EvalError(f"passkey length {length} does not fit: {room} tokens of text needed, {len(filler)} available")
    split = int(room * depth)
    return head + list(filler[:split]) + needle + list(filler[split:room]) + question


def passkey(runner, subject: Subject, settings: EvalSettings, progress: Progress) -> dict:
    rng = np.random.default_rng(settings.seed)
    encode = lambda text: runner.encode(text, add_special_tokens=False)  # noqa: E731
    question = encode(QUESTION)
    lengths, depths = settings.lengths, settings.depths
    accuracy = np.zeros((len(lengths), len(depths)))
    records, total = [], len(lengths) * len(depths) * settings.trials
    for i, length in enumerate(lengths):
        for j, depth in enumerate(depths):
            for _ in range(settings.trials):
                progress(f"passkey {subject.name}", len(records), total)
                key = int(rng.integers(10_000, 99_999))
                ids = passkey_ids(
                    subject.head, subject.plain_ids, encode(NEEDLE.format(key=key)), question, length, depth
                )
                answer = runner.decode(runner.greedy(ids, PASSKEY_NEW_TOKENS))
                success = str(key) in answer
                accuracy[i, j] += success / settings.trials
                records.append({"length": length, "depth": depth, "key": key, "answer": answer, "success": success})
    progress(f"passkey {subject.name}", total, total)
    return {
        "lengths": list(lengths),
        "depths": list(depths),
        "trials": settings.trials,
        "seed": settings.seed,
        "accuracy": accuracy.round(6).tolist(),
        "overall": float(accuracy.mean()),
        "records": records,
    }


def agreement_prompts(ids: Sequence[int], count: int) -> list[list[int]]:
    """``count`` prompts of PROMPT_TOKENS tokens, spread evenly over the text."""
    step = (len(ids) - PROMPT_TOKENS) // max(count - 1, 1)
    return [list(ids[i * step : i * step + PROMPT_TOKENS]) for i in range(count)]


def compare_tokens(ours: list[int], theirs: list[int]) -> tuple[int, int, int | None]:
    """(identical positions, positions, first divergence or None): a sequence that ended earlier (EOS) differs at
    every position the other goes on."""
    positions = max(len(ours), len(theirs))
    same = [a == b for a, b in zip(ours, theirs, strict=False)] + [False] * (positions - min(len(ours), len(theirs)))
    first = next((i for i, s in enumerate(same) if not s), None)
    return sum(same), positions, first


def agreement(runner, subject: Subject, settings: EvalSettings, progress: Progress, reference) -> dict:
    prompts = agreement_prompts(subject.ids, settings.prompts)
    identical = positions = 0
    divergences = []
    for done, prompt in enumerate(prompts):
        progress(f"agreement {subject.name}", done, len(prompts))
        ours = runner.greedy(prompt, settings.new_tokens)
        theirs = reference.greedy(prompt, settings.new_tokens, runner.eos_token_ids)
        same, count, first = compare_tokens(ours, theirs)
        identical, positions = identical + same, positions + count
        divergences.append(first)
    progress(f"agreement {subject.name}", len(prompts), len(prompts))
    return {
        "prompts": len(prompts),
        "prompt_tokens": PROMPT_TOKENS,
        "new_tokens": settings.new_tokens,
        "identical_fraction": identical / positions if positions else 1.0,
        "first_divergence": divergences,
        "identical_prompts": sum(d is None for d in divergences),
    }


def consistency(runner, subject: Subject, settings: EvalSettings, progress: Progress) -> dict:
    prompt = agreement_prompts(subject.ids, 1)[0]
    answers, first, bitwise, largest = [], None, True, 0.0
    for run in range(settings.runs):
        progress(f"consistency {subject.name}", run, settings.runs)
        answers.append(runner.greedy(prompt, settings.new_tokens))
        logits = np.concatenate([piece for _, piece in runner.logits(prompt + answers[0], len(prompt))])
        if first is None:
            first = logits
            continue
        bitwise = bitwise and bool(np.array_equal(first, logits))
        largest = max(largest, float(np.abs(first.astype(np.float64) - logits).max()))
    progress(f"consistency {subject.name}", settings.runs, settings.runs)
    return {
        "runs": settings.runs,
        "new_tokens": settings.new_tokens,
        "tokens_identical": all(answer == answers[0] for answer in answers),
        "logits_bitwise_identical": bitwise,
        "max_abs_logit_diff": largest,
    }


def paired(first: Iterator[tuple[int, np.ndarray]], second: Iterator[tuple[int, np.ndarray]]):
    """(start, a, b): the logits of the same positions from two streams cut into different pieces."""
    pending: list[np.ndarray | None] = [None, None]
    streams, start = (first, second), 0
    while True:
        for i, stream in enumerate(streams):
            if pending[i] is None or len(pending[i]) == 0:
                piece = next(stream, None)
                if piece is None:
                    return
                pending[i] = piece[1]
        n = min(len(pending[0]), len(pending[1]))
        yield start, pending[0][:n], pending[1][:n]
        pending = [p[n:] for p in pending]
        start += n


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def compare_logits(reference: np.ndarray, ours: np.ndarray, rows: int = 16) -> tuple[np.ndarray, ...]:
    """Per position: KL(reference ‖ ours) of the next-token distributions (float64), max |Δlogit|, top-1 equal."""
    kl, largest = np.empty(len(reference)), np.empty(len(reference))
    for start in range(0, len(reference), rows):  # a few rows at a time: vocab × float64 is large
        p = _log_softmax(reference[start : start + rows].astype(np.float64))
        q = _log_softmax(ours[start : start + rows].astype(np.float64))
        kl[start : start + rows] = np.maximum((np.exp(p) * (p - q)).sum(axis=-1), 0.0)
        delta = reference[start : start + rows].astype(np.float64) - ours[start : start + rows]
        largest[start : start + rows] = np.abs(delta).max(axis=-1)
    return kl, largest, reference.argmax(axis=-1) == ours.argmax(axis=-1)


def error_curve(runner, subject: Subject, settings: EvalSettings, progress: Progress, reference) -> dict:
    ids = subject.ids[: settings.curve_tokens]
    kl, largest, top1 = [], [], []
    pairs = paired(reference.logits(ids, CURVE_PROMPT), runner.logits(ids, CURVE_PROMPT))
    for start, theirs, ours in pairs:
        progress(f"error curve {subject.name}", start, len(ids))
        values = compare_logits(theirs, ours)
        for into, value in zip((kl, largest, top1), values, strict=True):
            into.extend(value.tolist())
    progress(f"error curve {subject.name}", len(ids), len(ids))
    segments = np.array_split(np.asarray(kl), 4)
    return {
        "tokens": len(ids),
        "prompt_tokens": CURVE_PROMPT,
        "kl_mean": float(np.mean(kl)),
        "kl_max": float(np.max(kl)),
        "kl_by_quarter": [float(s.mean()) for s in segments],
        "max_abs_logit_max": float(np.max(largest)),
        "top1_agreement": float(np.mean(top1)),
        "kl": kl,
        "max_abs_logit": largest,
        "top1": [bool(t) for t in top1],
    }


# --- the whole evaluation -------------------------------------------------------------------------------------------
def _unique_names(paths: Sequence[Path]) -> list[str]:
    names = [Path(p).name or str(p) for p in paths]
    return [name if names.count(name) == 1 else f"{name}#{i + 1}" for i, name in enumerate(names)]


def _open_reference(path: Path, threads: int | None):
    from edgec.runners import kind_of, open_runner

    if kind_of(Path(path)) == "genai":
        raise EvalError(f"the reference {one_line(path)} is an onnxruntime-genai folder; give a bundle or the source")
    return open_runner(Path(path), threads)


def machine() -> dict[str, Any]:
    """What an eval or bench report was measured on; the CPU model too, since speed ratios against other runtimes
    move with it (docs/BENCHMARKS.md, issue 21's eleventh round)."""
    import onnxruntime

    from edgec.runtime.calibration import cpu_model, usable_cpus

    cores = usable_cpus()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    return {
        "platform": f"{platform.system()} {platform.machine()}",
        "cpu": cpu_model(),
        "cores": cores,
        "load_average": round(load, 2) if load is not None else None,
        "onnxruntime": onnxruntime.__version__,
    }


def _bundle_record(subject: Subject, runner, settings: EvalSettings) -> dict[str, Any]:
    manifest, cache = subject.manifest, subject.manifest["cache"]
    lengths = sorted({*settings.windows, *(settings.lengths or ()), settings.curve_tokens or 0} - {0})
    return {
        "name": subject.name,
        "path": str(subject.path),
        "source": manifest["source"]["name"],
        "target": manifest["target"]["name"],
        "context": subject.context,
        "weights": manifest["build_settings"].get("weights", "fp32"),
        "cache": {
            "dtype": cache["dtype"],
            "compression": cache.get("compression"),
            "bytes_per_token": cache["bytes_per_token"],
            "allocated_bytes": runner.model.cache_spec.total_bytes(),
            "bytes_at": {str(n): runner.kv_bytes(n) for n in lengths},
        },
    }


def evaluate(
    bundles: Sequence[Path],
    text_path: Path,
    settings: EvalSettings,
    reference: Path | None = None,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Run the chosen metrics on every bundle (and a baseline perplexity on the reference); the report as a dict
    that serialises to JSON. Raises ``EdgecError`` for settings the bundles, reference or text cannot honour,
    before any metric runs."""
    from edgec.runners import BundleRunner

    progress = progress or (lambda task, done, total: None)
    text = read_text(text_path)
    subjects = [open_subject(Path(p), text, n) for p, n in zip(bundles, _unique_names(bundles), strict=True)]
    ref_runner = None
    if reference is not None and any(m in NEEDS_REFERENCE or m == "perplexity" for m in settings.metrics):
        progress("loading the reference", 0, 1)
        ref_runner = _open_reference(reference, settings.threads)
        progress("loading the reference", 1, 1)
        for subject in subjects:
            if ref_runner.vocab_size != subject.vocab_size:
                raise EvalError(
                    f"the reference {one_line(reference)} has a vocabulary of {ref_runner.vocab_size} tokens and "
                    f"{one_line(subject.name)} {subject.vocab_size}: compare a bundle with the model it was built "
                    "from (or another bundle of it)"
                )
    settings = resolve(settings, subjects, ref_runner.context if ref_runner else None)
    report: dict[str, Any] = {
        "date": date.today().isoformat(),
        "machine": machine(),
        "text": {"path": str(text_path), "characters": len(text)},
        "reference": None if reference is None else {"path": str(reference), "kind": getattr(ref_runner, "kind", None)},
        "settings": dataclasses.asdict(settings),
        "bundles": [],
    }
    if ref_runner is not None and "perplexity" in settings.metrics:
        first = subjects[0]
        windows = {
            str(n): window_perplexity(ref_runner.logprobs, first.ids, n, settings.window_count)
            for n in settings.windows
        }
        report["reference"]["perplexity"] = {"window_count": settings.window_count, "windows": windows}
    metric_functions = {
        "perplexity": perplexity,
        "passkey": passkey,
        "consistency": consistency,
    }
    for subject in subjects:
        progress(f"loading {subject.name}", 0, 1)
        runner = BundleRunner(subject.path, settings.threads)
        progress(f"loading {subject.name}", 1, 1)
        record = _bundle_record(subject, runner, settings)
        for metric in settings.metrics:
            if metric in NEEDS_REFERENCE:
                function = agreement if metric == "agreement" else error_curve
                record[metric] = function(runner, subject, settings, progress, ref_runner)
            else:
                record[metric] = metric_functions[metric](runner, subject, settings, progress)
        runner.model.close()
        report["bundles"].append(record)
    return report


# --- the printed summary --------------------------------------------------------------------------------------------
def size(count: float) -> str:
    """Bytes for a person: 912 B, 45.0 KiB, 12.3 MiB, 1.07 GiB."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= scale:
            return f"{count / scale:,.{2 if unit == 'GiB' else 1}f} {unit}"
    return f"{count:.0f} B"


def _cell(value: float, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if value == 0:
        return "0"
    return f"{value:.{digits}g}" if abs(value) < 1e-3 and value != 0 else f"{value:.{digits}f}"


def summary(report: dict[str, Any]) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, columns, rows) per metric, for a table on the terminal."""
    bundles, sections = report["bundles"], []
    with_metric = lambda metric: [b for b in bundles if metric in b]  # noqa: E731
    if rows := with_metric("perplexity"):
        windows = list(rows[0]["perplexity"]["windows"])
        columns = ["bundle", *[f"ppl @ {n} (per window)" for n in windows], f"KV bytes @ {windows[-1]}"]
        body = []
        reference = (report.get("reference") or {}).get("perplexity")
        entries = [("reference", reference, None)] if reference else []
        entries += [(b["name"], b["perplexity"], b["cache"]["bytes_at"][windows[-1]]) for b in rows]
        for name, result, kv in entries:
            cells = []
            for n in windows:
                per_window = ", ".join(f"{p:.2f}" for p in result["windows"][n]["per_window"])
                cells.append(f"{result['windows'][n]['perplexity']:.3f} ({per_window})")
            body.append([name, *cells, size(kv) if kv is not None else "-"])
        sections.append(("perplexity", columns, body))
    if rows := with_metric("passkey"):
        depths = rows[0]["passkey"]["depths"]
        columns = ["bundle", "length", *[f"depth {d:g}" for d in depths]]
        body = []
        for b in rows:
            for length, accuracy in zip(b["passkey"]["lengths"], b["passkey"]["accuracy"], strict=True):
                body.append([b["name"], str(length), *[f"{a:.0%}" for a in accuracy]])
        title = f"passkey accuracy ({rows[0]['passkey']['trials']} trials per cell)"
        sections.append((title, columns, body))
    if rows := with_metric("agreement"):
        columns = ["bundle", "identical greedy tokens", "identical prompts", "first divergence per prompt"]
        body = [
            [
                b["name"],
                f"{b['agreement']['identical_fraction']:.1%}",
                f"{b['agreement']['identical_prompts']}/{b['agreement']['prompts']}",
                ", ".join("-" if d is None else str(d) for d in b["agreement"]["first_divergence"]),
            ]
            for b in rows
        ]
        sections.append(
            (f"greedy agreement with the reference ({rows[0]['agreement']['new_tokens']} tokens)", columns, body)
        )
    if rows := with_metric("consistency"):
        columns = ["bundle", "runs", "same tokens", "logits bitwise equal", "max |Δlogit|"]
        body = [
            [
                b["name"],
                str(b["consistency"]["runs"]),
                "yes" if b["consistency"]["tokens_identical"] else "NO",
                "yes" if b["consistency"]["logits_bitwise_identical"] else "no",
                _cell(b["consistency"]["max_abs_logit_diff"]),
            ]
            for b in rows
        ]
        sections.append(("consistency (one prompt, repeated)", columns, body))
    if rows := with_metric("error_curve"):
        columns = ["bundle", "tokens", "mean KL", "KL by quarter", "max KL", "max |Δlogit|", "top-1 agreement"]
        body = [
            [
                b["name"],
                str(b["error_curve"]["tokens"]),
                _cell(b["error_curve"]["kl_mean"]),
                " → ".join(_cell(k) for k in b["error_curve"]["kl_by_quarter"]),
                _cell(b["error_curve"]["kl_max"]),
                _cell(b["error_curve"]["max_abs_logit_max"]),
                f"{b['error_curve']['top1_agreement']:.1%}",
            ]
            for b in rows
        ]
        sections.append(("error vs the reference per position (teacher forced, decode steps)", columns, body))
    return sections
