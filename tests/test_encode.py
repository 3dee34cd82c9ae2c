"""Real-table encoding: type inference, codes, inf/NaN, unseen values, JSON, overrides, inverse, bad input."""
from __future__ import annotations

import json
import math
import warnings
import zlib

import numpy as np
import pandas as pd
import pytest
import torch

from tabfm.data.batch import CATEGORICAL, NUMERIC, TableBatch
from tabfm.data.encode import EncodedTable, TableSchema, encode_frame
from tabfm.data.schema import MAX_CATEGORIES, MAX_COLUMNS, MAX_ROWS, ColumnSpec, EncodeConfig

NAN = float("nan")


def mixed_frame() -> pd.DataFrame:
    """Six rows with every column type, missing values everywhere it makes sense."""
    return pd.DataFrame({
        "num": [1.5, NAN, np.inf, -np.inf, 4.0, -2.0],
        "flag": [True, False, True, True, False, False],
        "color": ["red", "blue", None, "red", "green", "blue"],
        "size": pd.Categorical(["S", "M", None, "S", "M", "S"], categories=["S", "M", "L"]),
        "when": pd.to_datetime(["2024-01-01 10:00", None, "2024-03-02 00:00", "2024-01-01 00:00",
                                "1970-01-02 06:00", "2024-01-03 00:00"]),
        "note": ["hello world", "Hello   World", None, "red fox jumps", "", "a b"],
        "const": ["k"] * 6,
        "empty": [None] * 6,
        "count": [3, 1, 2, 3, 1, 2],
    })


def col(enc: EncodedTable, name: str) -> list[float]:
    return enc.x[:, enc.columns.index(name)].tolist()


def same(a: list[float], b: list[float]) -> bool:
    """Equal lists where NaN equals NaN."""
    return len(a) == len(b) and all((math.isnan(u) and math.isnan(v)) or u == v for u, v in zip(a, b))


@pytest.fixture(scope="module")
def fitted() -> tuple[EncodedTable, TableSchema]:
    return encode_frame(mixed_frame(), overrides={"note": "text"})


# ------------------------------------------------------------------ layout and codes
def test_every_column_type_layout(fitted):
    enc, schema = fitted
    assert [c.type for c in schema.columns] == [
        "numeric", "boolean", "categorical", "categorical", "datetime", "text", "constant", "constant", "numeric"]
    assert enc.columns == [
        "num", "num.inf", "flag", "color", "size",
        "when.epoch", "when.year", "when.month", "when.day", "when.dayofweek", "when.hour",
        "note.hash", "note.len", "note.words", "const", "empty", "count"]
    N, C = NUMERIC, CATEGORICAL
    assert enc.kind.tolist() == [N, C, C, C, C, N, N, N, N, N, N, C, N, N, C, N, N]
    assert enc.cardinality.tolist() == [0, 3, 2, 3, 3, 0, 0, 0, 0, 0, 0, 64, 0, 0, 1, 0, 0]
    assert enc.x.dtype == torch.float32 and enc.kind.dtype == torch.int8 and enc.cardinality.dtype == torch.int64
    assert enc.shape == (6, 17)
    assert schema.encoded_indices("when") == [5, 6, 7, 8, 9, 10]
    assert [e.source for e in schema.encoded_columns][11:14] == ["note"] * 3


def test_categorical_codes_sorted_and_missing(fitted):
    enc, schema = fitted
    assert schema["color"].categories == ["blue", "green", "red"]
    assert same(col(enc, "color"), [2, 0, NAN, 2, 1, 0])
    assert col(enc, "flag") == [1, 0, 1, 1, 0, 0]
    # category dtype: declared domain (L unobserved) sorted, not pandas' own code order
    assert schema["size"].categories == ["L", "M", "S"]
    assert same(col(enc, "size"), [2, 1, NAN, 2, 1, 2])


def test_inf_kept_distinct_from_nan_and_values(fitted):
    enc, schema = fitted
    spec = schema["num"]
    assert spec.has_inf and (spec.lo, spec.hi) == (-2.0, 4.0)
    # value column: +inf -> fitted max, -inf -> fitted min; NaN stays missing
    assert same(col(enc, "num"), [1.5, NAN, 4.0, -2.0, 4.0, -2.0])
    # the flag tells +inf (1) from the real max (0) and -inf (2) from the real min; missing stays NaN
    assert same(col(enc, "num.inf"), [0, NAN, 1, 2, 0, 0])
    assert torch.isfinite(enc.x[~torch.isnan(enc.x)]).all()


