"""Build a bundle: load → trace → passes → save → validate against the source → manifest, atomically."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from edgec import __version__
from edgec.bundle import atomic_folder, write_manifest, write_npz
from edgec.errors import BuildSettingsError
from edgec.kvcache.compression import Compression
from edgec.targets import ORT_PROVIDERS, Target, load_target

DEFAULT_POLICY = "snapkv"
STAGES = ("load", "calibrate", "export", "save", "validate", "engine", "bundle")
VALIDATION_PROMPTS = ("The capital of France is", "def fibonacci(n):\n    ")
Progress = Callable[..., None]  # (stage) as each stage starts; (stage, done, total) inside a long one


@dataclass(frozen=True)
class BuildResult:
    manifest: dict[str, Any]
    timings: dict[str, float]  # seconds per stage


@dataclass(frozen=True)
class BuildSettings:
    target: str = "cpu"
    context: int | None = None  # cache capacity in tokens; None = the model's maximum
    prefill_chunk: int | None = None  # None = the target's default
    weights: str | None = None  # fp32, fp16 or int4; None = the target's default
    block_size: int = 32  # int4: input channels per scale
    symmetric: bool = False  # int4: no zero point (always symmetric for TensorRT-RTX, which takes no UINT4)
    accuracy_level: int = 4  # int4 on ONNX Runtime: 4 = int8 activations (fast), 1 = fp32 activations (exact)
    kv_capacity: int | None = None  # compressed cache: slots per layer and head; None = context
    kv_sink: int = 4
    kv_window: int = 64
    kv_policy: str | None = None  # None = the default policy when compression is asked for
    kv_dtype: str | None = None  # fp32, fp16, int8, fp8, int4
    kv_group: int = 32
    prefill_compress: str = "end"
    protect: str | None = None  # built-in protect heuristics applied by default at run time ("numbers,names")
    embedding_bits: int = 8  # int4: the (tied, stored once) embedding table: 8 = exact for a GGUF's Q8_0, 4 = smaller
    quant_method: str = "rtn"  # int4: rtn (round to nearest), awq (activation-aware scaling), gptq (error feedback)
    calib: str | None = None  # awq/gptq: calibration text file; None = Python's own pydoc_data.topics
    int4_form: str | None = None  # matmulnbits (ONNX Runtime only) or qdq (portable); None = the target's
    allow_pickle: bool = False
    overwrite: bool = False

    @property
    def compressed(self) -> bool:
        """Any --kv-capacity/--kv-policy/--kv-dtype asks for the compressed cache on the global layers."""
        return any(value is not None for value in (self.kv_capacity, self.kv_policy, self.kv_dtype))

    def compression(self, context: int) -> Compression | None:
        if not self.compressed:
            return None
        return Compression(
            capacity=self.kv_capacity or context,
            sink=self.kv_sink,
            window=self.kv_window,
            policy=self.kv_policy or DEFAULT_POLICY,
            dtype=self.kv_dtype or "fp32",
            group=self.kv_group,
            prefill_compress=self.prefill_compress,
        )


def _check_settings(settings: BuildSettings) -> Target:
    target = load_target(settings.target)
    if not target.buildable:
        raise BuildSettingsError(
            f"target {target.name} ({target.runtime}) can be planned for (edgec plan) but not built yet; "
            "the build column of edgec targets says which are"
        )
    if settings.context is not None and settings.context < 1:
        raise BuildSettingsError(f"--context must be a positive number of tokens, got {settings.context}")
    if settings.prefill_chunk is not None and settings.prefill_chunk < 1:
        raise BuildSettingsError(f"--prefill-chunk must be positive, got {settings.prefill_chunk}")
    return target


BUILDABLE_WEIGHTS = ("fp32", "fp16", "fp8", "int8", "int4")
QUANT_METHODS = ("rtn", "awq", "gptq")


def pass_plan(
    target: Target, settings: BuildSettings, compression: Compression | None = None
) -> tuple[list[str], dict[str, dict], str]:
    """The passes this build runs (the target's, adjusted for the weight format and the compressed cache),
    their options, and the weight format."""
    weights = settings.weights or target.defaults.get("weights", "fp32")
    if weights == "fp8" and weights not in target.dtypes:
        raise BuildSettingsError(
            f"--weights fp8 needs FP8 tensor cores (compute capability 8.9+: rtx4090, l40s, rtx5090); "
            f"{target.name} has none — use int8 or int4"
        )
    if weights not in target.dtypes:
        raise BuildSettingsError(f"{target.name} has no {weights} weights; it has {', '.join(target.dtypes)}")
    if weights not in BUILDABLE_WEIGHTS:
        raise BuildSettingsError(f"--weights {weights} cannot be built yet; use {', '.join(BUILDABLE_WEIGHTS)}")
    if settings.accuracy_level not in (0, 1, 2, 3, 4):
        raise BuildSettingsError(f"--accuracy-level must be 0-4, got {settings.accuracy_level}")
    if settings.block_size not in (32, 64, 128):
        raise BuildSettingsError(f"--block-size must be 32, 64 or 128, got {settings.block_size}")
    if settings.embedding_bits not in (4, 8):
        raise BuildSettingsError(f"--embedding-bits must be 4 or 8, got {settings.embedding_bits}")
    if settings.quant_method not in QUANT_METHODS:
        known = ", ".join(QUANT_METHODS)
        raise BuildSettingsError(f"--quant-method must be one of {known}, got {settings.quant_method}")
    if settings.quant_method != "rtn" and weights != "int4":
        raise BuildSettingsError(f"--quant-method {settings.quant_method} needs --weights int4 (got {weights})")
    ort = target.runtime in ("ort-cpu", "ort-cuda")
    form = settings.int4_form or ("matmulnbits" if ort else "qdq")
    if form not in ("matmulnbits", "qdq") or (form == "matmulnbits" and not ort):
        allowed = "matmulnbits or qdq" if ort else "qdq"
        raise BuildSettingsError(f"--int4-form for {target.name} ({target.runtime}) is {allowed}, got {form}")
    if settings.calib is not None and settings.quant_method == "rtn":
        raise BuildSettingsError(
            "--calib is for a calibrated --quant-method (awq, gptq); rtn needs no calibration text"
        )
    if settings.calib is not None and not Path(settings.calib).is_file():
        raise BuildSettingsError(f"--calib {settings.calib}: no such file (give a UTF-8 text file)")
    names = [name for name in target.passes if not (name == "float16" and weights == "fp32")]
    if weights == "fp16" and "float16" not in names:
        names.append("float16")
    options: dict[str, dict] = {}
    if weights == "fp8":  # before the fp16 conversion, and before MatMuls with constant weights become Gemms
        names.insert(names.index("fuse_projections") + 1 if "fuse_projections" in names else 0, "fp8")
    if weights == "int8":
        if not ort:
            raise BuildSettingsError(
                f"--weights int8 is built for ONNX Runtime targets only (cpu, MatMulNBits), not {target.name}"
            )
        names.append("int8_weights")
        options["int8_weights"] = {"block_size": settings.block_size, "accuracy_level": settings.accuracy_level}
    if weights == "int4":
        names.insert(names.index("float16") if "float16" in names else len(names), "int4_weights")
        options["int4_weights"] = {
            "block_size": settings.block_size,
            "form": form,
            # TensorRT reads INT4 DequantizeLinear without zero points; ONNX Runtime reads either
            "symmetric": settings.symmetric or (form == "qdq" and not ort),
            "accuracy_level": settings.accuracy_level,
            "embedding_bits": settings.embedding_bits,
        }
    if compression is not None:
        if target.static_shapes:  # its slot count is a symbolic dim, and its prompt-end selection runs in numpy
            raise BuildSettingsError(
                f"the compressed cache (--kv-*) does not build for {target.name} yet: it needs static shapes; "
                "use the plain cache (--context) there"
            )
        if not target.runtime.startswith("ort-"):
            raise BuildSettingsError(
                f"the compressed cache (--kv-*) builds for ONNX Runtime targets; {target.name} runs "
                f"{target.runtime}, which takes the plain cache for now"
            )
        names.insert(0, "kv_cache")  # before any lowering of the remaining (sliding-window) KVAttention nodes
        options["kv_cache"] = compression.to_json()
    return names, options, weights


def resolve_context(settings: BuildSettings, max_context: int | None) -> int:
    maximum = int(max_context or 0)
    context = settings.context or maximum
    if maximum and context > maximum:
        raise BuildSettingsError(
            f"--context {context} is longer than the model was trained for ({maximum}); use --context {maximum} or less"
        )
    if not context:
        raise BuildSettingsError("the model config has no max_position_embeddings; pass --context")
    return context


def check_fits(shape, target: Target, context: int, prefill_chunk: int, weights: str, kv: str, capacity: int) -> None:
    """Run the memory planner on the settings this build produces: refuse what cannot fit."""
    from edgec.plan import Settings, plan

    settings = Settings(
        weights=weights, kv=kv, context=context, prefill_chunk=prefill_chunk, capacity_fraction=capacity / context
    )
    plan(shape, target, settings, fixed=frozenset({"weights", "kv", "prefill_chunk", "capacity"}))


def build(
    model_path: str | Path,
    output: str | Path,
    settings: BuildSettings,
    progress: Progress | None = None,
    seal: Callable[[Path], None] | None = None,
) -> BuildResult:
    """Compile ``model_path`` for ``settings.target`` into the bundle folder ``output``. ``seal`` runs on the
    finished bundle before it is renamed into place (``edgec build --sign``: write its signature)."""
    progress = progress or (lambda stage, done=None, total=None: None)
    target = _check_settings(settings)
    output = Path(output)
    from edgec.load import inspect_source

    # fail fast, from the config alone, before the output folder is touched or weights are read
    source = inspect_source(model_path, settings.allow_pickle)
    context = resolve_context(settings, source["max_context"])
    from edgec.plan import model_shape

    shape = model_shape(model_path)
    prefill_chunk = min(context, settings.prefill_chunk or int(target.defaults.get("prefill_chunk", 512)))
    compression = settings.compression(context)
    if compression is not None:
        compression.check(shape.head_dim, prefill_chunk)
        if compression.capacity > context:
            raise BuildSettingsError(f"--kv-capacity {compression.capacity} exceeds the context {context}")
    if settings.protect is not None:
        from edgec.runtime.protect import HEURISTICS

        kinds = [kind.strip() for kind in settings.protect.split(",")]
        if compression is None or not kinds or any(kind not in HEURISTICS for kind in kinds):
            raise BuildSettingsError(
                f"--protect takes {','.join(HEURISTICS)} and needs a compressed cache (--kv-capacity/--kv-dtype); "
                f"got {settings.protect!r}"
            )
    names, options, weights = pass_plan(target, settings, compression)
    kv = compression.dtype if compression else ("fp16" if "float16" in names else "fp32")
    check_fits(shape, target, context, prefill_chunk, weights, kv, compression.capacity if compression else context)
    with atomic_folder(output, settings.overwrite, seal=seal) as folder:
        return _build_into(Path(model_path), folder, target, settings, context, (names, options, weights), progress)


def _build_into(
    model_path: Path,
    folder: Path,
    target: Target,
    settings: BuildSettings,
    context: int,
    planned_passes: tuple[list[str], dict[str, dict], str],
    progress: Progress,
) -> BuildResult:
    import onnx_ir as ir

    from edgec.chat_template import chat_format_from_tokenizer
    from edgec.export import cache_spec_for, export_step
    from edgec.load import load_model
    from edgec.passes import run_passes

    timings: dict[str, float] = {}
    start = time.perf_counter()
    progress("load")
    loaded = load_model(model_path, settings.allow_pickle)
    prefill_chunk = min(context, settings.prefill_chunk or int(target.defaults.get("prefill_chunk", 512)))
    spec = cache_spec_for(loaded.config, context, prefill_chunk)
    prompts = [loaded.tokenizer(text)["input_ids"] for text in VALIDATION_PROMPTS]
    reference_logits = _torch_last_logits(loaded.causal_lm, prompts)
    generation = _generation_defaults(loaded)
    timings["load_s"] = time.perf_counter() - start

    progress("calibrate")
    if settings.quant_method in ("gptq", "awq"):
        start = time.perf_counter()
        _calibrate(settings, loaded, planned_passes, report=lambda done, total: progress("calibrate", done, total))
        timings["calibrate_s"] = time.perf_counter() - start

    progress("export")
    start = time.perf_counter()
    model = export_step(loaded.causal_lm, spec)
    names, options, weights = planned_passes
    options = options | {"kv_attention_gqa": {"context": context}}  # ring caches (capacity < context) stay
    pass_counts = run_passes(model, names, options)
    spec = _spec_after_passes(spec, model, options.get("kv_cache"))
    timings["export_s"] = time.perf_counter() - start
    del loaded.causal_lm

    progress("save")
    start = time.perf_counter()
    model_files = {"file": "model.onnx", "vocab_size": int(loaded.config.vocab_size)}
    ir.save(model, folder / "model.onnx", external_data="model.onnx.data")
    del model
    if target.static_shapes:
        model_files |= _write_static_graphs(folder, prefill_chunk)
    loaded.tokenizer.save_pretrained(folder)
    chat_format, chat_note = chat_format_from_tokenizer(loaded.tokenizer)
    (folder / "generation_config.json").write_text(json.dumps(generation, indent=2, sort_keys=True) + "\n")
    timings["save_s"] = time.perf_counter() - start

    progress("validate")
    start = time.perf_counter()
    validation = _validate(folder, model_files, spec, prompts, reference_logits)
    timings["validate_s"] = time.perf_counter() - start

    progress("engine")
    provider = ORT_PROVIDERS.get(target.runtime, "CPUExecutionProvider")
    runtime = {"library": "onnxruntime", "min_version": "1.20", "providers": [provider]}
    if target.provider_options:
        runtime["provider_options"] = {provider: target.provider_options}
    if target.runtime == "tensorrt-rtx":
        from edgec.trt import build_engine

        start = time.perf_counter()
        engine, runtime = build_engine(folder / "model.onnx", target, max_tokens=prefill_chunk)
        (folder / "engine.trt").write_bytes(engine)
        runtime |= {"min_version": runtime["version"], "providers": [], "engine": "engine.trt"}
        timings["engine_s"] = time.perf_counter() - start

    progress("bundle")
    manifest = {
        "edgec_version": __version__,
        "source": loaded.source,
        "target": target.to_json(),
        "build_settings": {**asdict(settings), "context": context, "prefill_chunk": prefill_chunk, "weights": weights},
        "runtime": runtime,
        "model": {**model_files, "num_layers": len(spec.layers), "context": context},
        "cache": {
            **spec.to_json(),
            "bytes_per_token": spec.bytes_per_token(),
            "kv_bytes_per_token": spec.kv_bytes_per_token(),
            "ring_kv_bytes": spec.ring_kv_bytes(),
            "total_bytes": spec.total_bytes(),
        },
        "tokenizer": {
            "file": "tokenizer.json",
            "chat_format": chat_format.to_json() if chat_format else None,
            "chat_note": chat_note,
        },
        "generation": generation,
        "passes": pass_counts,
        "validation": validation,
    }
    # timings vary from run to run: reported, but kept out of the (reproducible) bundle
    return BuildResult(write_manifest(folder, manifest), {key: round(value, 2) for key, value in timings.items()})


def _calibrate(settings: BuildSettings, loaded, planned_passes, report) -> None:
    """Round the torch model's Linear weights with a calibrated method before export (the int4 pass then finds
    the weights on its grids)."""
    if settings.quant_method == "gptq":
        from edgec.gptq import gptq

        # the lm_head (tied: the embedding) is 4-bit too with a 4-bit table
        with_output = settings.embedding_bits == 4
        gptq(
            loaded.causal_lm,
            loaded.tokenizer,
            settings.block_size,
            settings.symmetric,
            settings.calib,
            report,
            with_output,
        )
    else:
        from edgec.awq import awq

        symmetric = planned_passes[1]["int4_weights"]["symmetric"]  # the grid the pass will round to
        awq(loaded.causal_lm, loaded.tokenizer, settings.block_size, symmetric, settings.calib, report)


def _spec_after_passes(spec, model, compression_settings: dict | None):
    """The cache the built graph really has: compressed layers (by their score state), float dtype, whether
    positions are state."""
    import onnx_ir as ir

    graph_inputs = {value.name: value for value in model.graph.inputs}
    compression = Compression(**compression_settings) if compression_settings else None
    layers = tuple(
        dataclasses.replace(layer, compressed=True, capacity=compression.capacity)
        if f"cache.{layer.layer}.score" in graph_inputs
        else layer
        for layer in spec.layers
    )
    plain = [layer for layer in layers if not layer.compressed]
    positions = not plain or any(layer.input_names()[2] in graph_inputs for layer in plain)
    k_value = graph_inputs[(plain or layers)[0].input_names(compression)[0]]
    return dataclasses.replace(
        spec,
        layers=layers,
        positions=positions,
        dtype="float16" if k_value.dtype == ir.DataType.FLOAT16 else "float32",
        compression=compression,
    )


def _torch_last_logits(causal_lm, prompts: list[list[int]]) -> list[np.ndarray]:
    import torch

    with torch.no_grad():
        return [causal_lm(torch.tensor([ids])).logits[0, -1].float().numpy() for ids in prompts]


def _generation_defaults(loaded) -> dict[str, Any]:
    config = getattr(loaded.causal_lm, "generation_config", None)
    eos = getattr(config, "eos_token_id", None) if config is not None else None
    if eos is None:
        eos = loaded.tokenizer.eos_token_id
    eos_ids = sorted({int(e) for e in (eos if isinstance(eos, list) else [eos]) if e is not None})
    bos = loaded.tokenizer.bos_token_id
    return {"eos_token_ids": eos_ids, "bos_token_id": None if bos is None else int(bos)}


def _write_static_graphs(folder: Path, tokens: int) -> dict[str, Any]:
    """Turn the saved dynamic step graph into two fixed-shape graphs over its weights file: ``model.onnx`` for
    prefill chunks of ``tokens`` (padded) and ``decode.onnx`` for one token. Two graphs, because one fixed size
    would make every decode step pay for a whole chunk; one weights file, because the graphs differ only in
    shapes (each loaded from the dynamic graph, so weights stay references into model.onnx.data, never copied).
    """
    import onnx_ir as ir

    from edgec.passes.static_shapes import static_shapes

    for name, count in (("decode.onnx", 1), ("model.onnx", tokens)):
        graph = ir.load(folder / "model.onnx")
        static_shapes(graph, tokens=count)
        ir.save(graph, folder / f"{name}.tmp")
        del graph
    for name in ("decode.onnx", "model.onnx"):
        (folder / f"{name}.tmp").replace(folder / name)
    return {"decode_file": "decode.onnx", "static_tokens": tokens}


def _validate(
    folder: Path, model_files: dict[str, Any], spec, prompts: list[list[int]], reference: list[np.ndarray]
) -> dict[str, Any]:
    """Run the saved graph(s) on the validation prompts and compare with the source model's logits."""
    from edgec.runtime.backend_ort import open_step

    step = open_step(folder, model_files, spec, providers=["CPUExecutionProvider"])
    errors, agree = [], []
    for ids, expected in zip(prompts, reference, strict=True):
        step.reset()
        logits = step.run(np.asarray(ids, dtype=np.int64), 0, last_only=True)[-1]
        errors.append(float(np.abs(logits.astype(np.float32) - expected).max()))
        agree.append(bool(int(logits.argmax()) == int(expected.argmax())))
    arrays = {f"ids_{i}": np.asarray(p, np.int64) for i, p in enumerate(prompts)}
    arrays |= {f"logits_{i}": r for i, r in enumerate(reference)}
    write_npz(folder / "validation.npz", arrays)
    return {
        "prompts": len(prompts),
        "max_abs_logit_error": max(errors),
        "top1_agreement": sum(agree) / len(agree),
        "validated_with": "ONNX Runtime CPU, on model.onnx (the graph any engine in the bundle was built from)",
        "reference": "validation.npz (token ids and the source model's last-position logits)",
    }
