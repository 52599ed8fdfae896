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
