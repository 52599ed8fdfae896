"""Does an NVRTC compile hold Python's GIL, and do compiles on threads run in parallel? Through
cuda.bindings and through ctypes (which releases the GIL for every foreign call). A thread
counts while the main thread compiles: its rate against its rate alone is the share of the
compile that let Python run. Usage: python tools/probe_nvrtc_gil.py"""
import ctypes
import threading
import time

import cuda.bindings
from cuda.pathfinder import load_nvidia_dynamic_lib

from sparsegen.jit import codegen, compiler
from sparsegen.semi24 import specs as s24

SPECS = [s24.sp24_spec("bf16", 90, rows=rows) for rows in (1, 16, 128, None)]
SOURCES = [(codegen.render(spec), spec.name, spec.target) for spec in SPECS]
HEADERS = codegen.headers()


def ctypes_compile(source: str, name: str, target: str, headers: dict) -> bytes:
    lib = ctypes.CDLL(load_nvidia_dynamic_lib("nvrtc").abs_path)
    prog = ctypes.c_void_p()
    n = len(headers)
    texts = (ctypes.c_char_p * n)(*[h.encode() for h in headers.values()])
    names = (ctypes.c_char_p * n)(*[k.encode() for k in headers])
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(), n, texts, names) == 0
    opts = [o.encode() for o in compiler.options(target)]
    assert lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts)) == 0
    size = ctypes.c_size_t()
    lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
    cubin = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetCUBIN(prog, cubin)
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return cubin.raw


def spin_share(compile_all) -> tuple[float, float]:
    count, stop = [0], [False]

    def spin():
        while not stop[0]:
            count[0] += 1
    thread = threading.Thread(target=spin)
    thread.start()
    time.sleep(0.3)
    c0, t0 = count[0], time.perf_counter()
    time.sleep(0.3)
    alone = (count[0] - c0) / (time.perf_counter() - t0)
    c0, t0 = count[0], time.perf_counter()
    compile_all()
    took = time.perf_counter() - t0
    share = (count[0] - c0) / alone / took
    stop[0] = True
    thread.join()
    return took, share


def threaded(fn):
    def run():
        threads = [threading.Thread(target=fn, args=(*s, HEADERS)) for s in SOURCES]
        [t.start() for t in threads]
        [t.join() for t in threads]
    return run


def serial(fn):
    return lambda: [fn(*s, HEADERS) for s in SOURCES]


print("cuda.bindings", cuda.bindings.__version__, "NVRTC", compiler.nvrtc_version())
for label, fn in (("cuda.bindings", compiler.compile_cubin), ("ctypes", ctypes_compile)):
    fn(*SOURCES[0], HEADERS)  # (warm)
    took, share = spin_share(serial(fn))
    print(f"{label}: {len(SOURCES)} compiles one after another {took:.3f} s, a Python thread ran {share:.0%} of its rate")
    took, share = spin_share(threaded(fn))
    print(f"{label}: {len(SOURCES)} compiles on threads {took:.3f} s, a Python thread ran {share:.0%} of its rate")
