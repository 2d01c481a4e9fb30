"""The rotated cache (rotation.py): exact in fp32, the ONNX body equal to the numpy reference for every dtype and
policy (state in place too), the rotation a real one (it changes what is stored and what int4 loses), and the
settings recorded only when it is on."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import onnx
import pytest

from edgec.errors import BuildSettingsError
from edgec.kvcache import compressed_function as cf
from edgec.kvcache import reference, rotation
from edgec.kvcache.compression import Compression
from edgec.kvcache.policies import POLICIES
from edgec.kvcache.quantize import dequantize
from tests.kvcache.test_compressed import STEPS, _run, _session, compressed_model

# head dims that are powers of four: 1/√D is a power of two, so rotating grid inputs is exact (see _run)
ROTATED_SHAPES = [(4, 2, 16, 12), (2, 1, 64, 10), (6, 3, 16, 16)]
GRID = 2.0**-6


def test_hadamard_is_orthogonal_and_signs_are_seeded():
    for dim in (2, 16, 256):
        matrix = rotation.hadamard(dim).astype(np.float64)
        np.testing.assert_allclose(matrix @ matrix, np.eye(dim), atol=1e-6)  # symmetric and orthogonal
        np.testing.assert_array_equal(np.abs(matrix), np.full((dim, dim), dim**-0.5, np.float32))
    first, again, other = rotation.signs(0, 3, 256), rotation.signs(0, 3, 256), rotation.signs(1, 3, 256)
    np.testing.assert_array_equal(first, again)
    assert set(np.unique(first)) == {-1.0, 1.0}
    assert (first != other).mean() > 0.3 and (first[0] != first[1]).mean() > 0.3  # seeds and heads differ
    with pytest.raises(ValueError, match="power-of-two"):
        rotation.hadamard(96)


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_rotate_store_fp32_attend_equals_no_rotation(policy):
    """Rotated keys and values in fp32 slots: the same outputs, scores and slot choices as no rotation, through
    fills, evictions and chunks; only what is stored differs (the rotated vectors)."""
    heads, kv_heads, head_dim, capacity = 6, 3, 32, 12
    plain = Compression(capacity=capacity, sink=2, window=3, policy=policy, dtype="fp32", group=8, observe=4)
    rotated = replace(plain, rotation="hadamard", rotation_seed=7)
    rng = np.random.default_rng(1)
    states = {c: reference.empty_compressed_state(kv_heads, capacity, head_dim, c) for c in (plain, rotated)}
    matrix, signs = rotation.hadamard(head_dim), rotation.signs(7, kv_heads, head_dim)
    for start, count in STEPS:
        q = rng.standard_normal((1, heads, count, head_dim)).astype(np.float32)
        k = (rng.standard_normal((1, kv_heads, count, head_dim)) * rng.uniform(0.2, 3, (1, kv_heads, count, 1))).astype(
            np.float32
        )
        v = rng.standard_normal((1, kv_heads, count, head_dim)).astype(np.float32)
        positions = np.arange(start, start + count)[None]
        outs = {}
        for c in (plain, rotated):
            outs[c], states[c] = reference.compressed_kv_attention(
                q, k, v, positions, np.zeros_like(positions, bool), states[c], c, scale=0.2
            )
        np.testing.assert_allclose(outs[rotated], outs[plain], atol=2e-6, rtol=0)
        np.testing.assert_array_equal(states[rotated]["pos"], states[plain]["pos"])
        np.testing.assert_allclose(states[rotated]["score"], states[plain]["score"], rtol=1e-5, atol=1e-6)
    assert start + count > capacity  # the steps evicted
    stored = states[rotated]["k"]
    assert not np.allclose(stored, states[plain]["k"], atol=1e-2)
    np.testing.assert_allclose(stored, rotation.rotate(states[plain]["k"], signs, matrix), atol=1e-5)


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "int8", "fp8", "int4"])
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_rotated_body_matches_reference_every_dtype_and_policy(dtype, policy):
    heads, kv_heads, head_dim, capacity = ROTATED_SHAPES[(len(dtype) + len(policy)) % len(ROTATED_SHAPES)]
    compression = Compression(
        capacity=capacity, sink=2, window=3, policy=policy, dtype=dtype, group=8, observe=4, rotation="hadamard"
    )
    model = compressed_model(heads, kv_heads, head_dim, capacity, compression, scale=head_dim**-0.5)
    onnx.checker.check_model(model, full_check=True)
    seed = sum(map(ord, dtype + policy))
    _run(_session(model), compression, heads, kv_heads, head_dim, capacity, STEPS, seed=seed, grid=GRID)


@pytest.mark.parametrize("heads,kv_heads,head_dim,capacity", ROTATED_SHAPES)
@pytest.mark.parametrize("dtype,policy", [("int4", "snapkv"), ("int8", "h2o"), ("fp8", "adaptive")])
def test_rotated_state_in_place_equals_separate_buffers(heads, kv_heads, head_dim, capacity, dtype, policy):
    compression = Compression(
        capacity=capacity, sink=1, window=2, policy=policy, dtype=dtype, group=8, observe=3, rotation="hadamard"
    )
    compression = replace(compression, rotation_seed=capacity)
    sess = _session(compressed_model(heads, kv_heads, head_dim, capacity, compression, scale=head_dim**-0.5))
    _run(sess, compression, heads, kv_heads, head_dim, capacity, STEPS, seed=capacity, in_place=True, grid=GRID)


def test_static_body_is_rotated_too():
    """The every-slot body (TensorRT-RTX) rotates the same way."""
    heads, kv_heads, head_dim, capacity = 4, 2, 16, 12
    compression = Compression(capacity=capacity, sink=2, window=3, dtype="int4", group=8, rotation="hadamard")
    model = compressed_model(heads, kv_heads, head_dim, capacity, compression, scale=0.25)
    del model.functions[:]
    model.functions.append(cf.make_function(compression, 23, cf.Heads(heads, kv_heads, head_dim), False))
    _run(_session(model), compression, heads, kv_heads, head_dim, capacity, STEPS, seed=4, grid=GRID)


def test_rotation_spreads_an_outlier_channel_before_int4():
    """The reason for it: keys with one loud channel lose the others to a coarse int4 grid; rotated, they keep
    them. Error of the dequantized keys against the true keys, in the keys' own (unrotated) space."""
    rng = np.random.default_rng(0)
    head_dim, count = 64, 256
    keys = rng.standard_normal((1, 1, count, head_dim)).astype(np.float32)
    keys[..., 5] *= 40.0  # one outlier channel, as real keys have
    errors = {}
    for name in ("none", "hadamard"):
        compression = Compression(capacity=count, sink=0, window=1, dtype="int4", group=32, rotation=name)
        state = reference.empty_compressed_state(1, count, head_dim, compression)
        q = np.zeros((1, 1, count, head_dim), np.float32)
        positions = np.arange(count)[None]
        _, state = reference.compressed_kv_attention(
            q, keys, keys, positions, np.zeros_like(positions, bool), state, compression, scale=1.0
        )
        stored = dequantize(state["k"], state["k_scale"], "int4", 32)
        if name == "hadamard":  # back to the keys' space: (x H/√D) H/√D ⊙ s = x
            stored = rotation.unrotate(
                stored.transpose(0, 2, 1, 3), rotation.signs(0, 1, head_dim), rotation.hadamard(head_dim)
            )
            stored = stored.transpose(0, 2, 1, 3)
        quiet = np.arange(head_dim) != 5
        errors[name] = np.abs(stored - keys)[..., quiet].mean()
    assert errors["hadamard"] < 0.7 * errors["none"], errors  # measured: 0.20 against 0.35


def test_settings_recorded_only_when_on():
    off = Compression(capacity=128, dtype="int4")
    assert "rotation" not in off.to_json() and "rotation_seed" not in off.to_json()
    on = replace(off, rotation="hadamard", rotation_seed=3)
    assert on.to_json()["rotation"] == "hadamard" and on.to_json()["rotation_seed"] == 3
    assert Compression.from_json(on.to_json()) == on and Compression.from_json(off.to_json()) == off
    with pytest.raises(BuildSettingsError, match="power-of-two head dim"):
        on.check(head_dim=96)
    on.check(head_dim=64)
    with pytest.raises(BuildSettingsError, match="below 2\\*\\*32"):
        replace(on, rotation_seed=2**32).check(head_dim=64)
