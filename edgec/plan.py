"""Memory planner: weights + KV cache + activations against a target's usable memory, from a config alone.

``plan()`` starts from the requested settings (or the target's defaults) and, while the total does not fit,
makes the next concession in ``CONCESSIONS`` — cheapest in quality first (docs/planner.md gives the evidence):

1. KV cache fp32 → fp16, then int8 (SmolLM2: perplexity 20.39 → 20.40)
2. weights → int8, then int4 (block 32; lossless from a Q4 GGUF, small loss otherwise)
3. prefill chunk halved down to 128 (costs only prefill speed)
4. KV capacity 50 %, then 25 % of the context (compressed cache with eviction), prompts compressed as they are
   read (``--prefill-compress chunk``): an ``end`` prompt as long as the context is first read whole into a
   temporary state, so with ``end`` a smaller capacity never lowers the peak
5. KV int4 (SmolLM2: 20.39 → 23.05), then capacity 12.5 %

The total is the peak: weights (twice where a second ONNX Runtime session holds its own copy: a prompt-chunk graph
beside the step graph, or a static target's two graphs), the cache, the temporary state of an ``end`` prompt as
long as the context, and one chunk's activations. A concession that does not lower it is not made. Settings the
user fixed are never conceded. When nothing fits, the refusal gives the numbers and the largest context that
would fit with every concession made.
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
    # how a prompt longer than the capacity is read (--prefill-compress): end = whole into a temporary state first
    prefill_compress: str = Compression.prefill_compress
    # whether int4 products split their activations (the default for a GGUF's own blocks), which gives the
    # bundle a prompt-chunk graph (prefill.onnx) in a session of its own
    split_activations: bool = True
    # whether the bundle has that graph, as the build knows it; None: from the settings (``default_prompt_graph``)
    prompt_graph: bool | None = None

    @property
    def capacity(self) -> int:
        return max(1, int(self.context * self.capacity_fraction))

    @property
    def compressed(self) -> bool:
        """A compressed cache (slots chosen by eviction, or quantized storage)."""
        return self.capacity_fraction < 1 or self.kv in ("int8", "int4", "fp8")

    @property
    def reads_prompts_whole(self) -> bool:
        """Whether a prompt as long as the context is first read whole into a temporary state beside the slots
        (``prefill_compress`` end with fewer slots than the context: the runtime's ``begin_prompt``)."""
        return self.compressed and self.prefill_compress == "end" and self.capacity < self.context

    def describe(self) -> str:
        capacity = "full" if self.capacity_fraction == 1 else f"{self.capacity} slots ({self.capacity_fraction:.1%})"
        return (
            f"weights {self.weights}, KV {self.kv} at capacity {capacity}, context {self.context}, "
            f"prefill chunk {self.prefill_chunk}"
            + (
                f", prompts compressed {'at the end' if self.prefill_compress == 'end' else 'per chunk'}"
                if self.capacity_fraction < 1
                else ""
            )
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
    prompt_state_bytes: int = 0  # an `end` prompt's temporary state, beside the slots while the prompt is read
    weight_copies: int = 1

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.kv_bytes + self.prompt_state_bytes + self.activation_bytes

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.target.usable_bytes

    def _mixed(self) -> str:
        return _mixed_text(self.settings)

    def table(self) -> list[tuple[str, str]]:
        gb = lambda n: f"{n / GIB:.2f} GiB"  # noqa: E731
        copies = ""
        if self.weight_copies > 1:
            copies = ", one copy per static graph" if self.target.static_shapes else ", two sessions (prompt + step)"
        rows = [
            (
                "weights",
                f"{gb(self.weights_bytes)} ({self.model.parameters() / 1e6:,.0f} M params, {self.settings.weights}"
                + copies
                + ")",
            ),
            ("KV cache", f"{gb(self.kv_bytes)} ({self.settings.capacity} slots, {self.settings.kv}{self._mixed()})"),
        ]
        if self.prompt_state_bytes:
            rows.append(
                (
                    "prompt state",
                    f"{gb(self.prompt_state_bytes)} (a {self.settings.context}-token prompt read whole before its "
                    "slots are chosen: --prefill-compress end)",
                )
            )
        return rows + [
            ("activations", f"{gb(self.activation_bytes)} (prefill chunk {self.settings.prefill_chunk})"),
            ("total", gb(self.total_bytes)),
            ("usable on target", f"{gb(self.target.usable_bytes)} of {gb(self.target.memory_bytes)}"),
        ]


def _mixed_text(settings: Settings) -> str:
    if settings.kv_mixed == "none":
        return ""
    return f"; sinks + window ({settings.kv_sink + settings.kv_window} slots) {settings.kv_mixed}"


def default_prompt_graph(target: Target, settings: Settings) -> bool:
    """Whether a bundle of these settings has a prompt-chunk graph beside its step graph (``prefill_graph``): on
    ONNX Runtime targets (not static, no engine) when its int4 products split their activations (by default only
    a GGUF's own blocks do; int8 ones only when asked, which the build's own plan knows) or its compressed layers
    keep fp32 slots that GroupQueryAttention reads in place."""
    if target.static_shapes or target.abilities.engine:
        return False
    fp32_slots = settings.compressed and settings.kv == "fp32" and target.abilities.attention == "gqa"
    return fp32_slots or (settings.split_activations and settings.weights == "int4")


def count_weight_copies(target: Target, settings: Settings) -> int:
    """Copies of the weights the runtime holds: two where a second session has its own — a static target's two
    graphs, or a prompt-chunk graph (each ONNX Runtime session packs its own copy of the products' weights; float
    weights are mapped once and packed by the step session: docs/BENCHMARKS.md, sixteenth round of issue 21)."""
    if target.static_shapes:
        return 2
    graph = settings.prompt_graph
    return 2 if (default_prompt_graph(target, settings) if graph is None else graph) else 1


def estimate(model: ModelShape, target: Target, settings: Settings, concessions: tuple[str, ...] = ()) -> Estimate:
    # a static-shape target runs two graphs (prefill chunk, decode step) in two sessions, each holding its own
    # device copy of the weights, and its prefill graph computes logits for every row of the chunk; an ONNX
    # Runtime bundle with a prompt-chunk graph also has two sessions
    copies = count_weight_copies(target, settings)
    weights = int(model.parameters() * WEIGHT_BYTES[settings.weights]) * copies
    if copies == 1 and model.tied and target.runtime == "ort-cpu" and settings.weights in ("fp32", "fp16", "bf16"):
        # a tied float table twice: the embedding's Gather reads it as stored, the lm_head's product packs a copy
        # of its own (Gemma-3-270m: 0.625 GiB; two sessions already count every weight twice)
        weights += int(model.vocab * model.hidden * WEIGHT_BYTES[settings.weights])
    compressed = settings.compressed
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

    def global_layer(slots: int) -> float:
        if compression.hi_slots:  # two pools: the wide one's slots cost more (CacheSpec counts them the same way)
            return model.kv_heads * compression.bytes_for_slots(model.head_dim, slots)
        return slots * per_global_slot

    per_ring_slot = model.kv_heads * (2 * model.head_dim * compute + 8)
    kv = sum(
        min(settings.context, window + chunk) * per_ring_slot if window else global_layer(settings.capacity)
        for window in windows
    )
    # an `end` prompt longer than the capacity is read whole into a temporary state of the same storage (the
    # runtime's begin_prompt), beside the slots, before its best slots are chosen: the peak of a long prompt
    whole = settings.reads_prompts_whole
    prompt_state = sum(global_layer(settings.context) for window in windows if not window) if whole else 0
    # one layer's transients during a prefill chunk (hidden states, MLP, attention scores) + the logits row
    attended = settings.context if whole else settings.capacity
    activation = compute * chunk * (8 * model.hidden + 3 * model.intermediate + model.heads * attended)
    if compressed and settings.kv != "fp32" and target.abilities.attention == "gqa":
        # ONNX Runtime running the op node by node: slots stored narrower than float32 are read by dequantizing a
        # layer's attended slots (the op's Cast to float32), and at GroupQueryAttention its k and v are there twice,
        # as those copies and as the kernel's present outputs (fp32 slots are read in place). SmolLM2 int8 slots,
        # an 8,000-token `end` prompt: 23 MiB. (Engines that compile the op — TensorRT-RTX, OpenVINO, CANN — fuse
        # what they fuse: not counted, not measured.)
        activation += 2 * attended * model.kv_heads * model.head_dim * (4 + compute)
    activation += 4 * model.vocab * (chunk if target.static_shapes else 1)
    return Estimate(model, target, settings, weights, kv, int(activation), concessions, int(prompt_state), copies)


def _concessions(target: Target, fixed: set[str]):
    """(description, change) in the order they are tried."""
    steps = []
    if "kv" not in fixed:
        steps += [(f"KV cache {kv}", {"kv": kv}) for kv in ("fp16", "int8") if kv in target.dtypes]
    if "weights" not in fixed:
        steps += [(f"weights {w}", {"weights": w}) for w in ("int8", "int4") if w in target.dtypes]
    if "prefill_chunk" not in fixed:
        steps += [(f"prefill chunk {c}", {"prefill_chunk": c}) for c in (256, 128)]
    # fewer slots lower the peak only when long prompts are compressed as they are read: an `end` prompt is first
    # read whole (Settings.reads_prompts_whole); where the mode is fixed at `end`, plan() finds they save nothing
    chunk = {} if "prefill_compress" in fixed else {"prefill_compress": "chunk"}
    per_chunk = " (prompts compressed per chunk)" if chunk else ""
    if "capacity" not in fixed:
        steps += [(f"KV capacity {f:.0%}{per_chunk}", {"capacity_fraction": f, **chunk}) for f in (0.5, 0.25)]
    if "kv" not in fixed and "int4" in target.dtypes:
        steps.append(("KV cache int4", {"kv": "int4"}))
    if "capacity" not in fixed:
        steps.append((f"KV capacity 12%{per_chunk}", {"capacity_fraction": 0.125, **chunk}))
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
        if estimate(model, target, candidate).total_bytes >= current.total_bytes:
            continue  # it would cost quality and save nothing (fewer slots with `end` prompts: their peak grows)
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
        or (candidate.prefill_compress == "end" and current.prefill_compress != "end")
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
    if best.prompt_state_bytes and estimate(best.model, target, replace(settings, prefill_compress="chunk")).fits:
        hint = (
            f"an {settings.context}-token prompt read whole takes {best.prompt_state_bytes / GIB:.2f} GiB before its "
            f"slots are chosen: try --prefill-compress chunk (prompts compressed as they are read), or {hint}"
        )
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
        if settings.prefill_compress != Compression.prefill_compress:
            words += ["--prefill-compress", settings.prefill_compress]
    if settings.kv_mixed != "none":
        words += ["--kv-mixed", settings.kv_mixed]
    if memory is not None:
        words += ["--memory", shlex.quote(memory)]
    return " ".join([*words, "-o", shlex.quote(f"{estimate.model.name}.{target.name}.edgec")])
