"""The Triton decode kernel (plugins/compressed_attention/kernel.py), interpreted on the CPU (TRITON_INTERPRET=1),
against the numpy reference ``reference.compressed_kv_attention`` with T = 1, on fresh random inputs: every storage
dtype and policy, several head layouts and capacities (ragged against the kernel's slot block), empty slots, a
head with no filled slot at all, protected slots and a protected new token, a sliding window. The PTX for the
targets' compute capabilities is compiled here too."""

from __future__ import annotations

import re

import numpy as np
import pytest

from edgec.kvcache import reference
from edgec.kvcache.compression import Compression
from edgec.kvcache.policies import POLICIES
from edgec.kvcache.quantize import quantize

kernel = pytest.importorskip("edgec.plugins.compressed_attention.kernel", reason="needs triton (edgec[dev])")

# the kernel computes in float32 what the reference computes in float64, from the same stored bytes and scales:
# out within 2e-5 (values of order 1), scores within 1e-5 relative + 1e-6 (sums of probabilities)
OUT_ATOL = 2e-5
SCORE_RTOL, SCORE_ATOL = 1e-5, 1e-6
# (batch, query heads, kv heads, head dim, capacity): capacities off the kernel's slot block (16-128)
SHAPES = [(1, 6, 2, 64, 40), (2, 4, 1, 32, 17), (1, 2, 2, 128, 37), (1, 8, 1, 16, 7)]


def random_case(rng, shape, compression: Compression, window: int, fill: str):
    """A decode step at a position past every filled slot, with slots filled (distinct earlier positions) as
    ``fill`` says: partly (empty slots among them), ``empty_head`` (KV head 0 holds no token), ``full``."""
    batch, heads, kv_heads, head_dim, capacity = shape
    position = 3 * capacity + int(rng.integers(0, 20))
    pos = np.stack([[rng.permutation(position)[:capacity] for _ in range(kv_heads)] for _ in range(batch)]).astype(
        np.int64
    )
    if fill != "full":
        pos[rng.random(pos.shape) < 0.3] = -1
    if fill == "empty_head":
        pos[:, 0] = -1
    state = reference.empty_compressed_state(kv_heads, capacity, head_dim, compression)
    state = {name: np.repeat(value, batch, axis=0) for name, value in state.items()}
    for name in ("k", "v"):
        stored, scale = quantize(
            rng.standard_normal((batch, kv_heads, capacity, head_dim)), compression.dtype, compression.group
        )
        state[name] = stored.astype(state[name].dtype)
        if scale is not None:
            state[f"{name}_scale"] = scale
    score = rng.random((batch, kv_heads, capacity)).astype(np.float32) * 3
    score[rng.random(score.shape) < 0.1] = np.inf  # protected slots
    state["score"], state["pos"] = score, pos
    q = rng.standard_normal((batch, heads, 1, head_dim)).astype(np.float32)
    k = rng.standard_normal((batch, kv_heads, 1, head_dim)).astype(np.float32)
    v = rng.standard_normal((batch, kv_heads, 1, head_dim)).astype(np.float32)
    position_ids = np.full((batch, 1), position, np.int64)
    protect = rng.random((batch, 1)) < 0.5
    return q, k, v, position_ids, protect, state


def kernel_inputs(q, k, v, position_ids, protect, state) -> dict:
    inputs = {"q": q, "k": k, "v": v, "position_ids": position_ids, "protect": protect}
    inputs |= {"k_cache": state["k"], "v_cache": state["v"], "score": state["score"], "pos": state["pos"]}
    return inputs | {name: state[name] for name in ("k_scale", "v_scale") if name in state}


def expected_scores(new_state, position_ids):
    """Where the reference wrote the token (per head) and the state's scores there and elsewhere: the kernel's
    candidate scores must be the slots' new scores, and the token's the score of the slot it went to."""
    written = new_state["pos"] == position_ids[:, :, None]  # the token lands in exactly one slot per head
    assert (written.sum(-1) == 1).all()
    return written, new_state["score"]


