"""Time to first token for a repeated 8K-token document: read cold vs restored from a saved prompt on disk.

    python benchmarks/prefix_cache.py BUNDLE [--kv-capacity 1024] [--tokens 8000]

The prompt is ~8000 tokens of Pride and Prejudice and a question. Three fresh processes, one after another, each
loading the bundle and generating 32 greedy tokens: (1) cold, no prefix cache; (2) cold with ``prefix_cache=DIR``
(reads the prompt and saves its state); (3) with ``prefix_cache=DIR`` again — restores the state and the logits
from disk and reads nothing. Time to first token = ``GenerationStats.first_token_seconds`` (from the generate call
to the first token; loading the bundle is not counted in any of them). The answers must be identical.
Results: benchmarks/out/prefix_cache.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import models  # noqa: E402

QUESTION = "\n\nQuestion: who is the young man that has taken Netherfield Park? Answer:"


def worker(bundle: Path, capacity: int | None, tokens: int, folder: str | None) -> None:
    from edgec.runtime import GenerationStats, Model

    model = Model.load(bundle, kv_capacity=capacity)
    document = model.decode(model.encode(models.austen_text())[:tokens])
    stats = GenerationStats()
    answer = list(model.generate_ids(document + QUESTION, max_new_tokens=32, stats=stats, prefix_cache=folder))
    files = list(Path(folder).iterdir()) if folder else []
    record = {
        "prompt_tokens": stats.prompt_tokens,
        "first_token_s": stats.first_token_seconds,
        "answer_ids": answer,
        "answer": model.decode(answer),
        "state_file_bytes": max((f.stat().st_size for f in files), default=0),
    }
    print(json.dumps(record), flush=True)


def run(bundle: Path, capacity: int | None, tokens: int, folder: str | None) -> dict:
    command = [sys.executable, __file__, str(bundle), "--worker", "--tokens", str(tokens)]
    command += ["--kv-capacity", str(capacity)] if capacity else []
    command += ["--folder", folder] if folder else []
    output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    return json.loads(output.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bundle", type=Path)
    parser.add_argument("--kv-capacity", type=int, default=None)
    parser.add_argument("--tokens", type=int, default=8000)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--folder", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.bundle, args.kv_capacity, args.tokens, args.folder)
    with tempfile.TemporaryDirectory() as folder:
        runs = {
            "cold": run(args.bundle, args.kv_capacity, args.tokens, None),
            "cold, saving": run(args.bundle, args.kv_capacity, args.tokens, folder),
            "from disk": run(args.bundle, args.kv_capacity, args.tokens, folder),
        }
    for name, record in runs.items():
        print(f"{name:13} TTFT {record['first_token_s']:8.3f} s   answer {record['answer']!r}")
    speedup = runs["cold"]["first_token_s"] / runs["from disk"]["first_token_s"]
    same = len({tuple(r["answer_ids"]) for r in runs.values()}) == 1
    print(
        f"from disk: {speedup:.0f}× faster to the first token; state file {runs['from disk']['state_file_bytes']:,} B"
    )
    print(f"answers identical: {same}")
    report = {
        "date": date.today().isoformat(),
        "machine": f"{platform.machine()}, {__import__('os').cpu_count()} cores",
        "command": "python benchmarks/prefix_cache.py " + " ".join(sys.argv[1:]),
        "runs": runs,
        "speedup": speedup,
        "answers_identical": same,
    }
    (models.OUT / "prefix_cache.json").write_text(json.dumps(report, indent=2) + "\n")
    if not same:
        sys.exit("the answers differ")


if __name__ == "__main__":
    main()
