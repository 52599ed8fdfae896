"""Where sparsity layouts plug into the core. A layout registers, from its `specs` module:
per op, how a KernelSpec of it is checked, how much shared memory it takes, which template
renders it and what that template's context adds; and the kernels `sparsegen precompile`
builds. The core (spec, codegen, cache, runtime, cli) asks here and names no op itself.
"""
from __future__ import annotations

import functools
import importlib
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ..errors import SpecError, expect

# A KernelSpec (spec.py). Named by an alias, not imported: spec imports this module, and
# the registry must not import back into it (tests/test_structure.py).
Spec = Any

# The registry line: the layouts sparsegen ships. A new layout is a package with a specs
# module that calls register(); add its name here.
LAYOUTS = ("bsr", "semi24", "bell", "bdiag")


# What every template's context already holds (codegen.template_context): no parameter may shadow it.
RESERVED_NAMES = frozenset({"name", "op", "dtype", "arch", "trans", "bm", "bk", "mma", "elem", "tile_m", "warps_m",
                            "warps_n", "stages", "cluster", "threads", "instr", "ptx_type", "epilogue", "epi",
                            "params", "acc"})


def _no_context(spec: Spec) -> dict:
    return {}


def _not_int8(spec: Spec) -> bool:
    return spec.dtype != "int8"


def _no_spills(spec: Spec) -> tuple[int, str]:
    return 0, "0"


def _one(spec: Spec) -> int:
    return 1


@dataclass(frozen=True)
class Param:
    """A parameter of a layout's op beyond the fields every KernelSpec has (V:N:M's V, a
    fixed blocks-per-row count...): an integer with a default and, optionally, its choices.
    It appears in the kernel's name as _x<name><value> and in its template as {{ <name> }}."""

    name: str                                       # lowercase letters: the name's grammar
    default: int
    choices: tuple[int, ...] | None = None
    doc: str = ""
    # False: left out of the name and the cache key at its default, so that adding the
    # parameter to an op keeps the names (and cached kernels) its specs had before
    named_at_default: bool = True


@dataclass(frozen=True)
class ProductArgs:
    """A forward product op's arguments, declared once: its torch.library schema, its fake
    result (calls.fake_product), its layers' calls and the Inductor lowering all read this.
    Tensors come first (x first; the one named "bias" may be None), then the op's own ints,
    then every product op's last two: out_features (W's rows) and the epilogue."""

    tensors: tuple[str, ...]                        # e.g. ("x", "values", "bias", "cols")
    ints: tuple[str, ...] = ()

    def schema(self, op: str) -> str:
        tensors = ", ".join(f"Tensor{'?' if name == 'bias' else ''} {name}" for name in self.tensors)
        ints = "".join(f", int {name}" for name in self.ints)
        return f"{op}({tensors}{ints}, int out_features, str epilogue) -> Tensor"

    optional = ("bias",)                             # the tensors a call may pass as None

    def out_features_and_epilogue(self, args: tuple) -> tuple[int, str]:
        at = len(self.tensors) + len(self.ints)
        return args[at], args[at + 1]


@dataclass(frozen=True)
class OpRules:
    """One op of a layout: what its KernelSpecs may hold and how they render."""

    op: str
    template: str                                   # under templates/, e.g. "bsr/bsr_dds.cu.j2"
    validate: Callable[[Spec], None]        # raises SpecError ("Expected X. Got Y.")
    smem_bytes: Callable[[Spec], int]       # dynamic shared memory per block
    trans: tuple[str, ...] = ("nt",)                # operand layouts it accepts
    context: Callable[[Spec], dict] = _no_context  # what its template uses beyond the spec's fields
    epilogues: bool = False                         # whether it fuses an epilogue into its store
    tensor_cores: bool = True                       # False: copies and pruning (no SASS MMA check)
    params: tuple[Param, ...] = ()                  # the op's own typed parameters, compiled in (the name's _x...)
    # Parameters its kernels take at launch instead (trailing int arguments, in this order; the
    # template sees each as a C++ name): one kernel serves every value, so every layer shape
    run_params: tuple[Param, ...] = ()
    accs: tuple[str, ...] = ("f32",)                # accumulator types its templates implement (spec.ACCS)
    args: ProductArgs | None = None                 # a forward product op's arguments (its custom op's)
    float_output: Callable[[Spec], bool] = _not_int8  # Y in a float type (epilogues need one): int8 sums are int32
    known_spills: Callable[[Spec], tuple[int, str]] = _no_spills  # (LDL/STL allowed, stack bytes pattern) the
                                                                   # SASS test accepts for a spec (tests/test_compile.py)
    # Copies of the tile's warp grid a block runs, each taking its share of K (sp24_w4's kwarps):
    # the block's threads are the tile's times this
    k_warps: Callable[[Spec], int] = _one
    # What tile_m (a block's tokens, or rows of X) must be a multiple of: 16 for the mma and wgmma
    # kernels' row tiles; sp24_w4's decode tiles take 8 (one n8 step of mma.sp per W tile)
    tile_m_step: int = 16

    def __post_init__(self):
        for param in self.params + self.run_params:
            expect(param.name.isalpha() and param.name.islower() and param.name not in RESERVED_NAMES,
                   f"a parameter name of lowercase letters, none of {sorted(RESERVED_NAMES)}", repr(param.name),
                   SpecError)