def test_inf_unseen_at_fit_is_clipped_with_warning():
    schema = TableSchema.fit(pd.DataFrame({"a": [0.0, 1.0, 5.0]}))
    assert schema.encoded_names == ["a"]
    with pytest.warns(UserWarning, match=r"'a'.*inf"):
        enc = schema.transform(pd.DataFrame({"a": [np.inf, -np.inf, NAN]}))
    assert same(col(enc, "a"), [5.0, 0.0, NAN])


def test_datetime_parts_by_hand(fitted):
    enc, _ = fitted
    row0 = [col(enc, f"when.{p}")[0] for p in ("epoch", "year", "month", "day", "dayofweek", "hour")]
    assert row0 == pytest.approx([19723 + 10 / 24, 2024, 1, 1, 0, 10], abs=1e-3)  # Monday 2024-01-01 10:00
    row2 = [col(enc, f"when.{p}")[2] for p in ("epoch", "year", "month", "day", "dayofweek", "hour")]
    assert row2 == [19784, 2024, 3, 2, 5, 0]  # Saturday
    assert col(enc, "when.epoch")[4] == pytest.approx(1.25)
    assert all(math.isnan(col(enc, f"when.{p}")[1]) for p in ("epoch", "year", "hour"))  # NaT


def test_date_only_column_has_no_hour_and_decodes_exactly():
    dates = pd.to_datetime(["2001-05-06", "2030-12-31", None])
    enc, schema = encode_frame(pd.DataFrame({"d": dates}))
    assert enc.columns == ["d.epoch", "d.year", "d.month", "d.day", "d.dayofweek"]
    back = schema.inverse_transform(enc.x)["d"]
    assert back.iloc[:2].tolist() == dates[:2].tolist() and pd.isna(back.iloc[2])


def test_timezone_aware_parts_in_fitted_zone():
    when = pd.Series(pd.to_datetime(["2024-06-01 23:30", "2024-06-02 08:00"])).dt.tz_localize("Europe/Paris")
    enc, schema = encode_frame(pd.DataFrame({"w": when}))
    assert schema["w"].tz == "Europe/Paris"
    assert col(enc, "w.day") == [1, 2] and col(enc, "w.hour") == [23, 8]
    assert col(enc, "w.epoch")[0] == pytest.approx(19875 + 21.5 / 24, abs=1e-3)  # 21:30 UTC
    # the same instants given in UTC encode identically
    same_enc = schema.transform(pd.DataFrame({"w": when.dt.tz_convert("UTC")}))
    assert torch.equal(same_enc.x, enc.x)
    back = schema.inverse_transform(enc.x)["w"]
    assert (back - when).abs().max() < pd.Timedelta(minutes=3)
    with pytest.raises(ValueError, match="'w'"):
        schema.transform(pd.DataFrame({"w": when.dt.tz_localize(None)}))


def test_text_hash_len_words(fitted):
    enc, schema = fitted
    # crc32("hello world") = 222957957 -> bucket 5; case and whitespace are normalised away
    assert zlib.crc32(b"hello world") % 64 == 5
    assert same(col(enc, "note.hash"), [5, 5, NAN, 61, zlib.crc32(b"") % 64, zlib.crc32(b"a b") % 64])
    assert same(col(enc, "note.len"), [11, 13, NAN, 13, 0, 3])
    assert same(col(enc, "note.words"), [2, 2, NAN, 3, 0, 2])


def test_strings_with_many_uniques_are_text():
    many = [f"customer {i} from town {i % 7}" for i in range(40)]
    few = [f"town {i % 7}" for i in range(40)]
    _, schema = encode_frame(pd.DataFrame({"many": many, "few": few}))
    assert schema["many"].type == "text" and schema["few"].type == "categorical"
    # more distinct strings than max_categories -> text, even with a low unique ratio
    cfg = EncodeConfig(max_categories=5)
    _, schema = encode_frame(pd.DataFrame({"few": few * 3}), config=cfg)
    assert schema["few"].type == "text"


