"""Table stores, readers and `tabfm synth --out`: round trips, footer-only listing, atomic writes,
corrupt files, CSV errors that name file and line, resumable and worker-independent corpora."""
from __future__ import annotations

import os
import struct

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest

from tabfm.data.readers import read_tables
from tabfm.data.store import (
    NoHeaderError,
    TableHeader,
    clean_temp_files,
    list_store,
    read_header,
    read_table,
    write_table,
)

N = 40


def typed_frame() -> pd.DataFrame:
    """40 rows, one column of every kind (and the dtypes that map to them)."""
    rng = np.random.default_rng(0)
    when = pd.date_range("2024-01-01", periods=N, freq="37h")
    return pd.DataFrame({
        "num": np.where(np.arange(N) % 7 == 0, np.nan, rng.normal(size=N)),
        "count": np.arange(N, dtype=np.int64),
        "maybe": pd.array([None if i % 5 == 0 else i for i in range(N)], dtype="Int64"),
        "color": pd.Categorical(rng.choice(["red", "green", "blue"], N)),
        "flag": rng.random(N) < 0.5,
        "nflag": pd.array([None if i % 4 == 0 else bool(i % 3) for i in range(N)], dtype="boolean"),
        "when": when,
        "when_tz": when.tz_localize("Europe/Paris"),
        "city": pd.Series(rng.choice(["oslo", "rome", None], N), dtype="str"),
        "note": pd.Series([f"free text number {i} here" for i in range(N)], dtype="str"),
        "y": rng.integers(0, 3, N),
    })


KINDS = ("numeric", "numeric", "numeric", "categorical", "boolean", "boolean", "datetime", "datetime",
         "categorical", "text", "numeric")


# ------------------------------------------------------------------ store: round trip and listing
def test_round_trip_keeps_dtypes_and_header(tmp_path):
    df = typed_frame()
    h = write_table(tmp_path, "mixed", df, target="y", task="classification", source="unit", seed=3)
    assert isinstance(h, TableHeader)
    assert (h.name, h.n_rows, h.n_cols, h.cost) == ("mixed", N, 11, N * 11)
    assert h.columns == tuple(df.columns) and h.kinds == KINDS
    assert (h.target, h.task, h.extra) == ("y", "classification", {"source": "unit", "seed": 3})
    assert h.path == tmp_path / "mixed.parquet" and h.kind("note") == "text"
    assert list_store(tmp_path) == [h]
    assert read_header(h.path) == h
    back = read_table(h)
    pd.testing.assert_frame_equal(back, df)  # every dtype, tz and missing value preserved
    pd.testing.assert_frame_equal(read_table(str(h.path)), df)


def test_list_store_sorted_and_ignores_temporaries(tmp_path):
    small = pd.DataFrame({"a": [1.0, 2.0], "b": ["x", "y"]})
    for name in ("b", "a-1", "a", "C.v2"):
        write_table(tmp_path, name, small)
    (tmp_path / ".a.123.deadbeef.tmp").write_bytes(b"PAR1 half a table")  # a killed write
    (tmp_path / "notes.txt").write_text("not a table")
    (tmp_path / "sub").mkdir()
    assert [h.name for h in list_store(tmp_path)] == ["C.v2", "a", "a-1", "b"]
    assert clean_temp_files(tmp_path) == [tmp_path / ".a.123.deadbeef.tmp"]
    assert not (tmp_path / ".a.123.deadbeef.tmp").exists()


def test_list_store_reads_footers_only(tmp_path, monkeypatch):
    df = pd.DataFrame({"a": np.arange(300.0), "b": [f"s{i % 7}" for i in range(300)]})
    h = write_table(tmp_path, "t", df, target="a", task="regression")

    def no_rows(*args, **kwargs):
        raise AssertionError("list_store read row data")

    for target in (pq, pq.ParquetFile):
        for attr in ("read_table", "read", "read_row_group", "read_row_groups", "iter_batches", "ParquetDataset"):
            if hasattr(target, attr):
                monkeypatch.setattr(target, attr, no_rows)
    monkeypatch.setattr(pd, "read_parquet", no_rows)
    assert list_store(tmp_path) == [h]
    monkeypatch.undo()

    # zero every data page, keep the footer: listing still works, reading the rows fails naming the file
    data = bytearray(h.path.read_bytes())
    footer = struct.unpack("<i", bytes(data[-8:-4]))[0]
    end = len(data) - 8 - footer
    data[4:end] = bytes(end - 4)
    h.path.write_bytes(bytes(data))
    assert list_store(tmp_path)[0].n_rows == 300
    with pytest.raises(ValueError, match=r"t\.parquet: cannot read the rows"):
        read_table(h)