@pytest.mark.parametrize("dtype", ["fp16", "int8", "fp8", "int4", "fp32"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_kernel_equals_the_reference(dtype, shape):
    rng = np.random.default_rng()  # fresh inputs each run
    compression = Compression(capacity=shape[-1], sink=2, window=4, policy="h2o", dtype=dtype, group=16)
    for fill in ("partly", "empty_head", "full"):
        window = int(rng.choice([0, 0, shape[-1]]))  # a sliding window as long as the capacity, sometimes
        _check(rng, shape, compression, window, fill)


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_each_policys_score_update(policy):
    rng = np.random.default_rng()
    shape = (1, 6, 2, 32, 24)
    for dtype in ("int8", "int4"):
        compression = Compression(capacity=shape[-1], sink=2, window=4, policy=policy, dtype=dtype, group=16)
        _check(rng, shape, compression, 0, "full")
        _check(rng, shape, compression, 0, "partly")


def _check(rng, shape, compression, window, fill):
    batch, heads, kv_heads, head_dim, capacity = shape
    q, k, v, position_ids, protect, state = random_case(rng, shape, compression, window, fill)
    scale = 1 / np.sqrt(head_dim)
    want_out, new_state = reference.compressed_kv_attention(
        q, k, v, position_ids, protect, state, compression, scale, window
    )
    config = kernel.Config(
        kv_heads, heads // kv_heads, head_dim, compression.dtype, compression.group, compression.policy
    )
    out, scores = kernel.run_numpy(config, kernel_inputs(q, k, v, position_ids, protect, state), scale, window)
    np.testing.assert_allclose(out, want_out, rtol=0, atol=OUT_ATOL)
    written, kept = expected_scores(new_state, position_ids)
    token = scores[..., capacity:]
    np.testing.assert_allclose(token, kept[written].reshape(token.shape), rtol=SCORE_RTOL, atol=SCORE_ATOL)
    np.testing.assert_allclose(scores[..., :capacity][~written], kept[~written], rtol=SCORE_RTOL, atol=SCORE_ATOL)
    assert np.isposinf(token[protect[:, :, None].repeat(kv_heads, 1)]).all()


GPU_CHECK = """
import sys, numpy as np
from edgec.plugins.compressed_attention import kernel
from edgec.kvcache import reference
from edgec.kvcache.compression import Compression
sys.path.insert(0, sys.argv[1])
from tests.plugins.test_decode_kernel import random_case, kernel_inputs, OUT_ATOL
rng = np.random.default_rng(0)
for dtype in ("fp16", "int8", "fp8", "int4"):
    compression = Compression(capacity=40, sink=2, window=4, policy="h2o", dtype=dtype, group=16)
    q, k, v, position_ids, protect, state = random_case(rng, (1, 6, 2, 64, 40), compression, 0, "partly")
    want, _ = reference.compressed_kv_attention(q, k, v, position_ids, protect, state, compression, 0.125)
    config = kernel.Config(2, 3, 64, dtype, 16, "h2o")
    out, _ = kernel.run_numpy(config, kernel_inputs(q, k, v, position_ids, protect, state), 0.125, device="cuda")
    np.testing.assert_allclose(out, want, rtol=0, atol=OUT_ATOL)
print("ok")
"""


def test_the_compiled_kernel_on_a_gpu():
    """The compiled kernel on a CUDA GPU (a child process: this one interprets) against the reference."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU here (torch.cuda.is_available() is False): the compiled kernel needs one")
    environment = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    root = str(Path(__file__).resolve().parents[2])
    done = subprocess.run([sys.executable, "-c", GPU_CHECK, root], env=environment, capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_a_wrong_score_rule_is_caught():
    """The comparison can fail: the same kernel told another policy's rule differs from the reference."""
    rng = np.random.default_rng(1)
    shape = (1, 4, 2, 32, 20)
    compression = Compression(capacity=20, sink=2, window=4, policy="h2o", dtype="int8", group=16)
    q, k, v, position_ids, protect, state = random_case(rng, shape, compression, 0, "full")
    protect[:] = False
    _, new_state = reference.compressed_kv_attention(q, k, v, position_ids, protect, state, compression, 0.2)
    wrong = kernel.Config(2, 2, 32, "int8", 16, "tova")
    _, scores = kernel.run_numpy(wrong, kernel_inputs(q, k, v, position_ids, protect, state), 0.2)
    written, kept = expected_scores(new_state, position_ids)
    assert not np.allclose(scores[..., :20][~written], kept[~written], rtol=SCORE_RTOL, atol=SCORE_ATOL)


def test_every_policy_has_a_decode_rule():
    """The kernel's table names every registered policy: a new policy file must say how its decode step scores."""
    assert set(kernel.RULES) == set(POLICIES)


@pytest.mark.parametrize(
    "capabilities", [["8.6"], pytest.param(["8.9", "12.0"], marks=pytest.mark.slow)], ids=["sm86", "sm89+sm120"]
)
def test_ptx_for_each_capability(capabilities):
    """PTX (and its launch record) for sm86, sm89 and sm120 (~7 s each, one Triton compile), compiled on this
    CPU-only machine: one entry whose parameters are the kernel's runtime arguments plus Triton's two scratch
    pointers."""
    config = kernel.Config(3, 3, 64, "int4", 32, "snapkv")
    for capability, compiled in kernel.compile_ptx(config, capabilities).items():
        major, minor = capability.split(".")
        assert f".target sm_{major}{minor}" in compiled.ptx
        entry = re.search(r"\.entry\s+(\w+)\(([^)]*)\)", compiled.ptx)
        assert entry and entry.group(1) == compiled.record["name"]
        params = re.findall(r"\.param\s+\.(\w+)", entry.group(2))
        assert params == compiled.record["params"]
        assert params == ["u64"] * len(kernel.POINTERS) + ["u32", "f32", "u32", "f32"] + ["u64", "u64"]
        assert compiled.record["num_warps"] == kernel.NUM_WARPS and compiled.record["config"] == config.to_json()
        assert compiled.record["compute_capability"] == capability
