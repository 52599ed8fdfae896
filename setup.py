"""Only what pyproject.toml cannot say: the packages are every package under sparsegen/
(found, so a new layout folder ships without an edit here) plus sparsegen.templates, which
lives at the repo's top (templates/) and ships inside the package."""
from setuptools import find_packages, setup

setup(packages=find_packages(include=["sparsegen", "sparsegen.*"]) + ["sparsegen.templates"])
