"""The model as an ONNX graph: `export_onnx` writes one, `OnnxModel` runs one in onnxruntime.

The graph is `TabFM.forward` in eval mode, fp32, with the table count, rows, columns, key rows and
query cells all dynamic (one file serves every table shape; TabPFN's export fixes the feature
count). `OnnxModel(path)(batch, id_seed)` returns the `ModelOutput` of `model(batch, id_seed)`,
equal within `ATOL` + `RTOL` * |torch| (the tests check it on tables of several shapes, with
categorical columns, padding and missing cells; `export_onnx` checks every file it writes).

Where the torch forward has a data-dependent shape, or an operation ONNX (opset 20, which every
onnxruntime >= 1.17 runs) lacks, the graph (`ExportableTabFM`) computes the same numbers another way:
- the query cells (`batch.query.nonzero()`) are an input, `index` (N, 3);
- the keys-first row order and the number of key rows (`transformer._keys_first`, `n_keys`) come
  in with the inputs (`graph_inputs` reorders in numpy; `keys` (B, n_keys) marks the key rows), and
  each block's row attention runs as two calls, key rows among themselves then the other rows
  against their cached keys/values (`encode_context` / `forward_queries` inside one graph);
- the categorical code vectors have a fixed width, `max_codes` (default 1,024, above the 1,000
  categories tabfm.data encodes at most) instead of max(K, the batch's largest cardinality);
  the code vectors do not depend on that width, and `OnnxModel` refuses a wider column;
- the eval-mode column identities hash the float32 bit pattern of every visible context cell
  (`encoder._value_bits`, a `view(torch.int32)`: ONNX has a bitcast only from opset 26);
  `float32_bits` computes the same integers arithmetically (exact; tested on every kind of float);
- masks are always applied (the torch forward skips them when nothing is masked), and attention
  is translated by `_onnx_attention` (the mask as one more feature of the keys, not a pass over
  every score).

Exporter: torch's dynamo exporter (`torch.onnx.export(..., dynamo=True, dynamic_shapes=...)`),
which expresses all five dimensions as symbols; the TorchScript exporter is deprecated and
would need the same rewrites. `cells_per_token` > 1 and mixture-of-experts models (their routing's
shapes depend on the data) are not exported. onnx, onnxruntime and onnxscript are imported only
when used (`pip install "tabfm[onnx]"`).
"""
from __future__ import annotations

import copy
import json
import logging
import math
import warnings
import weakref
from dataclasses import dataclass
from functools import lru_cache
from os import PathLike
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from tabfm.data.batch import TableBatch

from .config import FIXED_CODE_SEED, ModelConfig
from .attention import KVCache
from .encoder import ColumnFacts, ColumnSums, _visible, hash_normal, mean_std, mix32
from .heads import BarDistribution
from .transformer import ModelOutput, TabFM

DEFAULT_MAX_CODES = 1024  # code vectors in the graph (tabfm.data encodes at most 1,000 categories)
OPSET = 20
ATOL = 1e-4  # |onnxruntime - torch| on logits and standardisation, fp32: ATOL + RTOL * |torch|
RTOL = 1e-4
METADATA_KEY = "tabfm"  # metadata_props entry: the ModelConfig and the graph's contract, as JSON
FORMAT = "tabfm.onnx"
FORMAT_VERSION = 1
INPUTS = ("x", "kind", "cardinality", "row_valid", "col_valid", "keys", "query", "index", "id_seed")
REF_INPUT = "feature_ref"  # one more input for a model with context_refs (TableBatch.feature_ref, (B, C, 3))
OUTPUTS = ("cat_logits", "num_logits", "cell_mean", "cell_std")  # graph outputs: ModelOutput's
FIELDS = ("cat_logits", "num_logits", "mean", "std")  # ... fields of the same names (mean, std: the column's)
INSTALL_HINT = 'the ONNX backend needs onnx, onnxruntime and onnxscript: pip install "tabfm[onnx]"'

_M32 = 0xFFFFFFFF
_POW2_LOW = 150  # float32_bits' table of powers of two starts at 2**-150
_MASKED = -1e9  # a masked key's score in the graph's attention (its weight underflows to 0)


class OnnxUnavailableError(ImportError):
    """onnxruntime (or, to export, onnx / onnxscript) is not installed; the message says how to install it."""


