"""Build a bundle: load → trace → passes → save → validate against the source → manifest, atomically."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from edgec import __version__
from edgec.bundle import atomic_folder, write_manifest, write_npz
from edgec.errors import BuildError, BuildSettingsError, BundleError
from edgec.kvcache.compression import Compression
from edgec.pipeline import Choices, passes_for
from edgec.plan import WEIGHT_BYTES, Settings, with_memory
from edgec.shape import ModelShape
from edgec.targets import ORT_MIN_VERSIONS, ORT_PROVIDERS, Target, load_target

STAGES = ("load", "calibrate", "export", "save", "validate", "engine", "bundle")
VALIDATION_PROMPTS = ("The capital of France is", "def fibonacci(n):\n    ")
Progress = Callable[..., None]  # (stage) as each stage starts; (stage, done, total) inside a long one
BUILDABLE_WEIGHTS = ("fp32", "fp16", "fp8", "int8", "int4")
QUANT_METHODS = ("rtn", "awq", "gptq")
MIXED_TARGETS = ("cpu", "cpu-portable")  # --kv-mixed: the ONNX Runtime CPU targets (data-dependent shapes)


@dataclass(frozen=True)
class BuildResult:
    manifest: dict[str, Any]
    timings: dict[str, float]  # seconds per stage


@dataclass(frozen=True)
class BuildSettings:
    target: str = "cpu"
    context: int | None = None  # cache capacity in tokens; None = the model's maximum
    prefill_chunk: int | None = None  # None = the target's default
    weights: str | None = None  # fp32, fp16, fp8, int8, int4; None = the target's default
    block_size: int = 32  # int4/int8: input channels per scale
    symmetric: bool = False  # int4: no zero point (always symmetric where the target reads no zero points)
    accuracy_level: int = 4  # int4 on ONNX Runtime: 4 = int8 activations (fast), 1 = fp32 activations (exact)
    # int8 activations as two rows each (near fp32's accuracy, ~0.7-0.8x the speed of one); None = on for a GGUF's
    # carried blocks (their answers are the fp32 bundle's), off otherwise (rounded weights' error dominates there)
    split_activations: bool | None = None
    embedding_bits: int = 8  # int4: the (tied, stored once) embedding table: 8 = exact for a GGUF's Q8_0, 4 = smaller
    quant_method: str = "rtn"  # int4: rtn (round to nearest), awq (activation-aware scaling), gptq (error feedback)
    calib: str | None = None  # awq/gptq: calibration text file; None = Python's own pydoc_data.topics
    int4_form: str | None = None  # matmulnbits (ONNX Runtime) or qdq (portable); None = the target's first form
    kv: Compression | None = None  # the compressed cache of the global layers; None = the plain cache
    kv_plugin: bool = False  # TensorRT-RTX: the compressed op's one-token step as a plugin (plugins/, docs/plugins.md)
    protect: str | None = None  # built-in protect heuristics applied by default at run time ("numbers,names")
    allow_pickle: bool = False
    overwrite: bool = False
    memory: int | None = None  # the device's bytes for the fit check; None = the target's (edgec plan --memory)


@dataclass(frozen=True)
class Plan:
    """What a build makes of its settings, its target and its model — decided before any weight is read."""

    target: Target
    shape: ModelShape
    context: int
    prefill_chunk: int
    weights: str
    kv: Compression | None  # resolved: its capacity is a number
    passes: list[str]
    options: dict[str, dict[str, Any]]

    def runtime_section(self, settings: BuildSettings) -> dict[str, Any]:
        """What the runtime needs beyond the graph (the manifest's ``runtime``, with the library added)."""
        return {"prefill_chunk": self.prefill_chunk, "protect": settings.protect}


def plan_build(
    settings: BuildSettings, shape: ModelShape, max_context: int | None, source_kind: str | None = None
) -> Plan:
    """Check every setting against the target and the model; the passes to run. One clear line per problem.
    ``source_kind`` (``inspect_source``'s ``kind``): a GGUF's own blocks split their activations by default."""
    target = with_memory(load_target(settings.target), settings.memory)
    if not target.buildable:
        raise BuildSettingsError(
            f"target {target.name} ({target.runtime}) can be planned for (edgec plan) but not built yet "
            f"({target.unbuildable_reason}); the build column of edgec targets says which are"
        )
    context = resolve_context(settings, max_context)
    if settings.prefill_chunk is not None and settings.prefill_chunk < 1:
        raise BuildSettingsError(f"--prefill-chunk must be positive, got {settings.prefill_chunk}")
    prefill_chunk = min(context, settings.prefill_chunk or int(target.defaults.get("prefill_chunk", 512)))
    kv = settings.kv.resolved(context) if settings.kv is not None else None
    if kv is not None:
        kv.check(shape.head_dim, context)
    if settings.protect is not None:
        from edgec.runtime.protect import HEURISTICS

        kinds = [kind.strip() for kind in settings.protect.split(",")]
        if kv is None or not kinds or any(kind not in HEURISTICS for kind in kinds):
            raise BuildSettingsError(
                f"--protect takes {','.join(HEURISTICS)} and needs a compressed cache (--kv-capacity/--kv-dtype); "
                f"got {settings.protect!r}"
            )
    weights = settings.weights or target.defaults.get("weights", "fp32")
    if settings.kv_plugin and (kv is None or target.abilities.engine != "tensorrt-rtx"):
        raise BuildSettingsError(
            f"--kv-plugin on runs the compressed cache's decode step as a TensorRT-RTX plugin: it needs a compressed "
            f"cache (--kv-capacity, --kv-dtype, ...) and a TensorRT-RTX target (rtx3060, rtx4090, ...); got "
            f"{'no compressed cache' if kv is None else target.name}"
        )
    if settings.kv_plugin and kv.rotation != "none":
        raise BuildSettingsError(
            f"--kv-plugin on and --kv-rotation {kv.rotation}: the plugin's kernel reads an unrotated cache; "
            "build with one of them"
        )
    if kv is not None and kv.mixed != "none":
        if settings.kv_plugin:
            raise BuildSettingsError(
                f"--kv-plugin on and --kv-mixed {kv.mixed}: the plugin's kernel reads one slot pool; build with one "
                "of them"
            )
        if target.name not in MIXED_TARGETS:
            raise BuildSettingsError(
                f"--kv-mixed {kv.mixed} is built for the ONNX Runtime CPU targets ({', '.join(MIXED_TARGETS)}); "
                f"{target.name} reads one slot pool: use --kv-mixed none"
            )
    if kv is not None and kv.recall and (target.runtime != "ort-cpu" or settings.kv_plugin):
        raise BuildSettingsError(
            f"--kv-recall (the hierarchical cache) is built for ONNX Runtime on the CPU (targets cpu, cpu-portable): "
            f"its runtime writes recalled tokens into host buffers between steps; not for {target.name} "
            f"({target.runtime}{', --kv-plugin on' if settings.kv_plugin else ''}); build with --kv-recall 0"
        )
    if kv is not None and native_decode(target, kv, settings.kv_plugin):
        kv = replace(kv, decode_kernel="gqa")
    choices = Choices(target, weights, context, kv, weight_options(target, settings, weights), settings.kv_plugin)
    passes, options = passes_for(choices)
    plan = Plan(target, shape, context, prefill_chunk, weights, kv, passes, options)
    kv_dtype = kv.dtype if kv else ("fp16" if choices.fp16_compute else "fp32")
    check_fits(plan, kv_dtype, splits_activations(plan, settings, source_kind))
    return plan


def splits_activations(plan: Plan, settings: BuildSettings, source_kind: str | None) -> bool:
    """Whether this build's int4/int8 products will split their activations (asked for, or the default for a
    GGUF's own blocks: ``_with_source_blocks``), which gives the bundle a prompt-chunk graph."""
    if any(isinstance(options, dict) and options.get("split_activations") for options in plan.options.values()):
        return True
    int4 = plan.options.get("int4_weights")
    gguf_default = settings.split_activations is None and settings.accuracy_level >= 2
    return (
        bool(int4 and int4["form"] == "matmulnbits" and settings.quant_method == "rtn" and source_kind == "gguf")
        and gguf_default
    )


def native_decode(target: Target, kv: Compression, kv_plugin: bool) -> bool:
    """Whether one-token steps read the compressed slots in place (``Compression.decode_kernel`` gqa: ONNX
    Runtime's CPU GroupQueryAttention, which the decode graph then turns into products over the same buffers where
    the evictions are batched, ``prefill_graph.decode_kernels_as_matmuls``): fp32 slots of one pool, unrotated,
    without recall, on an ONNX Runtime CPU target with the fused kernel. It halves the cache's share of a decode
    step at 1K slots (docs/kv-cache.md)."""
    abilities = target.abilities
    cpu_gqa = target.runtime == "ort-cpu" and abilities.attention == "gqa" and abilities.data_dependent_shapes
    return cpu_gqa and not kv_plugin and kv.native_decode_fits()


def weight_options(target: Target, settings: BuildSettings, weights: str) -> dict[str, Any]:
    """The int4/int8 pass's keywords, every weight setting checked against the target's abilities."""
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
    if settings.split_activations and (settings.accuracy_level <= 1 or weights not in ("int4", "int8")):
        raise BuildSettingsError(
            "--split-activations splits int8 activations: it needs --weights int4 or int8 at --accuracy-level 2-4"
        )
    if settings.embedding_bits not in (4, 8):
        raise BuildSettingsError(f"--embedding-bits must be 4 or 8, got {settings.embedding_bits}")
    if settings.quant_method not in QUANT_METHODS:
        known = ", ".join(QUANT_METHODS)
        raise BuildSettingsError(f"--quant-method must be one of {known}, got {settings.quant_method}")
    if settings.quant_method != "rtn" and weights != "int4":
        raise BuildSettingsError(f"--quant-method {settings.quant_method} needs --weights int4 (got {weights})")
    forms = target.abilities.weight_forms
    form = settings.int4_form or forms[0]
    if form not in forms:
        raise BuildSettingsError(
            f"--int4-form for {target.name} ({target.runtime}) is {' or '.join(forms)}, got {form}"
        )
    if settings.calib is not None and settings.quant_method == "rtn":
        raise BuildSettingsError(
            "--calib is for a calibrated --quant-method (awq, gptq); rtn needs no calibration text"
        )
    if settings.calib is not None and not Path(settings.calib).is_file():
        raise BuildSettingsError(f"--calib {settings.calib}: no such file (give a UTF-8 text file)")
    if weights == "int8":
        if "matmulnbits" not in forms:
            raise BuildSettingsError(
                f"--weights int8 is built as MatMulNBits, which {target.name} ({target.runtime}) does not run"
            )
        return {
            "block_size": settings.block_size,
            "accuracy_level": settings.accuracy_level,
            "split_activations": bool(settings.split_activations),
        }
    if weights == "int4":
        return {
            "block_size": settings.block_size,
            "form": form,
            "symmetric": settings.symmetric or (form == "qdq" and not target.abilities.zero_points),
            "accuracy_level": settings.accuracy_level,
            "embedding_bits": settings.embedding_bits,
            "split_activations": bool(settings.split_activations) and form == "matmulnbits",
        }
    return {}


def resolve_context(settings: BuildSettings, max_context: int | None) -> int:
    if settings.context is not None and settings.context < 1:
        raise BuildSettingsError(f"--context must be a positive number of tokens, got {settings.context}")
    maximum = int(max_context or 0)
    context = settings.context or maximum
    if maximum and context > maximum:
        raise BuildSettingsError(
            f"--context {context} is longer than the model was trained for ({maximum}); use --context {maximum} or less"
        )
    if not context:
        raise BuildSettingsError("the model config has no max_position_embeddings; pass --context")
    return context


def memory_settings(plan: Plan, kv_dtype: str, split_activations: bool = False) -> Settings:
    """The memory planner's view of what this build produces (``split_activations``: ``splits_activations``)."""
    target = plan.target
    # a prompt-chunk graph (prefill_graph.write_prefill_graph) is a second session with its own weights
    fp32_slots = plan.kv is not None and plan.kv.dtype == "fp32" and target.abilities.attention == "gqa"
    prompt_graph = not target.static_shapes and not target.abilities.engine and (split_activations or fp32_slots)
    capacity = plan.kv.capacity if plan.kv else plan.context
    return Settings(
        weights=plan.weights,
        kv=kv_dtype,
        context=plan.context,
        prefill_chunk=plan.prefill_chunk,
        capacity_fraction=capacity / plan.context,
        kv_group=plan.kv.group if plan.kv else Settings.kv_group,
        kv_mixed=plan.kv.mixed if plan.kv else Settings.kv_mixed,
        kv_sink=plan.kv.sink if plan.kv else Settings.kv_sink,
        kv_window=plan.kv.window if plan.kv else Settings.kv_window,
        prefill_compress=plan.kv.prefill_compress if plan.kv else Settings.prefill_compress,
        split_activations=split_activations,
        prompt_graph=prompt_graph,
    )


def check_fits(plan: Plan, kv_dtype: str, split_activations: bool = False) -> None:
    """Run the memory planner on the settings this build produces: refuse what cannot fit."""
    from edgec.plan import plan as memory_plan

    everything = frozenset({"weights", "kv", "prefill_chunk", "capacity", "prefill_compress"})
    memory_plan(plan.shape, plan.target, memory_settings(plan, kv_dtype, split_activations), fixed=everything)


def weights_on_disk(plan: Plan) -> int:
    """Bytes a bundle's weights take at least: the planner's bytes per parameter for its weight dtype, one copy
    (every graph of a bundle reads one data file). A lower bound on the whole bundle: SmolLM2-135M from its GGUF,
    int4 78 MB of 104 (its Q8_0 table is kept at 8 bits), fp32 540 of 545."""
    return int(plan.shape.parameters() * WEIGHT_BYTES[plan.weights])


def check_disk_room(output: Path, plan: Plan) -> None:
    """Refuse a build whose weights alone cannot fit where its bundle is written, before a weight is read: a
    build writes its bundle in a temporary folder beside ``output`` and renames it, so the free space there is
    what it has (a bundle it replaces, ``--overwrite``, stays until the rename). A build that passes may still find
    the disk full at its end (``bundle.write_failure`` says so in one line)."""
    import shutil

    folder = Path(os.path.abspath(output)).parent
    while not folder.is_dir() and folder != folder.parent:  # a missing folder is atomic_folder's to report
        folder = folder.parent
    if not os.access(folder, os.W_OK | os.X_OK):  # so is one it cannot write in
        return
    try:
        usage = shutil.disk_usage(folder)
    except OSError:
        return
    if usage.total == 0:  # no disk behind it (sysfs, procfs: root may pass os.access, creating fails)
        return
    needed = weights_on_disk(plan)
    if needed > usage.free:
        megabytes = lambda n: f"{n / 1e6:,.{1 if n < 10e6 else 0}f} MB"  # noqa: E731
        raise BundleError(
            f"{folder} has {megabytes(usage.free)} free and this bundle's weights alone take {megabytes(needed)} "
            f"({plan.shape.parameters() / 1e6:,.1f} M parameters in {plan.weights}): free some space or write it "
            "elsewhere (-o); nothing was written"
        )


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
    load_target(settings.target)  # an unknown target is the first thing to say
    output = Path(output)
    from edgec.load import inspect_source

    # fail fast, from the config alone, before the output folder is touched or weights are read
    source = inspect_source(model_path, settings.allow_pickle)
    plan = plan_build(settings, source["shape"], source["shape"].max_context, source["kind"])
    check_disk_room(output, plan)
    with atomic_folder(output, settings.overwrite, seal=seal) as folder:
        return _build_into(Path(model_path), folder, settings, plan, progress)


def _build_into(model_path: Path, folder: Path, settings: BuildSettings, plan: Plan, progress: Progress) -> BuildResult:
    import onnx_ir as ir

    from edgec.chat_template import chat_format_from_tokenizer
    from edgec.export import cache_spec_for, export_step
    from edgec.load import load_model
    from edgec.passes import run_passes

    target, context, prefill_chunk = plan.target, plan.context, plan.prefill_chunk
    timings: dict[str, float] = {}
    start = time.perf_counter()
    progress("load")
    loaded = load_model(model_path, settings.allow_pickle, report=progress)
    spec = cache_spec_for(plan.shape, context, prefill_chunk)
    prompts = [loaded.tokenizer(text)["input_ids"] for text in VALIDATION_PROMPTS]
    reference_logits = _torch_last_logits(loaded.causal_lm, prompts)
    generation = _generation_defaults(loaded)
    timings["load_s"] = time.perf_counter() - start

    progress("calibrate")
    if settings.quant_method in ("gptq", "awq"):
        start = time.perf_counter()
        _calibrate(settings, loaded, plan, report=lambda done, total: progress("calibrate", done, total))
        timings["calibrate_s"] = time.perf_counter() - start

    progress("export")
    start = time.perf_counter()
    model = export_step(loaded.causal_lm, spec, report=progress)
    options = _with_source_blocks(plan, settings, loaded)
    pass_counts: dict[str, int] = {}
    for done, name in enumerate(plan.passes, 1):  # one at a time, to show progress inside the export stage
        counts, spec = run_passes(model, [name], options, spec)
        pass_counts.update(counts)
        progress("passes", done, len(plan.passes))
    source_blocks = options.get("int4_weights", {}).get("source")
    timings["export_s"] = time.perf_counter() - start
    del loaded.causal_lm

    progress("save")
    start = time.perf_counter()
    model_files = {"file": "model.onnx", "vocab_size": int(loaded.config.vocab_size)}
    ir.save(model, folder / "model.onnx", external_data="model.onnx.data")
    del model
    if target.static_shapes:
        model_files |= _write_static_graphs(folder, prefill_chunk)
    elif target.abilities.engine != "tensorrt-rtx":  # ONNX Runtime: prompt chunks at fp32 activations
        from edgec.logits_rows import takes_no_rows
        from edgec.prefill_graph import write_prefill_graph

        native_decode = plan.kv is not None and plan.kv.decode_kernel == "gqa"
        cache = spec if plan.kv is not None else None
        model_files |= write_prefill_graph(folder, spec if native_decode else None, plan.context, cache)
        # the graph multi-token steps run on: a prompt's chunks before its last then compute no logits
        if takes_no_rows(ir.load(folder / model_files.get("prefill_file", "model.onnx"))):
            model_files["no_logits_rows"] = True
    loaded.tokenizer.save_pretrained(folder)
    chat_format, chat_note = chat_format_from_tokenizer(loaded.tokenizer)
    (folder / "generation_config.json").write_text(json.dumps(generation, indent=2, sort_keys=True) + "\n")
    timings["save_s"] = time.perf_counter() - start

    progress("validate")
    start = time.perf_counter()
    tolerance = compare_tolerance(plan, settings)
    validation = _validate(folder, model_files, spec, prefill_chunk, prompts, reference_logits, tolerance)
    timings["validate_s"] = time.perf_counter() - start

    progress("engine")
    provider = ORT_PROVIDERS.get(target.runtime, "CPUExecutionProvider")
    min_version = ORT_MIN_VERSIONS.get(target.runtime, "1.20")
    runtime = {"library": "onnxruntime", "min_version": min_version, "providers": [provider]}
    if target.provider_options:
        runtime["provider_options"] = {provider: target.provider_options}
    if target.abilities.engine == "tensorrt-rtx":
        from edgec.trt import build_engine

        start = time.perf_counter()
        plugin = None
        if settings.kv_plugin:  # the plugin's files first: the engine build registers it from them
            from edgec.plugin_files import write_plugin

            plugin = write_plugin(folder, plan.kv, plan.shape, target)
        slots = (plan.kv.capacity, context) if plan.kv else None
        engine, runtime = build_engine(
            folder / "model.onnx",
            target,
            max_tokens=prefill_chunk,
            slots=slots,
            report=progress,
            plugin=folder if plugin else None,
        )
        (folder / "engine.trt").write_bytes(engine)
        runtime |= {"min_version": runtime["version"], "providers": [], "engine": "engine.trt"}
        if plugin:
            runtime["plugin"] = plugin
        timings["engine_s"] = time.perf_counter() - start

    progress("bundle")
    recorded = {**asdict(settings), "kv": plan.kv.to_json() if plan.kv else None}
    if not settings.kv_plugin:  # recorded only when on: --kv-plugin off writes the manifest it always did
        del recorded["kv_plugin"]
    weight_pass = options.get("int4_weights") or options.get("int8_weights") or {}
    recorded["split_activations"] = bool(weight_pass.get("split_activations", False))  # as built, not as asked
    if source_blocks is not None:  # the exact GGUF import: which weights kept the file's own blocks
        recorded["gguf_blocks"] = source_blocks.record()
    manifest = {
        "edgec_version": __version__,
        "source": loaded.source,
        "target": target.to_json(),
        "build_settings": {**recorded, "context": context, "prefill_chunk": prefill_chunk, "weights": plan.weights},
        "runtime": runtime | plan.runtime_section(settings),
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


def _with_source_blocks(plan: Plan, settings: BuildSettings, loaded) -> dict[str, dict[str, Any]]:
    """The passes' options, the int4 pass given the GGUF's own quantized blocks to carry across exactly (the
    default RTN grid only: AWQ and GPTQ change the weights, and other grids are the user's explicit choice)."""
    options = plan.options.get("int4_weights")
    if options is None or options["form"] != "matmulnbits" or settings.quant_method != "rtn":
        return plan.options
    if loaded.source.get("kind") != "gguf":
        return plan.options
    from edgec.ggufblocks import GgufBlocks

    carried = {**options, "source": GgufBlocks(loaded.source_path)}
    if settings.split_activations is None:  # the default for a GGUF's own blocks: answers as the fp32 bundle's
        carried["split_activations"] = settings.accuracy_level >= 2
    return {**plan.options, "int4_weights": carried}


def _calibrate(settings: BuildSettings, loaded, plan: Plan, report) -> None:
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

        symmetric = plan.options["int4_weights"]["symmetric"]  # the grid the pass will round to
        awq(loaded.causal_lm, loaded.tokenizer, settings.block_size, symmetric, settings.calib, report)


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


def _not_finite_reason(dtype: np.dtype) -> str:
    if dtype == np.float16:
        return (
            "the built graph's logits are not finite on the validation prompts: the model's activations overflow "
            "fp16 (Gemma 3's residual stream, for one, reaches ~1e5, past fp16's 65,504); build it for a target that "
            "computes in fp32 (cpu, cpu-portable, openvino-ipc, ascend-910b with --weights fp32)"
        )
    return "the built graph's logits are not finite on the validation prompts: the model or its conversion is broken"


def _validate(
    folder: Path,
    model_files: dict[str, Any],
    spec,
    prefill_chunk: int,
    prompts: list[list[int]],
    reference: list[np.ndarray],
    tolerance: float,
) -> dict[str, Any]:
    """Run the saved graph(s) on the validation prompts. Two records: the bundle's own logits (its reference:
    ``edgec verify --compare`` reruns the prompts and must reproduce them within ``tolerance``) and the error
    against the source model's logits (a property of the quantization, shown, never a failure)."""
    from edgec.runtime.backend_ort import open_backend

    state = open_backend(folder, model_files, spec, prefill_chunk, providers=["CPUExecutionProvider"]).open_state()
    errors, agree, outputs = [], [], []
    for ids, expected in zip(prompts, reference, strict=True):
        state.reset()
        logits = state.run(np.asarray(ids, dtype=np.int64), 0, last_only=True)[-1]
        if not np.isfinite(logits).all():
            raise BuildError(_not_finite_reason(logits.dtype))
        logits = logits.astype(np.float32)
        outputs.append(logits)
        errors.append(float(np.abs(logits - expected).max()))
        agree.append(bool(int(logits.argmax()) == int(expected.argmax())))
    arrays = {f"ids_{i}": np.asarray(p, np.int64) for i, p in enumerate(prompts)}
    arrays |= {f"logits_{i}": r for i, r in enumerate(reference)}
    arrays |= {f"bundle_logits_{i}": logits for i, logits in enumerate(outputs)}
    write_npz(folder / "validation.npz", arrays)
    return {
        "prompts": len(prompts),
        "max_abs_logit_error": max(errors),
        "top1_agreement": sum(agree) / len(agree),
        "validated_with": "ONNX Runtime CPU, on model.onnx (the graph any engine in the bundle was built from)",
        "reference": "validation.npz (token ids; the source model's and the bundle's own last-position logits)",
        "compare_tolerance": tolerance,
    }


def compare_tolerance(plan: Plan, settings: BuildSettings) -> float:
    """How far ``edgec verify --compare`` lets a bundle's logits move from the ones it recorded at build: the same
    graph on another machine's kernels. fp32 arithmetic: summation order only; int8 activations (accuracy level
    ≥ 2 with quantized weights): a rounding of an activation may go the other way; fp16: both."""
    if plan.weights == "fp16" or (plan.target.abilities.compute == "fp16" and plan.weights != "fp32"):
        return 5e-2
    if plan.weights in ("int4", "int8") and settings.accuracy_level >= 2:
        return 1e-2
    return 1e-3