def test_truncated_and_plain_parquet_errors_name_the_file(tmp_path):
    df = pd.DataFrame({"a": np.arange(50.0)})
    h = write_table(tmp_path, "cut", df)
    h.path.write_bytes(h.path.read_bytes()[:100])
    with pytest.raises(ValueError, match=r"cut\.parquet: not a readable Parquet file.*truncated or corrupt"):
        list_store(tmp_path)
    with pytest.raises(ValueError, match=r"cut\.parquet"):
        read_table(h.path)
    h.path.unlink()
    df.to_parquet(tmp_path / "plain.parquet")
    with pytest.raises(NoHeaderError, match=r"plain\.parquet: Parquet file without a tabfm header"):
        list_store(tmp_path)
    (tmp_path / "plain.parquet").rename(tmp_path / "renamed.parquet")
    write_table(tmp_path, "x", df)
    (tmp_path / "renamed.parquet").unlink()
    (tmp_path / "x.parquet").rename(tmp_path / "y.parquet")
    with pytest.raises(ValueError, match=r"y\.parquet: header names the table 'x'"):
        list_store(tmp_path)
    with pytest.raises(ValueError, match="not a directory"):
        list_store(tmp_path / "nope")


def test_write_is_atomic(tmp_path, monkeypatch):
    old = pd.DataFrame({"a": [1.0, 2.0]})
    write_table(tmp_path, "t", old)
    real = pq.write_table

    def dies_half_way(table, where, **kwargs):
        where.write(b"PAR1 partial bytes of a table")
        raise OSError("disk full")

    monkeypatch.setattr(pq, "write_table", dies_half_way)
    with pytest.raises(OSError, match="disk full"):
        write_table(tmp_path, "t", pd.DataFrame({"a": [9.0, 9.0, 9.0]}))
    with pytest.raises(OSError, match="disk full"):
        write_table(tmp_path, "new", pd.DataFrame({"a": [1.0]}))
    monkeypatch.setattr(pq, "write_table", real)
    assert sorted(os.listdir(tmp_path)) == ["t.parquet"]  # no partial file, no temporary left
    assert [h.name for h in list_store(tmp_path)] == ["t"]
    pd.testing.assert_frame_equal(read_table(tmp_path / "t.parquet"), old)  # the old table survived


def test_write_table_rejects_bad_input(tmp_path):
    df = pd.DataFrame({"a": [1.0, 2.0], "b": ["x", "y"]})
    for bad in ("../up", "a/b", "", ".hidden", "t.parquet", "sp ace", "x" * 201):
        with pytest.raises(ValueError, match="safe file name|must not end"):
            write_table(tmp_path, bad, df)
    with pytest.raises(ValueError, match=r"table 't': target column 'z' is not in the table; columns are: a, b"):
        write_table(tmp_path, "t", df, target="z")
    with pytest.raises(ValueError, match=r"task 'clustering' is not one of"):
        write_table(tmp_path, "t", df, target="a", task="clustering")
    with pytest.raises(ValueError, match=r"task 'classification' needs a target"):
        write_table(tmp_path, "t", df, task="classification")
    with pytest.raises(ValueError, match=r"regression target 'b' is categorical"):
        write_table(tmp_path, "t", df, target="b", task="regression")
    with pytest.raises(ValueError, match=r"table 't' is empty: it has no rows \(columns: a, b\)"):
        write_table(tmp_path, "t", df.iloc[:0])
    with pytest.raises(ValueError, match="duplicate column names"):
        write_table(tmp_path, "t", pd.DataFrame([[1, 2]], columns=["a", "a"]))
    with pytest.raises(ValueError, match="JSON-serialisable"):
        write_table(tmp_path, "t", df, when=object())
    assert os.listdir(tmp_path) == []


