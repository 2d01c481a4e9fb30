"""The reference's fast forms against numpy's plain ones: the row gather (``reference._rows``) and SnapKV's
max-pool (``snapkv.pool``) give the same arrays, bit for bit, for every shape the runtime hands them."""

import numpy as np
import pytest

from edgec.kvcache import reference
from edgec.kvcache.policies import snapkv


@pytest.mark.parametrize(
    ("values_shape", "index_shape"),
    [((1, 3, 40, 8), (1, 3, 12)), ((2, 2, 17), (2, 2, 5)), ((2, 4, 9, 2, 3), (2, 1, 9)), ((1, 3, 6, 4), (1, 3, 0))],
)
def test_rows_is_take_along_axis(values_shape: tuple[int, ...], index_shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(0)
    values = rng.standard_normal(values_shape).astype(np.float32)
    index = rng.integers(0, values_shape[2], index_shape)
    expected = np.take_along_axis(values, index.reshape(index.shape + (1,) * (values.ndim - 3)), axis=2)
    got = reference._rows(values, index)
    assert got.shape == expected.shape
    np.testing.assert_array_equal(got, expected)


def test_rows_reads_non_contiguous_values() -> None:
    values = np.arange(2 * 3 * 10 * 4, dtype=np.float32).reshape(2, 3, 10, 4)[:, :, ::2]
    index = np.array([[[4, 0], [1, 1], [3, 2]]] * 2)
    expected = np.take_along_axis(values, index[..., None], axis=2)
    np.testing.assert_array_equal(reference._rows(values, index), expected)


def test_pool_is_the_sliding_window_max() -> None:
    rng = np.random.default_rng(1)
    scores = rng.standard_normal((2, 3, 50)).astype(np.float32)
    scores[0, 0, 7] = np.inf
    scores[1, 2, 10:20] = -np.inf
    scores[0, 1, 30] = np.nan  # NaN spreads over its window in both forms
    half = snapkv.POOL // 2
    padded = np.pad(scores, [(0, 0), (0, 0), (half, half)], constant_values=-np.inf)
    expected = np.lib.stride_tricks.sliding_window_view(padded, snapkv.POOL, axis=-1).max(-1)
    np.testing.assert_array_equal(snapkv.pool(scores), expected)
    for length in (1, 3):
        short = scores[..., :length]
        padded = np.pad(short, [(0, 0), (0, 0), (half, half)], constant_values=-np.inf)
        expected = np.lib.stride_tricks.sliding_window_view(padded, snapkv.POOL, axis=-1).max(-1)
        np.testing.assert_array_equal(snapkv.pool(short), expected)