def test_constant_and_all_missing_flagged(fitted):
    enc, schema = fitted
    const, empty = schema["const"], schema["empty"]
    assert const.constant and not const.all_missing and const.categories == ["k"]
    assert empty.constant and empty.all_missing
    assert col(enc, "const") == [0] * 6
    assert all(math.isnan(v) for v in col(enc, "empty"))
    frame = mixed_frame().iloc[:2].copy()
    frame["const"] = ["k", "other"]
    frame["empty"] = [None, "surprise"]
    with pytest.warns(UserWarning) as record:
        enc2 = schema.transform(frame)
    messages = " ".join(str(w.message) for w in record)
    assert "'const'" in messages and "'other'" in messages and "'empty'" in messages
    assert same(col(enc2, "const"), [0, NAN]) and same(col(enc2, "empty"), [NAN, NAN])
    # booleans keep their type even when constant (their domain is known)
    _, s2 = encode_frame(pd.DataFrame({"b": [True, True], "x": [1.0, 1.0]}))
    assert (s2["b"].type, s2["b"].constant, s2["x"].type) == ("boolean", True, "constant")


def test_integers_stay_numeric_unless_asked(fitted):
    enc, schema = fitted
    assert schema["count"].type == "numeric" and col(enc, "count") == [3, 1, 2, 3, 1, 2]
    frame = pd.DataFrame({"count": [3, 1, 2, 3, 1, 2], "big": [0, 5, 9, 10, 11, 12]})
    _, s2 = encode_frame(frame, config=EncodeConfig(categorical_max_int=10))
    assert s2["count"].type == "categorical" and s2["count"].categories == [1, 2, 3]
    assert s2["big"].type == "numeric"  # 11 > 10


# ------------------------------------------------------------------ unseen categories
def test_unseen_categories_become_missing_with_one_warning(fitted):
    _, schema = fitted
    frame = mixed_frame()
    frame["color"] = ["purple", "red", "purple", "teal", None, "blue"]
    with pytest.warns(UserWarning, match=r"'color'.*3 value.*purple") as record:
        enc = schema.transform(frame)
    assert sum("'color'" in str(w.message) for w in record) == 1
    assert same(col(enc, "color"), [NAN, 2, NAN, NAN, NAN, 0])
    frame = mixed_frame()
    frame["size"] = pd.Categorical(["XL", "L", None, "S", "M", "S"])
    with pytest.warns(UserWarning, match="'size'"):
        enc = schema.transform(frame)
    assert same(col(enc, "size"), [NAN, 0, NAN, 2, 1, 2])


def test_no_warning_when_nothing_is_unseen(fitted):
    _, schema = fitted
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        schema.transform(mixed_frame())


# ------------------------------------------------------------------ JSON
def test_json_round_trip_gives_identical_transform(fitted, tmp_path):
    enc, schema = fitted
    text = schema.to_json(tmp_path / "schema.json")
    assert json.loads(text)["columns"][2]["categories"] == ["blue", "green", "red"]
    for loaded in (TableSchema.from_json(text), TableSchema.from_json(tmp_path / "schema.json"),
                   TableSchema.from_json(str(tmp_path / "schema.json"))):
        assert loaded == schema
        again = loaded.transform(mixed_frame())
        torch.testing.assert_close(again.x, enc.x, rtol=0, atol=0, equal_nan=True)
        assert again.columns == enc.columns and torch.equal(again.kind, enc.kind)
    with pytest.raises(ValueError, match="format"):
        TableSchema.from_json('{"format": "other", "version": 1}')


def test_json_keeps_numeric_categories_and_config():
    frame = pd.DataFrame({"code": [10, 20, 10, 30], "rate": [0.5, 1.5, 0.5, 0.5]})
    enc, schema = encode_frame(frame, overrides={"code": "categorical", "rate": "categorical"},
                               config=EncodeConfig(max_categories=7))
    loaded = TableSchema.from_json(schema.to_json())
    assert loaded["code"].categories == [10, 20, 30] and loaded["rate"].categories == [0.5, 1.5]
    assert loaded.config.max_categories == 7
    assert torch.equal(loaded.transform(frame).x, enc.x)
    assert col(enc, "code") == [0, 1, 0, 2]