@dataclass(frozen=True)
class Lowering:
    """A forward op a compiled graph calls straight (inductor.py): `launcher(*the op's
    arguments, out=buffer)` writes Y into Inductor's buffer. The arguments are the op's
    declared ProductArgs (its OpRules.args)."""

    op: str                                         # its name under torch.ops.sparsegen
    launcher: Callable
    output_dtype: Callable = lambda dtype, args: dtype  # Y's dtype for X's (and the op's arguments)
    own_args: object = None                          # an op that is no registered product: its
                                                     # ProductArgs-like tensors / optional / out_features_and_epilogue
    inline: Callable | None = None                  # inline(args, Inductor's lowerings, inductor.GraphContext):
                                                     # the op as other lowerings and calls, or None (the launcher)
    more_launchers: tuple = ()                       # (name, launcher): what inline's graph.extern calls may name

    @property
    def args(self) -> ProductArgs:
        return self.own_args or op_rules(self.op).args


def _whole_blocks(n: int, k: int, block, density: float) -> bool:
    return n % block[0] == 0 and k % block[1] == 0


@dataclass(frozen=True)
class Tuning:
    """What `sparsegen tune` measures of a layout against cuBLAS: its key in the crossover
    tables (launch/crossovers.py), its (block, density) points, a layer of a shape
    (`layer(out, in, block, density, **factory)`), which weight shapes a point fits, and the
    tile its calls look the table up by (a layer may choose its own)."""

    key: str                                        # e.g. "bell"
    points: tuple[tuple[tuple[int, int], float], ...]
    layer: Callable[..., Any]
    fits: Callable[[int, int, tuple, float], bool] = _whole_blocks
    tile: Callable[[Any, tuple], tuple] = lambda layer, block: tuple(block)


@dataclass(frozen=True)
class Face:
    """How users ask for a layout: `sparsegen.linear(sparsity=<sparsity>, ...)` builds its layer
    by `build(in_features, out_features, bias, device, dtype, given)`, where `given` holds the
    arguments the user passed among `takes` (every other one is refused before build runs)."""

    sparsity: str                                   # e.g. "block-ell"
    takes: tuple[str, ...]                          # the arguments beyond in/out features, bias, device, dtype
    build: Callable[..., Any]
    # sparsegen.patch: the settings a rule of this sparsity takes (besides "sparsity"), the layer
    # for a linear (`patch(linear, settings, from_dense)`; None: no rules of it), the layout's
    # own check of a rule's settings, and whether a gated MLP's gate and up under these settings
    # become one layer with a gated epilogue (rows interleaved: the layout must allow it)
    rule: tuple[str, ...] = ()
    patch: Callable[..., Any] | None = None
    check_rule: Callable[[str, dict], None] = lambda pattern, settings: None
    pairs: Callable[[dict], bool] = lambda settings: False
    tuning: Tuning | None = None                    # sparsegen tune's points (None: not tuned)
    # The kernels patch's conversion of a dense weight launches under a rule's settings
    # (`packing(settings, weight)` -> KernelSpecs; pruning, packing): patch starts building them
    # first, so the first layer's conversion waits for less of its compile (warm.warm_packing)
    packing: Callable[[dict, Any], list] = lambda settings, weight: []
    # For the shared tests (tests/test_arguments.py): each argument in `takes` with a value it
    # accepts for a 128 -> 256 layer and what that value makes of the layer, (name, value,
    # effect(layer) -> bool): every argument is shown used, in every layout alike.
    examples: tuple[tuple[str, Any, Callable[[Any], bool]], ...] = ()

    def make(self, in_features: int, out_features: int, bias: bool, device, dtype, given: dict):
        """build's layer, checked against the layer contract (check_layer)."""
        return check_layer(self.build(in_features, out_features, bias, device, dtype, given), self)

    def make_patched(self, linear, settings: dict, from_dense: bool):
        """patch's layer for `linear`, checked against the layer contract (check_layer)."""
        return check_layer(self.patch(linear, settings, from_dense), self)


