"""Imports of tabfm.data, tabfm.synth, tabfm.parallel and tabfm.eval from a source checkout.

pyproject.toml maps those packages to the repository's top-level folders (data/, synth/, ...).
A wheel installs them inside tabfm/; in a checkout they sit beside tabfm/, where the import
system does not look. setuptools' editable finder maps them to the installed checkout's folders,
but only after the path search, so from another checkout's root (a worktree, a second clone) it
would pair that tree's tabfm/ with the installed tree's data/. This finder, first on the meta path,
resolves them beside the tabfm/ actually imported: the same tree for an editable install, a
`PYTHONPATH=.` run, or a regular install shadowed by ./tabfm from the repository root.
"""
from __future__ import annotations

import sys
from importlib.machinery import ModuleSpec, PathFinder
from pathlib import Path

SUBPACKAGES = ("data", "synth", "parallel", "eval")


class SourceTreeFinder:
    """Meta-path finder: tabfm.<sub> for each of SUBPACKAGES is the folder `root/<sub>`."""

    def __init__(self, root: Path):
        self.root = str(root)

    def find_spec(self, fullname: str, path=None, target=None) -> ModuleSpec | None:
        parent, _, name = fullname.rpartition(".")
        if parent != "tabfm" or name not in SUBPACKAGES:
            return None  # deeper modules follow their parent's __path__
        return PathFinder.find_spec(fullname, [self.root])


def install(package_dir: Path) -> None:
    """Put the finder first when `package_dir` (tabfm/) lies in a checkout rather than a wheel."""
    root = package_dir.parent
    if (package_dir / "data").is_dir() or not (root / "pyproject.toml").is_file():
        return  # an installed wheel: the subpackages are inside tabfm/
    if not any(isinstance(f, SourceTreeFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, SourceTreeFinder(root))
