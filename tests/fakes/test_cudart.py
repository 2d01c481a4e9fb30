"""The fake CUDA runtime keeps a real device's pointer rules, so the runtime tests over it cannot pass or fail by
where numpy happened to place a buffer."""

import numpy as np

from tests.fakes import cudart


def _malloc(size: int) -> int:
    error, pointer = cudart.cudaMalloc(size)
    assert error == cudart.cudaError_t.cudaSuccess
    return pointer


def test_a_pointer_freed_late_by_an_earlier_owner_is_invalid_not_someone_elses_allocation():
    """A cache state that an earlier test left open is freed by its finalizer whenever the collector runs, maybe
    after a reset and new allocations. Its pointers must never name a live allocation (the CI failure of stop 64:
    a late free removed a fresh state's buffer that numpy had placed at the freed one's address)."""
    cudart.reset()
    stale = [_malloc(256) for _ in range(8)]
    cudart.reset()
    fresh = [_malloc(256) for _ in range(8)]  # numpy reuses small buffers at once
    assert not set(stale) & set(fresh)  # a device address is handed out once
    for pointer in stale:
        assert cudart.cudaFree(pointer) == (cudart.cudaError_t.cudaErrorInvalidDevicePointer,)
    assert all(cudart.allocation_of(pointer, 256) is not None for pointer in fresh)
    for pointer in fresh:
        assert cudart.cudaFree(pointer) == (cudart.cudaError_t.cudaSuccess,)
    assert cudart.cudaFree(fresh[0]) == (cudart.cudaError_t.cudaErrorInvalidDevicePointer,)  # freed once only


def test_copies_reach_the_allocations_bytes_and_stay_inside_them():
    cudart.reset()
    error, stream = cudart.cudaStreamCreate()
    first, second = _malloc(64), _malloc(64)
    assert second >= first + 64 + 1  # one past an allocation's end is no allocation
    assert cudart.allocation_of(first + 64, 1) is None
    data = np.arange(16, dtype=np.float32)
    kind = cudart.cudaMemcpyKind
    assert cudart.cudaMemcpyAsync(first, data.ctypes.data, 64, kind.cudaMemcpyHostToDevice, stream)[0] == 0
    assert cudart.cudaMemcpy(second + 32, first + 16, 32, kind.cudaMemcpyDeviceToDevice)[0] == 0
    back = np.zeros(16, np.float32)
    assert cudart.cudaMemcpy(back.ctypes.data, second, 64, kind.cudaMemcpyDeviceToHost)[0] == 0
    np.testing.assert_array_equal(back, np.r_[np.zeros(8), data[4:12]])
    np.testing.assert_array_equal(cudart.device_bytes(first + 4, 8).view(np.float32), data[1:3])
    assert cudart.device_bytes(first, 65) is None  # past the end
    assert cudart.cudaMemcpy(first + 8, data.ctypes.data, 64, kind.cudaMemcpyHostToDevice) == (
        cudart.cudaError_t.cudaErrorInvalidValue,
    )
    assert cudart.cudaMemcpy(back.ctypes.data, data.ctypes.data, 64, kind.cudaMemcpyDeviceToHost) == (
        cudart.cudaError_t.cudaErrorInvalidValue,  # a host address is no device pointer
    )
    cudart.reset()