# The layer contract: what sparsegen.linear, patch, dense_copy and the checkpoint code read of
# every layer a face makes, by name (docs/adding-a-layout.md). Face.make and make_patched -
# the only ways sparsegen builds a layer from a face - check it, so a plugin's layer that
# lacks one fails when it is made, naming its face, not later in whichever path reads it.
LAYER_SIZES = ("in_features", "out_features")
LAYER_METHODS = ("forward", "to_dense_weight", "to_linear")  # W [out, in]; an nn.Linear of it


def check_layer(layer, face: Face):
    """layer, if it keeps the contract (and has .density where its face takes density=)."""
    import torch  # (late: the registry is read by the torch-free command line too)

    missing = [name for name in LAYER_SIZES if not isinstance(getattr(layer, name, None), int)]
    missing += [name for name in LAYER_METHODS if not callable(getattr(layer, name, None))]
    if "density" in face.takes and not isinstance(getattr(layer, "density", None), (int, float)):
        missing.append("density (its face takes density=)")
    expect(isinstance(layer, torch.nn.Module) and not missing,
           f"sparsity={face.sparsity!r}'s layer to be an nn.Module with integer {' and '.join(LAYER_SIZES)} and "
           f"methods {', '.join(LAYER_METHODS)}",
           f"{type(layer).__qualname__} lacking {', '.join(missing) or 'nn.Module'}", SpecError)
    return layer


@dataclass(frozen=True)
class Layout:
    name: str                                       # the package: sparsegen.<name>, templates/<name>/
    ops: tuple[OpRules, ...]
    default_specs: Callable[[int, tuple, list | None], list]  # (arch, dtypes, blocks) -> what precompile builds
    package_dir: Path                               # its Python, hashed with the templates (cache aliases)
    lowerings_module: str | None = None             # a module of it with LOWERINGS (Lowering, ...): compiled graphs
    faces_module: str | None = None                 # a module of it with FACES (Face, ...): sparsegen.linear
    kit_module: str | None = None                   # a module of it with KIT_KERNELS {role: function}: kit_kernel
    # A plugin's (a package of its own, found by its entry point): its Python package, and the
    # folder its templates' paths start from (the core's templates/ where None)
    package: str | None = None
    templates: Path | None = None

    def module(self, name: str) -> str:
        """The import path of the layout's module `name`."""
        return f"{self.package or 'sparsegen.' + self.name}.{name}"


_REGISTERED: dict[str, Layout] = {}
_OPS: dict[str, OpRules] = {}


def register(layout: Layout) -> None:
    for rules in layout.ops:
        expect(_OPS.get(rules.op, rules) is rules, f"op {rules.op!r} registered once",
               f"a second registration by layout {layout.name!r}", SpecError)
        _OPS[rules.op] = rules
    _REGISTERED[layout.name] = layout


def layouts() -> tuple[Layout, ...]:
    """The shipped layouts in LAYOUTS order, then the plugins that loaded, in their entry points' order."""
    _load()
    return tuple(_REGISTERED[name] for name in LAYOUTS) + tuple(
        layout for name, layout in _REGISTERED.items() if name not in LAYOUTS)


def failed_plugins() -> dict[str, str]:
    """Plugins whose entry point did not load, by name: what went wrong."""
    _load()
    return dict(_FAILED)


def op_rules(op: str) -> OpRules:
    _load()
    rules = _OPS.get(op)
    expect(rules is not None, f"op one of {tuple(_OPS)}", repr(op), SpecError)
    return rules


def layout_of(op: str) -> str:
    """The name of the layout that registered `op`."""
    op_rules(op)  # (an unknown op: "Expected op one of (...)")
    return next(name for name, layout in _REGISTERED.items() if any(r.op == op for r in layout.ops))


def ops() -> tuple[str, ...]:
    _load()
    return tuple(_OPS)


def lowerings() -> tuple[Lowering, ...]:
    """Every layout's compiled-graph lowerings (importing their modules: the layers and ops)."""
    modules = [importlib.import_module(layout.module(layout.lowerings_module))
               for layout in layouts() if layout.lowerings_module]
    return tuple(lowering for module in modules for lowering in module.LOWERINGS)


def launcher(op: str) -> Callable:
    """The launcher compiled graphs call for forward op `op` (its layout's Lowering), found once:
    an eager layer's repeated calls take it too."""
    found = _LAUNCHERS.get(op)
    if found is None:
        found = _LAUNCHERS[op] = next(lowering.launcher for lowering in lowerings() if lowering.op == op)
    return found


