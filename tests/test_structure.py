"""The package's shape: folders in pipeline order and imports that flow one way.

    errors, env  ->  jit/  ->  launch/  ->  the layer kit  ->  layouts  ->  the top

A module imports from its own tier or those before it, never after; layouts do not import
each other; and no module imports back into one that imports it (no circle, counting
imports inside functions and under TYPE_CHECKING too)."""
import ast
from pathlib import Path

import sparsegen
from sparsegen.jit import registry

PACKAGE = Path(sparsegen.__file__).parent
BASE = {"errors", "env"}                                       # everything may import these
KIT = {"layer", "gathered", "blocks", "checkpoint", "warm"}          # what layers of every layout share
TOP = {"__init__", "__main__", "factory", "inductor", "patching", "dense_twin", "tune", "cli", "compressed",
       "checkpoint_files", "parallel"}  # over all layouts
TIERS = ("base", "jit", "launch", "kit", "layout", "top")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" and len(parts) > 1 else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def tier(module: str) -> str:
    first = module.split(".")[0]
    if first in ("jit", "launch"):
        return first
    if first in registry.LAYOUTS:
        return "layout"
    for name, members in (("base", BASE), ("kit", KIT), ("top", TOP)):
        if module in members:
            return name
    raise AssertionError(f"sparsegen/{module.replace('.', '/')}.py belongs to no tier: add it to one")


def as_module(name: str) -> str:
    """The module a dotted import target lives in ("jit.spec.KernelSpec" -> "jit.spec")."""
    while name not in MODULES and "." in name:
        name = name.rsplit(".", 1)[0]
    return name if name in MODULES else "__init__"


