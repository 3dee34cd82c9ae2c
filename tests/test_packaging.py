"""What the distribution ships and how it imports: one tabfm namespace (the repository's data/,
synth/, parallel/ and eval/ install as tabfm.data, ...), the weights and kernel sources in the
wheel and the sdist, and a wheel that works in a fresh venv from a directory whose own data/,
eval.py and parallel.py would shadow top-level packages of those names."""
import json
import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = sorted(p.relative_to(ROOT).as_posix() for pattern in
                 ("tabfm/weights/tabfm-tiny/*", "tabfm/model/cpu_kernels/*.cpp", "tabfm/model/cpu_kernels/*.h")
                 for p in ROOT.glob(pattern))
USER_MODULES = ("data/__init__.py", "eval.py", "parallel.py")  # a user's project, next to where Python runs
INSTALL_TIMEOUT_S = 600


def packages_on_disk(package_dir: dict[str, str]) -> set[str]:
    """Import names of every folder with an __init__.py under tabfm/ and the mapped folders."""
    names = set()
    for name, folder in {"tabfm": "tabfm", **package_dir}.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder).parts
            names.add(".".join((name, *rel)))
    return names


def test_pyproject_lists_every_package():
    tomllib = pytest.importorskip("tomllib")
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed, on_disk = set(tool["packages"]), packages_on_disk(tool["package-dir"])
    assert listed == on_disk, f"pyproject.toml [tool.setuptools] packages: add {sorted(on_disk - listed)}, " \
                              f"remove {sorted(listed - on_disk)}"
    assert set(tool["package-dir"]) == {"tabfm.data", "tabfm.synth", "tabfm.parallel", "tabfm.eval"}


def user_project(path: Path) -> Path:
    """A directory holding modules named like the repository's folders; importing one fails loudly."""
    for name in USER_MODULES:
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(f"raise ImportError('the user\\'s own {name} was imported')\n")
    return path


def test_checkout_imports_its_own_subpackages(tmp_path):
    """A checkout on sys.path, with no install's finder to help, resolves tabfm.data etc. beside
    its own tabfm/: the `PYTHONPATH=.` case, and a regular install shadowed by ./tabfm."""
    code = ("import json, sys\n"
            "sys.meta_path[:] = [f for f in sys.meta_path if 'Editable' not in getattr(f, '__name__', '')]\n"
            f"sys.path.insert(0, {str(ROOT)!r})\n"
            "import tabfm.data.batch, tabfm.eval.metrics, tabfm.parallel.plan, tabfm.synth.config\n"
            "print(json.dumps({m: sys.modules[m].__file__ for m in "
            "['tabfm', 'tabfm.data.batch', 'tabfm.eval.metrics', 'tabfm.parallel.plan', 'tabfm.synth.config']}))")
    run = subprocess.run([sys.executable, "-c", code], cwd=user_project(tmp_path), capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    files = json.loads(run.stdout)
    assert files == {"tabfm": str(ROOT / "tabfm" / "__init__.py"), "tabfm.data.batch": str(ROOT / "data" / "batch.py"),
                     "tabfm.eval.metrics": str(ROOT / "eval" / "metrics.py"),
                     "tabfm.parallel.plan": str(ROOT / "parallel" / "plan.py"),
                     "tabfm.synth.config": str(ROOT / "synth" / "config.py")}


# ------------------------------------------------------------------ build and install (slow)
def run(cmd: list, env: dict[str, str] | None = None, **kw) -> str:
    """Run a command (no PYTHONPATH leaking the checkout in); its stdout; stderr in the failure."""
    env = {k: v for k, v in (os.environ if env is None else env).items() if k != "PYTHONPATH"}
    res = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env=env,
                         timeout=INSTALL_TIMEOUT_S, **kw)
    assert res.returncode == 0, f"{cmd} failed:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    return res.stdout


