"""Which released chunk copy leaves the device tier first, and which chunk to fetch ahead.

`LRUPolicy` (static placement): evict the least recently released copy; no prefetch.

`AutoPolicy` (placement="auto"): the warm-up step (everything until the first optimizer step)
runs as LRU while recording the order in which chunks are acquired (forward and backward) and,
through the manager, how many bytes of activations the step saves for backward. Afterwards a
cursor follows that recorded schedule: the copy to evict is the one whose next use lies farthest
ahead (Belady's rule; never used again counts as infinitely far), and after each acquire the
next `prefetch_depth` chunks of the schedule are fetched while there is room (or a copy needed
later than them can make room). The schedule only steers choices: an acquire off the schedule
is served like any other, so results never depend on it.

Optimizer state under auto (`device_optim_chunks`): every chunk's Adam state starts off device
(on disk for the last `disk_optim_frac` of the chunks, on host for the others). When the warm-up
ends, the device bytes left over (budget - resident - measured activations - the parameter
cache the schedule needs) take the optimizer state of as many chunks as fit: disk chunks first
(their step would stream from disk), then host chunks, each group in step order (chunk index).
Where state lives never changes what the step computes, only where it runs.
"""
from __future__ import annotations

import bisect
import math
from collections import OrderedDict
from typing import Any, Callable


class LRUPolicy:
    """Least recently released first; no schedule, no prefetch."""

    name = "lru"

    def on_acquire(self, index: int) -> None:
        pass

    def on_step(self) -> None:
        pass

    def next_use(self, index: int) -> float:
        return math.inf

    def victim(self, cached: "OrderedDict[int, Any]") -> int:
        return next(iter(cached))

    def prefetch(self, skip: Callable[[int], bool]) -> list[int]:
        return []


class AutoPolicy(LRUPolicy):
    """Record the warm-up step's chunk order, then evict farthest-next-use and prefetch ahead."""

    name = "auto"

    def __init__(self, prefetch_depth: int = 1) -> None:
        self.prefetch_depth = prefetch_depth
        self.trace: list[int] = []
        self.warm = False          # True once the schedule is frozen
        self.cursor = 0
        self._positions: dict[int, list[int]] = {}

    def on_acquire(self, index: int) -> None:
        if not self.warm:
            self.trace.append(index)
            return
        pos = self._positions.get(index)
        if pos:
            i = bisect.bisect_left(pos, self.cursor)
            if i < len(pos):
                self.cursor = pos[i] + 1

    def end_warmup(self) -> None:
        """Freeze the schedule recorded so far (called at the first optimizer step)."""
        self.warm = True
        self._positions = {}
        for i, c in enumerate(self.trace):
            self._positions.setdefault(c, []).append(i)
        self.cursor = 0

    def on_step(self) -> None:
        self.cursor = 0

    def next_use(self, index: int) -> float:
        if not self.warm:
            return math.inf
        pos = self._positions.get(index, [])
        i = bisect.bisect_left(pos, self.cursor)
        return pos[i] - self.cursor if i < len(pos) else math.inf

    def victim(self, cached: "OrderedDict[int, Any]") -> int:
        if not self.warm:
            return next(iter(cached))
        return max(cached, key=self.next_use)  # ties: the first in LRU order (max keeps the first)

    def prefetch(self, skip: Callable[[int], bool], horizon: int = 256) -> list[int]:
        """The next `prefetch_depth` distinct chunks of the schedule for which `skip` is False
        (looking at most `horizon` acquires ahead)."""
        if not self.warm or self.prefetch_depth <= 0:
            return []
        out: list[int] = []
        for c in self.trace[self.cursor:self.cursor + horizon]:
            if c not in out and not skip(c):
                out.append(c)
                if len(out) == self.prefetch_depth:
                    break
        return out


def device_optim_chunks(chunks: list, free_bytes: int | None) -> list:
    """The chunks (off-device optimizer state) whose Adam state fits into `free_bytes` of the
    device tier (None: unbounded), costliest tier first (disk, then host), then in step order.
    A chunk's state costs 2 shards of fp32 (exp_avg + exp_avg_sq); the first that does not fit
    ends the choice, so the chosen chunks are a prefix of that order."""
    rank = {"disk": 0, "host": 1}
    order = sorted((c for c in chunks if c.optim_tier in rank), key=lambda c: (rank[c.optim_tier], c.index))
    chosen, left = [], free_bytes
    for c in order:
        cost = 2 * c.shard_nbytes
        if left is not None and cost > left:
            break
        chosen.append(c)
        left = None if left is None else left - cost
    return chosen


def belady_fetches(trace: list[int], capacity: int) -> int:
    """Fetches of an optimal cache of `capacity` chunks over `trace` (brute force over all
    eviction choices; for tests on short traces)."""
    from functools import lru_cache

    @lru_cache(maxsize=None)
    def best(i: int, held: frozenset) -> int:
        if i == len(trace):
            return 0
        c = trace[i]
        if c in held:
            return best(i + 1, held)
        if len(held) < capacity:
            return 1 + best(i + 1, held | {c})
        return 1 + min(best(i + 1, (held - {v}) | {c}) for v in held)

    return best(0, frozenset())
