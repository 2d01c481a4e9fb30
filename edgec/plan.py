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

from dataclasses import dataclass, replace

from edgec.errors import BuildSettingsError
from edgec.kvcache.compression import Compression
from edgec.kvcache.quantize import bytes_per_value
from edgec.shape import ModelShape, model_shape
from edgec.targets import Target

__all__ = ["ModelShape", "Settings", "estimate", "model_shape", "plan", "PlanError"]

WEIGHT_BYTES = {"fp32": 4.0, "fp16": 2.0, "bf16": 2.0, "fp8": 1.0, "int8": 1.0 + 2 / 128, "int4": 0.5 + 2.5 / 32}
GIB = 2**30


class PlanError(BuildSettingsError):
    """No settings fit the target; the message has the numbers and what to change."""


@dataclass(frozen=True)
class Settings:
    weights: str
    kv: str
    context: int
    capacity_fraction: float = 1.0
    prefill_chunk: int = 512
    kv_group: int = Compression.group  # channels per scale of a quantized cache (--kv-group)

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
    windows = model.layer_windows()
    # a slot's bytes come from the cache contract the bundle will carry (CacheSpec sizes slots the same way), so
    # the plan and the built bundle's `cache.bytes_per_token` cannot disagree
    compression = Compression(dtype=settings.kv, group=settings.kv_group)
    per_global_slot = model.kv_heads * (
        compression.bytes_per_slot(model.head_dim)
        if compressed
        else 2 * model.head_dim * bytes_per_value(settings.kv, compression.group)
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
