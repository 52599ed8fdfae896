"""Load CUBINs with the CUDA driver API and launch them on PyTorch's current stream."""
from __future__ import annotations

import ctypes
import functools
import struct
import threading

import torch

from ..jit import cache
from .. import env
from ..errors import LaunchError
from ..jit.spec import KernelSpec


def _call(what: str, status: int) -> None:
    """Raise LaunchError for a failed driver call, with the driver's name for the error."""
    if status != 0:
        name = ctypes.c_char_p()
        _libcuda().cuGetErrorName(status, ctypes.byref(name))
        raise LaunchError(f"CUDA driver call {what} failed: {(name.value or b'?').decode()} ({status})")


def device_arch(device: torch.device) -> int:
    major, minor = torch.cuda.get_device_capability(device)
    return 10 * major + minor


@functools.lru_cache(maxsize=None)
def device_name(device_index: int) -> str:
    return torch.cuda.get_device_name(device_index)


@functools.lru_cache(maxsize=None)
def sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def persistent_blocks(at_once: int) -> int:
    """The blocks a persistent kernel launches where the GPU runs `at_once` of them together
    (env.persistent_waves of that): each walks its share of the tiles."""
    return at_once * env.persistent_waves()


def _ensure_context(device_index: int) -> None:
    """Make torch's primary context current on this thread, as the driver API needs."""
    torch.cuda.init()  # torch creates the primary context; we share it
    lib, dev, ctx = _libcuda(), ctypes.c_int(), ctypes.c_void_p()
    _call("cuDeviceGet", lib.cuDeviceGet(ctypes.byref(dev), device_index))
    _call("cuDevicePrimaryCtxRetain", lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev))
    _call("cuCtxSetCurrent", lib.cuCtxSetCurrent(ctx))


@functools.lru_cache(maxsize=1)
def _libcuda():
    """The driver library itself, called through ctypes: a launch costs a few microseconds
    where the cuda.bindings wrappers cost tens, and a new process skips their first call
    (about 15 ms on an H100 host, resolving the driver's entry points)."""
    lib = ctypes.CDLL("libcuda.so.1")
    u32, i32, ptr, out = ctypes.c_uint, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p  # out: T* results
    argtypes = {"cuLaunchKernel": [ptr, u32, u32, u32, u32, u32, u32, u32, ptr, ptr, ptr],
                "cuLaunchKernelEx": [ptr, ptr, ptr, ptr],
                "cuTensorMapEncodeTiled": [ptr, i32, u32, ptr, ptr, ptr, ptr, ptr, i32, i32, i32, i32],
                "cuDeviceGet": [out, i32], "cuDevicePrimaryCtxRetain": [out, i32], "cuCtxSetCurrent": [ptr],
                "cuModuleLoadData": [out, ctypes.c_char_p], "cuModuleGetFunction": [out, ptr, ctypes.c_char_p],
                "cuFuncSetAttribute": [ptr, i32, i32], "cuGetErrorName": [i32, out],
                "cuOccupancyMaxActiveBlocksPerMultiprocessor": [out, ptr, i32, ctypes.c_size_t],
                "cuOccupancyMaxActiveClusters": [out, ptr, ptr]}
    for name, types in argtypes.items():
        if hasattr(lib, name):  # (cuLaunchKernelEx came with CUDA 12: see _launch_ex)
            getattr(lib, name).argtypes = types
    return lib


@functools.lru_cache(maxsize=1)
def _launch_ex():
    """cuLaunchKernelEx, or None for a driver older than CUDA 12 (launches then take
    cuLaunchKernel) or none at all (a CPU-only machine packs launches it never makes)."""
    try:
        return getattr(_libcuda(), "cuLaunchKernelEx", None)
    except OSError:
        return None


def _slow_current_stream(device_index: int) -> int:
    return torch.cuda.current_stream(device_index).cuda_stream


