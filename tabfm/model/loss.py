"""The one pretraining objective: NLL of hidden (query) cells given the visible rest of the table."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tabfm.data.batch import CATEGORICAL, NUMERIC, TableBatch

from .transformer import ModelOutput

Z_CLAMP = 2.0  # numeric targets are clamped to +-Z_CLAMP * bin_range (standardised) for the loss


def masked_cell_loss(output: ModelOutput, batch: TableBatch) -> tuple[torch.Tensor, dict[str, float]]:
    """Mean NLL over scored query cells: categorical cross-entropy + numeric bar NLL.

    Scored cells: query cells with a known true value (not NaN); categorical ones only when
    the column's cardinality fits the head (<= K). Numeric NLL is a density NLL on the
    context-standardised scale, -log(p_bin / bin_width) in inner bins; targets are clamped
    to +-2 * bin_range there, which changes no gradient (tail shapes are fixed) and only
    keeps the reported value readable when a target is wildly out of range.
    Usable as a Booster criterion: `loss, metrics = criterion(output, batch)`.
    Metrics: loss, cat_nll, num_nll (means over their cells; NaN if none), cat_acc, cells,
    cat_cells, num_cells.

    A mixture-of-experts model's output carries its routing losses (`output.moe`, with the
    config's weights); the loss then adds moe_aux_weight * aux + moe_z_weight * z, `loss` reports
    that sum (cat_nll and num_nll stay the cells' NLL), and the metrics gain moe_aux, moe_z and
    moe_dropped (the fraction of token assignments dropped for capacity).
    """
    bi, ri, ci = output.index.unbind(1)
    target = batch.x[bi, ri, ci]
    known = ~torch.isnan(target)
    k = output.cat_logits.shape[-1]
    is_cat = known & (output.kind == CATEGORICAL) & (output.cardinality <= k)
    is_num = known & (output.kind == NUMERIC)

    # no branch on the data: an empty selection still reaches its head (with zero gradient), so
    # every parameter is in every step's graph, as data-parallel gradient reduction expects
    cat_logits = output.cat_logits[is_cat]
    cat_target = target[is_cat].long()
    cat_nll = F.cross_entropy(cat_logits, cat_target, reduction="sum")

    z = (target[is_num].double() - output.mean[is_num]) / output.std[is_num]
    lim = Z_CLAMP * output.bar.edges[-1].item()
    num_nll = output.bar.nll(output.num_logits[is_num], z.clamp(-lim, lim)).sum()

    n_cat, n_num = int(cat_target.numel()), int(z.numel())
    cells = n_cat + n_num
    loss = (cat_nll + num_nll.to(cat_nll.dtype)) / max(cells, 1)
    with torch.no_grad():
        cat_acc = float((cat_logits.argmax(-1) == cat_target).float().mean()) if n_cat else float("nan")
    metrics = {
        "loss": float(loss.detach()),
        "cat_nll": float(cat_nll.detach()) / n_cat if n_cat else float("nan"),
        "num_nll": float(num_nll.detach()) / n_num if n_num else float("nan"),
        "cat_acc": cat_acc,
        "cells": float(cells),
        "cat_cells": float(n_cat),
        "num_cells": float(n_num),
    }
    moe = output.moe
    if moe is not None:
        loss = loss + moe.penalty().to(loss.dtype)
        metrics.update(loss=float(loss.detach()), moe_aux=float(moe.aux.detach()), moe_z=float(moe.z.detach()),
                       moe_dropped=moe.dropped_fraction)
    return loss, metrics