@pytest.fixture(scope="module")
def dists(tmp_path_factory) -> dict[str, Path]:
    """The sdist and, built from it, the wheel (`python -m build`) of a copy of the tracked files."""
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("dist")
    try:
        tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("needs a git checkout (the tracked files are what a build ships)")
    for name in filter(None, tracked.decode().split("\0")):
        if (ROOT / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            (src / name).write_bytes((ROOT / name).read_bytes())
    run([sys.executable, "-m", "build", "--outdir", out, src])
    (sdist,), (wheel,) = out.glob("*.tar.gz"), out.glob("*.whl")
    return {"sdist": sdist, "wheel": wheel}


@pytest.mark.slow
def test_wheel_and_sdist_ship_weights_and_kernel_sources(dists):
    wheel = set(zipfile.ZipFile(dists["wheel"]).namelist())
    assert set(SHIPPED) <= wheel and "tabfm/data/batch.py" in wheel and "tabfm/parallel/gemini/plugin.py" in wheel
    assert all(n.startswith(("tabfm/", "tabfm-")) for n in wheel), "the wheel installs only under tabfm/"
    with tarfile.open(dists["sdist"]) as tar:
        top = tar.getnames()[0].split("/")[0]
        sdist = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    assert set(SHIPPED) <= sdist and {"pyproject.toml", "data/batch.py", "parallel/gemini/plugin.py"} <= sdist, top


@pytest.mark.slow
def test_wheel_installs_and_predicts_beside_a_users_modules(dists, tmp_path):
    """A fresh venv (torch pinned to the CPU wheel, the rest from the registry), `pip check` clean;
    from a directory with its own data/, eval.py and parallel.py: one prediction and `tabfm --version`.

    For speed, one `pip install --no-compile` (run by this interpreter's pip into the venv, which
    gets none of its own) installs torch and the wheel: byte-compiling every file of torch, sympy,
    scipy, ... was most of this test's time. Python compiles what the venv's commands import as
    they import it (into a cache folder of this test, also where PYTHONDONTWRITEBYTECODE is set, so
    later commands reuse it), and every module of the installed tabfm must compile."""
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", venv])
    python, tabfm = venv / "bin" / "python", venv / "bin" / "tabfm"
    pip = [sys.executable, "-m", "pip", "--python", python]
    run([*pip, "install", "-q", "--no-compile", "torch==2.13.0", dists["wheel"]])
    run([*pip, "check"])
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPYCACHEPREFIX"] = str(tmp_path / "pycache")  # bytecode lands there, not in the venv or the checkout
    site = run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], env=env).strip()
    assert site.startswith(str(venv)), site
    run([python, "-m", "compileall", "-q", Path(site) / "tabfm"], env=env)  # exits non-zero on any error
    project = user_project(tmp_path / "project")
    code = ("import json, numpy as np, tabfm\n"
            "from tabfm import TabFMClassifier\n"
            "rng = np.random.default_rng(0)\n"
            "X = rng.normal(size=(60, 3)); y = (X[:, 0] + 0.5 * X[:, 1] > 0).astype(int)\n"
            "pred = TabFMClassifier(n_estimators=1).fit(X[:40], y[:40]).predict(X[40:])\n"
            "print(json.dumps({'file': tabfm.__file__, 'accuracy': float((pred == y[40:]).mean())}))")
    result = json.loads(run([python, "-c", code], env=env, cwd=project).strip().splitlines()[-1])
    assert result["file"].startswith(str(venv)) and result["accuracy"] >= 0.7
    assert run([tabfm, "--version"], env=env, cwd=project).strip() == f"tabfm {dists['wheel'].name.split('-')[1]}"
    # from the repository root ./tabfm shadows the installed one; its subpackages still resolve (beside it)
    where = run([python, "-c", "import tabfm.data.batch as b; print(b.__file__)"], env=env, cwd=ROOT).strip()
    assert where == str(ROOT / "data" / "batch.py")
