"""Test-session settings: tests use small tensors, where one intra-op thread is fastest and
immune to oversubscription on the 2-core CI machine; fixtures the estimator tests share."""
import pytest
import torch

torch.set_num_threads(1)


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
