"""Test-session settings: tests use small tensors, where one intra-op thread is fastest and
immune to oversubscription on the 2-core CI machine; fixtures the estimator tests share."""
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

torch.set_num_threads(1)
BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def pytest_collection_modifyitems(config, items):
    """Files with the most slow (multi-process) tests first, each file's order kept: under
    `-n 2 --dist loadfile` the long files start early instead of ending the run on one worker."""
    slow: dict[str, int] = {}
    for item in items:
        slow[item.fspath.strpath] = slow.get(item.fspath.strpath, 0) + (item.get_closest_marker("slow") is not None)
    first_seen = {}
    for i, item in enumerate(items):
        first_seen.setdefault(item.fspath.strpath, i)
    items.sort(key=lambda item: (-slow[item.fspath.strpath], first_seen[item.fspath.strpath]))


def _load_benchmark(name: str) -> ModuleType:
    """benchmarks/NAME.py as the module `bench_NAME` (benchmarks/ on sys.path for their `common` import)."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def load_benchmark():
    """A loader of the scripts under benchmarks/ (they are not a package): load_benchmark("loader")."""
    return _load_benchmark


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module, whatever an earlier module set (use with usefixtures)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory) -> str:
    """A random-weight tiny model in the export format the estimators load (head of K=10 codes)."""
    from tabfm.model import ModelConfig, TabFM
    from tabfm.parallel import export_model
    from tabfm.train.pretrain import EXPORT_FORMAT

    torch.manual_seed(0)
    cfg = ModelConfig.preset("tiny", n_layers=1, d_model=32, n_heads=2, n_bins=16, id_dim=8)
    out = tmp_path_factory.mktemp("weights") / "export"
    export_model(TabFM(cfg), out, {"format": EXPORT_FORMAT, "version": 1, "model": cfg.to_dict()})
    return str(out)
