"""The manifest schemas of bundle format versions 1 and 2, as data, and their validator (standard library and
the compressed-cache settings type, whose fields give that section's schema).

A schema is a dict of key → type, a nested schema dict, or ``[schema]`` for a list of such items. Keys marked
optional with a trailing ``?`` may be absent; ``None`` in a type tuple allows null. A ``Closed`` schema also refuses
keys it does not name (its objects are passed to dataclasses as keyword arguments).

A manifest may come from anyone (a bundle copied from a USB stick), so beyond its types every number has bounds
(``BOUNDS``: checked before the runtime allocates anything from it), every string with a fixed vocabulary has its
values (``CHOICES``), every path it names is a plain relative path inside the bundle (``PATH_FIELDS``,
``path_problem``) and provider options come from an allow-list (``PROVIDER_OPTIONS``). docs/bundle-format.md
describes the same rules for people.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

from edgec.kvcache.compression import Compression
from edgec.kvcache.quantize import bytes_per_value
from edgec.kvcache.spec import COMPRESSED_STATE, MIXED_STATE, compressed_state

NUMBER = (int, float)


class Closed(dict):
    """An object schema whose objects may hold no keys but the ones it names."""


LAYER_V1 = Closed(
    {"layer": int, "num_kv_heads": int, "head_dim": int, "capacity": int, "window": int, "compressed?": bool}
)
# v2: every layer names the state tensors it carries (CacheSpec)
LAYER = Closed(
    {key: value for key, value in LAYER_V1.items() if key != "compressed?"} | {"compressed": bool, "state": [str]}
)
# the compressed cache's settings: the fields of the type that owns them
COMPRESSION = Closed(Compression.schema())
CHAT_FORMAT = Closed({"system": [str], "user": [str], "assistant": [str], "preamble": str, "generation_prompt": str})
SCHEMA_V1: dict[str, Any] = {
    "format_version": int,
    "edgec_version": str,
    "source": {"name": str, "kind": str, "model_type": str, "config_sha256": str, "weights_sha256": dict},
    "target": {
        "name": str,
        "device": str,
        "runtime": str,
        "memory_bytes": int,
        "usable_fraction": NUMBER,
        "dtypes": [str],
        "compute_capability?": (str, type(None)),
    },
    "build_settings": {"target": str, "context": int, "prefill_chunk": int, "protect?": (str, type(None))},
    "runtime": {
        "library": str,
        "min_version": str,
        "providers": [str],
        "provider_options?": dict,
        # TensorRT-RTX bundles: the engine file, the release that built it, what it was built for
        "engine?": str,
        "version?": str,
        "compute_capability?": str,
        "max_tokens_per_step?": int,
        # --kv-plugin on: the cache plugin's files (edgec/plugin_files.py), registered before the engine loads
        "plugin?": Closed({"op": str, "module": str, "ptx": str, "kernel": str, "engine_built": str}),
    },
    # decode_file + static_tokens: static-shape bundles (a prefill graph of static_tokens, a one-token graph)
    "model": {
        "file": str,
        "vocab_size": int,
        "num_layers": int,
        "context": int,
        "decode_file?": str,
        "static_tokens?": int,
        "prefill_file?": str,  # multi-token steps' graph over the same weights (edgec/prefill_graph.py)
        "extend_file?": str,  # the prompt chunks that only extend the slots (edgec/extend_graph.py)
        "no_logits_rows?": bool,  # the graphs take an empty logits_index (edgec/logits_rows.py)
    },
    "cache": {
        "dtype": str,
        "positions?": bool,
        "compression?": (dict, type(None)),
        "layers": [LAYER_V1],
        "bytes_per_token": int,
        "kv_bytes_per_token?": NUMBER,
        "ring_kv_bytes?": NUMBER,
        "total_bytes": int,
    },
    "tokenizer": {"file": str, "chat_format": (dict, type(None)), "chat_note": str},
    "generation": {"eos_token_ids": [int], "bos_token_id": (int, type(None))},
    "passes?": dict,
    "validation": {
        "prompts": int,
        "max_abs_logit_error": NUMBER,
        "top1_agreement": NUMBER,
        "reference": str,
        "compare_tolerance?": NUMBER,  # verify --compare: how far the bundle may move from its own recorded logits
    },
    "files": dict,
}
# v2: the runtime reads only the runtime, model, cache, tokenizer and generation sections; build_settings is a
# record of how the bundle was made (free to change between releases)
SCHEMA_V2: dict[str, Any] = SCHEMA_V1 | {
    "build_settings": dict,
    "runtime": SCHEMA_V1["runtime"] | {"prefill_chunk": int, "protect": (str, type(None))},
    "cache": {key: value for key, value in SCHEMA_V1["cache"].items() if key != "positions?"} | {"layers": [LAYER]},
}
SCHEMAS = {1: SCHEMA_V1, 2: SCHEMA_V2}
FILE_ENTRY = Closed({"size": int, "sha256": str})

# Bounds on every number the runtime or a tool reads, as (lowest, highest), checked once the types fit. A path is
# keys joined by dots; ``[]`` after a key means every item of that list, ``*`` every value of an object, a final
# ``#`` the number of items. Absent optional keys and nulls are skipped. A new manifest section adds its rows here.
MAX_TOKENS = 2**24  # 16 M tokens of context: far beyond any model, small enough to keep every product finite
BOUNDS: dict[str, tuple[float, float]] = {
    "format_version": (1, 1_000),
    "target.memory_bytes": (0, 2**50),
    "target.usable_fraction": (0, 1),
    "build_settings.context": (1, MAX_TOKENS),
    "build_settings.prefill_chunk": (1, 2**16),
    "runtime.providers#": (0, 8),
    "runtime.max_tokens_per_step": (1, 2**16),
    "runtime.prefill_chunk": (1, 2**16),
    "model.vocab_size": (1, 2**22),
    "model.num_layers": (1, 1_024),
    "model.context": (1, MAX_TOKENS),
    "model.static_tokens": (1, 2**16),
    "cache.layers#": (1, 1_024),
    "cache.layers[].layer": (0, 1_023),
    "cache.layers[].num_kv_heads": (1, 1_024),
    "cache.layers[].head_dim": (1, 4_096),
    "cache.layers[].capacity": (1, MAX_TOKENS),
    "cache.layers[].window": (0, MAX_TOKENS),
    "cache.layers[].state#": (1, len(COMPRESSED_STATE) + len(MIXED_STATE)),
    "cache.compression.capacity": (1, MAX_TOKENS),
    "cache.compression.sink": (0, MAX_TOKENS),
    "cache.compression.window": (1, MAX_TOKENS),
    "cache.compression.group": (1, 4_096),
    "cache.compression.observe": (1, 2**16),
    "cache.compression.protect_fraction": (0, 0.999),
    "cache.compression.rotation_seed": (0, 2**32 - 1),
    "cache.compression.recall": (1, 2**16),  # present only when on
    "cache.compression.recall_block": (1, 2**16),
    "cache.compression.recall_every": (1, 2**16),
    "cache.bytes_per_token": (0, 2**40),
    "cache.kv_bytes_per_token": (0, 2**40),
    "cache.ring_kv_bytes": (0, 2**50),
    "cache.total_bytes": (0, 2**50),
    "tokenizer.chat_format.system#": (2, 2),
    "tokenizer.chat_format.user#": (2, 2),
    "tokenizer.chat_format.assistant#": (2, 2),
    "generation.eos_token_ids#": (0, 256),
    # not bounded by vocab_size: a config may name an EOS the vocabulary lacks (the runtime only compares with it)
    "generation.eos_token_ids[]": (0, 2**22 - 1),
    "generation.bos_token_id": (0, 2**22 - 1),
    "validation.prompts": (0, 64),
    "validation.max_abs_logit_error": (0, 1e30),
    "validation.top1_agreement": (0, 1),
    "validation.compare_tolerance": (0, 1e6),
    "files#": (1, 10_000),
    "files.*.size": (0, 2**44),
}
# The cache state the runtime allocates from the manifest (every layer at full capacity): a bound on the product
# of the per-layer numbers above, so no combination of in-range numbers asks for an absurd allocation.
MAX_STATE_BYTES = 2**40
MAX_LOGITS = 2**31  # prefill_chunk × vocab_size logits of one step

# Strings with a fixed vocabulary (the runtime looks them up: anything else would fail deep inside it): the
# allowed values, or a pattern the whole string must match
CHOICES: dict[str, tuple[str, ...] | re.Pattern[str]] = {
    "runtime.library": ("onnxruntime", "tensorrt_rtx"),
    "runtime.plugin.op": ("CompressedDecodeAttention",),
    "runtime.plugin.engine_built": ("here",),
    "target.device": ("cpu", "gpu", "npu"),
    "cache.dtype": ("float32", "float16"),
    # the compressed cache's settings with a fixed vocabulary, as the type that owns them declares it
    **{f"cache.compression.{name}": option.allowed() for name, _, option in Compression.options() if option.choices},
    "cache.layers[].state[]": COMPRESSED_STATE + MIXED_STATE,  # a plain layer's state is a subset
    "build_settings.protect": re.compile(r" *(numbers|names) *(, *(numbers|names) *)?"),  # runtime/protect.py
    "runtime.protect": re.compile(r" *(numbers|names) *(, *(numbers|names) *)?"),
}
# Fields that name a file of the bundle: each must be a plain relative path listed in ``files``
PATH_FIELDS = (
    "model.file",
    "model.decode_file",
    "model.prefill_file",
    "model.extend_file",
    "tokenizer.file",
    "runtime.engine",
    "runtime.plugin.module",
    "runtime.plugin.ptx",
    "runtime.plugin.kernel",
)
# Files beside the listed ones: the manifest itself and the optional signature over it (edgec.signing)
UNLISTED = ("manifest.json", "signature.json")
_PATH_PART = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._+-]{0,254}")

# ONNX Runtime execution providers a bundle may name, each with the options it may pass and their allowed values
# (a tuple of values, or a pattern the whole value must match). Options that name a file or a library to load,
# a folder to write, a memory address or a remote endpoint are absent on purpose: a bundle must not choose them.
_UINT = re.compile(r"[0-9]{1,12}")
_FLAG = ("0", "1")
_TRUE_FALSE = ("true", "false", "True", "False")
_ARENA = ("kNextPowerOfTwo", "kSameAsRequested")
_DEVICE = r"(CPU|GPU|NPU)(\.[0-9]{1,2})?"
_OPENVINO_DEVICE = re.compile(rf"((AUTO|HETERO|MULTI):)?{_DEVICE}(,{_DEVICE}){{0,3}}")
PROVIDER_OPTIONS: dict[str, dict[str, tuple[str, ...] | re.Pattern[str]]] = {
    "CPUExecutionProvider": {},
    "CUDAExecutionProvider": {
        "device_id": _UINT,
        "gpu_mem_limit": _UINT,
        "arena_extend_strategy": _ARENA,
        "cudnn_conv_algo_search": ("EXHAUSTIVE", "HEURISTIC", "DEFAULT"),
        "do_copy_in_default_stream": _FLAG,
        "enable_cuda_graph": _FLAG,
        "use_tf32": _FLAG,
        "prefer_nhwc": _FLAG,
    },
    "CANNExecutionProvider": {
        "device_id": _UINT,
        "npu_mem_limit": _UINT,
        "arena_extend_strategy": _ARENA,
        "enable_cann_graph": _FLAG,
        "precision_mode": (
            "force_fp32",
            "force_fp16",
            "allow_fp32_to_fp16",
            "must_keep_origin_dtype",
            "allow_mix_precision",
        ),
        "op_select_impl_mode": ("high_precision", "high_performance"),
    },
    "OpenVINOExecutionProvider": {
        "device_type": _OPENVINO_DEVICE,
        "precision": ("FP32", "FP16", "ACCURACY"),
        "num_of_threads": _UINT,
        "num_streams": _UINT,
        "enable_qdq_optimizer": _TRUE_FALSE,
        "disable_dynamic_shapes": _TRUE_FALSE,
    },
}


def schema_errors(value: Any, schema: Any = SCHEMA_V2, where: str = "manifest") -> list[str]:
    """Every place where ``value`` does not fit ``schema``, as readable paths; empty when it fits."""
    if isinstance(schema, dict):
        if not isinstance(value, dict):
            return [f"{where} must be an object"]
        errors = []
        for key, sub_schema in schema.items():
            name, optional = key.rstrip("?"), key.endswith("?")
            if name not in value:
                if not optional:
                    errors.append(f"{where}.{name} is missing")
                continue
            errors += schema_errors(value[name], sub_schema, f"{where}.{name}")
        if isinstance(schema, Closed):
            known = {key.rstrip("?") for key in schema}
            errors += [f"{where} has an unknown key {show(key)}" for key in value if key not in known]
        return errors
    if isinstance(schema, list):
        if not isinstance(value, list):
            return [f"{where} must be a list"]
        return [
            error for index, item in enumerate(value) for error in schema_errors(item, schema[0], f"{where}[{index}]")
        ]
    allowed = schema if isinstance(schema, tuple) else (schema,)
    if isinstance(value, bool) and bool not in allowed:
        return [f"{where} must be {' or '.join(t.__name__ for t in allowed)}, not bool"]
    if not isinstance(value, allowed):
        return [f"{where} must be {' or '.join(t.__name__ for t in allowed)}, not {type(value).__name__}"]
    return []


def manifest_errors(manifest: Any) -> list[str]:
    """Everything wrong with a manifest, most basic first: types, then bounds, vocabularies, paths, options."""
    version = manifest.get("format_version") if isinstance(manifest, dict) else None
    if version not in SCHEMAS:
        return [f"manifest.format_version {show(version)} is not one of {', '.join(map(str, SCHEMAS))}"]
    errors = schema_errors(manifest, SCHEMAS[version])
    if errors:
        return errors
    for name, entry in manifest["files"].items():
        errors += schema_errors(entry, FILE_ENTRY, f"manifest.files[{show(name)}]")
        if problem := path_problem(name):
            errors.append(f"manifest.files has an unsafe path {show(name)}: {problem}")
    if isinstance(manifest["cache"].get("compression"), dict):
        errors += schema_errors(manifest["cache"]["compression"], COMPRESSION, "manifest.cache.compression")
    if isinstance(manifest["tokenizer"]["chat_format"], dict):
        errors += schema_errors(manifest["tokenizer"]["chat_format"], CHAT_FORMAT, "manifest.tokenizer.chat_format")
    if errors:
        return errors
    errors += bound_errors(manifest)
    errors += choice_errors(manifest)
    if errors:
        return errors
    return relation_errors(manifest) + path_field_errors(manifest) + provider_errors(manifest["runtime"])


def values_at(document: Any, path: str, where: str = "manifest") -> Iterator[tuple[str, Any]]:
    """(readable place, value) for every value ``path`` (see ``BOUNDS``) reaches in ``document``."""
    if not path:
        yield where, document
        return
    if path == "#":
        if isinstance(document, (list, dict, str)):
            yield f"{where} (its length)", len(document)
        return
    key, dot, rest = path.partition(".")
    if key.endswith("#"):  # a final "name#": the length of that value
        key, rest = key[:-1], "#"
    if key == "*":
        if isinstance(document, dict):
            for name, item in document.items():
                yield from values_at(item, rest, f"{where}[{show(name)}]")
        return
    each = key.endswith("[]")
    key = key.removesuffix("[]")
    if not isinstance(document, dict) or document.get(key) is None:
        return
    value = document[key]
    if each:
        if isinstance(value, list):
            for index, item in enumerate(value):
                yield from values_at(item, rest, f"{where}.{key}[{index}]")
        return
    yield from values_at(value, rest, f"{where}.{key}")


def bound_errors(document: Any, bounds: dict[str, tuple[float, float]] = BOUNDS) -> list[str]:
    errors = []
    for path, (low, high) in bounds.items():
        for where, value in values_at(document, path):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue  # a type error, reported by the schema
            if not low <= value <= high:
                errors.append(f"{where} is {show(value)}, outside [{_number(low)}, {_number(high)}]")
    return errors


def choice_errors(manifest: dict[str, Any]) -> list[str]:
    errors = []
    for path, allowed in CHOICES.items():
        for where, value in values_at(manifest, path):
            if isinstance(allowed, re.Pattern):
                if not (isinstance(value, str) and allowed.fullmatch(value)):
                    errors.append(f"{where} is {show(value)}; it must match {allowed.pattern}")
            elif value not in allowed:
                errors.append(f"{where} is {show(value)}; it must be one of {', '.join(allowed)}")
    return errors


def relation_errors(manifest: dict[str, Any]) -> list[str]:
    """Numbers that are each in range but cannot go together."""
    model, cache = manifest["model"], manifest["cache"]
    # the prefill chunk the runtime steps by: in the runtime section from format v2, among the build settings in v1
    where = "runtime" if "prefill_chunk" in manifest["runtime"] else "build_settings"
    chunk = manifest[where]["prefill_chunk"]
    errors = []
    if chunk > model["context"]:
        errors.append(f"{where}.prefill_chunk {chunk} exceeds the context")
    if model.get("static_tokens", 0) > model["context"]:
        errors.append(f"model.static_tokens {model['static_tokens']} exceeds the context")
    if ("decode_file" in model) != ("static_tokens" in model):
        errors.append("model.decode_file and model.static_tokens go together (a static-shape bundle has both)")
    if model["vocab_size"] * chunk > MAX_LOGITS:
        errors.append(f"model.vocab_size × {where}.prefill_chunk exceeds {MAX_LOGITS:,} logits per step")
    layers = cache["layers"]
    if len(layers) != model["num_layers"]:
        errors.append(f"cache.layers has {len(layers)} layers, model.num_layers says {model['num_layers']}")
    if sorted(layer["layer"] for layer in layers) != list(range(len(layers))):
        errors.append("cache.layers must number the layers 0, 1, 2, … once each")
    compression = cache.get("compression")
    if any(layer.get("compressed") for layer in layers) and not compression:
        errors.append("cache.layers has compressed layers but cache.compression is null")
    for layer in layers:  # v2: the state each layer carries is the spec's for its kind
        if "state" not in layer:
            continue
        if layer["compressed"] and compression:
            expected = compressed_state(Compression.from_json(compression))
            if tuple(layer["state"]) != expected:
                errors.append(f"cache.layers[{layer['layer']}].state must be {list(expected)} for this compression")
        elif not layer["compressed"] and (layer["state"][:2] != ["k", "v"] or layer["state"][2:] not in ([], ["pos"])):
            errors.append(f"cache.layers[{layer['layer']}].state must be [k, v] or [k, v, pos]")
    if compression:
        if compression["capacity"] < compression["sink"] + compression["window"] + 1:
            errors.append("cache.compression.capacity must exceed its sink + window")
        mixed = compression.get("mixed", "none")
        if mixed != "none" and bytes_per_value(mixed, compression["group"]) <= bytes_per_value(
            compression["dtype"], compression["group"]
        ):
            errors.append("cache.compression.mixed must be wider storage than cache.compression.dtype")
        recall = ("recall", "recall_block", "recall_every")
        if any(name in compression for name in recall) and not all(name in compression for name in recall):
            errors.append(f"cache.compression must hold all of {', '.join(recall)} or none")
        elif "recall" in compression:
            reserved = compression["recall"] * compression["recall_block"]
            if compression["capacity"] - reserved < compression["sink"] + compression["window"] + 1:
                errors.append("cache.compression.capacity less its recall slots must exceed its sink + window")
        if (
            compression.get("decode_kernel", "none") == "gqa"
            and not Compression.from_json(compression).native_decode_fits()
        ):
            errors.append("cache.compression.decode_kernel gqa reads fp32 slots of one pool, unrotated, without recall")
        quantized = compression["dtype"] in ("int8", "fp8", "int4")
        for layer in layers:
            if layer.get("compressed") and quantized and layer["head_dim"] % compression["group"]:
                errors.append(f"cache.layers[{layer['layer']}].head_dim is not a multiple of the compression group")
            if layer.get("compressed") and compression["dtype"] == "int4" and layer["head_dim"] % 2:
                errors.append(f"cache.layers[{layer['layer']}].head_dim must be even for an int4 cache")
    # every layer at full capacity (a compressed layer may hold a whole prompt while reading it), every value
    # counted at 8 bytes, the widest element any state tensor has
    state = 0
    for layer in layers:
        slots = max(layer["capacity"], model["context"]) if layer.get("compressed") else layer["capacity"]
        state += layer["num_kv_heads"] * slots * (2 * layer["head_dim"] + 4) * 8
    if state > MAX_STATE_BYTES:
        errors.append(f"the cache state the manifest describes needs {state:,} bytes (more than {MAX_STATE_BYTES:,})")
    return errors


def path_problem(name: Any) -> str | None:
    """Why ``name`` is not a plain relative path inside a bundle (letters, digits, ``_ . + -``, parts split by
    ``/``; no absolute, ``..``, backslash, control or other characters), or None when it is one."""
    if not isinstance(name, str):
        return "not a string"
    if not name or len(name) > 1024:
        return "empty or too long"
    if name.startswith("/"):
        return "an absolute path"
    if "\\" in name:
        return "a backslash"
    parts = name.split("/")
    if any(part in ("", ".", "..") for part in parts):
        return "an empty, '.' or '..' part"
    if not all(_PATH_PART.fullmatch(part) for part in parts):
        return "characters other than letters, digits and _ . + -"
    if name in UNLISTED:
        return "a name the bundle keeps for itself"
    return None


def path_field_errors(manifest: dict[str, Any]) -> list[str]:
    """Each file the manifest names must be one of its listed files (so it lies inside the bundle)."""
    errors = []
    files = manifest["files"]
    folded = {name.lower() for name in files}
    if len(folded) != len(files):
        errors.append("manifest.files lists names that differ only in case (one file on Windows and macOS)")
    for path in PATH_FIELDS:
        for where, value in values_at(manifest, path):
            if problem := path_problem(value):
                errors.append(f"{where} is {show(value)}: {problem}")
            elif value not in files:
                errors.append(f"{where} names {show(value)}, which manifest.files does not list")
    return errors


def provider_errors(runtime: dict[str, Any]) -> list[str]:
    """Execution providers and their options, against ``PROVIDER_OPTIONS``."""
    errors = []
    for provider in runtime["providers"]:
        if provider not in PROVIDER_OPTIONS:
            errors.append(
                f"manifest.runtime.providers names {show(provider)}; edgec runs bundles on "
                f"{', '.join(PROVIDER_OPTIONS)}"
            )
    for provider, options in runtime.get("provider_options", {}).items():
        allowed = PROVIDER_OPTIONS.get(provider)
        if allowed is None:
            errors.append(f"manifest.runtime.provider_options names an unknown provider {show(provider)}")
            continue
        if not isinstance(options, dict):
            errors.append(f"manifest.runtime.provider_options[{show(provider)}] must be an object")
            continue
        for option, value in options.items():
            rule = allowed.get(option)
            where = f"manifest.runtime.provider_options[{show(provider)}]"
            if rule is None:
                known = ", ".join(allowed) or "none"
                errors.append(f"{where} has option {show(option)}, which edgec does not pass on (allowed: {known})")
            elif not isinstance(value, str):
                errors.append(f"{where}[{show(option)}] must be a string")
            elif not (value in rule if isinstance(rule, tuple) else rule.fullmatch(value)):
                errors.append(f"{where}[{show(option)}] is {show(value)}, not an allowed value")
    return errors


def _number(value: float) -> str:
    return f"{value:,}" if isinstance(value, int) else f"{value:g}"


def show(value: Any, limit: int = 60) -> str:
    """``repr`` of a value from an untrusted document, cut short: escapes control characters, bounds the length."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"
