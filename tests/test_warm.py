"""Kernels built ahead (sparsegen.warm, jit.cache.build_soon): patch() starts the builds a
patched model's forward will need on background threads; a build() that needs one waits for
it rather than compiling it again."""
import threading
import time

import pytest
import torch
from torch import nn

import sparsegen
from sparsegen import warm
from sparsegen.jit import cache, compiler
from sparsegen.semi24 import dispatch, scaled
from sparsegen.bdiag.nn import BlockDiagonalLinear
from sparsegen.bell.nn import BlockEllLinear
from sparsegen.launch import calls
from sparsegen.semi24.specs import sp24_spec


def test_a_background_build_is_waited_for_not_repeated(nvrtc_calls):
    spec = sp24_spec("fp16", 80, rows=1)
    assert cache.build_soon([spec, spec]) == 1  # (each once)
    built = cache.build(spec)
    assert nvrtc_calls == [spec.name]
    assert cache.build_soon([spec]) == 0  # (in memory now)
    assert built.cubin == cache.build(spec).cubin and not cache.build(spec).compiled


def test_a_build_not_started_yet_is_taken_over(monkeypatch):
    """With every background thread busy, build() compiles a queued spec itself at once
    instead of waiting behind the queue."""
    release, real = threading.Event(), compiler.compile_cubin
    blocked = sp24_spec("fp16", 80, rows=128)

    def slow(source, name, target, headers):
        if name == blocked.name:
            release.wait(30)
        return real(source, name, target, headers)
    monkeypatch.setattr(compiler, "compile_cubin", slow)
    monkeypatch.setattr(cache, "BACKGROUND_THREADS", 1)
    monkeypatch.setattr(cache, "_pool", [])
    wanted = sp24_spec("fp16", 80, rows=None)
    cache.build_soon([blocked, wanted])
    begin = time.perf_counter()
    assert cache.build(wanted).cubin
    assert time.perf_counter() - begin < 25  # (not behind the blocked build)
    release.set()
    cache.build(blocked)


def test_a_failed_background_build_raises_in_the_foreground(monkeypatch):
    def broken(source, name, target, headers):
        raise sparsegen.SparsegenError("NVRTC said no")
    monkeypatch.setattr(compiler, "compile_cubin", broken)
    spec = sp24_spec("bf16", 80, rows=128, narrow=True)
    cache.build_soon([spec])
    with pytest.raises(sparsegen.SparsegenError, match="NVRTC said no"):
        cache.build(spec)


@pytest.mark.parametrize("arch", [80, 90])
def test_a_2_4_layers_likely_kernels_cover_decode_to_prefill(arch):
    layer = sparsegen.linear(256, 512, sparsity="2:4").to(torch.bfloat16).fuse("swiglu")
    specs = layer.likely_specs(arch, 132)
    assert {s.epilogue for s in specs} == {"swiglu"} and {s.arch for s in specs} == {arch}
    for m in TOKEN_COUNTS:  # (every token count a forward may see: the kernel its dispatch takes)
        rows, narrow = dispatch.rows_bucket(m), dispatch._narrow(m, 512, 132)
        assert sp24_spec("bf16", arch, rows=rows, narrow=narrow, epilogue="swiglu") in specs, m


TOKEN_COUNTS = [*range(1, 40), 63, 64, 65, 100, 127, 128, 129, 300, 2048, 5000]


def test_a_one_byte_layer_warms_its_quantization_too():
    layer = scaled.ScaledSparse24Linear.from_dense(nn.Linear(256, 128), "e4m3")
    ops = {s.op for s in layer.likely_specs(90, 132)}
    assert ops == {"sp24_dds", "sp24_quantize"}
    assert any(s.param_values.get("quantize") for s in layer.likely_specs(90, 132))


