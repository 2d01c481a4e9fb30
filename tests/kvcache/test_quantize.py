"""Cache storage quantization: round trips, error bounds per dtype, packing, and bad settings."""

from __future__ import annotations

import numpy as np
import pytest

from edgec.kvcache.quantize import bytes_per_value, dequantize, pack_int4, quantize, unpack_int4


@pytest.mark.parametrize(
    "dtype,relative",
    # error bound relative to each group's absmax: half a step for integers, e4m3's 3 mantissa bits for fp8
    [("fp32", 0.0), ("fp16", 1e-3), ("int8", 0.5 / 127), ("int4", 0.5 / 7), ("fp8", 2.0**-4)],
)
@pytest.mark.parametrize("group", [16, 32, 64])
def test_round_trip_error_is_bounded_per_group(dtype, relative, group):
    rng = np.random.default_rng(group)
    x = (rng.standard_normal((2, 3, 5, 64)) * rng.uniform(0.1, 10, (2, 3, 5, 1))).astype(np.float32)
    stored, scale = quantize(x, dtype, group)
    back = dequantize(stored, scale, dtype, group)
    absmax = np.abs(x.reshape(2, 3, 5, 64 // group, group)).max(-1, keepdims=True)
    error = np.abs((back - x).reshape(2, 3, 5, 64 // group, group))
    assert (error <= relative * absmax + 1e-7).all()
    if dtype == "int4":
        assert stored.dtype == np.uint8 and stored.shape == (2, 3, 5, 32)
    if dtype in ("int8", "fp8", "int4"):
        assert scale.shape == (2, 3, 5, 64 // group) and scale.dtype == np.float32


def test_int4_packing_is_two_per_byte_low_nibble_first():
    q = np.array([[-8, 7, 0, -1]], np.int8)
    packed = pack_int4(q)
    assert packed.tolist() == [[0 | (15 << 4), 8 | (7 << 4)]]
    assert unpack_int4(packed).tolist() == q.tolist()


def test_zero_groups_and_bytes():
    stored, scale = quantize(np.zeros((1, 1, 2, 32), np.float32), "int8", 32)
    assert not np.isnan(dequantize(stored, scale, "int8", 32)).any()
    assert bytes_per_value("fp16", 32) == 2 and bytes_per_value("int8", 32) == 1.125
    assert bytes_per_value("int4", 32) == 0.625


def test_bad_settings():
    with pytest.raises(ValueError, match="does not divide"):
        quantize(np.zeros((1, 64), np.float32), "int8", 48)
    with pytest.raises(ValueError, match="unknown cache dtype"):
        quantize(np.zeros((1, 64), np.float32), "int3", 32)
