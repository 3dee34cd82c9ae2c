"""Training batches drawn from two streams: the synthetic prior and a table store, at a fixed share.

Real-TabPFN continued a prior-trained model on real tables mixed with prior tables; `tabfm pretrain
--data STORE --data-share P` does the same: each batch comes from the store with probability P,
else from the synthetic stream. Which stream batch i comes from is a pure function of (seed, i),
the same on every data-parallel rank (the store's epochs stay in lock step), so a resumed run sees
exactly the batches an uninterrupted run would.
"""
from __future__ import annotations

from typing import Any, Iterator, Protocol

import numpy as np

_MIX = 0x6D6978  # spawn-key tag of the stream choice ("mix")


class ResumableBatches(Protocol):
    def __iter__(self) -> Iterator[Any]: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class MixedBatches:
    """Batches from `store` with probability `share` each, else from `synthetic`; resumable."""

    def __init__(self, synthetic: ResumableBatches, store: ResumableBatches, share: float, seed: int) -> None:
        if not 0.0 < share < 1.0:
            raise ValueError(f"data share must be in (0, 1) for a mixture (got {share!r})")
        self.synthetic, self.store, self.share, self.seed = synthetic, store, float(share), int(seed)
        self.position = 0  # batches handed out

    def from_store(self, i: int) -> bool:
        """Whether batch i comes from the store."""
        return bool(np.random.default_rng(np.random.SeedSequence(self.seed, spawn_key=(_MIX, i))).random() < self.share)

    def __iter__(self) -> Iterator[Any]:
        streams = {True: iter(self.store), False: iter(self.synthetic)}
        while True:
            batch = next(streams[self.from_store(self.position)])
            self.position += 1
            yield batch

    def state_dict(self) -> dict[str, Any]:
        return {"mix": {"share": self.share, "seed": self.seed, "position": self.position},
                "synthetic": self.synthetic.state_dict(), "store": self.store.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        mix = state.get("mix") if isinstance(state, dict) else None
        if mix is None:
            raise ValueError("the saved data state is not a mixture's (was the run trained on one stream only?)")
        if float(mix["share"]) != self.share or int(mix["seed"]) != self.seed:
            raise ValueError(f"the run was saved with data share {mix['share']} and seed {mix['seed']}, this one has "
                             f"{self.share} and {self.seed}")
        self.synthetic.load_state_dict(state["synthetic"])
        self.store.load_state_dict(state["store"])
        self.position = int(mix["position"])
