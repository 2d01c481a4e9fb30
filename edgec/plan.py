"""Memory planner: weights + KV cache + activations against a target's usable memory, from a config alone.

``plan()`` starts from the requested settings (or the target's defaults) and, while the total does not fit,
makes the next concession in ``CONCESSIONS`` — cheapest in quality first (docs/planner.md gives the evidence):

1. KV cache fp32 → fp16, then int8 (SmolLM2: perplexity 20.39 → 20.40)
2. weights → int8, then int4 (block 32; lossless from a Q4 GGUF, small loss otherwise)
3. prefill chunk halved down to 128 (costs only prefill speed)
4. KV capacity 50 %, then 25 % of the context (compressed cache with eviction)
5. KV int4 (SmolLM2: 20.39 → 23.05), then capacity 12.5 %

Settings the user fixed are never conceded. When nothing fits, the refusal gives the numbers and the largest
context that would fit with every concession made.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path
from typing import Any

from edgec.errors import BuildSettingsError
from edgec.targets import Target

WEIGHT_BYTES = {"fp32": 4.0, "fp16": 2.0, "bf16": 2.0, "fp8": 1.0, "int8": 1.0 + 2 / 128, "int4": 0.5 + 2.5 / 32}
KV_BYTES = {"fp32": 4.0, "fp16": 2.0, "fp8": 1.0 + 4 / 32, "int8": 1.0 + 4 / 32, "int4": 0.5 + 4 / 32}
SLOT_METADATA_BYTES = 12  # per slot and KV head when compressed: position (int64) + score (float32)
GIB = 2**30


class PlanError(BuildSettingsError):
    """No settings fit the target; the message has the numbers and what to change."""


@dataclass(frozen=True)
class ModelShape:
    name: str
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    max_context: int
    windows: tuple[int, ...] = ()  # sliding window per layer (0 = global); empty = all global

    @classmethod
    def from_config(cls, config: dict[str, Any], name: str) -> ModelShape:
        from edgec.load import check_config_values

        check_config_values(config, f"the config of {name}")
        heads = config["num_attention_heads"]
        return cls(
            windows=_layer_windows(config),
            name=name,
            layers=config["num_hidden_layers"],
            hidden=config["hidden_size"],
            intermediate=config["intermediate_size"],
            heads=heads,
            kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            vocab=config["vocab_size"],
            tied=bool(config.get("tie_word_embeddings", False)),
            max_context=config.get("max_position_embeddings") or 0,
        )

    def parameters(self) -> int:
        attention = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        mlp = 3 * self.hidden * self.intermediate
        embeddings = self.vocab * self.hidden * (1 if self.tied else 2)
        return self.layers * (attention + mlp + 2 * self.hidden) + embeddings + self.hidden


def _layer_windows(config: dict[str, Any]) -> tuple[int, ...]:
    """As ``export.layer_windows`` (which reads a transformers config object), from a plain dict; Gemma 3
    configs written before ``layer_types`` give a pattern instead (every n-th layer global)."""
    layers, window = config["num_hidden_layers"], config.get("sliding_window") or 0
    if not window:
        return ()
    if layer_types := config.get("layer_types"):
        return tuple(window if kind == "sliding_attention" else 0 for kind in layer_types)
    if pattern := config.get("sliding_window_pattern"):
        return tuple(0 if (i + 1) % pattern == 0 else window for i in range(layers))
    return (window,) * layers if config.get("use_sliding_window", True) else ()


@dataclass(frozen=True)
class Settings:
    weights: str
    kv: str
    context: int
    capacity_fraction: float = 1.0
    prefill_chunk: int = 512

    @property
    def capacity(self) -> int:
        return max(1, int(self.context * self.capacity_fraction))

    def describe(self) -> str:
        capacity = "full" if self.capacity_fraction == 1 else f"{self.capacity} slots ({self.capacity_fraction:.1%})"
        return (
            f"weights {self.weights}, KV {self.kv} at capacity {capacity}, context {self.context}, "
            f"prefill chunk {self.prefill_chunk}"
        )


@dataclass(frozen=True)
class Estimate:
    model: ModelShape
    target: Target
    settings: Settings
    weights_bytes: int
    kv_bytes: int
    activation_bytes: int
    concessions: tuple[str, ...] = ()

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.kv_bytes + self.activation_bytes

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.target.usable_bytes

    def table(self) -> list[tuple[str, str]]:
        gb = lambda n: f"{n / GIB:.2f} GiB"  # noqa: E731
        return [
            (
                "weights",
                f"{gb(self.weights_bytes)} ({self.model.parameters() / 1e6:,.0f} M params, {self.settings.weights}"
                + (", one copy per static graph)" if self.target.static_shapes else ")"),
            ),
            ("KV cache", f"{gb(self.kv_bytes)} ({self.settings.capacity} slots, {self.settings.kv})"),
            ("activations", f"{gb(self.activation_bytes)} (prefill chunk {self.settings.prefill_chunk})"),
            ("total", gb(self.total_bytes)),
            ("usable on target", f"{gb(self.target.usable_bytes)} of {gb(self.target.memory_bytes)}"),
        ]


def estimate(model: ModelShape, target: Target, settings: Settings, concessions: tuple[str, ...] = ()) -> Estimate:
    # a static-shape target runs two graphs (prefill chunk, decode step) in two sessions, each holding its own
    # device copy of the weights; and its prefill graph computes logits for every row of the chunk
    copies = 2 if target.static_shapes else 1
    weights = int(model.parameters() * WEIGHT_BYTES[settings.weights]) * copies
    compressed = settings.capacity_fraction < 1 or settings.kv in ("int8", "int4", "fp8")
    compute = 2 if target.device != "cpu" else 4  # GPUs and NPUs compute in fp16, CPUs in fp32
    chunk = settings.prefill_chunk
    # global layers hold `capacity` slots in the chosen KV dtype; a sliding-window layer is a ring of its window
    # plus one prefill chunk in the compute dtype, whatever the context (export.cache_spec_for)
    windows = model.windows or (0,) * model.layers
    per_global_slot = model.kv_heads * (
        2 * model.head_dim * KV_BYTES[settings.kv] + (SLOT_METADATA_BYTES if compressed else 0)
    )
    per_ring_slot = model.kv_heads * (2 * model.head_dim * compute + 8)
    kv = sum(
        min(settings.context, window + chunk) * per_ring_slot if window else settings.capacity * per_global_slot
        for window in windows
    )
    # one layer's transients during a prefill chunk (hidden states, MLP, attention scores) + the logits row
    activation = compute * chunk * (8 * model.hidden + 3 * model.intermediate + model.heads * settings.capacity)
    activation += 4 * model.vocab * (chunk if target.static_shapes else 1)
    return Estimate(model, target, settings, weights, kv, int(activation), concessions)


def _concessions(target: Target, fixed: set[str]):
    """(description, change) in the order they are tried."""
    steps = []
    if "kv" not in fixed:
        steps += [(f"KV cache {kv}", {"kv": kv}) for kv in ("fp16", "int8") if kv in target.dtypes]
    if "weights" not in fixed:
        steps += [(f"weights {w}", {"weights": w}) for w in ("int8", "int4") if w in target.dtypes]
    if "prefill_chunk" not in fixed:
        steps += [(f"prefill chunk {c}", {"prefill_chunk": c}) for c in (256, 128)]
    if "capacity" not in fixed:
        steps += [(f"KV capacity {f:.0%}", {"capacity_fraction": f}) for f in (0.5, 0.25)]
    if "kv" not in fixed and "int4" in target.dtypes:
        steps.append(("KV cache int4", {"kv": "int4"}))
    if "capacity" not in fixed:
        steps.append(("KV capacity 12%", {"capacity_fraction": 0.125}))
    return steps


def plan(model: ModelShape, target: Target, settings: Settings, fixed: frozenset[str] = frozenset()) -> Estimate:
    """The first settings (in concession order) that fit; PlanError with the numbers when none do."""
    current = estimate(model, target, settings)
    made: list[str] = []
    for description, change in _concessions(target, set(fixed)):
        if current.fits:
            return current
        candidate = replace(current.settings, **change)
        if candidate == current.settings or _weaker(candidate, current.settings):
            continue  # nothing to concede, or it would go back to a larger setting
        made.append(description)
        current = estimate(model, target, candidate, tuple(made))
    if current.fits:
        return current
    raise PlanError(_refusal(current))


def _weaker(candidate: Settings, current: Settings) -> bool:
    order = ["int4", "fp8", "int8", "fp16", "bf16", "fp32"]
    return (
        order.index(candidate.weights) > order.index(current.weights)
        or order.index(candidate.kv) > order.index(current.kv)
        or candidate.capacity_fraction > current.capacity_fraction
        or candidate.prefill_chunk > current.prefill_chunk
    )


def _refusal(best: Estimate) -> str:
    settings, target = best.settings, best.target
    low, high = 0, settings.context
    while low < high:  # the largest context that fits with these settings
        middle = (low + high + 1) // 2
        if estimate(best.model, target, replace(settings, context=middle)).fits:
            low = middle
        else:
            high = middle - 1
    hint = f"try --context {low // 256 * 256 or low}" if low >= 256 else "choose a larger target or a smaller model"
    return (
        f"{best.model.name} needs {best.total_bytes / GIB:.2f} GiB even with {settings.describe()}; "
        f"{target.name} has {target.usable_bytes / GIB:.2f} GiB usable; {hint}"
    )


def model_shape(source: str | Path) -> ModelShape:
    """A config from: a bundled name (llama-2-7b, llama-3-8b, smollm2-135m), a config.json, a model folder, or a
    GGUF file (its metadata; no weights are read)."""
    source_path = Path(source)
    bundled = resources.files("edgec.configs") / f"{source}.json"
    if not source_path.exists() and bundled.is_file():
        return ModelShape.from_config(json.loads(bundled.read_text()), str(source))
    if source_path.is_dir():
        source_path = source_path / "config.json"
    if source_path.suffix.lower() == ".gguf" and source_path.is_file():
        return _gguf_shape(source_path)
    if source_path.is_file():
        try:
            return ModelShape.from_config(json.loads(source_path.read_text()), source_path.parent.name)
        except (json.JSONDecodeError, KeyError, UnicodeDecodeError) as error:
            raise BuildSettingsError(f"{source_path} is not a usable model config ({error})") from None
    names = ", ".join(
        sorted(p.name[:-5] for p in resources.files("edgec.configs").iterdir() if p.name.endswith(".json"))
    )
    raise BuildSettingsError(f"{source} is not a model folder, config.json, .gguf or a known config ({names})")


def _gguf_shape(path: Path) -> ModelShape:
    import gguf

    reader = gguf.GGUFReader(str(path))

    def value(key: str, default: Any = None) -> Any:
        field = reader.fields.get(key)
        return default if field is None else field.parts[field.data[0]][0].item()

    arch_field = reader.fields["general.architecture"]
    arch = bytes(arch_field.parts[arch_field.data[0]]).decode()
    heads = value(f"{arch}.attention.head_count")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    names = {tensor.name for tensor in reader.tensors}
    config = {
        "num_hidden_layers": value(f"{arch}.block_count"),
        "hidden_size": value(f"{arch}.embedding_length"),
        "intermediate_size": value(f"{arch}.feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": value(f"{arch}.attention.head_count_kv", heads),
        "head_dim": value(f"{arch}.attention.key_length"),
        "vocab_size": value(f"{arch}.vocab_size") or (len(tokens.data) if tokens is not None else 0),
        "tie_word_embeddings": "output.weight" not in names,
        "max_position_embeddings": value(f"{arch}.context_length", 0),
        "sliding_window": value(f"{arch}.attention.sliding_window", 0),
    }
    if arch == "gemma3":  # its GGUF states the window, not the layout: every 6th layer is global
        config["sliding_window_pattern"] = 6
    return ModelShape.from_config(config, path.stem)