def test_warm_dedupes_layers_of_one_shape_and_can_be_turned_off(monkeypatch):
    layers = [sparsegen.linear(128, 256, sparsity="2:4").to(torch.float16) for _ in range(3)]
    assert len(warm.likely_specs(layers, 90, 132)) == len(set(layers[0].likely_specs(90, 132)))
    assert warm.likely_specs([nn.Linear(4, 4)], 90, 132) == []
    monkeypatch.setenv("SPARSEGEN_WARM", "0")
    assert warm.warm(layers, gpu=(90, 132)) == 0


def test_patch_warms_without_a_gpu_only_when_asked(monkeypatch):
    """Without a GPU patch starts nothing (no arch to build for); warm with an arch does."""
    started = []
    monkeypatch.setattr(cache, "build_soon", lambda specs: started.append(specs) or len(specs))
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64)).half()
    sparsegen.patch(model, {r"0|2": {"sparsity": "2:4"}})
    if not torch.cuda.is_available():
        assert started == []
    assert warm.warm(list(model.modules()), gpu=(80, 108)) > 0


@pytest.mark.parametrize("setting, loads", [(None, True), ("0", False), ("maybe", False)])
def test_import_starts_loading_nvrtc_unless_warming_is_off(setting, loads):
    """`import sparsegen` starts a daemon thread that loads NVRTC (the first build's ~0.1 s in a
    new process); SPARSEGEN_WARM=0 starts none, and a malformed value does not break the import
    (patch reports it)."""
    import os
    import subprocess
    import sys

    script = ("import threading, sparsegen\nnames = [t.name for t in threading.enumerate()]\n"
              "loader = [t for t in threading.enumerate() if t.name == 'sparsegen-nvrtc']\n"
              "[t.join(60) for t in loader]\nprint(names, [t.daemon for t in loader])\n"
              "from cuda.bindings import nvrtc\nprint('loaded' if loader else 'none')\n")
    environ = {key: value for key, value in os.environ.items() if key != "SPARSEGEN_WARM"}
    if setting is not None:
        environ["SPARSEGEN_WARM"] = setting
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=environ)
    assert done.returncode == 0, done.stderr[-2000:]
    assert ("'sparsegen-nvrtc'" in done.stdout) is loads, done.stdout
    assert ("[True]" in done.stdout) is loads  # a daemon: never holds the process at exit


def test_warm_cublas_takes_only_the_dense_linears_patch_leaves_on_a_gpu(monkeypatch):
    """Nothing to set up on the CPU, nor for linears patch replaces, nor when warming is off."""
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    assert warm.warm_cublas(model) is None  # (CPU weights)
    if torch.cuda.is_available():
        model.cuda()
        assert warm.warm_cublas(model, skip={"0", "1"}) is None
        monkeypatch.setenv("SPARSEGEN_WARM", "0")
        assert warm.warm_cublas(model) is None


def test_patch_asks_for_cublas_for_the_linears_it_leaves_dense(monkeypatch):
    asked = []
    monkeypatch.setattr(warm, "warm_cublas", lambda model, skip: asked.append(set(skip)))
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.Linear(64, 32)).half()
    sparsegen.patch(model, {r"0|2": {"sparsity": "2:4"}})
    assert asked == [{"0", "2"}]


def test_a_process_that_exits_does_not_wait_for_queued_builds(tmp_path):
    """The background threads are daemons: a script that patches and ends is not held until
    every queued kernel is built (40 here, about half a minute of NVRTC on one thread)."""
    import os
    import subprocess
    import sys

    script = ("import time, sparsegen\nfrom sparsegen.jit import cache\nfrom sparsegen.bsr.specs import forward_spec\n"
              "specs = [forward_spec((b, b), d, 80, epilogue=e) for b in (16, 32, 64, 128) for d in ('fp16', 'bf16')\n"
              "         for e in ('none', 'relu', 'gelu', 'silu', 'gelu_tanh')]\n"
              "cache.BACKGROUND_THREADS = 1\nassert cache.build_soon(specs) == 40\nprint('queued', flush=True)\n")
    begin = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, SPARSEGEN_CACHE_DIR=str(tmp_path)))
    assert done.returncode == 0 and "queued" in done.stdout, done.stderr[-2000:]
    assert time.perf_counter() - begin < 20