# The raw-handle query inductor uses costs ~1 us; building a torch Stream object, ~10.
current_stream = getattr(torch._C, "_cuda_getCurrentRawStream", _slow_current_stream)
# Likewise the raw device query: torch.cuda.current_device() adds its lazy-init check (~3 us).
current_device = getattr(torch._C, "_cuda_getDevice", torch.cuda.current_device)
# And the capture query, without torch.cuda's Python wrapper around it (a frame per call).
capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", torch.cuda.is_current_stream_capturing)


class Kernel:
    """A loaded kernel: launch(grid, ...) on the current stream of its device."""

    def __init__(self, spec: KernelSpec, device_index: int):
        self.spec, self.device_index = spec, device_index
        self.threads, self.smem = spec.threads, spec.smem_bytes()
        cubin = cache.build(spec).cubin
        # Inside torch's device guard, so the caller's current device (and the context the
        # runtime binds to it) is restored afterwards.
        with torch.cuda.device(device_index):
            _ensure_context(device_index)
            self._function = self._load(cubin)
            self.resident_blocks = self._resident_blocks()
        self._handle = self._function.value
        self._cu_launch = _libcuda().cuLaunchKernel

    def _load(self, cubin: bytes):
        lib, module, function = _libcuda(), ctypes.c_void_p(), ctypes.c_void_p()
        _call(f"cuModuleLoadData({self.spec.name})", lib.cuModuleLoadData(ctypes.byref(module), cubin))
        self._module = module  # kept (a failed load above leaves the old one): the function lives as long as it
        _call("cuModuleGetFunction", lib.cuModuleGetFunction(ctypes.byref(function), module, self.spec.name.encode()))
        _call("cuFuncSetAttribute", lib.cuFuncSetAttribute(function, _MAX_DYNAMIC_SHARED_SIZE_BYTES, self.smem))
        return function

    def _resident_blocks(self) -> int:
        """Blocks of this kernel the GPU runs at once (persistent kernels size their grid by it;
        a block more would wait for a whole one to finish). Clusters must fit whole in a GPC."""
        lib, cluster, count = _libcuda(), self.spec.tile.cluster, ctypes.c_int()
        if cluster == 1:
            _call("cuOccupancyMaxActiveBlocksPerMultiprocessor", lib.cuOccupancyMaxActiveBlocksPerMultiprocessor(
                ctypes.byref(count), self._function, self.threads, self.smem))
            return max(1, count.value) * sm_count(self.device_index)
        config = _LaunchConfig(gridDimX=cluster, gridDimY=1, gridDimZ=1, blockDimX=self.threads, blockDimY=1,
                               blockDimZ=1, sharedMemBytes=self.smem)
        _call("cuOccupancyMaxActiveClusters", lib.cuOccupancyMaxActiveClusters(
            ctypes.byref(count), self._function, ctypes.byref(config)))
        return max(1, count.value) * cluster

    def launch(self, grid: tuple[int, int, int], maps: tuple, pointers: tuple, ints: tuple) -> None:
        """Parameters in kernel order: TMA descriptors, then pointers, then int32 scalars."""
        self.launch_array(grid, _kernel_params(maps, pointers, ints).array)

    def launch_array(self, grid: tuple[int, int, int], array) -> None:
        """Launch with cuLaunchKernel's void*[] of parameter addresses, already packed."""
        if current_device() != self.device_index:
            # The driver launches into the thread's current context: make it this device's.
            with torch.cuda.device(self.device_index):
                return self.launch_array(grid, array)
        # (_launch_raw's call written out: this is every planned launch's path, a frame costs)
        status = self._cu_launch(self._handle, *grid, self.threads, 1, 1, self.smem,
                                 current_stream(self.device_index), array, None)
        if status == _CUDA_ERROR_INVALID_CONTEXT:
            # A thread that has not touched CUDA through torch yet - autograd's backward
            # thread when a kernel is its first GPU work - has no current context.
            _ensure_context(self.device_index)
            status = self._launch_raw(grid, array)
        if status:  # the message only when needed: formatting it costs more than the launch
            _call(f"cuLaunchKernel({self.spec.name})", status)

    def _launch_raw(self, grid, array) -> int:
        return self._cu_launch(self._handle, *grid, self.threads, 1, 1, self.smem,
                               current_stream(self.device_index), array, None)


