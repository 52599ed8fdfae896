"""The package's shape: a core that names no layout, layouts that do not import each other,
and imports that flow one way (core -> layouts -> the modules over all layouts)."""
import ast
from pathlib import Path

import sparsegen
from sparsegen import registry

PACKAGE = Path(sparsegen.__file__).parent
# Modules over every layout: the public API, the model patcher, compile lowerings, tuning.
OVER_LAYOUTS = {"__init__", "__main__", "factory", "inductor", "patching", "tune", "cli"}


def sparsegen_imports(path: Path) -> set[str]:
    """The sparsegen modules `path` imports, as dotted names relative to the package."""
    here = path.relative_to(PACKAGE).with_suffix("").parts[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = list(here[:len(here) - node.level + 1])
            module = base + (node.module.split(".") if node.module else [])
            found.update(".".join(module + [a.name]) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sparsegen"):
            found.update(f"{node.module}.{a.name}".split(".", 1)[1] for a in node.names)
    return found


def layout_of(name: str) -> str | None:
    first = name.split(".")[0]
    return first if first in registry.LAYOUTS else None


def test_core_modules_import_no_layout():
    for path in PACKAGE.glob("*.py"):
        if path.stem in OVER_LAYOUTS:
            continue
        layouts = {layout_of(name) for name in sparsegen_imports(path)} - {None}
        assert not layouts, f"{path.name} (core) imports layouts {layouts}"


def test_layouts_import_the_core_and_themselves_only():
    for layout in registry.LAYOUTS:
        for path in (PACKAGE / layout).glob("*.py"):
            others = {layout_of(name) for name in sparsegen_imports(path)} - {None, layout}
            assert not others, f"{layout}/{path.name} imports layouts {others}"
            over = {name for name in sparsegen_imports(path) if name.split(".")[0] in OVER_LAYOUTS}
            assert not over, f"{layout}/{path.name} imports {over}, which sit over the layouts"


def test_every_registered_layout_has_its_package_and_templates():
    templates = Path(__file__).parent.parent / "templates"
    for layout in registry.layouts():
        assert (PACKAGE / layout.name / "specs.py").is_file()
        for rules in layout.ops:
            assert rules.template.startswith(f"{layout.name}/") and (templates / rules.template).is_file()