@pytest.mark.parametrize("arch", [80, 89, 90])
def test_every_kernel_a_patched_2_4_layer_warms_is_one_precompile_ships(arch):
    """What patch builds ahead for a layer of any dtype and any epilogue it fuses is in the
    default kernel list - what `precompile` builds and the sparsegen-kernels wheel ships - so a
    model with those kernels installed compiles nothing on its first call."""
    from sparsegen.jit import epilogues
    from sparsegen.jit.spec import default_specs

    layers = [sparsegen.linear(256, 512, sparsity="2:4").to(dtype).fuse(epilogue)
              for dtype in (torch.bfloat16, torch.float16) for epilogue in epilogues.EPILOGUES]
    one_byte = ("int8", "e4m3") if arch >= 89 else ("int8",)
    layers += [scaled.ScaledSparse24Linear.from_dense(nn.Linear(256, 512).to(dtype), fmt).fuse(epilogue)
               for fmt in one_byte for dtype in (torch.bfloat16, torch.float16) for epilogue in epilogues.EPILOGUES]
    layers += [sparsegen.Int4Sparse24Linear.from_dense(nn.Linear(256, 512).to(dtype)).fuse(epilogue)
               for dtype in (torch.bfloat16, torch.float16) for epilogue in ("none", *epilogues.FUSED)]
    wanted = warm.likely_specs(layers, arch, 132)
    assert {s.op for s in wanted} >= {"sp24_w4"} | ({"sp24_w4_values"} if arch >= 90 else set())
    missing = set(wanted) - set(default_specs(arch, None, None, None))
    assert len(wanted) > 100 and not missing, sorted(s.name for s in missing)


@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("out_features", [512, 28672])
def test_a_4_bit_layers_likely_kernels_are_those_its_forward_takes_at_any_token_count(arch, out_features):
    """For every token count a forward may see, the kernel it launches (sp24_w4's bucket and
    width, or Hopper's 16-bit prefill route) is one patch builds ahead: 32 sequences of decode
    took a kernel built on first use before (17-32 tokens, a bucket of its own)."""
    from sparsegen.semi24 import int4_nn
    from sparsegen.semi24.specs import sp24_w4_spec, w4_narrow, w4_rows_bucket

    layer = sparsegen.Int4Sparse24Linear.from_dense(nn.Linear(256, out_features, dtype=torch.bfloat16)).fuse("gelu")
    specs = set(layer.likely_specs(arch, 132))
    for m in TOKEN_COUNTS:
        if arch >= 90 and m > int4_nn.PREFILL_ROWS:
            rows, narrow = dispatch.rows_bucket(m), dispatch._narrow(m, out_features, 132)
            taken = sp24_spec("bf16", arch, rows=rows, narrow=narrow, epilogue="gelu")
        else:
            taken = sp24_w4_spec("bf16", arch, rows=w4_rows_bucket(m), epilogue="gelu",
                                 narrow=w4_narrow(out_features, 132))
        assert taken in specs, (m, taken.name)


@pytest.mark.parametrize("arch", [89, 90])
def test_a_one_byte_layers_likely_kernels_are_those_its_forward_takes_at_any_token_count(arch):
    """The scaled product's kernel per token count (and, on Hopper, up to ops.QUANTIZING_ROWS
    tokens, the one that quantizes X itself) is among those patch builds ahead."""
    from sparsegen.semi24 import ops

    layer = scaled.ScaledSparse24Linear.from_dense(nn.Linear(256, 512, dtype=torch.bfloat16), "e4m3").fuse("gelu")
    specs, code = set(layer.likely_specs(arch, 132)), dispatch.SCALED_CODES[torch.bfloat16]
    for m in TOKEN_COUNTS:
        rows, narrow = dispatch.rows_bucket(m), dispatch._narrow(m, 512, 132)
        assert sp24_spec("e4m3", arch, rows=rows, narrow=narrow, epilogue="gelu", scales=code) in specs, m
        if arch == 90 and m <= ops.QUANTIZING_ROWS:
            assert sp24_spec("e4m3", arch, rows=rows, epilogue="gelu", scales=code, quantize=1) in specs, m