def require(*modules: str) -> None:
    """Import `modules` or raise OnnxUnavailableError naming the extra."""
    import importlib

    missing = []
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise OnnxUnavailableError(f"{', '.join(missing)} not installed; {INSTALL_HINT}")


# ------------------------------------------------------------------------- the graph
def float32_bits(x: torch.Tensor) -> torch.Tensor:
    """int64 bit patterns of float32 values, as `encoder._value_bits` (one NaN 0x7FC00000, -0.0 -> 0),
    from arithmetic alone: float64 holds every float32 exactly and scaling by powers of two is exact."""
    v = x.double()
    nan, inf = torch.isnan(v), torch.isinf(v)
    a = torch.where(nan | inf, 1.0, v.abs())
    normal = a >= 2.0**-126
    e = torch.floor(torch.log2(torch.where(normal, a, 1.0))).long()
    pow2 = torch.tensor([math.ldexp(1.0, k) for k in range(-_POW2_LOW, 131)], dtype=torch.float64, device=v.device)
    p = pow2[e + _POW2_LOW]
    e = torch.where(a < p, e - 1, torch.where(a >= 2 * p, e + 1, e))  # log2 may be one off next to a power of two
    p = pow2[e + _POW2_LOW]
    mantissa = torch.where(normal, (a / p - 1.0) * 2.0**23, a * 2.0**149).round().long()  # exact integers
    exponent = torch.where(normal, e + 127, 0)
    sign = torch.where(v < 0, 1 << 31, 0)  # -0.0 is not < 0: it maps to +0.0's pattern
    bits = torch.where(inf, sign + 255 * 2**23, sign + exponent * 2**23 + mantissa)
    return torch.where(nan, 0x7FC00000, bits)


class _Shaped(TableBatch):
    """A TableBatch whose `shape` keeps symbolic sizes (TableBatch.shape casts to int, which would
    fix them to the example's during export)."""

    @property
    def shape(self) -> tuple[Any, Any, Any]:  # type: ignore[override]
        return tuple(self.x.shape)


