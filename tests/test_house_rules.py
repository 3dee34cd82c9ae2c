"""docs/design.md's import rules, on the source and on a live import: imports run one way, and every
import uses the one installed namespace (tabfm.data, not data)."""
import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# installed package -> (repository folder, the other tabfm packages it may import)
RULES = {
    "tabfm.data": ("data", ()),
    "tabfm.synth": ("synth", ("tabfm.data",)),
    "tabfm.parallel": ("parallel", ()),
    "tabfm.eval": ("eval", ("tabfm.data",)),
}
OLD_NAMES = {"data", "synth", "parallel", "eval"}  # the folders' names, never import names


def imported(path: Path) -> list[str]:
    """Absolute module names that `path` imports (relative imports are inside its package)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    return names


def within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


@pytest.mark.parametrize("package", sorted(RULES))
def test_packages_import_only_what_the_house_allows(package):
    folder, allowed = RULES[package]
    for path in sorted((ROOT / folder).rglob("*.py")):
        for name in imported(path):
            if within(name, "tabfm"):
                assert any(within(name, p) for p in (package, *allowed)), \
                    f"{path.relative_to(ROOT)} imports {name}; {package} may import {allowed or 'no other tabfm package'}"


def test_every_import_uses_the_tabfm_namespace():
    for folder in ("tabfm", *OLD_NAMES, "tests", "benchmarks"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            old = [n for n in imported(path) if n.split(".")[0] in OLD_NAMES]
            assert not old, f"{path.relative_to(ROOT)} imports {old}: use tabfm.{old[0]}"


def test_importing_the_engine_loads_no_model_code():
    """Every tabfm.parallel module, imported in a fresh process, brings no other tabfm package
    and no table library with it ("knows torch, never tables")."""
    code = ("import pkgutil, sys, importlib, tabfm.parallel as p\n"
            "for m in pkgutil.walk_packages(p.__path__, 'tabfm.parallel.'): importlib.import_module(m.name)\n"
            "print(' '.join(sorted(sys.modules)))")
    loaded = subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, capture_output=True,
                            text=True, timeout=120).stdout.split()
    assert "tabfm.parallel.plugins.hybrid" in loaded and "tabfm.parallel.gemini.plugin" in loaded
    foreign = [m for m in loaded if (within(m, "tabfm") and not within(m, "tabfm.parallel")
                                     and m not in ("tabfm", "tabfm._source_tree"))
               or m.split(".")[0] in ("pandas", "sklearn", "pyarrow")]
    assert not foreign, f"importing tabfm.parallel loaded {foreign}"
