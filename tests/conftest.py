"""Test-session settings: tests use small tensors, where one intra-op thread is fastest and
immune to oversubscription on the 2-core CI machine."""
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
