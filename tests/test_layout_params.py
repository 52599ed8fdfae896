"""A layout's own typed parameters (registry.Param): defaults, the name's grammar, checks,
the template context - with a toy op registered the way a new layout registers its ops,
rendered and compiled by NVRTC."""
import shutil

import pytest

from sparsegen.jit import cache, codegen, gathered_specs, registry
from sparsegen.errors import SpecError
from sparsegen.jit.spec import THREADS_256, KernelSpec

TOY_TEMPLATE = """// {{ name }}: every {{ v }}th of {{ m }} elements
extern "C" __global__ void {{ name }}(const float* x, float* y, int n) {
  const int i = blockIdx.x * {{ threads }} + threadIdx.x;
  if (i < n) y[i] = (i % {{ m }}) < {{ v }} ? x[i] : 0.f;
}
"""


def _no_smem(spec):
    return 0


def _any(spec):
    return None


TOY = registry.OpRules("toy_keep", "toy/toy_keep.cu.j2", _any, _no_smem, tensor_cores=False,
                       params=(registry.Param("v", 2, (1, 2, 4)), registry.Param("m", 8)))


@pytest.fixture
def toy_op(monkeypatch, tmp_path):
    """The toy op registered, its template in a copy of the templates folder."""
    yield from registered(TOY, TOY_TEMPLATE, monkeypatch, tmp_path)


def registered(rules, template: str, monkeypatch, tmp_path):
    """`rules` registered beside the real layouts, its template in a copy of the templates."""
    registry.ops()  # the real layouts first
    monkeypatch.setitem(registry._OPS, rules.op, rules)
    copy = tmp_path / "templates"
    shutil.copytree(codegen.templates_dir(), copy)
    (copy / rules.template).parent.mkdir()
    (copy / rules.template).write_text(template)
    monkeypatch.setattr(codegen, "templates_dir", lambda: copy)
    codegen._environment.cache_clear()
    yield rules
    codegen._environment.cache_clear()


def toy_spec(**params) -> KernelSpec:
    return KernelSpec(op="toy_keep", dtype="fp32", arch=80, tile=THREADS_256, params=params)


def test_defaults_fill_in_and_the_name_round_trips(toy_op):
    spec = toy_spec(m=16)
    assert spec.params == (("v", 2), ("m", 16))
    assert spec.name.endswith("_xv2_xm16")
    assert KernelSpec.from_name(spec.name) == spec
    other = toy_spec(v=4, m=16)
    assert other.key != spec.key and other.name != spec.name


def test_unknown_or_bad_parameters_are_clear_errors(toy_op):
    with pytest.raises(SpecError, match=r"parameters of toy_keep among \('v', 'm'\)"):
        toy_spec(w=3)
    with pytest.raises(SpecError, match=r"v one of \(1, 2, 4\)"):
        toy_spec(v=3)
    with pytest.raises(SpecError, match="an integer for parameter 'm'"):
        toy_spec(m="8")
    with pytest.raises(SpecError, match="parameters of bsr_dds among"):
        KernelSpec(op="bsr_dds", params={"v": 2})


def test_parameters_reach_the_template_and_the_kernel_compiles(toy_op):
    spec = toy_spec(v=4)
    source = codegen.render(spec)
    assert "every 4th of 8" in source and "(i % 8) < 4" in source
    built = cache.build(spec)
    assert built.cubin[:4] == b"\x7fELF"


def test_a_parameter_may_not_shadow_the_core_context():
    with pytest.raises(SpecError, match="lowercase letters"):
        registry.OpRules("toy_bad", "toy/x.cu.j2", _any, _no_smem, params=(registry.Param("tile_m", 1),))


def test_ops_without_parameters_keep_their_names_and_keys():
    spec = KernelSpec(op="bsr_dds", block=(64, 64), dtype="bf16", arch=80)
    assert spec.params == () and "_x" not in spec.name
    assert spec.key == KernelSpec(op="bsr_dds", block=(64, 64), dtype="bf16", arch=80, params={}).key


KIT_TEMPLATE = """// {{ name }}
{%- import "common/sg_fixed_rows.j2" as kit with context %}
{{ kit.product("(r + blk) % " ~ gridcols) }}
"""


@pytest.fixture
def kit_op(monkeypatch, tmp_path):
    """A fixed-rows op through the kit whose `gridcols` is compiled in, rowblocks at launch."""
    rules = gathered_specs.product_rules("wrap_dds", "wrap/wrap_dds.cu.j2", params=(registry.Param("gridcols", 1),),
                                         compile_time=("gridcols",))
    yield from registered(rules, KIT_TEMPLATE, monkeypatch, tmp_path)


def test_the_kit_passes_parameters_at_launch_unless_compiled_in(kit_op):
    assert [p.name for p in kit_op.params] == ["gridcols"] and [p.name for p in kit_op.run_params] == ["rowblocks"]
    assert kit_op.args.ints == ("rowblocks", "gridcols")  # the op's schema keeps every parameter, in order
    spec = gathered_specs.forward_spec("wrap_dds", (64, 64), "bf16", 80, {"rowblocks": 3, "gridcols": 12})
    assert spec.name.endswith("_xgridcols12") and "rowblocks" not in spec.name
    source = codegen.render(spec)
    assert "return (r + blk) % 12;" in source and "return r * rowblocks;" in source
    assert "int M, int K, int N, int rowblocks)" in source and "Rows{rowblocks}" in source
    assert cache.build(spec).cubin[:4] == b"\x7fELF"


def test_compile_time_names_only_declared_parameters():
    with pytest.raises(SpecError, match=r"compile_time among the parameters \('rowblocks',\)"):
        gathered_specs.product_rules("wrap_dds", "wrap/wrap_dds.cu.j2", compile_time=("gridcols",))