_LAUNCHERS: dict[str, Callable] = {}


def faces() -> tuple[Face, ...]:
    """Every layout's faces, in LAYOUTS order (importing their modules: the layers)."""
    modules = [importlib.import_module(layout.module(layout.faces_module))
               for layout in layouts() if layout.faces_module]
    return tuple(face for module in modules for face in module.FACES)


def kit_kernel(role: str) -> Callable:
    """The function a layout lends the layout kit under `role` (its module's KIT_KERNELS), so
    that the kit calls a kernel without naming the layout it comes from (found once). Roles:
    "sampled_weight_grad" (dy2 [M, N], x2 [M, K], flat_index, block) -> [len(flat_index), bm, bk],
    dY^T X at the stored blocks whose row-major places in W's block grid flat_index lists
    (block rows in order), differentiable by no one, under torch.compile as on any device;
    "sampled_input_grad" (dy, values [count, bm, bk], perm, row_offsets, col_indices,
    flat_index, (bk, bm), in_features) -> dX = dY W, given W^T's block-CSR index (its block b
    is values[perm[b]] transposed), in eager calls; "gated_product" (y [..., 2N], act) -> H
    [..., N] and "gated_product_grad" (dh, y, act) -> dY, a training step's gated epilogue
    (jit/epilogues.py) on 16-bit CUDA tensors, in eager calls."""
    found = _KIT_KERNELS.get(role)
    if found is None:
        found = _KIT_KERNELS[role] = _lent(role)
    return found


_KIT_KERNELS: dict[str, Callable] = {}


def _lent(role: str) -> Callable:
    for layout in layouts():
        if layout.kit_module:
            lent = importlib.import_module(layout.module(layout.kit_module)).KIT_KERNELS
            if role in lent:
                return lent[role]
    raise SpecError(f"Expected a layout lending the kit kernel {role!r}. Got none among {LAYOUTS}.")


# Where plugins are found: a package of its own names the module that registers its layout in
# its pyproject.toml, `[project.entry-points."sparsegen.layouts"] band = "band_layout.specs"`.
ENTRY_POINTS = "sparsegen.layouts"
_FAILED: dict[str, str] = {}


def _load() -> None:
    """Load each layout once through its entry point (its specs module registers it): the
    shipped ones first - an error there raises, the core needs them - then every installed
    plugin's, one that fails set aside with a warning naming it while the others load."""
    for entry in _shipped_entry_points():
        if entry.name not in _REGISTERED:
            _load_entry(entry)
    for entry in _plugin_entry_points():
        if entry.name not in _REGISTERED and entry.name not in _FAILED:
            _load_plugin(entry)


@functools.lru_cache(maxsize=1)
def _shipped_entry_points() -> tuple:
    """The shipped layouts' entry points as sparsegen's pyproject.toml declares them (a plugin's
    declare theirs the same way); in a checkout run from PYTHONPATH, with no metadata installed,
    the same entries made here. Another package's entry of a shipped name is never taken."""
    from importlib.metadata import EntryPoint, entry_points

    ours = {f"sparsegen.{name}.specs" for name in LAYOUTS}
    declared = {entry.name: entry for entry in entry_points(group=ENTRY_POINTS) if entry.value in ours}
    return tuple(declared.get(name) or EntryPoint(name, f"sparsegen.{name}.specs", ENTRY_POINTS) for name in LAYOUTS)


@functools.lru_cache(maxsize=1)
def _plugin_entry_points() -> tuple:
    from importlib.metadata import entry_points

    return tuple(entry for entry in entry_points(group=ENTRY_POINTS) if entry.name not in LAYOUTS)


def _load_entry(entry) -> None:
    """Import a layout's entry point and check that it registered a layout of the entry's name:
    the one check every layout passes, shipped or plugin."""
    entry.load()
    expect(entry.name in _REGISTERED, f"its module {entry.value} to register a layout named {entry.name!r}",
           f"layouts {sorted(_REGISTERED)}", SpecError)


def _load_plugin(entry) -> None:
    try:
        _load_entry(entry)
    except Exception as error:  # (a broken plugin never breaks the others, or the shipped layouts)
        _FAILED[entry.name] = f"{type(error).__name__}: {error}"
        warnings.warn(f"sparsegen: the layout plugin {entry.name!r} ({entry.value}) did not load: "
                      f"{_FAILED[entry.name]}", RuntimeWarning, stacklevel=3)
