"""The compressed-cache settings of a build (``--kv-*``), checked once, recorded in the manifest."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from edgec.errors import BuildSettingsError
from edgec.kvcache.quantize import STORAGE, bytes_per_value

PREFILL_MODES = ("end", "chunk")


@dataclass(frozen=True)
class Compression:
    """How the global layers' cache is pruned and stored.

    capacity: slots per layer and KV head; sink: the first positions, never evicted; window: the most recent
    positions, never evicted; policy: how the other slots are scored (edgec/kvcache/policies); dtype/group:
    storage with one dynamic scale per token per ``group`` channels; observe: the last prompt queries whose
    attention judges a prompt (snapkv); prefill_compress: ``end`` holds the whole prompt and selects once it
    has been read, ``chunk`` selects between chunks so memory never exceeds capacity; protect_fraction: the
    share of capacity that protected tokens may hold.
    """

    capacity: int
    sink: int = 4
    window: int = 64
    policy: str = "snapkv"
    dtype: str = "fp32"
    group: int = 32
    observe: int = 32
    prefill_compress: str = "end"
    protect_fraction: float = 0.25

    def check(self, head_dim: int, prefill_chunk: int) -> None:
        """One clear line for every setting that cannot work."""
        from edgec.kvcache.policies import POLICIES

        if self.policy not in POLICIES:
            raise BuildSettingsError(f"unknown --kv-policy {self.policy!r}; one of {', '.join(POLICIES)}")
        if self.dtype not in STORAGE:
            raise BuildSettingsError(f"unknown --kv-dtype {self.dtype!r}; one of {', '.join(STORAGE)}")
        if self.prefill_compress not in PREFILL_MODES:
            raise BuildSettingsError(
                f"unknown --prefill-compress {self.prefill_compress!r}; one of {', '.join(PREFILL_MODES)}"
            )
        if self.sink < 0 or self.window < 1:
            raise BuildSettingsError(f"--kv-sink must be ≥ 0 and --kv-window ≥ 1 (got {self.sink}, {self.window})")
        if self.capacity < self.sink + self.window + 1:
            raise BuildSettingsError(
                f"--kv-capacity {self.capacity} leaves no room to evict: it must exceed --kv-sink + --kv-window "
                f"({self.sink} + {self.window})"
            )
        if self.dtype in ("int8", "fp8", "int4") and (self.group < 1 or head_dim % self.group):
            raise BuildSettingsError(
                f"--kv-group {self.group} does not divide the head dim {head_dim}; use a divisor such as "
                f"{max(g for g in (16, 32, 64, head_dim) if head_dim % g == 0)}"
            )
        if self.dtype == "int4" and self.group % 2:
            raise BuildSettingsError(f"--kv-group must be even for int4 (two values per byte), got {self.group}")
        if self.observe < 1:  # a chunk shorter than it is observed whole
            raise BuildSettingsError(f"the observation window must be ≥ 1 query, got {self.observe}")
        if not 0 <= self.protect_fraction < 1:
            raise BuildSettingsError(f"protect fraction must lie in [0, 1), got {self.protect_fraction}")

    @property
    def quantized(self) -> bool:
        return self.dtype in ("int8", "fp8", "int4")

    @property
    def max_protected(self) -> int:
        """Protected slots allowed per head; the sinks and the recent window always keep their room."""
        return int(self.protect_fraction * (self.capacity - self.sink - self.window))

    def bytes_per_slot(self, head_dim: int) -> float:
        """Bytes of one token's k + v in one KV head (scales included) plus its score and position."""
        return 2 * head_dim * bytes_per_value(self.dtype, self.group) + 4 + 8

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> Compression:
        return cls(**data)