class ExportableTabFM(nn.Module):
    """`TabFM.forward` (eval mode) for the cells at `index`, in shapes ONNX can express (module doc).

    forward(x, kind, cardinality, row_valid, col_valid, keys, query, index, id_seed) ->
    (cat_logits (N, K), num_logits (N, n_bins), cell_mean (N,) float64, cell_std (N,) float64).
    The inputs are a TableBatch's, with each table's rows ordered key rows first (`graph_inputs`):
    keys (B, n_keys) marks which of the first n_keys rows are key rows (valid context rows), and no
    later row is one; `id_seed` is a 0-d int64 tensor (the salt of `TabFM.forward`)."""

    def __init__(self, model: TabFM, max_codes: int = DEFAULT_MAX_CODES) -> None:
        super().__init__()
        cfg = model.config
        if cfg.cells_per_token != 1:
            raise ValueError(f"ONNX export takes models with cells_per_token = 1 (this one has {cfg.cells_per_token})")
        if cfg.moe_experts:
            raise ValueError(f"ONNX export takes dense models; this one has mixture-of-experts MLPs (moe_experts = "
                             f"{cfg.moe_experts}), whose routing has data-dependent shapes the graph cannot express")
        if max_codes < cfg.max_categories:
            raise ValueError(f"max_codes = {max_codes} must be >= the model's max_categories = {cfg.max_categories}")
        self.model = model
        self.max_codes = int(max_codes)
        e = cfg.id_dim
        if cfg.code_ids == "fixed":  # the shared code vectors of encoder.columns, a constant of the graph
            counters = torch.arange(e, (self.max_codes + 1) * e)
            self.register_buffer("fixed_codes", hash_normal(torch.tensor(FIXED_CODE_SEED), counters).view(-1, e),
                                 persistent=False)
        else:
            self.fixed_codes = None

    def _facts(self, batch: TableBatch, x_keys: torch.Tensor, keys: torch.Tensor, id_seed: torch.Tensor) -> ColumnFacts:
        """encoder.columns in eval mode over the key rows `x_keys` (B, n_keys, C), with the content hash
        from `float32_bits` and `max_codes` code vectors."""
        b, _, c = batch.shape
        e = self.model.config.id_dim
        sums = self.model.encoder.stats(x_keys, keys, with_hash=False)
        content_hash = torch.where(keys[:, :, None], mix32(float32_bits(x_keys) ^ 0x5BD1E995), 0).sum(1)  # as ContextStatistics
        mean, std = mean_std(ColumnSums(sums.total, sums.total_sq, sums.count, content_hash))
        # encoder.column_seeds (eval), the salt a tensor
        seeds = mix32((content_hash & _M32) ^ mix32((batch.kind.long() * 0x27D4EB2F + batch.cardinality.long() * 0x165667B1
                                                      + 7) & _M32))
        seeds = torch.where(id_seed != 0, mix32(seeds ^ mix32(id_seed & _M32)), seeds)
        if self.fixed_codes is not None:
            col_vec = hash_normal(seeds[:, :, None], torch.arange(e, device=x_keys.device))
            code_vec = self.fixed_codes.expand(b, c, self.max_codes, e)
        else:
            counters = torch.arange((self.max_codes + 1) * e, device=x_keys.device)
            vecs = hash_normal(seeds[:, :, None], counters).view(b, c, self.max_codes + 1, e)
            col_vec, code_vec = vecs[:, :, 0], vecs[:, :, 1:]
        return ColumnFacts(mean=mean, std=std, col_vec=col_vec, code_vectors=code_vec)

    @staticmethod
    def _block(block: nn.Module, x: torch.Tensor, col_mask: torch.Tensor, n_keys: Any, kv_mask: torch.Tensor
               ) -> torch.Tensor:
        """TableBlock.forward with its row attention in two calls: the key rows among themselves
        (recording their keys/values) and the other rows against those (as `forward_queries` does),
        so attention never scores a non-key row as a key and needs no data-dependent slice."""
        x = x + block.drop(block.col_attn(block.norm_col(x), col_mask))
        h = block.norm_row(x)
        cache = KVCache()
        head = block.row_attn(h[:, :n_keys], n_keys, kv_mask, cache)
        tail = block.row_attn(h[:, n_keys:], 0, None, cache)
        x = x + block.drop(torch.cat([head, tail], dim=1))
        return x + block.drop(block.mlp(block.norm_mlp(x)))

    def forward(self, x: torch.Tensor, kind: torch.Tensor, cardinality: torch.Tensor, row_valid: torch.Tensor,
                col_valid: torch.Tensor, keys: torch.Tensor, query: torch.Tensor, index: torch.Tensor,
                id_seed: torch.Tensor, feature_ref: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        model, t = self.model, self.model.config.n_thinking_rows
        if feature_ref is None:  # a model without context_refs reads none: any placeholder will do
            feature_ref = torch.full((1, 1, 3), -1, dtype=torch.int64, device=x.device)
        batch = _Shaped(x=x, kind=kind, cardinality=cardinality, row_valid=row_valid, col_valid=col_valid,
                        context=row_valid, query=query,  # `context` is read by nothing below: `keys` says it
                        feature_ref=feature_ref)
        b, r, c = batch.shape
        k = keys.shape[1]
        visible = _visible(batch)
        facts = self._facts(batch, visible[:, :k], keys, id_seed)
        tokens = model.encoder.embed(batch, facts, x=visible)  # (B, T + R, C, d)
        col_ok = col_valid.clone()
        col_ok[:, 0] |= ~col_ok.any(1)
        col_mask = col_ok[:, None, :].expand(b, t + r, c).reshape(b * (t + r), 1, 1, c)
        kv_mask = torch.cat([torch.ones(b, t, dtype=torch.bool, device=x.device), keys], dim=1)
        for block in model.blocks:
            tokens = self._block(block, tokens, col_mask, t + k, kv_mask)
        bi, ri, ci = index.unbind(1)
        out = model._heads(model._query_states(tokens, bi, ri + t, ci, None), index, batch, facts)
        return out.cat_logits, out.num_logits, out.mean, out.std


def _onnx_attention(head_dim: int):
    """The translation of `F.scaled_dot_product_attention` into the graph, for key masks of shape
    (N, 1, 1, S) (what both attentions pass): softmax(q' k'^T / sqrt(hd)) v, where k' carries one more
    feature, 0 for a real key and -1e9 for a masked one, and q' a 1 there. The mask costs one
    column of the score matmul instead of a pass over every score (torch's exporter adds it to
    the scores, then zeroes NaN weights of rows without any key, a second pass; every row here has
    a key). Exact for the real keys (q.k + 0); a masked key's weight underflows to 0, as with -inf."""
    from onnxscript import opset20 as op

    def attention(query, key, value, attn_mask=None, dropout_p: float = 0.0, is_causal: bool = False,
                  scale: float | None = None, enable_gqa: bool = False):
        factor = float(scale) if scale is not None else head_dim ** -0.5
        if attn_mask is not None:
            bias = op.Where(attn_mask, op.Constant(value_float=0.0), op.Constant(value_float=_MASKED))  # (N, 1, 1, S)
            bias = op.Transpose(bias, perm=[0, 1, 3, 2])  # (N, 1, S, 1)
            one = op.Constant(value_ints=[1])
            key = op.Concat(key, op.Expand(bias, op.Concat(op.Shape(key, end=3), one, axis=0)), axis=-1)
            query = op.Concat(query, op.Expand(op.Constant(value_float=1.0), op.Concat(op.Shape(query, end=3), one,
                                                                                          axis=0)), axis=-1)
        scores = op.Mul(op.MatMul(query, op.Transpose(key, perm=[0, 1, 3, 2])), op.Constant(value_float=factor))
        return op.MatMul(op.Softmax(scores, axis=-1), value)

    return attention


# ------------------------------------------------------------------------- exporting
def _example(config: ModelConfig, n_tables: int, n_rows: int, n_cols: int, seed: int = 0, missing: float = 0.0,
             n_context: int | None = None) -> TableBatch:
    """A random batch: numeric and categorical columns (the last one a categorical target hidden on the
    non-context rows), a padding column and a padding row in the first table when there are several."""
    g = torch.Generator().manual_seed(seed)
    n_context = n_rows * 2 // 3 if n_context is None else n_context
    kind = torch.ones(n_tables, n_cols, dtype=torch.int8)
    kind[:, 1::3] = 2
    kind[:, -1] = 2
    card = torch.where(kind == 2, torch.randint(2, 6, (n_tables, n_cols), generator=g), 0)
    card[:, -1] = min(config.max_categories, 3)
    x = torch.randn(n_tables, n_rows, n_cols, generator=g) * 3 + 1
    codes = (torch.rand(n_tables, n_rows, n_cols, generator=g) * card[:, None, :]).floor()
    x = torch.where(kind[:, None, :] == 2, codes, x)
    if missing:
        x = x.masked_fill(torch.rand(x.shape, generator=g) < missing, float("nan"))
    row_valid = torch.ones(n_tables, n_rows, dtype=torch.bool)
    col_valid = torch.ones(n_tables, n_cols, dtype=torch.bool)
    if n_tables > 1 and n_cols > 2 and n_rows > 3:  # padding in table 0
        row_valid[0, -1] = False
        col_valid[0, 0] = False
        kind[0, 0], card[0, 0] = 0, 0
        x[0, :, 0] = 0.0
        x[0, -1] = 0.0
    context = torch.zeros(n_tables, n_rows, dtype=torch.bool)
    context[:, :n_context] = True
    context &= row_valid
    query = torch.zeros(n_tables, n_rows, n_cols, dtype=torch.bool)
    query[:, n_context:, -1] = True
    query &= row_valid[:, :, None]
    x[:, n_context:, -1] = x[:, n_context:, -1].nan_to_num(0.0)  # targets of query cells are known values
    ref = torch.full((n_tables, n_cols, 3), -1, dtype=torch.int64)
    if config.context_refs:  # numeric columns as context features of the target, classes and estimators in turn
        for j in range(n_cols - 1):
            marked = kind[:, j] == 1
            ref[marked, j] = torch.tensor([n_cols - 1, j % int(card[0, -1]), j % 3])
    return TableBatch(x=x, kind=kind, cardinality=card.long(), row_valid=row_valid, col_valid=col_valid,
                      context=context, query=query, feature_ref=ref)


def graph_input_names(config: ModelConfig) -> tuple[str, ...]:
    """The graph's inputs: `INPUTS`, and `REF_INPUT` for a model with context_refs."""
    return INPUTS + ((REF_INPUT,) if config.context_refs else ())


def graph_inputs(batch: TableBatch, id_seed: int = 0) -> dict[str, np.ndarray]:
    """The graph's inputs (`INPUTS`) for a batch, as numpy: each table's rows reordered key rows (valid
    context rows) first, as `transformer._keys_first` does; `keys` (B, n_keys), n_keys = the most key
    rows of any table (at least 1); `index` = the query cells in `batch.query.nonzero()` order, with
    the rows' new positions."""
    x = batch.x.detach().cpu().numpy().astype(np.float32, copy=False)
    row_valid = batch.row_valid.cpu().numpy()
    query = batch.query.cpu().numpy()
    is_key = batch.context.cpu().numpy() & row_valid
    index = np.argwhere(query).astype(np.int64)
    order = np.argsort(~is_key, axis=1, kind="stable")  # the original row at each new position
    pos = np.empty_like(order)
    np.put_along_axis(pos, order, np.arange(order.shape[1])[None, :].repeat(len(order), 0), axis=1)
    index[:, 1] = pos[index[:, 0], index[:, 1]]
    n_keys = max(int(is_key.sum(1).max(initial=0)), 1)
    return {"x": np.take_along_axis(x, order[:, :, None], axis=1),
            "kind": batch.kind.cpu().numpy().astype(np.int8, copy=False),
            "cardinality": batch.cardinality.cpu().numpy().astype(np.int64, copy=False),
            "row_valid": np.take_along_axis(row_valid, order, axis=1),
            "col_valid": batch.col_valid.cpu().numpy(),
            "keys": np.take_along_axis(is_key, order, axis=1)[:, :n_keys],
            "query": np.take_along_axis(query, order[:, :, None], axis=1),
            "index": index, "id_seed": np.asarray(int(id_seed), dtype=np.int64),
            REF_INPUT: batch.feature_ref.cpu().numpy().astype(np.int64, copy=False)}


@dataclass
class CheckResult:
    """How far onnxruntime's outputs lie from torch's on the check tables."""

    max_abs: dict[str, float]  # per output
    worst_ratio: float  # max |diff| / (ATOL + RTOL |torch|): <= 1 passes
    shapes: list[tuple[int, int, int]]

    @property
    def ok(self) -> bool:
        return self.worst_ratio <= 1.0


def check_against_torch(onnx_model: "OnnxModel", model: TabFM, batches: list[TableBatch] | None = None,
                        id_seeds: tuple[int, ...] = (0, 12345)) -> CheckResult:
    """Run `batches` (default: 1 and 3 tables, 5 and 40 rows, 2 and 12 columns, with and without
    missing cells) through onnxruntime and `model(batch)`; the largest differences per output."""
    if batches is None:
        cfg = model.config
        batches = [_example(cfg, 1, 5, 2, seed=1), _example(cfg, 3, 40, 12, seed=2, missing=0.2),
                   _example(cfg, 1, 40, 2, seed=3, missing=0.3), _example(cfg, 3, 5, 12, seed=4)]
    was_training = model.training
    model.eval()
    max_abs = {k: 0.0 for k in FIELDS}
    worst = 0.0
    try:
        with torch.inference_mode():
            for i, batch in enumerate(batches):
                seed = id_seeds[i % len(id_seeds)]
                ref = model(batch, id_seed=seed)
                got = onnx_model(batch, id_seed=seed)
                for name in FIELDS:
                    a, b = getattr(ref, name).double(), getattr(got, name).double()
                    same_inf = torch.isinf(a) & (a == b)
                    diff = torch.where(same_inf, 0.0, (a - b).abs()).nan_to_num(float("inf"))
                    if diff.numel():
                        max_abs[name] = max(max_abs[name], float(diff.max()))
                        bound = ATOL + RTOL * torch.where(same_inf, 0.0, a.abs())
                        worst = max(worst, float((diff / bound).max()))
    finally:
        model.train(was_training)
    return CheckResult(max_abs=max_abs, worst_ratio=worst, shapes=[b.shape for b in batches])


def export_onnx(model: TabFM, path: str | PathLike | None = None, max_codes: int = DEFAULT_MAX_CODES,
                check: bool = True) -> tuple[bytes, CheckResult | None]:
    """Export `model`'s eval-mode forward (module doc) to ONNX; write it to `path` (if given).

    Returns (the serialised model, the check against torch, or None with check=False). With check,
    a graph that differs from torch beyond ATOL / RTOL raises RuntimeError and nothing is written.
    The file carries the ModelConfig in its metadata, so `OnnxModel(path)` needs nothing else.
    """
    require("onnx", "onnxscript", "onnxruntime")
    import onnx

    if any(p.device.type != "cpu" for p in model.parameters()):
        model = copy.deepcopy(model).to("cpu")  # the graph runs on onnxruntime's CPU; export and check it there
    wrapper = ExportableTabFM(model, max_codes).eval()
    example = _example(model.config, 2, 9, 4, seed=0, missing=0.2)
    feeds = graph_inputs(example)
    names = graph_input_names(model.config)
    args = tuple(torch.from_numpy(np.array(feeds[n])) for n in names)  # np.array keeps 0-d id_seed 0-d
    tables, rows, cols, keys, cells = (torch.export.Dim(n) for n in ("tables", "rows", "columns", "keys", "cells"))
    dynamic = ({0: tables, 1: rows, 2: cols}, {0: tables, 1: cols}, {0: tables, 1: cols}, {0: tables, 1: rows},
               {0: tables, 1: cols}, {0: tables, 1: keys}, {0: tables, 1: rows, 2: cols}, {0: cells}, None,
               {0: tables, 1: cols})[:len(names)]
    was_training = model.training
    model.eval()
    log = logging.getLogger("torch.onnx")  # its notes on skipped torchvision ops and the like
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")
            program = torch.onnx.export(wrapper, args, dynamo=True, dynamic_shapes=dynamic, input_names=list(names),
                                        output_names=list(OUTPUTS), opset_version=OPSET, verbose=False,
                                        optimize=True, custom_translation_table={
                                            torch.ops.aten.scaled_dot_product_attention.default:
                                                _onnx_attention(model.config.head_dim)})
    finally:
        log.setLevel(level)
        model.train(was_training)
    proto = program.model_proto
    meta = {"format": FORMAT, "version": FORMAT_VERSION, "model": model.config.to_dict(), "max_codes": int(max_codes),
            "inputs": list(names), "outputs": list(OUTPUTS), "torch": torch.__version__, "opset": OPSET}
    onnx.helper.set_model_props(proto, {METADATA_KEY: json.dumps(meta, sort_keys=True)})
    data = proto.SerializeToString()
    result = None
    if check:
        result = check_against_torch(OnnxModel(data), model)
        if not result.ok:
            raise RuntimeError(f"the exported graph differs from torch beyond atol={ATOL}, rtol={RTOL}: "
                               f"max |diff| {result.max_abs}")
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_bytes(data)
    return data, result


# ------------------------------------------------------------------------- running
class OnnxModel:
    """An exported graph in an onnxruntime session, called as the model is:
    `onnx_model(batch, id_seed) -> ModelOutput` for the batch's query cells (in `query.nonzero()` order).

    source   a .onnx file written by `export_onnx` / `tabfm export --onnx`, or its bytes.
    threads  onnxruntime's intra-op threads (default: torch.get_num_threads(), as the torch path uses).
    `config` is the exported model's ModelConfig (from the file's metadata). CPU only (CPUExecutionProvider).
    """

    def __init__(self, source: str | PathLike | bytes, threads: int | None = None) -> None:
        require("onnxruntime")
        import onnxruntime as ort

        where = "ONNX bytes" if isinstance(source, (bytes, bytearray)) else str(source)
        if not isinstance(source, (bytes, bytearray)) and not Path(source).is_file():
            raise FileNotFoundError(f"{source}: no such ONNX file")
        options = ort.SessionOptions()
        options.intra_op_num_threads = int(threads or torch.get_num_threads())
        options.inter_op_num_threads = 1
        options.log_severity_level = 3
        self.session = ort.InferenceSession(bytes(source) if isinstance(source, (bytes, bytearray)) else str(source),
                                            sess_options=options, providers=["CPUExecutionProvider"])
        raw = self.session.get_modelmeta().custom_metadata_map.get(METADATA_KEY)
        meta = json.loads(raw) if raw else {}
        if meta.get("format") != FORMAT or meta.get("version") != FORMAT_VERSION:
            raise ValueError(f"{where}: not a {FORMAT} v{FORMAT_VERSION} graph (written by `tabfm export --onnx`); "
                             f"its metadata says format={meta.get('format')!r}, version={meta.get('version')!r}")
        self.config = ModelConfig.from_dict(meta["model"])
        self.max_codes = int(meta["max_codes"])
        self.inputs = tuple(i.name for i in self.session.get_inputs())
        self.threads = options.intra_op_num_threads
        self.bar = BarDistribution.from_range(self.config.n_bins, self.config.bin_range)
        self.where = where

    def __repr__(self) -> str:
        return f"OnnxModel({self.where!r}, threads={self.threads})"

    def __call__(self, batch: TableBatch, id_seed: int = 0) -> ModelOutput:
        feeds = graph_inputs(batch, int(id_seed) & _M32 if id_seed else 0)
        if feeds["x"].shape[2] == 0 or feeds["x"].shape[1] == 0:
            raise ValueError(f"the ONNX graph needs at least one row and one column, got a batch of {feeds['x'].shape}")
        widest = int(feeds["cardinality"].max(initial=0))
        if widest > self.max_codes:
            raise ValueError(f"a categorical column has {widest} categories; this ONNX graph was exported with "
                             f"max_codes={self.max_codes} (tabfm export --onnx ... --max-codes N)")
        if id_seed and int(id_seed) & _M32 == 0:  # a nonzero salt whose low 32 bits are 0 still salts (encoder)
            feeds["id_seed"] = np.asarray(1 << 32, dtype=np.int64)
        if len(feeds["index"]) == 0:  # nothing to answer (onnxruntime 1.32 dies of SIGFPE on an empty index)
            k = self.config.max_categories
            cat, num = np.zeros((0, k), np.float32), np.zeros((0, self.config.n_bins), np.float32)
            mean = std = np.zeros(0, np.float64)
        else:
            cat, num, mean, std = self.session.run(list(OUTPUTS), {n: feeds[n] for n in self.inputs})
        index = batch.query.detach().cpu().nonzero()  # the caller's row numbers (feeds["index"]: keys-first rows)
        bi, ci = feeds["index"][:, 0], feeds["index"][:, 2]
        return ModelOutput(index=index, cat_logits=torch.from_numpy(cat), num_logits=torch.from_numpy(num),
                           mean=torch.from_numpy(mean), std=torch.from_numpy(std),
                           kind=torch.from_numpy(feeds["kind"][bi, ci]),
                           cardinality=torch.from_numpy(feeds["cardinality"][bi, ci]), bar=self.bar)


@lru_cache(maxsize=8)
def _load_cached(path: str, size: int, mtime_ns: int, threads: int) -> OnnxModel:
    """One session per file version and thread count, per process (as tabfm.weights caches models)."""
    return OnnxModel(path, threads)


_EXPORTED: "weakref.WeakKeyDictionary[TabFM, tuple[tuple, int, OnnxModel]]" = weakref.WeakKeyDictionary()


def onnx_model_of(model: TabFM | str | PathLike, threads: int | None = None) -> OnnxModel:
    """An OnnxModel for `model`, cached per process: a .onnx file is loaded once per version (size and
    modification time); a TabFM module is exported (in memory, checked against torch) once per weights
    version, which costs seconds to a minute."""
    threads = int(threads or torch.get_num_threads())
    if not isinstance(model, nn.Module):
        path = Path(model).resolve()
        if not path.is_file():
            raise FileNotFoundError(f"{model}: no such ONNX file")
        stat = path.stat()
        return _load_cached(str(path), stat.st_size, stat.st_mtime_ns, threads)
    signature = tuple((p.data_ptr(), p._version) for p in model.parameters())
    hit = _EXPORTED.get(model)
    if hit is not None and hit[0] == signature and hit[1] == threads:
        return hit[2]
    data, _ = export_onnx(model, check=True)
    onnx_model = OnnxModel(data, threads)
    _EXPORTED[model] = (signature, threads, onnx_model)
    return onnx_model


def is_onnx_file(model: Any) -> bool:
    """Whether `model` names a .onnx file (a path ending in .onnx)."""
    return isinstance(model, (str, PathLike)) and str(model).lower().endswith(".onnx")


__all__ = ["ExportableTabFM", "OnnxModel", "OnnxUnavailableError", "export_onnx", "onnx_model_of", "check_against_torch",
           "float32_bits", "graph_inputs", "is_onnx_file", "ATOL", "RTOL", "DEFAULT_MAX_CODES"]