@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("block", [(16, 16), (32, 64), (64, 64), (128, 128)])
def test_a_block_sparse_layers_likely_kernels_are_those_its_forward_takes(arch, block):
    """Patch builds a block-sparse layer's kernels ahead as it does 2:4's (it built none): for
    every token count the forward's kernel (decode's up to 64 tokens, then the other), each
    variant a call may pick (pairs, clusters), and the dense path's scatter kernel - all of
    them kernels precompile ships, so an installed kernel package covers a first call."""
    from sparsegen.bsr import specs as bsr_specs
    from sparsegen.jit.spec import default_specs

    layer = sparsegen.linear(256, 512, block=block, density=0.5).to(torch.bfloat16).fuse("gelu")
    specs = layer.likely_specs(arch, 132)
    for m in TOKEN_COUNTS:  # (ops._bsr_plan: dispatch.forward_kernel, then dispatch.swap_variant)
        taken = bsr_specs.forward_spec(block, "bf16", arch, rows=1 if m <= 64 else None, epilogue="gelu")
        assert set(bsr_specs.call_variants(taken)) <= set(specs), m
    assert bsr_specs.scatter_spec(block, "bf16", arch) in specs
    assert not set(specs) - set(default_specs(arch, None, None, None))
    assert sparsegen.linear(64, 64, block=(16, 16), density=0.5).double().likely_specs(arch, 132) == []


def test_warm_starts_a_patched_block_sparse_models_kernels(monkeypatch):
    started = []
    monkeypatch.setattr(cache, "build_soon", lambda specs: started.extend(specs) or len(specs))
    model = nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 128)).to(torch.bfloat16)
    sparsegen.patch(model, {r"0|2": {"block": (32, 32), "density": 0.5}})
    started.clear()  # (what patch itself started, where a GPU is)
    warm.warm(list(model.modules()), gpu=(90, 132))
    assert {s.op for s in started} == {"bsr_dds", "bsr_scatter"}
    assert set(started) == set(model[0].likely_specs(90, 132))  # (two layers of one kind: built once)


@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("make", [
    lambda: BlockEllLinear(256, 512, block=(32, 32), density=0.5, dtype=torch.bfloat16).fuse("gelu"),
    lambda: BlockDiagonalLinear(256, 512, nblocks=4, dtype=torch.float16)], ids=["bell", "bdiag"])
def test_a_kit_layers_likely_kernels_are_those_its_forward_takes(arch, make):
    """The kit's layouts (and so a plugin's) are warmed as the shipped ones: for every token
    count, the kernel gathered._plan takes (the small-batch one up to SMALL_ROWS tokens, its
    layout's compiled-in parameters, the epilogue) is among the layer's likely kernels."""
    from sparsegen.jit import gathered_specs

    layer = make()
    specs, product = layer.likely_specs(arch, 132), layer.PRODUCT
    call = product._call((*layer.op_args(), layer.out_features, layer.epilogue))
    compiled_in = dict(product._split_params(call)[0])
    for m in TOKEN_COUNTS:
        taken = gathered_specs.forward_spec(product.op, layer.block, calls.DTYPE_NAMES[layer.values.dtype], arch,
                                            compiled_in, rows=1 if m <= gathered_specs.SMALL_ROWS else None,
                                            epilogue=layer.epilogue)
        assert taken in specs, m
    assert {s.arch for s in specs} == {arch} and len(specs) == 2


def test_a_layer_whose_kernels_cannot_be_named_ahead_is_passed_over(monkeypatch):
    """Warming is a head start: a layer whose likely_specs names no valid kernel (SpecError) is
    passed over, the others warm, and patch does not fail."""
    from sparsegen.errors import SpecError

    class Odd(nn.Module):
        def likely_specs(self, arch, sm_count):
            raise SpecError("no kernel for this block on this arch")
    good = sparsegen.linear(128, 256, sparsity="2:4").to(torch.float16)
    assert warm.likely_specs([Odd(), good], 90, 132) == list(dict.fromkeys(good.likely_specs(90, 132)))