def imports_of(module: str) -> set[str]:
    """The package modules `module` imports, anywhere in it."""
    path = MODULES[module]
    here = path.relative_to(PACKAGE).with_suffix("").parts[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = list(here[:len(here) - node.level + 1]) + (node.module.split(".") if node.module else [])
            found.update(as_module(".".join(base + [a.name])) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sparsegen"):
            found.update(as_module(f"{node.module}.{a.name}".split(".", 1)[1]) for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(as_module(a.name.split(".", 1)[1]) for a in node.names if a.name.startswith("sparsegen."))
    return found - {module, "__init__"}


def test_every_module_has_a_tier():
    for module in MODULES:
        tier(module)


def test_imports_flow_one_way():
    for module in MODULES:
        for imported in imports_of(module):
            assert TIERS.index(tier(imported)) <= TIERS.index(tier(module)), \
                f"{module} ({tier(module)}) imports {imported} ({tier(imported)}), a later tier"


def test_layouts_import_no_other_layout():
    for module in MODULES:
        if tier(module) == "layout":
            own = module.split(".")[0]
            others = {m for m in imports_of(module) if tier(m) == "layout" and m.split(".")[0] != own}
            assert not others, f"{module} imports other layouts' {others}"


# Modules outside the layouts that still import one (issue 41 shrinks this to the package's
# exports): sparsegen.linear, patch rules and sparsegen tune read every layout from the
# registry's faces, sparsegen.parallel splits whatever layer lends its parts (layer.py).
NAMING_LAYOUTS = {"__init__": {"bsr", "semi24"}, "compressed": {"semi24"}}


def test_only_the_listed_modules_outside_the_layouts_import_one():
    for module in MODULES:
        if tier(module) != "layout":
            named = {m.split(".")[0] for m in imports_of(module) if tier(m) == "layout"}
            assert named <= NAMING_LAYOUTS.get(module, set()), \
                f"{module} imports the layouts {named}: read them from jit.registry (faces, lowerings) instead"


def test_sparsegen_linear_reaches_every_registered_face():
    from sparsegen import factory
    from sparsegen.jit import registry
    assert set(factory.SPARSITIES) == {face.sparsity for face in registry.faces()}
    assert len(factory.SPARSITIES) >= len(registry.LAYOUTS)  # (every shipped layout has a face)


def test_no_import_circle():
    graph = {module: imports_of(module) for module in MODULES}

    def reaches(start, goal, seen):
        return any(nxt == goal or (nxt not in seen and not seen.add(nxt) and reaches(nxt, goal, seen))
                   for nxt in graph[start])

    circles = sorted(module for module in MODULES if reaches(module, module, set()))
    assert not circles, f"modules on an import circle: {circles}"


def test_the_checks_see_imports():
    """The walker finds relative, absolute and late imports (else the tests above pass vacuously)."""
    assert {"jit.registry", "jit.spec", "errors"} <= imports_of("jit.gathered_specs")
    assert "jit.spec" in imports_of("jit.codegen") and "launch.calls" in imports_of("gathered")
    assert "tune" in imports_of("cli")  # imported inside a function


def test_every_registered_layout_has_its_package_and_templates():
    templates = Path(__file__).parent.parent / "templates"
    for layout in registry.layouts():
        assert (PACKAGE / layout.name / "specs.py").is_file()
        for rules in layout.ops:
            assert rules.template.startswith(f"{layout.name}/") and (templates / rules.template).is_file()


# ---- the file gate (issue 59): filesystem operations only in jit/private_files.py ----------
# Calls that touch the filesystem by path: builtins, os / shutil / tempfile functions and
# pathlib methods. Outside the gate only these, each for its reason.
FILE_CALLS = {"open", "os.open", "os.replace", "os.rename", "os.remove", "os.unlink", "os.rmdir", "os.mkdir",
              "os.makedirs", "os.chmod", "os.chown", "os.listdir", "os.scandir", "shutil.rmtree", "shutil.copy",
              "shutil.move", "tempfile.mkdtemp", "tempfile.mkstemp", "tempfile.NamedTemporaryFile"}
PATH_METHODS = {"write_text", "write_bytes", "read_text", "read_bytes", "mkdir", "rmdir", "unlink", "chmod",
                "iterdir", "glob", "rglob", "touch", "rename", "replace", "open", "symlink_to"}
GATE = "jit/private_files.py"
FILE_CALL_EXCEPTIONS = {
    ("env.py", "tempfile.mkdtemp"): "the base tier, below the gate: a fresh 0700 folder of a new name, exclusively",
    ("jit/codegen.py", "read_text"): "the package's own templates and modules, installed with it, not a user path",
    ("jit/codegen.py", "rglob"): "the package's own template folder",
    ("jit/compiler.py", "glob"): "the installed NVRTC libraries' names and sizes (the cache key's compiler identity)",
}


def file_calls(path: Path) -> set[str]:
    """The filesystem calls a module makes: 'os.unlink' for a function, 'read_text' for a
    method (any object's: a Path's is the case that matters)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Name) and func.id in FILE_CALLS:
            found.add(func.id)
        elif isinstance(func, ast.Attribute):
            dotted = f"{func.value.id}.{func.attr}" if isinstance(func.value, ast.Name) else None
            if dotted in FILE_CALLS:
                found.add(dotted)
            elif func.attr in PATH_METHODS and not _not_a_path_call(node, dotted):
                found.add(func.attr)
    return found


def _not_a_path_call(call: ast.Call, dotted: str | None) -> bool:
    """dataclasses.replace(obj, ...), and str.replace(old, new) - two arguments, where
    Path.replace and Path.rename take one: not the filesystem."""
    if dotted == "dataclasses.replace":
        return True
    return call.func.attr in ("replace", "rename") and len(call.args) == 2


def test_every_file_operation_goes_through_the_gate():
    outside = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        module = path.relative_to(PACKAGE).as_posix()
        if module == GATE:
            continue
        calls = {call for call in file_calls(path) if (module, call) not in FILE_CALL_EXCEPTIONS}
        if calls:
            outside[module] = sorted(calls)
    assert not outside, f"filesystem calls outside {GATE} (make them functions there): {outside}"


def test_the_gate_check_sees_file_calls():
    """The scan above finds each kind of call (it could pass by seeing nothing)."""
    sample = Path(sparsegen.__file__).parent / GATE
    assert {"os.open", "os.unlink", "os.rmdir", "os.listdir", "os.mkdir", "tempfile.mkdtemp"} <= file_calls(sample)
    assert len(FILE_CALL_EXCEPTIONS) <= 5
