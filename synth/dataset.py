"""SynthDataset / SynthLoader: the synthetic stream behind a torch DataLoader.

Each item is already a whole TableBatch, so the DataLoader runs with
batch_size=None and no collate function. Worker w of n generates positions
start+w, start+w+n, ...; the DataLoader takes one item from each worker in turn,
so it yields positions start, start+1, ... in order: the same batches whatever
num_workers is. Resuming needs only the number of batches consumed, which
SynthLoader counts in the main process (workers run ahead by their prefetch).
"""
from __future__ import annotations

import copy
import itertools
from typing import Any, Iterator

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from .stream import StreamConfig, SynthStream

MODES = ("batch", "episode", "frames")


class SynthDataset(IterableDataset):
    """Positions [start, start + num_batches) of rank `rank`'s synthetic stream (endless if num_batches is None).

    mode: "batch" yields TableBatch; "episode" yields (TableBatch, BatchInfo);
    "frames" yields (list of raw DataFrames, BatchInfo).

    micro_batches = A > 1 (gradient accumulation): each position is one optimizer step and yields a
    list of A items, micro-batch a of rank r being the stream's sub-rank a * world_size + r of
    A * world_size. So a step's tables depend only on the global batch, not on how it is split:
    W ranks x A micro-batches draw exactly what one process with W * A micro-batches draws.
    """

    def __init__(
        self,
        cfg: StreamConfig | None = None,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        start: int = 0,
        num_batches: int | None = None,
        mode: str = "batch",
        micro_batches: int = 1,
    ):
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"SynthDataset mode must be one of {MODES}, got {mode!r}")
        if num_batches is not None and (isinstance(num_batches, bool) or not isinstance(num_batches, int) or num_batches < 0):
            raise ValueError(f"num_batches must be None or an integer >= 0, got {num_batches!r}")
        if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
            raise ValueError(f"micro_batches must be an integer >= 1, got {micro_batches!r}")
        # building the stream validates cfg, seed, rank, world_size and start here, not in a worker
        stream = SynthStream(cfg, seed=seed, rank=rank, world_size=world_size, position=start)
        self.cfg, self.seed, self.rank, self.world_size = stream.cfg, seed, rank, world_size
        self.micro_batches = micro_batches
        self.start = start
        self.stop = None if num_batches is None else start + num_batches
        self.mode = mode

    def __len__(self) -> int:
        if self.stop is None:
            raise TypeError("an endless SynthDataset has no len()")
        return max(0, self.stop - self.start)

    def positions(self, worker: int = 0, num_workers: int = 1) -> Iterator[int]:
        """The stream positions worker `worker` of `num_workers` generates."""
        if self.stop is None:
            return itertools.count(self.start + worker, num_workers)
        return iter(range(self.start + worker, self.stop, num_workers))

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        worker, n = (0, 1) if info is None else (info.id, info.num_workers)
        a, w = self.micro_batches, self.world_size
        streams = [SynthStream(self.cfg, seed=self.seed, rank=i * w + self.rank, world_size=a * w) for i in range(a)]
        for p in self.positions(worker, n):
            items = [self._item(stream, p) for stream in streams]
            yield items[0] if a == 1 else items

    def _item(self, stream: SynthStream, p: int) -> Any:
        if self.mode == "batch":
            return stream.batch_at(p)
        if self.mode == "episode":
            return stream.episode_at(p)
        return stream.frames_at(p)

    def state_dict(self, consumed: int = 0) -> dict[str, int]:
        """State after `consumed` batches of this dataset were used: resume from start + consumed."""
        return {"seed": self.seed, "position": self.start + int(consumed)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Start at a saved position (the end, if finite, stays where it was)."""
        if int(state["seed"]) != self.seed:
            raise ValueError(f"state was saved with seed {state['seed']}, this dataset has seed {self.seed}")
        self.start = int(state["position"])


class SynthLoader:
    """A DataLoader over a SynthDataset that knows how many positions it has handed out
(with micro_batches = A, it yields A batches per position, one by one).

    Iterating again continues where the last iteration stopped; `state_dict()` /
    `load_state_dict()` save and restore that point. Keyword arguments go to the
    DataLoader (num_workers, pin_memory, prefetch_factor, ...); batch_size is None.
    """

    def __init__(self, dataset: SynthDataset, **loader_kwargs: Any):
        if "batch_size" in loader_kwargs or "collate_fn" in loader_kwargs:
            raise ValueError("SynthLoader items are whole batches: do not pass batch_size or collate_fn")
        if loader_kwargs.get("persistent_workers"):
            raise ValueError("SynthLoader restarts workers at the resume position: persistent_workers is not supported")
        self.dataset = dataset
        self.loader_kwargs = loader_kwargs
        self.position = dataset.start

    def __len__(self) -> int:
        if self.dataset.stop is None:
            raise TypeError("an endless SynthLoader has no len()")
        return max(0, self.dataset.stop - self.position)

    def __iter__(self) -> Iterator[Any]:
        ds = copy.copy(self.dataset)
        ds.start = self.position
        # the tables depend only on positions; a private generator keeps the DataLoader from
        # drawing its worker base seed from the global torch RNG, which a resumed run restores
        kwargs = {"generator": torch.Generator().manual_seed(self.dataset.seed), **self.loader_kwargs}
        for item in DataLoader(ds, batch_size=None, **kwargs):
            group = item if self.dataset.micro_batches > 1 else [item]
            for i, micro in enumerate(group):
                if i == len(group) - 1:
                    self.position += 1  # a position is consumed with its last micro-batch
                yield micro

    def state_dict(self) -> dict[str, int]:
        return {"seed": self.dataset.seed, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if int(state["seed"]) != self.dataset.seed:
            raise ValueError(f"state was saved with seed {state['seed']}, this loader has seed {self.dataset.seed}")
        self.position = int(state["position"])