def test_read_table_notices_a_replaced_table(tmp_path):
    h = write_table(tmp_path, "t", pd.DataFrame({"a": [1.0, 2.0]}))
    write_table(tmp_path, "t", pd.DataFrame({"a": [1.0, 2.0, 3.0]}))
    with pytest.raises(ValueError, match=r"t\.parquet: the table changed since it was listed \(n_rows differ\)"):
        read_table(h)


# ------------------------------------------------------------------ readers
def test_read_tables_from_files_dirs_and_frames(tmp_path):
    (tmp_path / "a.csv").write_text("x,when,label\n1.5,2024-01-02,u\n2.5,2024-03-04,v\n")
    pd.DataFrame({"x": [1, 2, 3], "z": ["p", "q", "r"]}).to_parquet(tmp_path / "b.parquet")
    write_table(tmp_path, "c", typed_frame(), target="y", task="classification")
    (tmp_path / ".c.1.abc.tmp").write_bytes(b"junk")
    (tmp_path / "readme.md").write_text("ignored")

    tables = read_tables(tmp_path)
    assert [t.name for t in tables] == ["a", "b", "c"]
    a, b, c = tables
    assert a.frame["when"].dtype.kind == "M" and a.frame["x"].tolist() == [1.5, 2.5]
    assert (a.target, a.task, a.source) == (None, None, str(tmp_path / "a.csv"))
    assert b.frame.shape == (3, 2) and (b.target, b.task) == (None, None)
    assert (c.target, c.task) == ("y", "classification")  # from the store header
    pd.testing.assert_frame_equal(c.frame, typed_frame())

    [one] = read_tables(tmp_path / "a.csv", target="label", task="classification")
    assert (one.name, one.target, one.task) == ("a", "label", "classification")
    [c2] = read_tables(tmp_path / "c.parquet", target="num")  # another target: the header's task no longer applies
    assert (c2.target, c2.task) == ("num", None)

    df = pd.DataFrame({"u": [1.0, 2.0]})
    assert [t.name for t in read_tables([df, df.copy()])] == ["frame0", "frame1"]
    assert [t.name for t in read_tables({"left": df, "right": np.ones((3, 2))})] == ["left", "right"]
    assert read_tables({"right": np.ones((3, 2))})[0].frame.columns.tolist() == ["x0", "x1"]
    with pytest.raises(ValueError, match=r"two tables are named 'a'"):
        read_tables([tmp_path / "a.csv", tmp_path / "a.csv"])


def test_csv_ragged_row_names_file_and_line(tmp_path):
    p = tmp_path / "rag.csv"
    p.write_text('a,b,c\n1,"two\nlines",3\n\n4,5,6\n7,8,9,10\n')  # the bad record starts on physical line 6
    with pytest.raises(ValueError, match=r"rag\.csv line 6: expected 3 fields, saw 4"):
        read_tables(p)
    p.write_text('a,b\n1,2\n3,"open quote\n5,6\n')
    with pytest.raises(ValueError, match=r"rag\.csv line 3: a quoted field opened here is never closed"):
        read_tables(p)


def test_csv_bad_encoding_names_file_offset_and_line(tmp_path):
    p = tmp_path / "latin.csv"
    body = b"name,price\n" + b"tea,1\n" * 3 + b"caf\xe9,2\n"
    p.write_bytes(body)
    offset = body.index(b"\xe9")
    with pytest.raises(ValueError, match=rf"latin\.csv line 5: byte 0xe9 at offset {offset} .*encoding="):
        read_tables(p)
    [t] = read_tables(p, encoding="latin-1")
    assert t.frame["name"].iloc[-1] == "café"


