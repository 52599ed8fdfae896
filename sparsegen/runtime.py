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
        self.threads, self.smem = spec.tile.threads, spec.smem_bytes()
        cubin = cache.build(spec).cubin
        _ensure_context(device_index)
        driver = _driver()
        self._module = _check(driver.cuModuleLoadData(cubin), f"cuModuleLoadData({spec.name})")
        self._function = _check(driver.cuModuleGetFunction(self._module, spec.name.encode()),
                                "cuModuleGetFunction")
        attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        _check(driver.cuFuncSetAttribute(self._function, attr, self.smem), "cuFuncSetAttribute")

    def launch(self, grid: tuple[int, int, int], args: list) -> None:
        """args: ctypes scalars (c_void_p for pointers, c_int for ints), in kernel order."""
        params = (ctypes.c_void_p * len(args))(*[ctypes.addressof(a) for a in args])
        stream = torch.cuda.current_stream(self.device_index).cuda_stream
        status, = _driver().cuLaunchKernel(self._function, *grid, self.threads, 1, 1, self.smem,
                                           stream, ctypes.addressof(params), 0)
        if int(status) != 0:
            raise LaunchError(f"launch of {self.spec.name} failed: {status!r}")


@functools.lru_cache(maxsize=None)
def kernel(spec: KernelSpec, device_index: int) -> Kernel:
    """Loaded kernels are cached per (spec, device): a module belongs to one context."""
    return Kernel(spec, device_index)
