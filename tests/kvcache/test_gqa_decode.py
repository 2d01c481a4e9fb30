"""``Compression.decode_kernel`` gqa: one-token steps over fp32 slots through ONNX Runtime's GroupQueryAttention
(``compressed_function._decode_gqa``) keep the reference's meaning — the same outputs, slots, bytes and scores as
``reference.compressed_kv_attention`` for every policy, with empty slots, a sliding window and protected tokens,
on separate buffers and in place (the kernel's present and the new state bound to the input's own buffer, as the
runtime binds the decode graph), beside the general branch reading prompt chunks into the same buffers."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from edgec.errors import BuildSettingsError
from edgec.kvcache import compressed_function as cf
from edgec.kvcache.compression import Compression
from edgec.kvcache.policies import POLICIES
from tests.kvcache.test_compressed import STEPS, _one_branch_model, _run, _session, compressed_model


def _gqa(policy: str, capacity: int, **changes) -> Compression:
    settings = dict(capacity=capacity, sink=2, window=3, policy=policy, dtype="fp32", observe=4, decode_kernel="gqa")
    return Compression(**(settings | changes))


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_decode_through_the_kernel_matches_reference(policy):
    heads, kv_heads, head_dim, capacity = 6, 3, 32, 16
    compression = _gqa(policy, capacity)
    model = compressed_model(heads, kv_heads, head_dim, capacity, compression, scale=0.3, fused=True)
    onnx.checker.check_model(model, full_check=True)
    decode = _one_branch_model(model, "decode")
    assert "GroupQueryAttention" in {node.op_type for node in decode.functions[0].node}
    seed = hash((policy, "gqa")) % 1000
    shape = (heads, kv_heads, head_dim, capacity)
    # the If form (decode branch for one token) on separate buffers, then the two branches bound in place
    _run(_session(model), compression, *shape, STEPS, seed, scale=0.3)
    _run(_session(model), compression, *shape, STEPS, seed, scale=0.3, in_place=True, decode_sess=_session(decode))


@pytest.mark.parametrize("policy", ["h2o", "snapkv"])
def test_sliding_window_protected_tokens_and_an_empty_start(policy):
    """A sliding window masks slots below it through the kernel's attention bias; protected tokens stay; the first
    steps decode into an empty cache (every slot masked but the token's own row)."""
    heads, kv_heads, head_dim, capacity = 4, 2, 16, 12
    compression = _gqa(policy, capacity, sink=1, window=2)
    model = compressed_model(heads, kv_heads, head_dim, capacity, compression, scale=0.25, window=6, fused=True)
    decode = _session(_one_branch_model(model, "decode"))
    steps = [(0, 1), (1, 1), (2, 1), *((start + 3, count) for start, count in STEPS)]
    state = _run(
        _session(model), compression, heads, kv_heads, head_dim, capacity, steps, seed=11, window=6,
        protect_at=[3, 9], in_place=True, decode_sess=decode, scale=0.25,
    )  # fmt: skip
    assert {3, 9} <= set(state["pos"].ravel().tolist()), "protected positions were evicted"


def test_the_spare_row_is_never_read():
    """Whatever the spare row holds (a huge value here) changes no output: the kernel writes the token there
    before it attends, and the general branch reads slots [0, active) only."""
    heads, kv_heads, head_dim, capacity = 4, 2, 16, 12
    compression = _gqa("snapkv", capacity)
    model = compressed_model(heads, kv_heads, head_dim, capacity, compression, scale=0.25, fused=True)
    sess = _session(model)
    rng = np.random.default_rng(2)
    feeds = {
        "q": rng.standard_normal((1, heads, 1, head_dim)).astype(np.float32),
        "k": rng.standard_normal((1, kv_heads, 1, head_dim)).astype(np.float32),
        "v": rng.standard_normal((1, kv_heads, 1, head_dim)).astype(np.float32),
        "position_ids": np.array([[20]], np.int64),
        "protect": np.zeros((1, 1), bool),
        "observe": np.ones(1, bool),
        "score": rng.uniform(0, 1, (1, kv_heads, capacity)).astype(np.float32),
        "pos": np.broadcast_to(np.arange(capacity), (1, kv_heads, capacity)).copy(),
    }
    outputs = []
    for spare in (0.0, 1e30):
        for name in ("k_cache", "v_cache"):
            slots = np.random.default_rng(3).standard_normal((1, kv_heads, capacity, head_dim)).astype(np.float32)
            feeds[name] = np.concatenate([slots, np.full((1, kv_heads, 1, head_dim), spare, np.float32)], axis=2)
        outputs.append(sess.run(None, feeds))
    for first, second in zip(*outputs, strict=True):
        if first.ndim == 4 and first.shape[2] == capacity + 1:  # k/v: the spare row holds the token either way
            first, second = first[:, :, :capacity], second[:, :, :capacity]
        np.testing.assert_array_equal(first, second)


@pytest.mark.parametrize(
    "changes", [{"dtype": "int8"}, {"rotation": "hadamard"}, {"dtype": "int4", "mixed": "int8"}, {"recall": 1}]
)
def test_the_kernel_reads_only_plain_fp32_slots(changes):
    compression = Compression(capacity=512, decode_kernel="gqa", **changes)
    assert not compression.native_decode_fits()
    with pytest.raises(BuildSettingsError, match="decode kernel gqa"):
        compression.check(head_dim=64)
    with pytest.raises(ValueError, match="GroupQueryAttention"):
        cf.make_function(compression, 23, cf.Heads(4, 2, 64), fused_attention=True)


def test_layout_follows_the_kernel():
    """A spare k/v row with the kernel, none without; a manifest without the setting reads as before."""
    plain, native = Compression(capacity=64), Compression(capacity=64, decode_kernel="gqa")
    assert (plain.spare_rows, native.spare_rows) == (0, 1)
    assert "decode_kernel" not in plain.to_json()
    assert Compression.from_json(native.to_json()) == native
