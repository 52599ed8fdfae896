"""Load CUBINs with the CUDA driver API and launch them on PyTorch's current stream."""
from __future__ import annotations

import ctypes
import functools

import torch

from . import cache
from .errors import LaunchError
from .spec import KernelSpec


def _driver():
    from cuda.bindings import driver

    return driver


def _check(result, what: str):
    status, *values = result
    if int(status) != 0:
        raise LaunchError(f"CUDA driver call {what} failed: {status!r}")
    return values[0] if len(values) == 1 else (values or None)


def device_arch(device: torch.device) -> int:
    major, minor = torch.cuda.get_device_capability(device)
    return 10 * major + minor


@functools.lru_cache(maxsize=None)
def sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _ensure_context(device_index: int) -> None:
    """Make torch's primary context current on this thread, as the driver API needs."""
    torch.cuda.init()  # torch creates the primary context; we share it
    driver = _driver()
    dev = _check(driver.cuDeviceGet(device_index), "cuDeviceGet")
    ctx = _check(driver.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
    _check(driver.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")


class Kernel:
    """A loaded kernel: launch(grid, args) on the current stream of its device."""

    def __init__(self, spec: KernelSpec, device_index: int):
        self.spec, self.device_index = spec, device_index
        self.threads, self.smem = spec.threads, spec.smem_bytes()
        cubin = cache.build(spec).cubin
        _ensure_context(device_index)
        driver = _driver()
        self._module = _check(driver.cuModuleLoadData(cubin), f"cuModuleLoadData({spec.name})")
        self._function = _check(driver.cuModuleGetFunction(self._module, spec.name.encode()),
                                "cuModuleGetFunction")
        attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        _check(driver.cuFuncSetAttribute(self._function, attr, self.smem), "cuFuncSetAttribute")

    def launch(self, grid: tuple[int, int, int], args: list) -> None:
        """args in kernel order: ctypes scalars (c_void_p for pointers, c_int for ints) or
        TensorMap objects (passed by value)."""
        params = (ctypes.c_void_p * len(args))(*[_param_address(a) for a in args])
        stream = torch.cuda.current_stream(self.device_index).cuda_stream
        status, = _driver().cuLaunchKernel(self._function, *grid, self.threads, 1, 1, self.smem,
                                           stream, ctypes.addressof(params), 0)
        if int(status) != 0:
            raise LaunchError(f"launch of {self.spec.name} failed: {status!r}")


def _param_address(arg) -> int:
    return arg.address if isinstance(arg, TensorMap) else ctypes.addressof(arg)


_TMA_DTYPES = {torch.bfloat16: "CU_TENSOR_MAP_DATA_TYPE_BFLOAT16",
               torch.float16: "CU_TENSOR_MAP_DATA_TYPE_FLOAT16"}
_SWIZZLE = {32: "CU_TENSOR_MAP_SWIZZLE_32B", 64: "CU_TENSOR_MAP_SWIZZLE_64B",
            128: "CU_TENSOR_MAP_SWIZZLE_128B"}


class TensorMap:
    """A TMA descriptor of a row-major 2-D tensor at `ptr`, read in boxes of box_rows x
    box_cols into shared memory swizzled to the box's row width (32, 64 or 128 bytes)."""

    def __init__(self, ptr: int, dtype: torch.dtype, rows: int, cols: int, box_rows: int, box_cols: int):
        driver, size = _driver(), dtype.itemsize
        self._map = _check(driver.cuTensorMapEncodeTiled(
            getattr(driver.CUtensorMapDataType, _TMA_DTYPES[dtype]), 2, ptr,
            _u64(cols, rows), _u64(cols * size), _u32(box_cols, box_rows), _u32(1, 1),
            driver.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
            getattr(driver.CUtensorMapSwizzle, _SWIZZLE[box_cols * size]),
            driver.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            driver.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE), "cuTensorMapEncodeTiled")
        self.address = self._map.getPtr()


def _u64(*values) -> list:
    return [_driver().cuuint64_t(v) for v in values]


def _u32(*values) -> list:
    return [_driver().cuuint32_t(v) for v in values]


# A descriptor holds only an address and a shape, so it is safe to reuse whenever both
# match - a training loop hands the same buffers back step after step.
tensor_map = functools.lru_cache(maxsize=256)(TensorMap)


@functools.lru_cache(maxsize=None)
def kernel(spec: KernelSpec, device_index: int) -> Kernel:
    """Loaded kernels are cached per (spec, device): a module belongs to one context."""
    return Kernel(spec, device_index)
