"""benchmarks/kv_channel_scales.py stores keys and values as its table says: today's per-slot groups (absmax/127 per
32 channels of a row) and GroupQueryAttention's per-channel int8 (round, clip to [-128, 127], one scale per KV head
and channel)."""

from __future__ import annotations

import numpy as np
import torch

from tests.conftest import benchmark_script


def test_group_storage_matches_the_caches_int8_rounding():
    script = benchmark_script("kv_channel_scales")
    x = torch.randn(1, 3, 5, 64, generator=torch.Generator().manual_seed(0))
    stored = script.group_int8(x).numpy()
    groups = x.numpy().reshape(1, 3, 5, 2, 32)
    step = np.abs(groups).max(-1, keepdims=True) / 127
    np.testing.assert_allclose(stored.reshape(groups.shape), np.round(groups / step) * step, rtol=1e-6, atol=1e-7)
    assert np.abs(stored - x.numpy()).max() <= step.max() / 2 + 1e-6
    assert np.abs(stored - x.numpy()).max() > 0  # it does quantize


def test_channel_storage_rounds_per_channel_and_counts_what_it_clips():
    script = benchmark_script("kv_channel_scales")
    scale = torch.full((2, 1, 4), 0.1)
    scale[1, 0, 3] = 0.01
    x = torch.zeros(1, 2, 3, 4)
    x[0, 0, 0, 0] = 0.26  # 2.6 steps → 3
    x[0, 1, 2, 3] = 5.0  # 500 steps → clipped to 127
    x[0, 1, 1, 3] = -5.0  # → -128
    stored, clipped = script.channel_int8(x, scale)
    assert clipped == 2
    assert stored[0, 0, 0, 0] == torch.tensor(0.3)
    assert torch.isclose(stored[0, 1, 2, 3], torch.tensor(1.27))
    assert torch.isclose(stored[0, 1, 1, 3], torch.tensor(-1.28))
    assert float(stored.abs().sum()) == float(
        stored[0, 0, 0, 0].abs() + stored[0, 1, 2, 3].abs() + stored[0, 1, 1, 3].abs()
    )


def test_calibration_records_the_largest_magnitude_per_head_and_channel():
    script = benchmark_script("kv_channel_scales")
    storage = script.Storage()
    storage.mode = "record"
    first = torch.zeros(1, 2, 3, 4)
    first[0, 1, 2, 0] = -3.0
    second = torch.zeros(1, 2, 5, 4)
    second[0, 1, 4, 0] = 2.0
    second[0, 0, 0, 3] = 1.5
    for key in (first, second):
        storage(0, key, key * 2)
    assert storage.absmax[0, "k"].shape == (2, 1, 4)
    assert float(storage.absmax[0, "k"][1, 0, 0]) == 3.0 and float(storage.absmax[0, "k"][0, 0, 3]) == 1.5
    assert float(storage.absmax[0, "v"][1, 0, 0]) == 6.0
    scales = storage.scales_from(storage.absmax, 1.25)
    assert torch.isclose(scales[0, "k"][1, 0, 0], torch.tensor(3.0 * 1.25 / 127))


def test_rotation_is_undone_after_storing():
    from edgec.kvcache import rotation

    script = benchmark_script("kv_channel_scales")
    storage = script.Storage()
    signs = torch.from_numpy(rotation.signs(0, 2, 64))[:, None, :]
    storage.rotation = (signs, torch.from_numpy(rotation.hadamard(64)))
    x = torch.randn(1, 2, 5, 64, generator=torch.Generator().manual_seed(1))
    x[0, 1, :, 7] *= 40  # an outlier channel: the rotation spreads it before rounding
    key, value = storage(0, x, 2 * x)  # fp32 storage: the round trip gives the input back
    torch.testing.assert_close(key, x, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(value, 2 * x, rtol=1e-5, atol=1e-5)
    storage.mode = "group"
    rotated, _ = storage(0, x, x)
    storage.rotation = None
    plain, _ = storage(0, x, x)
    assert (rotated - x).abs().mean() < (plain - x).abs().mean()  # the outlier no longer coarsens its groups
