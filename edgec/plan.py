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

import re
from dataclasses import dataclass, replace

from edgec.errors import BuildSettingsError
from edgec.kvcache.compression import Compression
from edgec.kvcache.quantize import bytes_per_value
from edgec.shape import ModelShape, model_shape
from edgec.targets import Target

__all__ = ["ModelShape", "Settings", "estimate", "model_shape", "parse_memory", "plan", "PlanError", "with_memory"]

WEIGHT_BYTES = {"fp32": 4.0, "fp16": 2.0, "bf16": 2.0, "fp8": 1.0, "int8": 1.0 + 2 / 128, "int4": 0.5 + 2.5 / 32}
GIB = 2**30


_SIZE_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


def parse_memory(text: str) -> int:
    """Bytes from a size as people write it: ``6GB`` and ``6G`` are 6·10⁹ bytes, ``8GiB`` is 8·2³⁰, ``512MiB``,
    ``1.5TB``, a bare number is bytes. BuildSettingsError for anything else, or a size that is not positive."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(i?)(b?)\s*", str(text), re.IGNORECASE)
    if not match or (match.group(3) and not match.group(2)):
        raise BuildSettingsError(f"--memory takes a size such as 6GB, 8GiB or 512MiB, got {text!r}")
    number, prefix, binary, _ = match.groups()
    prefix = prefix.lower()
    scale = 1024 ** "kmgt".index(prefix) * 1024 if binary else _SIZE_UNITS[prefix]
    size = int(float(number) * scale)
    if size <= 0:
        raise BuildSettingsError(f"--memory must be more than 0 bytes, got {text!r}")
    return size


def with_memory(target: Target, memory_bytes: int | None) -> Target:
    """The target with the device memory given on the command line (``--memory``) in place of its own; its usable
    share and the runtime's own overhead still apply."""
    if memory_bytes is None:
        return target
    changed = replace(target, memory_bytes=int(memory_bytes))
    if changed.usable_bytes <= 0:
        raise BuildSettingsError(
            f"--memory {memory_bytes / GIB:.2f} GiB leaves nothing usable on {target.name} (it keeps "
            f"{1 - target.usable_fraction:.0%} for the system and {target.runtime_overhead_bytes / GIB:.2f} GiB for "
            "the runtime)"
        )
    return changed


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
    # a mixed-precision cache (--kv-mixed): sink + window slots per head in this wider storage
    kv_mixed: str = Compression.mixed
    kv_sink: int = Compression.sink
    kv_window: int = Compression.window

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

    def _mixed(self) -> str:
        return _mixed_text(self.settings)

    def table(self) -> list[tuple[str, str]]:
        gb = lambda n: f"{n / GIB:.2f} GiB"  # noqa: E731
        return [
            (
                "weights",
                f"{gb(self.weights_bytes)} ({self.model.parameters() / 1e6:,.0f} M params, {self.settings.weights}"
                + (", one copy per static graph)" if self.target.static_shapes else ")"),
            ),
            ("KV cache", f"{gb(self.kv_bytes)} ({self.settings.capacity} slots, {self.settings.kv}{self._mixed()})"),
            ("activations", f"{gb(self.activation_bytes)} (prefill chunk {self.settings.prefill_chunk})"),
            ("total", gb(self.total_bytes)),
            ("usable on target", f"{gb(self.target.usable_bytes)} of {gb(self.target.memory_bytes)}"),
        ]


def _mixed_text(settings: Settings) -> str:
    if settings.kv_mixed == "none":
        return ""
    return f"; sinks + window ({settings.kv_sink + settings.kv_window} slots) {settings.kv_mixed}"


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
    compression = Compression(
        dtype=settings.kv,
        group=settings.kv_group,
        mixed=settings.kv_mixed,
        sink=settings.kv_sink,
        window=settings.kv_window,
    )
    per_global_slot = model.kv_heads * (
        compression.bytes_per_slot(model.head_dim)
        if compressed
        else 2 * model.head_dim * bytes_per_value(settings.kv, compression.group)
    )
    if compression.hi_slots:  # two pools: the wide one's slots cost more (CacheSpec counts them the same way)
        per_global_layer = model.kv_heads * compression.bytes_for_slots(model.head_dim, settings.capacity)
    else:
        per_global_layer = settings.capacity * per_global_slot
    per_ring_slot = model.kv_heads * (2 * model.head_dim * compute + 8)
    kv = sum(
        min(settings.context, window + chunk) * per_ring_slot if window else per_global_layer for window in windows
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


def build_command(model: str, estimate: Estimate, memory: str | None = None) -> str:
    """The ``edgec build`` line that builds what ``estimate`` planned, ready to copy. ``model`` as the user named it
    (a bundled config name becomes a placeholder for the model's folder or .gguf); ``memory``: the --memory text."""
    import shlex
    from pathlib import Path

    settings, target = estimate.settings, estimate.target
    path = Path(model)
    if path.is_file() and path.suffix.lower() == ".json":  # a config.json: the build reads its folder
        path = path.parent
    source = shlex.quote(str(path)) if path.exists() else f"PATH/TO/{model}"
    words = ["edgec", "build", source, "--target", target.name, "--context", str(settings.context)]
    words += ["--weights", settings.weights]
    if settings.prefill_chunk != int(target.defaults.get("prefill_chunk", 512)):
        words += ["--prefill-chunk", str(settings.prefill_chunk)]
    if settings.capacity_fraction < 1 or settings.kv != target.defaults.get("kv", "fp32"):
        # anything but the target's plain cache is the compressed cache: its slot count and storage
        words += ["--kv-capacity", str(settings.capacity), "--kv-dtype", settings.kv]
    if settings.kv_mixed != "none":
        words += ["--kv-mixed", settings.kv_mixed]
    if memory is not None:
        words += ["--memory", shlex.quote(memory)]
    return " ".join([*words, "-o", shlex.quote(f"{estimate.model.name}.{target.name}.edgec")])