def test_reader_errors_for_empty_tables_targets_and_dialects(tmp_path):
    (tmp_path / "only_header.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match=r"only_header\.csv: empty table, it has no rows \(columns: a, b\)"):
        read_tables(tmp_path / "only_header.csv")
    (tmp_path / "nothing.csv").write_text("")
    with pytest.raises(ValueError, match=r"nothing\.csv: empty file"):
        read_tables(tmp_path / "nothing.csv")
    with pytest.raises(ValueError, match="DataFrame frame0>: empty table, it has no rows"):
        read_tables(pd.DataFrame({"a": []}))
    (tmp_path / "ok.csv").write_text("age,income,y\n1,2,3\n")
    with pytest.raises(ValueError, match=r"ok\.csv: no target column 'label'; the columns are: age, income, y"):
        read_tables(tmp_path / "ok.csv", target="label")
    (tmp_path / "dup.csv").write_text("a,a,b\n1,2,3\n")
    with pytest.raises(ValueError, match=r"dup\.csv line 1: duplicate column name 'a'"):
        read_tables(tmp_path / "dup.csv")
    (tmp_path / "semi.csv").write_text("a;b;c\n1;2;3\n")
    with pytest.raises(ValueError, match=r"semi\.csv: .*pass sep=';'"):
        read_tables(tmp_path / "semi.csv")
    assert read_tables(tmp_path / "semi.csv", sep=";")[0].frame.shape == (1, 3)
    (tmp_path / "t.xlsx").write_text("")
    with pytest.raises(ValueError, match=r"t\.xlsx: unsupported file type"):
        read_tables(tmp_path / "t.xlsx")
    with pytest.raises(ValueError, match="no such file"):
        read_tables(tmp_path / "missing.csv")
    empty = tmp_path / "empty_dir"
    empty.mkdir()
    with pytest.raises(ValueError, match="no tables found"):
        read_tables(empty)


# ------------------------------------------------------------------ tabfm synth --out
def _files(d) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def test_synth_out_writes_resumes_and_ignores_worker_count(tmp_path, capsys):
    from tabfm.synth.stream import StreamConfig, SynthStream
    from tabfm.cli import main
    from tabfm.commands.synth import corpus_table

    flags = ["synth", "--preset", "tiny", "--tables", "6", "--seed", "5", "--no-progress"]
    one, two = tmp_path / "one", tmp_path / "two"
    assert main([*flags, "--out", str(one)]) == 0
    text = capsys.readouterr().out
    for word in ("tables", "rows", "cells", "bytes", "seconds", "tables/s", "written"):
        assert word in text
    headers = list_store(one)
    assert [h.name for h in headers] == [f"synth-{i:08d}" for i in range(6)]
    for i, h in enumerate(headers):
        assert h.extra["seed"] == 5 and h.extra["index"] == i and h.extra["source"] == "tabfm synth"
        assert h.task in ("classification", "regression", "imputation")
        assert h.target == (None if h.task == "imputation" else "target")
    # table i is table 0 of stream position i, as raw frames
    cfg = StreamConfig.preset("tiny")
    pd.testing.assert_frame_equal(corpus_table(cfg, 5, 2)[0], SynthStream(cfg, seed=5).frames_at(2)[0][0])
    first = _files(one)
    mtimes = {p.name: p.stat().st_mtime_ns for p in one.iterdir()}

    # resume: delete one table, leave a killed run's temporary; only that table is written again
    (one / "synth-00000003.parquet").unlink()
    (one / ".synth-00000004.999.feedbeef.tmp").write_bytes(b"PAR1 partial")
    assert main([*flags, "--out", str(one)]) == 0
    assert "written           1" in capsys.readouterr().out
    assert _files(one) == first
    assert {p.name: p.stat().st_mtime_ns for p in one.iterdir() if p.name != "synth-00000003.parquet"} == \
        {k: v for k, v in mtimes.items() if k != "synth-00000003.parquet"}

    # two workers write the same bytes
    assert main([*flags, "--out", str(two), "--workers", "2"]) == 0
    assert _files(two) == first


def test_synth_out_errors(tmp_path, capsys):
    from tabfm.cli import main

    out = tmp_path / "corpus"
    assert main(["synth", "--tables", "2", "--no-progress"]) == 2
    assert "--out DIR and --tables N go together" in capsys.readouterr().err
    assert main(["synth", "--out", str(out), "--tables", "2", "--batches", "3", "--no-progress"]) == 2
    assert main(["synth", "--out", str(out), "--tables", "0", "--no-progress"]) == 2
    assert main(["synth", "--preset", "tiny", "--out", str(out), "--tables", "1", "--no-progress"]) == 0
    capsys.readouterr()
    assert main(["synth", "--preset", "tiny", "--out", str(out), "--tables", "1", "--seed", "1", "--no-progress"]) == 2
    assert "belongs to another corpus" in capsys.readouterr().err
