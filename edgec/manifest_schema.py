"""The manifest schemas of bundle format versions 1 and 2, as data, and their validator (standard library and
the compressed-cache settings type, whose fields give that section's schema).

A schema is a dict of key → type, a nested schema dict, or ``[schema]`` for a list of such items. Keys marked
optional with a trailing ``?`` may be absent; ``None`` in a type tuple allows null. docs/bundle-format.md
describes the same schema for people.
"""

from __future__ import annotations

from typing import Any

from edgec.kvcache.compression import Compression

NUMBER = (int, float)

LAYER_V1 = {"layer": int, "num_kv_heads": int, "head_dim": int, "capacity": int, "window": int, "compressed?": bool}
LAYER = LAYER_V1 | {"compressed": bool, "state": [str]}
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
        "dtypes": list,
    },
    "build_settings": {"target": str, "context": int, "prefill_chunk": int},
    "runtime": {"library": str, "min_version": str, "providers": list, "provider_options?": dict},
    # decode_file + static_tokens: static-shape bundles (a prefill graph of static_tokens, a one-token graph)
    "model": {
        "file": str,
        "vocab_size": int,
        "num_layers": int,
        "context": int,
        "decode_file?": str,
        "static_tokens?": int,
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
    "generation": {"eos_token_ids": list, "bos_token_id": (int, type(None))},
    "passes?": dict,
    "validation": {"prompts": int, "max_abs_logit_error": NUMBER, "top1_agreement": NUMBER, "reference": str},
    "files": dict,
}
# v2: the runtime reads only the runtime, model, cache, tokenizer and generation sections; build_settings is a
# record of how the bundle was made (free to change between releases)
SCHEMA_V2: dict[str, Any] = SCHEMA_V1 | {
    "build_settings": dict,
    "runtime": SCHEMA_V1["runtime"]
    | {"prefill_chunk": int, "protect": (str, type(None)), "engine?": str, "version?": str},
    "cache": {key: value for key, value in SCHEMA_V1["cache"].items() if key != "positions?"} | {"layers": [LAYER]},
}
SCHEMAS = {1: SCHEMA_V1, 2: SCHEMA_V2}
FILE_ENTRY = {"size": int, "sha256": str}


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
    version = manifest.get("format_version") if isinstance(manifest, dict) else None
    if version not in SCHEMAS:
        return [f"manifest.format_version {version!r} is not one of {', '.join(map(str, SCHEMAS))}"]
    errors = schema_errors(manifest, SCHEMAS[version])
    if not errors and manifest["cache"].get("compression"):
        errors += schema_errors(manifest["cache"]["compression"], Compression.schema(), "manifest.cache.compression")
    if not errors:
        for name, entry in manifest["files"].items():
            errors += schema_errors(entry, FILE_ENTRY, f"manifest.files[{name!r}]")
            if name.startswith("/") or ".." in name.split("/"):
                errors.append(f"manifest.files has an unsafe path {name!r}")
    return errors