# ------------------------------------------------------------------ overrides
def test_overrides():
    frame = pd.DataFrame({
        "zip": [101, 205, 101, 999],
        "amount": ["1.5", "2", None, "-inf"],
        "day": ["2024-01-02", "2024-01-03", None, "2024-01-05"],
        "mixed": [1, "a", 2.5, None],
        "label": ["x", "y", "x", "y"],
        "yes": [0, 1, 1, 0],
    })
    overrides = {"zip": "categorical", "amount": "numeric", "day": "datetime", "mixed": "text", "label": "text",
                 "yes": "boolean"}
    enc, schema = encode_frame(frame, overrides=overrides)
    assert [c.type for c in schema.columns] == ["categorical", "numeric", "datetime", "text", "text", "boolean"]
    assert all(c.overridden for c in schema.columns)
    assert col(enc, "zip") == [0, 1, 0, 2]
    assert same(col(enc, "amount"), [1.5, 2.0, NAN, 1.5]) and same(col(enc, "amount.inf"), [0, 0, NAN, 2])
    assert same(col(enc, "day.epoch"), [19724, 19725, NAN, 19727])
    assert same(col(enc, "mixed.len"), [1, 1, 3, NAN])
    assert col(enc, "yes") == [0, 1, 1, 0]


@pytest.mark.parametrize("overrides, match", [
    ({"nope": "numeric"}, "'nope'"),
    ({"s": "float"}, r"'s'.*'float'"),
    ({"s": "constant"}, r"'s'.*'constant'"),
    ({"s": "numeric"}, r"'s'.*'abc'"),
    ({"s": "boolean"}, r"'s'.*'abc'"),
    ({"n": "boolean"}, r"'n'.*2\.0"),
    ({"n": "datetime"}, "'n'"),
    ({"s": "datetime"}, r"'s'.*'abc'"),
])
def test_bad_overrides_raise_naming_the_column(overrides, match):
    frame = pd.DataFrame({"s": ["abc", "de"], "n": [1, 2]})
    with pytest.raises(ValueError, match=match):
        encode_frame(frame, overrides=overrides)


# ------------------------------------------------------------------ inverse
def test_inverse_transform(fitted):
    enc, schema = fitted
    back = schema.inverse_transform(enc.x)
    frame = mixed_frame()
    assert list(back.columns) == list(frame.columns)
    assert back["num"].tolist()[2:] == [np.inf, -np.inf, 4.0, -2.0] and back["num"].iloc[0] == 1.5
    assert pd.isna(back["num"].iloc[1])
    assert back["flag"].tolist() == frame["flag"].tolist() and back["flag"].dtype == bool
    assert back["color"].iloc[[0, 1, 3, 4, 5]].tolist() == ["red", "blue", "red", "green", "blue"]
    assert pd.isna(back["color"].iloc[2])
    assert isinstance(back["size"].dtype, pd.CategoricalDtype) and back["size"].tolist()[:2] == ["S", "M"]
    assert back["const"].tolist() == ["k"] * 6 and back["empty"].isna().all() and back["note"].isna().all()
    assert back["count"].tolist() == [3, 1, 2, 3, 1, 2]
    assert (back["when"] - frame["when"]).abs().max() < pd.Timedelta(minutes=3)


def test_inverse_transform_of_predicted_codes(fitted):
    _, schema = fitted
    x = schema.transform(mixed_frame()).x.clone()
    j = schema.encoded_indices("color")[0]
    x[:, j] = torch.tensor([0.0, 1.0, 2.0, NAN, 0.0, 1.0])
    assert schema.inverse_transform(x)["color"].tolist()[:3] == ["blue", "green", "red"]
    x[0, j] = 3.0
    with pytest.raises(ValueError, match=r"'color'.*3\.0"):
        schema.inverse_transform(x)
    x[0, j] = 0.5
    with pytest.raises(ValueError, match="'color'"):
        schema.inverse_transform(x)
    with pytest.raises(ValueError, match="17"):
        schema.inverse_transform(x[:, :5])


# ------------------------------------------------------------------ numpy input and TableBatch
def test_numpy_input_and_batch():
    arr = np.array([[1.0, NAN], [2.0, 3.0], [np.inf, 4.0]])
    enc, schema = encode_frame(arr)
    assert schema.names == ["x0", "x1"] and enc.columns == ["x0", "x0.inf", "x1"]
    again, _ = encode_frame(arr[:2], schema=schema)
    torch.testing.assert_close(again.x, enc.x[:2], rtol=0, atol=0, equal_nan=True)
    obj = np.array([["a", 1.0], ["b", 2.0], ["a", NAN]], dtype=object)
    enc2, schema2 = encode_frame(obj)
    assert [c.type for c in schema2.columns] == ["categorical", "numeric"] and col(enc2, "x0") == [0, 1, 0]
    query = torch.zeros(3, 3, dtype=torch.bool)
    query[2, 2] = True
    batch = enc.to_batch(query=query)
    assert isinstance(batch, TableBatch) and batch.shape == (1, 3, 3)
    assert batch.cardinality[0].tolist() == [0, 3, 0]
    with pytest.raises(ValueError, match="2-D"):
        encode_frame(np.zeros(3))
    with pytest.raises(ValueError, match="overrides"):
        encode_frame(arr, overrides={"x0": "numeric"}, schema=schema)


