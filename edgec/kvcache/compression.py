"""The compressed-cache settings: one type that owns their defaults, choices, checks and flags.

Everything else is derived from ``Compression``'s fields: the ``--kv-*`` options of ``edgec build`` (cli.py reads
``Compression.options()``), the manifest schema of ``cache.compression`` (manifest_schema.py reads
``Compression.schema()``), and the overrides ``Model.load`` accepts (``Compression.override``). Adding a setting is
adding a field here.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from edgec.errors import BuildSettingsError
from edgec.kvcache.quantize import STORAGE, bytes_per_value
from edgec.kvcache.rotation import ROTATIONS, usable

PREFILL_MODES = ("end", "chunk")
MIXED = ("none", "int8", "fp16")  # storage of the high-precision pool (--kv-mixed); none = one pool
# settings a manifest holds only when their feature is on (the setting that turns it on → the settings it adds)
OMITTED_WHEN_OFF = {"rotation": ("rotation", "rotation_seed"), "mixed": ("mixed",), "decode_kernel": ("decode_kernel",)}
# how a one-token step reads the slots: none = the op's own decode body; gqa = ONNX Runtime's GroupQueryAttention
# reads fp32 slots in place (k/v buffers one spare row longer: compressed_function._decode_gqa). The build chooses
# it (``native_decode``), never a flag: a bundle's graph and state layout follow from it
DECODE_KERNELS = ("none", "gqa")
# settings a manifest holds only when recall is on (kvcache/recall.py), so other bundles stay byte-identical
RECALL_FIELDS = ("recall", "recall_block", "recall_every")


def _policy_names() -> tuple[str, ...]:
    from edgec.kvcache.policies import POLICIES

    return tuple(POLICIES)


@dataclass(frozen=True)
class Option:
    """How one setting is offered to users: its ``edgec build`` flag (None: not offered), help text, allowed
    values, its least value, whether it asks for the compressed cache by itself, and whether ``Model.load`` may
    change it on a built bundle (the graph takes it as data, not as a constant)."""

    flag: str | None
    help: str
    default_text: str | None = None  # what the default means, where the value alone does not say
    choices: Any = None  # a tuple, or a function returning one (looked up when used)
    minimum: float | None = None
    requests: bool = False
    at_load: bool = False

    def allowed(self) -> tuple | None:
        return self.choices() if callable(self.choices) else self.choices


def _setting(default: Any, option: Option) -> Any:
    return field(default=default, metadata={"option": option})


@dataclass(frozen=True)
class Compression:
    """How the global layers' cache is pruned and stored.

    ``capacity`` None means "the bundle's context" until the build resolves it (``resolved``); a built bundle
    always records a number.
    """

    capacity: int | None = _setting(
        None,
        Option("--kv-capacity", "slots per layer and KV head", "the context", minimum=1, requests=True, at_load=True),
    )
    sink: int = _setting(4, Option("--kv-sink", "first tokens never evicted", minimum=0))
    window: int = _setting(64, Option("--kv-window", "most recent tokens never evicted", minimum=1))
    policy: str = _setting(
        "snapkv", Option("--kv-policy", "how the other slots are scored", choices=_policy_names, requests=True)
    )
    dtype: str = _setting("fp32", Option("--kv-dtype", "storage of k and v", choices=STORAGE, requests=True))
    group: int = _setting(32, Option("--kv-group", "channels per dynamic scale (int8, fp8, int4)", minimum=1))
    # the last prompt queries whose attention judges a prompt (snapkv)
    observe: int = _setting(32, Option(None, "prompt queries that judge the prompt", minimum=1))
    prefill_compress: str = _setting(
        "end",
        Option(
            "--prefill-compress",
            "prompts longer than the capacity: end = read it whole, then select (query-aware); chunk = select "
            "between chunks (memory never exceeds the capacity)",
            choices=PREFILL_MODES,
            at_load=True,
        ),
    )
    # the share of the evictable capacity that protected tokens may hold
    protect_fraction: float = _setting(0.25, Option(None, "share of slots protected tokens may hold", minimum=0))
    # rotation.py; both are left out of the manifest when off, so bundles without it stay byte-identical
    rotation: str = _setting(
        "none",
        Option(
            "--kv-rotation",
            "orthogonal transform of k and v before storage: hadamard = a per-head Hadamard with random signs, "
            "which spreads outlier channels before int8/fp8/int4 rounding (exact in fp32)",
            choices=ROTATIONS,
        ),
    )
    rotation_seed: int = _setting(0, Option("--kv-rotation-seed", "seed of the rotation's random signs", minimum=0))
    # mixed precision (reference.py, mixed_function.py); left out of the manifest when off, like the rotation
    mixed: str = _setting(
        "none",
        Option(
            "--kv-mixed",
            "a second pool of sink + window slots in this wider storage (int8 or fp16) for the sinks, the recent "
            "window and protected tokens; the other slots keep --kv-dtype (e.g. int4), a token is re-quantized "
            "into them as it leaves the window",
            choices=MIXED,
        ),
    )
    # hierarchical cache (edgec/kvcache/recall.py, docs/kv-cache.md): every token also lives in a host tier of the
    # runtime; before each step the blocks whose key summaries score highest against the last query are copied
    # into recall × recall_block reserved slots. The graph gains the query outputs; the rest is the runtime's
    recall: int = _setting(
        0,
        Option(
            "--kv-recall",
            "hierarchical cache: blocks recalled per KV head into reserved slots from the host tier of every "
            "token (0 = off; ONNX Runtime CPU targets)",
            minimum=0,
            at_load=True,
        ),
    )
    recall_block: int = _setting(
        16, Option("--kv-recall-block", "tokens per host-tier block (one key summary each)", minimum=1, at_load=True)
    )
    recall_every: int = _setting(
        1, Option("--kv-recall-every", "decode steps between recalls", minimum=1, at_load=True)
    )
    decode_kernel: str = _setting(
        "none", Option(None, "the kernel of one-token steps (chosen by the build)", choices=DECODE_KERNELS)
    )

    # --- derived from the fields -------------------------------------------------------------------------------
    @classmethod
    def options(cls) -> list[tuple[str, Any, Option]]:
        """(field name, default, option) of every setting, in declaration order."""
        return [(f.name, f.default, f.metadata["option"]) for f in fields(cls)]

    @classmethod
    def parameters(cls) -> dict[str, str]:
        """Keyword name of each flag (``--kv-capacity`` → ``kv_capacity``, as the CLI and ``Model.load`` take it)
        → the field it sets."""
        return {option.flag[2:].replace("-", "_"): name for name, _, option in cls.options() if option.flag}

    @classmethod
    def from_flags(cls, values: dict[str, Any]) -> Compression | None:
        """The settings given on a command line (field name → value, None = not given), or None when none asks
        for the compressed cache. A setting given without one that asks for it is an error, not ignored."""
        given = {name: value for name, value in values.items() if value is not None}
        if not given:
            return None
        by_name = {name: option for name, _, option in cls.options()}
        if not any(by_name[name].requests for name in given):
            requesting = ", ".join(option.flag for _, _, option in cls.options() if option.requests)
            flags = ", ".join(by_name[name].flag or name for name in given)
            raise BuildSettingsError(f"{flags} set(s) the compressed cache; also give one of {requesting}")
        return cls(**given)

    @classmethod
    def schema(cls) -> dict[str, Any]:
        """The manifest schema of a built bundle's settings (manifest_schema.py's notation)."""
        types = {"int": int, "str": str, "float": (int, float), "int | None": int}
        optional = {name for names in OMITTED_WHEN_OFF.values() for name in names} | set(RECALL_FIELDS)
        return {f"{f.name}?" if f.name in optional else f.name: types[str(f.type)] for f in fields(cls)}

    @classmethod
    def from_json(cls, data: dict) -> Compression:
        known = {f.name for f in fields(cls)}
        return cls(**{key: value for key, value in data.items() if key in known})

    def to_json(self) -> dict:
        data = asdict(self)
        for switch, names in OMITTED_WHEN_OFF.items():
            if getattr(self, switch) == "none":  # as before the setting existed
                for name in names:
                    data.pop(name)
        if not self.recall:
            for name in RECALL_FIELDS:
                data.pop(name)
        return data

    # --- checks ------------------------------------------------------------------------------------------------
    def resolved(self, context: int) -> Compression:
        """With the capacity a build gets when none was given: the context."""
        return self if self.capacity is not None else replace(self, capacity=context)

    def check(self, head_dim: int, context: int | None = None) -> None:
        """One clear line for every setting that cannot work (a resolved capacity is required)."""
        for name, _, option in self.options():
            value = getattr(self, name)
            label = option.flag or name
            allowed = option.allowed()
            if allowed is not None and value not in allowed:
                raise BuildSettingsError(f"unknown {label} {value!r}; one of {', '.join(allowed)}")
            numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
            if option.minimum is not None and value is not None and (not numeric or value < option.minimum):
                raise BuildSettingsError(f"{label} must be a number ≥ {option.minimum:g}, got {value!r}")
        if self.capacity is None:
            raise BuildSettingsError("the compressed cache needs a capacity (--kv-capacity)")
        if self.capacity < self.sink + self.window + 1:
            raise BuildSettingsError(
                f"--kv-capacity {self.capacity} leaves no room to evict: it must exceed --kv-sink + --kv-window "
                f"({self.sink} + {self.window})"
            )
        if context is not None and self.capacity > context:
            raise BuildSettingsError(f"--kv-capacity {self.capacity} exceeds the context {context}")
        if self.quantized and head_dim % self.group:
            raise BuildSettingsError(
                f"--kv-group {self.group} does not divide the head dim {head_dim}; use a divisor such as "
                f"{max(g for g in (16, 32, 64, head_dim) if head_dim % g == 0)}"
            )
        if self.dtype == "int4" and self.group % 2:
            raise BuildSettingsError(f"--kv-group must be even for int4 (two values per byte), got {self.group}")
        if not self.rotation_seed < 2**32:
            raise BuildSettingsError(f"--kv-rotation-seed must be below 2**32, got {self.rotation_seed}")
        if self.rotation != "none" and not usable(head_dim):
            raise BuildSettingsError(
                f"--kv-rotation {self.rotation} needs a power-of-two head dim, got {head_dim}; use --kv-rotation none"
            )
        if self.mixed != "none" and bytes_per_value(self.mixed, self.group) <= bytes_per_value(self.dtype, self.group):
            raise BuildSettingsError(
                f"--kv-mixed {self.mixed} keeps the sinks, window and protected tokens wider than the other slots: "
                f"--kv-dtype {self.dtype} is not narrower; use --kv-dtype int4 (or int8/fp8 with --kv-mixed fp16)"
            )
        if not self.protect_fraction < 1:
            raise BuildSettingsError(f"protect fraction must lie in [0, 1), got {self.protect_fraction}")
        if self.recall and self.capacity - self.recall_slots < self.sink + self.window + self.max_protected + 1:
            raise BuildSettingsError(
                f"--kv-recall {self.recall} × --kv-recall-block {self.recall_block} reserves {self.recall_slots} of "
                f"{self.capacity} slots: the rest must exceed the sink, the recent window and the protected tokens "
                f"({self.sink} + {self.window} + {self.max_protected}); recall fewer blocks or raise --kv-capacity"
            )
        if self.decode_kernel == "gqa" and not self.native_decode_fits():
            raise BuildSettingsError(
                f"decode kernel gqa reads unrotated fp32 slots in one pool without recall; these settings have "
                f"--kv-dtype {self.dtype}, --kv-rotation {self.rotation}, --kv-mixed {self.mixed}, "
                f"--kv-recall {self.recall}"
            )
        if self.recall and self.mixed != "none":
            raise BuildSettingsError(
                f"--kv-recall {self.recall} with --kv-mixed {self.mixed}: the host tier and the reserved slots are "
                "built for one slot pool; use one of them"
            )

    def override(self, head_dim: int, context: int | None = None, **changes: Any) -> Compression:
        """These settings with the changes a loaded bundle may take (``Option.at_load``), checked as a build
        would check them (against the bundle's ``context``: no more slots than positions); None values are
        ignored."""
        changes = {name: value for name, value in changes.items() if value is not None}
        movable = {name for name, _, option in self.options() if option.at_load}
        if fixed := sorted(set(changes) - movable):
            raise BuildSettingsError(f"{', '.join(fixed)} is fixed when the bundle is built; rebuild to change it")
        changed = replace(self, **changes)
        changed.check(head_dim, context)
        return changed

    # --- what the settings imply -------------------------------------------------------------------------------
    def native_decode_fits(self) -> bool:
        """Whether ONNX Runtime's GroupQueryAttention can read these slots itself in a one-token step: fp32
        storage (no scales), one pool, no rotation, no recall (``decode_kernel`` gqa)."""
        return self.dtype == "fp32" and self.rotation == "none" and self.mixed == "none" and not self.recall

    @property
    def spare_rows(self) -> int:
        """Rows the k/v buffers carry beyond the slots: 1 where GroupQueryAttention writes the token into a
        spare row before the eviction moves it into its slot (``decode_kernel`` gqa), else 0."""
        return 1 if self.decode_kernel == "gqa" else 0

    @property
    def quantized(self) -> bool:
        return self.dtype in ("int8", "fp8", "int4")

    @property
    def max_protected(self) -> int:
        """Protected slots allowed per head; the sinks and the recent window always keep their room."""
        return int(self.protect_fraction * (self.capacity - self.sink - self.window))

    @property
    def hi_slots(self) -> int:
        """Slots of the high-precision pool (``mixed``): the sinks and the recent window; 0 without one."""
        return self.sink + self.window if self.mixed != "none" else 0

    def bytes_per_slot(self, head_dim: int, dtype: str | None = None) -> float:
        """Bytes of one token's k + v in one KV head (scales included) plus its score and position, stored as
        ``dtype`` (default: the cache's; a mixed cache's slots differ by pool, see ``bytes_for_slots``)."""
        return 2 * head_dim * bytes_per_value(dtype or self.dtype, self.group) + 4 + 8

    def bytes_for_slots(self, head_dim: int, slots: int, bookkeeping: bool = True) -> float:
        """Bytes of ``slots`` slots of one KV head (a mixed cache fills its ``hi_slots`` first); without
        ``bookkeeping``, k + v with scales only."""
        extra = 0 if bookkeeping else 12
        hi = min(slots, self.hi_slots)
        wide = self.bytes_per_slot(head_dim, self.mixed) - extra if hi else 0.0
        return hi * wide + (slots - hi) * (self.bytes_per_slot(head_dim) - extra)

    @property
    def recall_slots(self) -> int:
        """Slots per head reserved for recalled tokens (0 without recall): the last ones of each head."""
        return self.recall * self.recall_block
