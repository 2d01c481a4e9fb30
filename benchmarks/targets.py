"""SmolLM2-135M on the ONNX Runtime targets other than `cpu`: same greedy tokens as the `cpu` bundle? decode speed?

    bash scripts/setup-openvino.sh && .venv/bin/python benchmarks/targets.py [--rounds 5] [--new-tokens 64]

- openvino-ipc runs on onnxruntime-openvino (OpenVINO EP on this CPU), which installs a module also named
  `onnxruntime`: it lives in .venv-openvino, so each runtime gets a worker process of its own venv that loads its
  bundle once. Speed rounds alternate between the workers (paired), medians and the ratio are reported.
- ascend-910b (fp16, two static graphs, standard ONNX) has no NPU here: its graphs run on ONNX Runtime's CPU
  provider (an explicit override), for token parity only — CPU speed says nothing about an Ascend.
Results: benchmarks/out/targets.json; the printed table goes into docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import models  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
OUT = models.OUT
CONTEXT = 2048
VENVS = {"cpu": ROOT / ".venv", "openvino-ipc": ROOT / ".venv-openvino", "ascend-910b": ROOT / ".venv"}
PARITY_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Explain KV caches in one sentence.",
    "Once upon a time, in a small village by the sea,",
]


def bundle(target: str) -> Path:
    path = OUT / f"smollm2-{target}.edgec"
    if not (path / "manifest.json").exists():
        start = time.perf_counter()
        command = [str(ROOT / ".venv/bin/edgec"), "build", str(models.smollm2_gguf()), "-o", str(path)]
        subprocess.run([*command, "--target", target, "--context", str(CONTEXT)], check=True)
        print(f"built {path.name} in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    return path


class Worker:
    """A process in the target's venv that loads the bundle once and answers one JSON request per line."""

    def __init__(self, target: str, threads: int) -> None:
        python = VENVS[target] / "bin/python"
        if not python.exists():
            sys.exit(f"{python} is missing: bash scripts/setup-openvino.sh")
        command = [str(python), __file__, "--worker", str(bundle(target)), "--threads", str(threads)]
        if target.startswith("ascend"):
            command.append("--cpu-provider")  # no NPU here: the static graphs on ONNX Runtime's CPU provider
        self.target = target
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def ask(self, **request) -> dict:
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            sys.exit(f"the {self.target} worker died")
        return json.loads(line)


def serve(bundle_path: str, threads: int, cpu_provider: bool) -> None:
    import numpy as np
    import onnxruntime

    from edgec.runtime import Model

    model = Model.load(bundle_path, threads=threads, providers=["CPUExecutionProvider"] if cpu_provider else None)
    info = {"onnxruntime": onnxruntime.__version__, "providers": model._step.providers}
    for line in sys.stdin:
        request = json.loads(line)
        if request["kind"] == "info":
            answer = info
        elif request["kind"] == "greedy":
            ids = request["ids"] or model.encode(request["text"])
            logits = model.next_token_logits(ids)
            tokens = list(model.generate_ids(ids, max_new_tokens=request["new"]))
            answer = {"tokens": tokens, "logits": np.asarray(logits, np.float32).tolist()}
        else:  # speed
            start = time.perf_counter()
            tokens = model.generate_ids(request["ids"], max_new_tokens=request["new"] + 1)
            next(tokens)
            prefilled = time.perf_counter()
            produced = sum(1 for _ in tokens)
            answer = {"prefill_s": prefilled - start, "tok_s": produced / (time.perf_counter() - prefilled)}
        print(json.dumps(answer), flush=True)


def austen_ids(length: int) -> list[int]:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(bundle("cpu") / "tokenizer.json"))
    return tokenizer.encode(models.austen_text()[5000 : 5000 + 20 * length]).ids[:length]


def parity(workers: dict[str, Worker], new_tokens: int) -> dict:
    import numpy as np

    requests = [{"text": text, "ids": None} for text in PARITY_PROMPTS] + [{"text": "", "ids": austen_ids(700)}]
    results = {}
    for request in requests:
        answers = {name: w.ask(kind="greedy", new=new_tokens, **request) for name, w in workers.items()}
        reference = answers["cpu"]
        label = request["text"][:30] or f"austen {len(request['ids'])} tokens"
        results[label] = {
            name: {
                "same_tokens": answer["tokens"] == reference["tokens"],
                "first_difference": _first_difference(answer["tokens"], reference["tokens"]),
                "max_abs_logit_diff": float(np.abs(np.subtract(answer["logits"], reference["logits"])).max()),
            }
            for name, answer in answers.items()
            if name != "cpu"
        }
    return results


def _first_difference(tokens: list[int], reference: list[int]) -> int | None:
    pairs = enumerate(zip(tokens, reference, strict=False))
    return next((i for i, (a, b) in pairs if a != b), None if len(tokens) == len(reference) else len(reference))


def speed(workers: list[Worker], lengths: list[int], rounds: int, new_tokens: int) -> dict:
    import numpy as np

    prompts = {length: austen_ids(length) for length in lengths}
    for worker in workers:  # warm-up: first-run allocations, OpenVINO's compilation per shape
        for length in lengths:
            worker.ask(kind="speed", ids=prompts[length], new=4)
    samples = {w.target: {length: [] for length in lengths} for w in workers}
    for _ in range(rounds):
        for length in lengths:
            for worker in workers:
                samples[worker.target][length].append(worker.ask(kind="speed", ids=prompts[length], new=new_tokens))
    return {
        name: {
            str(length): {
                "prefill_s": float(np.median([r["prefill_s"] for r in runs])),
                "decode_tok_s": float(np.median([r["tok_s"] for r in runs])),
                "decode_tok_s_all": [round(r["tok_s"], 1) for r in runs],
            }
            for length, runs in per_length.items()
        }
        for name, per_length in samples.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--lengths", default="128,1024")
    parser.add_argument("--worker")
    parser.add_argument("--cpu-provider", action="store_true")
    args = parser.parse_args()
    if args.worker:
        return serve(args.worker, args.threads, args.cpu_provider)
    OUT.mkdir(parents=True, exist_ok=True)
    workers = {target: Worker(target, args.threads) for target in ("cpu", "openvino-ipc", "ascend-910b")}
    report = {
        "date": str(date.today()),
        "machine": f"{platform.processor() or platform.machine()}, {args.threads} threads",
        "runtimes": {name: w.ask(kind="info") for name, w in workers.items()},
        "parity": parity(workers, args.new_tokens),
    }
    workers.pop("ascend-910b").process.stdin.close()
    lengths = [int(n) for n in args.lengths.split(",")]
    report["speed"] = speed(list(workers.values()), lengths, args.rounds, args.new_tokens)
    for length in map(str, lengths):  # the median of per-round ratios: each pair ran back to back
        cpu, ov = (report["speed"][name][length]["decode_tok_s_all"] for name in ("cpu", "openvino-ipc"))
        ratios = sorted(o / c for o, c in zip(ov, cpu, strict=True))
        report["speed"][f"openvino_over_cpu_{length}"] = round(ratios[len(ratios) // 2], 3)
    (OUT / "targets.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