_CUDA_ERROR_INVALID_CONTEXT = 201
_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8  # CUfunction_attribute


class _LaunchConfig(ctypes.Structure):
    """cuda.h's CUlaunchConfig (no launch attributes: cluster shapes are compiled in)."""
    _fields_ = [(name, ctypes.c_uint) for name in ("gridDimX", "gridDimY", "gridDimZ", "blockDimX", "blockDimY",
                                                   "blockDimZ", "sharedMemBytes")]
    _fields_ += [("hStream", ctypes.c_void_p), ("attrs", ctypes.c_void_p), ("numAttrs", ctypes.c_uint)]


class _Params:
    """cuLaunchKernel's void*[]: one address per parameter, pointing at its value."""

    def __init__(self, maps: tuple, pointers: tuple, ints: tuple):
        self._values = ctypes.create_string_buffer(struct.pack(f"{len(pointers)}Q{len(ints)}i", *pointers, *ints))
        base = ctypes.addressof(self._values)
        addresses = [m.address for m in maps] + [base + 8 * i for i in range(len(pointers))]
        addresses += [base + 8 * len(pointers) + 4 * i for i in range(len(ints))]
        self.array = (ctypes.c_void_p * len(addresses))(*addresses)


# The driver copies parameter values at launch, so identical parameter lists (the same
# layer on the same buffers, step after step) can share one packed array. Sized for whole
# models: a few launches per layer, a hundred layers, and a cache that holds fewer entries
# than a forward makes misses on every call.
_kernel_params = functools.lru_cache(maxsize=4096)(_Params)


# CUtensorMapDataType, CUtensorMapSwizzle and CUtensorMapL2promotion values from cuda.h.
# One-byte types are copied as UINT8 (TMA moves bits).
_TMA_DTYPES = {torch.int32: 3, torch.float16: 6, torch.bfloat16: 9, torch.float8_e4m3fn: 0, torch.int8: 0}
_SWIZZLE = {32: 1, 64: 2, 128: 3}
_L2_PROMOTE_256B = 3


class TensorMap:
    """A TMA descriptor of a row-major 2-D tensor at `ptr`, read in boxes of box_rows x
    box_cols into shared memory swizzled to the box's row width (32, 64 or 128 bytes), or
    as they are (swizzle=False)."""

    def __init__(self, ptr: int, dtype: torch.dtype, rows: int, cols: int, box_rows: int, box_cols: int,
                 swizzle: bool = True):
        size = dtype.itemsize
        self._storage = ctypes.create_string_buffer(128 + 64)  # the driver wants 64-byte alignment
        self.address = (ctypes.addressof(self._storage) + 63) & ~63
        u64x2, u32x2 = ctypes.c_uint64 * 2, ctypes.c_uint * 2
        arguments = (self.address, _TMA_DTYPES[dtype], 2, ptr, u64x2(cols, rows), u64x2(cols * size, 0),
                     u32x2(box_cols, box_rows), u32x2(1, 1), 0, _SWIZZLE[box_cols * size] if swizzle else 0,
                     _L2_PROMOTE_256B, 0)
        status = _libcuda().cuTensorMapEncodeTiled(*arguments)
        if status == _CUDA_ERROR_INVALID_CONTEXT:  # a thread whose first CUDA work this is (see Kernel.launch_array)
            _ensure_context(current_device())
            status = _libcuda().cuTensorMapEncodeTiled(*arguments)
        _call(f"cuTensorMapEncodeTiled(rows {rows}, cols {cols}, box {box_rows}x{box_cols})", status)