def test_transform_matches_columns_by_name(fitted):
    enc, schema = fitted
    frame = mixed_frame()
    reordered = schema.transform(frame[list(reversed(frame.columns))])
    torch.testing.assert_close(reordered.x, enc.x, rtol=0, atol=0, equal_nan=True)
    with pytest.raises(ValueError, match="'color'"):
        schema.transform(frame.drop(columns="color"))
    partial = schema.transform(frame.drop(columns=["color", "when"]), allow_missing_columns=True)
    assert torch.isnan(partial.x[:, schema.encoded_indices("when") + schema.encoded_indices("color")]).all()
    with pytest.raises(ValueError, match="'extra'"):
        schema.transform(frame.assign(extra=1))


# ------------------------------------------------------------------ bad input
def test_limits_are_documented_constants():
    cfg = EncodeConfig()
    assert (cfg.max_rows, cfg.max_columns, cfg.max_categories) == (MAX_ROWS, MAX_COLUMNS, MAX_CATEGORIES)
    assert (MAX_ROWS, MAX_COLUMNS, MAX_CATEGORIES) == (1_000_000, 1_000, 1_000)


@pytest.mark.parametrize("frame, match", [
    (pd.DataFrame(), "no columns"),
    (pd.DataFrame({"a": pd.Series([], dtype=float)}), "no rows"),
    (pd.DataFrame([[1, 2]], columns=["a", "a"]), r"duplicate.*'a'"),
    (pd.DataFrame({0: [1.0], "b": [2.0]}), r"0 \(int\)"),
    (pd.DataFrame({"": [1.0]}), "non-empty strings"),
    (pd.DataFrame({"ok": [1, 2], "mix": [1, "a"]}), r"'mix'.*int.*str"),
    (pd.DataFrame({"ok": [1, 2], "lists": [[1], [2]]}), r"'lists'.*list"),
    (pd.DataFrame({"cx": [1 + 2j]}), "'cx'"),
    (pd.DataFrame({"huge": [1e300, 1.0]}), r"'huge'.*1e\+300"),
    (pd.DataFrame({"cat": pd.Categorical(["a"], categories=[f"c{i}" for i in range(1001)] + ["a"])}),
     r"'cat'.*1002.*max_categories=1000"),
    (pd.DataFrame({"when": pd.to_datetime(["2024-01-01"]), "when.year": [1.0]}), r"'when\.year'"),
])
def test_bad_frames_raise_value_error(frame, match):
    with pytest.raises(ValueError, match=match):
        encode_frame(frame)


def test_limits_raise_naming_column_and_limit():
    frame = pd.DataFrame({"a": [1.0, 2.0, 3.0], "b": ["x", "y", "z"], "c": [1, 2, 3]})
    with pytest.raises(ValueError, match=r"3 rows.*max_rows=2"):
        encode_frame(frame, config=EncodeConfig(max_rows=2))
    with pytest.raises(ValueError, match=r"3 columns.*max_columns=2.*'c'"):
        encode_frame(frame, config=EncodeConfig(max_columns=2))
    with pytest.raises(ValueError, match=r"'b'.*3 categories.*max_categories=2"):
        encode_frame(frame, overrides={"b": "categorical"}, config=EncodeConfig(max_categories=2))
    _, schema = encode_frame(frame, config=EncodeConfig(max_rows=3))
    with pytest.raises(ValueError, match="max_rows=3"):
        schema.transform(pd.concat([frame, frame]))


def test_transform_rejects_bad_values_naming_the_column(fitted):
    _, schema = fitted
    frame = mixed_frame()
    with pytest.raises(ValueError, match=r"'num'.*'lots'"):
        schema.transform(frame.assign(num=["lots"] * 6))
    with pytest.raises(ValueError, match=r"'color'.*int.*str"):
        schema.transform(frame.assign(color=[1, "a", "b", "c", "d", "e"]))
    with pytest.raises(ValueError, match="'flag'"):
        schema.transform(frame.assign(flag=["yes"] * 6))


def test_column_spec_rejects_unknown_type():
    with pytest.raises(ValueError, match=r"'a'.*'blob'"):
        ColumnSpec("a", "blob")