@pytest.mark.parametrize("settings, ops", [({"sparsity": "2:4"}, {"sp24_compress"}),
                                           ({"sparsity": "2:4", "method": "transposable"}, {"sp24_compress", "sp24_mask"}),
                                           ({"sparsity": "2:4", "training": {}}, {"sp24_compress", "sp24_mask"}),
                                           ({"sparsity": "2:4", "weight_dtype": "e4m3"}, {"sp24_compress", "sp24_quantize"}),
                                           ({"sparsity": "2:4", "weight_dtype": "int8"}, {"sp24_compress", "sp24_quantize"}),
                                           ({"sparsity": "2:4", "group_size": 128}, {"sp24_compress"})])
def test_the_2_4_face_names_the_pruning_kernels_its_conversion_launches(settings, ops, monkeypatch):
    """In the weight's dtype (bf16 for a float32 weight going to 4 bits: from_dense prunes it so),
    on the weight's arch; nothing where the conversion runs in PyTorch ops."""
    from sparsegen.launch import runtime
    from sparsegen.semi24 import face, tensor

    assert face.packing(settings, torch.zeros(32, 64)) == []  # (a CPU weight: PyTorch ops)
    monkeypatch.setattr(tensor, "on_kernels", lambda w: w.dtype in (torch.float16, torch.bfloat16))
    monkeypatch.setattr(runtime, "device_arch", lambda device: 90)
    monkeypatch.setattr(face, "has_byte_kernels", lambda dtype, device: True)
    for dtype in (torch.float16, torch.float32):
        specs = face.packing(settings, torch.zeros(32, 64, dtype=dtype))
        converted = "group_size" in settings and dtype == torch.float32  # (4-bit weights)
        want = "fp16" if dtype == torch.float16 else "bf16" if converted else None
        assert {s.op for s in specs} == (ops if want else set()), dtype
        # (the quantizing kernel's dtype is the bytes'; it reads the weight's)
        assert all(s.arch == 90 and s.dtype == (settings["weight_dtype"] if s.op == "sp24_quantize" else want)
                   for s in specs)


def test_patch_starts_the_packing_builds_before_it_converts_a_layer(monkeypatch):
    """warm_packing sees every planned layer (its face and dense weight) before the first conversion."""
    from sparsegen import patching

    events = []
    monkeypatch.setattr(warm, "warm_packing", lambda conversions: events.append(
        ("warm", [(face.sparsity, weight.shape) for face, _, weight in conversions])))
    real_build = patching._build
    monkeypatch.setattr(patching, "_build", lambda module, settings, from_dense, name:
                        events.append(("build", name)) or real_build(module, settings, from_dense, name))
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64)).half()
    sparsegen.patch(model, {r"0|2": {"sparsity": "2:4"}})
    assert events == [("warm", [("2:4", (128, 64)), ("2:4", (64, 128))]), ("build", "0"), ("build", "2")]


def test_warm_packing_passes_over_cpu_weights_and_a_face_that_cannot_say(monkeypatch):
    from sparsegen.errors import InputError
    from sparsegen.semi24.specs import sp24_compress_spec

    started = []
    monkeypatch.setattr(cache, "build_soon", lambda specs: started.append(specs) or len(specs))
    spec = sp24_compress_spec("bf16", 90)

    class Face:
        def __init__(self, fails):
            self.fails = fails

        def packing(self, settings, weight):
            if self.fails:
                raise InputError("no kernels for this")
            return [spec]
    weight = torch.zeros(32, 64)
    assert warm.warm_packing([(Face(False), {}, weight)]) == 0 and started == []  # (a CPU weight: nothing asked)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    assert warm.warm_packing([(Face(True), {}, weight)]) == 0 and started == []
    assert warm.warm_packing([(Face(False), {}, weight), (Face(False), {}, weight)]) == 1  # (deduplicated)
    assert started == [[spec]]