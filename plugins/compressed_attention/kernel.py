"""The one-token decode step of ``ai.edgec::CompressedKVAttention`` as a Triton kernel.

Meaning: ``edgec.kvcache.reference.compressed_kv_attention`` with T = 1, its attention and score half. One program
per (sequence, KV head) reads that head's slots straight from their storage — fp32/fp16 values, int8, fp8-e4m3
bit patterns or int4 nibbles, each group of ``GROUP`` channels times its scale, decoded in registers — and:
  1. attends from the head's query rows (the query heads that share it) over the filled slots plus the new token
     (full precision), masking empty slots, slots after the query position and, for a sliding-window layer,
     slots at or before ``position - window`` (an online softmax over blocks of ``BLOCK_C`` slots);
  2. writes ``out`` [B, 1, H, D];
  3. reads the slots once more for each slot's attention probability and writes every candidate's new score
     (C slots + the token), [B, Hkv, C + 1]: the policy's decode rule (``RULES``), then +inf for protected
     candidates (a slot whose score is +inf, a new token flagged in ``protect``).

What stays standard ONNX ops around it (plugins/README.md): the choice of the slot (ArgMin over keep-scores),
quantizing and scattering the new token, and a pruning policy's threshold.

The kernel is compiled ahead of time to PTX (``compile_ptx``); with ``TRITON_INTERPRET=1`` ``kernel()`` returns
the interpreted form, which runs on the CPU over torch CPU tensors (the tests and tests/fakes use it).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

import triton
import triton.language as tl

# storage codes (constexpr STORAGE)
STORAGE_CODES = {"fp32": 0, "fp16": 1, "int8": 2, "fp8": 3, "int4": 4}
# the decode-step score rule of every policy (edgec/kvcache/policies): accumulate = score·decay + attention received,
# last = attention received from the one query averaged over the query rows, position = the slot's position
ACCUMULATE, LAST, POSITION = 0, 1, 2
RULES = {"h2o": ACCUMULATE, "snapkv": ACCUMULATE, "adaptive": ACCUMULATE, "tova": LAST, "streaming": POSITION}
NUM_WARPS = 4
BLOCK_ELEMENTS = 8192  # query rows × slots × channels held at once per program


@dataclass(frozen=True)
class Config:
    """Everything the kernel is specialised on (constexprs): one compiled kernel per build."""

    kv_heads: int
    per_kv: int  # query heads per KV head
    head_dim: int
    storage: str
    group: int
    policy: str

    @property
    def block_g(self) -> int:
        return max(2, triton.next_power_of_2(self.per_kv))

    @property
    def block_c(self) -> int:
        return min(128, max(16, triton.next_power_of_2(BLOCK_ELEMENTS // (self.block_g * self.head_dim))))

    def check(self) -> None:
        if self.head_dim & (self.head_dim - 1) or self.head_dim < 16:
            raise ValueError(f"the decode kernel needs a power-of-two head dim ≥ 16, got {self.head_dim}")
        if self.storage not in STORAGE_CODES:
            raise ValueError(f"unknown cache storage {self.storage!r}")
        if self.policy not in RULES:
            raise ValueError(f"the decode kernel has no score rule for policy {self.policy!r}")
        if self.head_dim % self.group:
            raise ValueError(f"group {self.group} does not divide the head dim {self.head_dim}")

    def constexprs(self) -> dict[str, int]:
        return {
            "KV_HEADS": self.kv_heads,
            "PER_KV": self.per_kv,
            "BLOCK_G": self.block_g,
            "HEAD_DIM": self.head_dim,
            "STORAGE": STORAGE_CODES[self.storage],
            "GROUP": self.group,
            "POLICY": RULES[self.policy],
            "BLOCK_C": self.block_c,
        }

    def to_json(self) -> dict:
        return asdict(self)


# the runtime arguments, in order: 13 pointers, then capacity (i32), scale (f32), window (i32), decay (f32)
POINTERS = (
    "q",
    "k",
    "v",
    "position_ids",
    "protect",
    "k_cache",
    "v_cache",
    "k_scale",
    "v_scale",
    "score",
    "pos",
    "out",
    "score_out",
)
SCALARS = (("capacity", "i32"), ("scale", "fp32"), ("window", "i32"), ("decay", "fp32"))
STORAGE_POINTER = {"fp32": "*fp32", "fp16": "*fp16", "int8": "*i8", "fp8": "*u8", "int4": "*u8"}


def signature(config: Config) -> dict[str, str]:
    """Triton's signature of the kernel's runtime arguments for ``config`` (pointer element types)."""
    types = dict.fromkeys(POINTERS, "*fp32")
    types |= {"position_ids": "*i64", "protect": "*i8", "pos": "*i64"}
    types |= {"k_cache": STORAGE_POINTER[config.storage], "v_cache": STORAGE_POINTER[config.storage]}
    return {f"{name}_ptr": kind for name, kind in types.items()} | dict(SCALARS)


def _decode_attention(
    q_ptr,
    k_ptr,
    v_ptr,
    position_ids_ptr,
    protect_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    score_ptr,
    pos_ptr,
    out_ptr,
    score_out_ptr,
    capacity,
    scale,
    window,
    decay,
    KV_HEADS: tl.constexpr,
    PER_KV: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    STORAGE: tl.constexpr,
    GROUP: tl.constexpr,
    POLICY: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    head = tl.program_id(0).to(tl.int64)  # b · Hkv + h
    batch = head // KV_HEADS
    rows = tl.arange(0, BLOCK_G)
    dims = tl.arange(0, HEAD_DIM)
    row_ok = rows < PER_KV
    # q [B,H,1,D] and out [B,1,H,D] hold this KV head's query rows at the same offsets
    row_offsets = (head * PER_KV + rows)[:, None] * HEAD_DIM + dims[None, :]
    q = tl.load(q_ptr + row_offsets, mask=row_ok[:, None], other=0.0).to(tl.float32)
    k_new = tl.load(k_ptr + head * HEAD_DIM + dims).to(tl.float32)
    v_new = tl.load(v_ptr + head * HEAD_DIM + dims).to(tl.float32)
    position = tl.load(position_ids_ptr + batch)
    lowest = tl.where(window > 0, position - window + 1, -1)  # a sliding window sees pos > position - window

    # the new token: always attended (it is the query's own position); it starts the online softmax
    score_new = tl.sum(q * k_new[None, :], axis=1) * scale  # [G]
    row_max = score_new
    row_sum = tl.full([BLOCK_G], 1.0, tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32) + v_new[None, :]
    first = head * capacity  # this head's first slot
    for start in range(0, capacity, BLOCK_C):
        slots = start + tl.arange(0, BLOCK_C)
        in_range = slots < capacity
        pos = tl.load(pos_ptr + first + slots, mask=in_range, other=-1)
        valid = (pos >= 0) & (pos <= position) & (pos >= lowest)
        keys = _slot_values(k_cache_ptr, k_scale_ptr, first + slots, in_range, HEAD_DIM, STORAGE, GROUP)
        scores = tl.sum(q[:, None, :] * keys[None, :, :], axis=2) * scale  # [G, BLOCK_C]
        scores = tl.where(valid[None, :], scores, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(scores, axis=1))
        rescale = tl.exp(row_max - new_max)
        probs = tl.exp(scores - new_max[:, None])
        values = _slot_values(v_cache_ptr, v_scale_ptr, first + slots, in_range, HEAD_DIM, STORAGE, GROUP)
        acc = acc * rescale[:, None] + tl.sum(probs[:, :, None] * values[None, :, :], axis=1)
        row_sum = row_sum * rescale + tl.sum(probs, axis=1)
        row_max = new_max
    tl.store(out_ptr + row_offsets, acc / row_sum[:, None], mask=row_ok[:, None])

    # every candidate's score from this step's attention probabilities
    written = head * (capacity + 1)
    for start in range(0, capacity, BLOCK_C):
        slots = start + tl.arange(0, BLOCK_C)
        in_range = slots < capacity
        pos = tl.load(pos_ptr + first + slots, mask=in_range, other=-1)
        valid = (pos >= 0) & (pos <= position) & (pos >= lowest)
        keys = _slot_values(k_cache_ptr, k_scale_ptr, first + slots, in_range, HEAD_DIM, STORAGE, GROUP)
        scores = tl.sum(q[:, None, :] * keys[None, :, :], axis=2) * scale
        probs = tl.exp(scores - row_max[:, None]) / row_sum[:, None]
        probs = tl.where(valid[None, :] & row_ok[:, None], probs, 0.0)
        old = tl.load(score_ptr + first + slots, mask=in_range, other=0.0)
        updated = _score_rule(old, tl.sum(probs, axis=0), pos, decay, PER_KV, POLICY)
        updated = tl.where((old == float("inf")) & (pos >= 0), float("inf"), updated)
        tl.store(score_out_ptr + written + slots, updated, mask=in_range)
    received = tl.sum(tl.where(row_ok, tl.exp(score_new - row_max) / row_sum, 0.0), axis=0)
    token = _score_rule(0.0, received, position, decay, PER_KV, POLICY)
    token = tl.where(tl.load(protect_ptr + batch) != 0, float("inf"), token)
    tl.store(score_out_ptr + written + capacity, token)


def _score_rule(old, received, pos, decay, PER_KV: tl.constexpr, POLICY: tl.constexpr):
    if POLICY == 0:  # accumulate (h2o, snapkv's decode step, adaptive)
        result = old * decay + received
    elif POLICY == 1:  # the last query's attention, averaged over the query rows (tova)
        result = received / PER_KV
    else:  # the position (streaming)
        result = pos.to(tl.float32)
    return result


def _slot_values(
    cache_ptr, scale_ptr, slots, in_range, HEAD_DIM: tl.constexpr, STORAGE: tl.constexpr, GROUP: tl.constexpr
):
    """[BLOCK_C, D] float32 values of the given slots, decoded from their storage and scaled per group."""
    dims = tl.arange(0, HEAD_DIM)
    mask = in_range[:, None]
    if STORAGE == 4:  # int4: two offset-binary nibbles per byte, the low one first
        packed = tl.load(cache_ptr + slots[:, None] * (HEAD_DIM // 2) + dims[None, :] // 2, mask=mask, other=0)
        nibble = (packed.to(tl.int32) >> ((dims[None, :] % 2) * 4)) & 15
        values = nibble.to(tl.float32) - 8.0
    elif STORAGE == 3:  # fp8 e4m3fn bit patterns: sign, 4 exponent bits (bias 7), 3 mantissa bits
        code = tl.load(cache_ptr + slots[:, None] * HEAD_DIM + dims[None, :], mask=mask, other=0).to(tl.int32)
        exponent = (code >> 3) & 15
        mantissa = (code & 7).to(tl.float32)
        power = ((exponent + 117) << 23).to(tl.float32, bitcast=True)  # 2^(exponent - 10), exactly
        magnitude = tl.where(exponent == 0, mantissa * 0.001953125, (mantissa + 8.0) * power)  # subnormal: m·2^-9
        values = tl.where(code >= 128, -magnitude, magnitude)
    else:  # fp32, fp16, int8
        values = tl.load(cache_ptr + slots[:, None] * HEAD_DIM + dims[None, :], mask=mask, other=0).to(tl.float32)
    if STORAGE >= 2:  # quantized: × the slot's scale of each channel's group
        groups = tl.load(
            scale_ptr + slots[:, None] * (HEAD_DIM // GROUP) + dims[None, :] // GROUP, mask=mask, other=0.0
        )
        values = values * groups
    return values


def kernel():
    """The kernel, jitted: interpreted on the CPU when ``TRITON_INTERPRET=1`` was set before triton was imported
    (Triton decides then how its own library functions run), compiled for a GPU otherwise."""
    if not _interpreting():
        return _jit()
    from triton.runtime.interpreter import InterpretedFunction

    return InterpretedFunction(_decode_attention)  # the helpers run as the plain Python they are


def _interpreting() -> bool:
    from triton.runtime.jit import JITFunction

    asked = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    library_jitted = isinstance(tl.sum, JITFunction)
    if asked == library_jitted:
        raise RuntimeError(
            "TRITON_INTERPRET changed after triton was imported: set it (or unset it) before the first import"
        )
    return asked


def _jit():
    """The compiled form: the kernel sees jitted helpers (its own copy of the module's names)."""
    import types

    from triton.runtime.jit import JITFunction

    names = dict(_decode_attention.__globals__)
    names |= {"_score_rule": JITFunction(_score_rule), "_slot_values": JITFunction(_slot_values)}
    code = _decode_attention
    return JITFunction(types.FunctionType(code.__code__, names, code.__name__, code.__defaults__, code.__closure__))


def decay_of(policy: str) -> float:
    """The decay an accumulating policy applies to old scores (0 for the others)."""
    from edgec.kvcache import policies

    return float(getattr(policies.get(policy), "DECAY", 0.0)) if RULES[policy] == ACCUMULATE else 0.0


def run_numpy(config: Config, inputs: dict, scale: float, window: int = 0, device: str = "cpu"):
    """Launch the kernel on numpy arrays, copied to ``device`` (CPU: set ``TRITON_INTERPRET=1``; "cuda": the
    compiled kernel on a GPU); the inputs by ``POINTERS`` name
    (q [B,H,1,D], k/v [B,Hkv,1,D], position_ids [B,1], protect [B,1], the state; no scales for float storage).
    Returns (out [B,1,H,D] float32, scores of the C + 1 candidates [B,Hkv,C+1] float32)."""
    import numpy as np
    import torch

    batch, kv_heads, capacity = inputs["pos"].shape
    out = np.zeros((batch, 1, kv_heads * config.per_kv, config.head_dim), np.float32)
    score_out = np.zeros((batch, kv_heads, capacity + 1), np.float32)
    arrays = dict(inputs) | {"out": out, "score_out": score_out}
    arrays["protect"] = np.asarray(arrays["protect"]).astype(np.int8)
    for name in ("k_scale", "v_scale"):  # float storage reads no scales: any buffer will do
        arrays.setdefault(name, arrays["score"])
    tensors = [torch.from_numpy(np.ascontiguousarray(arrays[name])).to(device) for name in POINTERS]
    kernel()[(batch * kv_heads,)](*tensors, capacity, scale, window, decay_of(config.policy), **config.constexprs())
    return tensors[POINTERS.index("out")].cpu().numpy(), tensors[POINTERS.index("score_out")].cpu().numpy()


@dataclass(frozen=True)
class Compiled:
    ptx: str
    record: dict  # what a launch needs: entry name, parameter types, warps, shared memory, the config


def compile_ptx(config: Config, capabilities: list[str]) -> dict[str, Compiled]:
    """PTX of the kernel for ``config``, per compute capability ("8.6"), compiled here (no GPU needed). Compiled
    in one child process: Triton compiles only where it was imported without ``TRITON_INTERPRET`` (the tests
    interpret), and its compiler's memory goes when the child ends."""
    import json
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    config.check()
    environment = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    environment.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, said (it warns otherwise)
    with tempfile.TemporaryDirectory() as folder:
        command = [sys.executable, "-m", __name__, json.dumps(config.to_json()), folder, *capabilities]
        done = subprocess.run(command, env=environment, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"Triton could not compile the decode kernel: {done.stderr[-2000:]}")
        found = {}
        for capability in capabilities:
            ptx = (Path(folder) / f"{capability}.ptx").read_text()
            found[capability] = Compiled(ptx, json.loads((Path(folder) / f"{capability}.json").read_text()))
    return found


def _compile_here(config: Config, capability: str) -> Compiled:
    import re

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    major, minor = (int(part) for part in capability.split("."))
    source = ASTSource(_jit(), signature(config), constexprs=config.constexprs())
    options = {"num_warps": NUM_WARPS, "enable_fp_fusion": True}
    compiled = triton.compile(source, target=GPUTarget("cuda", major * 10 + minor, 32), options=options)
    ptx = compiled.asm["ptx"]
    entry = re.search(r"\.entry\s+(\w+)\(([^)]*)\)", ptx)
    metadata = compiled.metadata
    record = {
        "name": entry.group(1),
        "params": re.findall(r"\.param\s+\.(\w+)", entry.group(2)),
        "num_warps": metadata.num_warps,
        "shared": metadata.shared,
        "global_scratch_size": metadata.global_scratch_size,
        "profile_scratch_size": metadata.profile_scratch_size,
        "compute_capability": capability,
        "triton": triton.__version__,
        "config": config.to_json(),
        "constexprs": config.constexprs(),
        "signature": [[name, kind] for name, kind in signature(config).items()],  # in argument order
    }
    return Compiled(ptx, record)


if __name__ == "__main__":  # compile_ptx's child: config JSON, output folder, capabilities
    import json
    import sys
    from pathlib import Path

    for _capability in sys.argv[3:]:
        _compiled = _compile_here(Config(**json.loads(sys.argv[1])), _capability)
        (Path(sys.argv[2]) / f"{_capability}.ptx").write_text(_compiled.ptx)
        (Path(sys.argv[2]) / f"{_capability}.json").write_text(json.dumps(_compiled.record))