# A descriptor holds only an address and a shape, so it is safe to reuse whenever both
# match - a training loop hands the same buffers back step after step.
tensor_map = functools.lru_cache(maxsize=4096)(TensorMap)  # sized as _kernel_params


class PackedLaunch:
    """One kernel on one grid with its parameters packed once, in place: a repeated call
    rewrites the few that change (its input's and output's addresses) and launches: the
    whole host work of a planned call (plans.py).

    `maps`: per TMA operand, its descriptor's shape (TensorMap's arguments after the
    address), bound per call by bind_map; `pointers` and `ints`: the other parameters'
    first values. Callers hold `lock` from their first write to the launch: the driver
    reads the block during cuLaunchKernel, which lets other threads run.
    """

    # Descriptors kept per TMA operand, the oldest dropped first: an eager decode step hands a
    # layer's launch a new X address most calls (generate() on an H200: 279 encodes in 408 calls
    # of a Gemma model's 2:4 layers with 8 kept), from a set of buffers the allocator cycles.
    MAPS_KEPT = 64

    def __init__(self, kern: Kernel, grid: tuple[int, int, int], maps: tuple, pointers: tuple, ints: tuple):
        self.kern, self.grid, self.lock = kern, grid, threading.Lock()
        self._config = _LaunchConfig(*grid, kern.threads, 1, 1, kern.smem)
        self._config_address, self._launch_ex = ctypes.addressof(self._config), _launch_ex()
        self._map_shapes, self._maps = maps, [{} for _ in maps]
        self.pointers = (ctypes.c_uint64 * max(1, len(pointers)))(*pointers)
        self._ints = (ctypes.c_int32 * max(1, len(ints)))(*ints)
        base, ints_base = ctypes.addressof(self.pointers), ctypes.addressof(self._ints)
        addresses = [0] * len(maps) + [base + 8 * i for i in range(len(pointers))]
        self.array = (ctypes.c_void_p * (len(addresses) + len(ints)))(
            *addresses, *[ints_base + 4 * i for i in range(len(ints))])

    def bind(self, index: int, address: int) -> None:
        """Parameter `index` (in kernel order) reads from `address`: a TMA operand through a
        descriptor of that address, any other as the pointer itself."""
        if index < len(self._maps):
            self.bind_map(index, address)
        else:
            self.pointers[index - len(self._maps)] = address

    def bind_map(self, slot: int, address: int) -> None:
        """TMA operand `slot` reads from `address` (a descriptor encoded once per address)."""
        kept = self._maps[slot]
        descriptor = kept.get(address)
        if descriptor is None:
            if len(kept) >= self.MAPS_KEPT:
                del kept[next(iter(kept))]  # (the oldest; the array's entry is replaced below, before any launch)
            descriptor = kept[address] = TensorMap(address, *self._map_shapes[slot])
        self.array[slot] = descriptor.address

    def run(self) -> None:
        """Launch by cuLaunchKernelEx on the kept configuration: four arguments for ctypes to
        convert where cuLaunchKernel takes eleven (1.5 us against 0.6 on the 2-core dev machine;
        a compiled decode step makes a few dozen of these launches and is host-bound)."""
        kern = self.kern
        if self._launch_ex is None or current_device() != kern.device_index:
            return kern.launch_array(self.grid, self.array)  # (it switches devices and contexts)
        config = self._config
        config.hStream = current_stream(kern.device_index)
        status = self._launch_ex(self._config_address, kern._handle, self.array, None)
        if status:  # (a thread without a current context, or a real failure: the general path says which)
            kern.launch_array(self.grid, self.array)


@functools.lru_cache(maxsize=None)
def kernel(spec: KernelSpec, device_index: int) -> Kernel:
    """Loaded kernels are cached per (spec, device): a module belongs to one context."""
    return Kernel(spec, device_index)
