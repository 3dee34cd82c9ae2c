"""benchmarks/finetune_family.py: how a family of tables and its new tables are cut from one table."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest


@pytest.fixture(scope="module")
def ff(load_benchmark):
    return load_benchmark("finetune_family")


def frame(n: int = 60) -> pd.DataFrame:
    rng = np.random.default_rng(0)
    return pd.DataFrame({"month": np.repeat(np.arange(1, 7), n // 6).astype(float), "x": rng.normal(size=n),
                         "y": rng.normal(size=n)})


def test_groups_by_value_hold_out_every_nth_from_the_last(ff):
    fam, new = ff.family(frame(), "month", None, 3, seed=0)
    assert list(new) == ["month=3", "month=6"]  # the last, then every 3rd before it
    assert list(fam) == ["month=1", "month=2", "month=4", "month=5"]
    for name, t in {**fam, **new}.items():
        assert set(t["month"]) == {float(name.split("=")[1])} and len(t) == 10  # the column stays a feature


def test_shards_are_disjoint_and_cover_the_table(ff):
    f = frame()
    fam, new = ff.family(f, None, 4, 2, seed=0)
    assert list(new) == ["shard1", "shard3"] and list(fam) == ["shard0", "shard2"]
    rows = pd.concat([*fam.values(), *new.values()])
    assert len(rows) == len(f) and sorted(rows["x"]) == sorted(f["x"])  # every row once
    again, _ = ff.family(f, None, 4, 2, seed=0)
    assert all(again[n].equals(fam[n]) for n in fam)  # seeded


def test_unknown_group_column_is_named(ff):
    with pytest.raises(SystemExit, match="'store'"):
        ff.family(frame(), "store", None, 3, seed=0)
