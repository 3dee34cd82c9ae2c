"""SeekableStream: an endless stream of batches addressed by position, resumable exactly.

Both batch streams of the project (the synthetic prior's `tabfm.synth.stream.SynthStream` and the
real-table `tabfm.data.table_episodes.TableEpisodeSampler`) are pure functions of (seed, position):
iteration yields `batch_at(position)` and advances `position`, so a `state_dict()` taken after
k batches resumes at batch k, and a state saved under another seed is refused.
"""
from __future__ import annotations

from typing import Any, Iterator

from .batch import TableBatch


class SeekableStream:
    """Base of a position-addressed stream. Subclasses set `seed` and `position` and define
    `batch_at`; `kind` names the object in errors, `_check_position` validates a position."""

    seed: int
    position: int
    kind = "stream"

    def batch_at(self, position: int) -> TableBatch:
        raise NotImplementedError

    def _check_position(self, position: Any) -> int:
        return int(position)

    def __iter__(self) -> Iterator[TableBatch]:
        while True:
            batch = self.batch_at(self.position)
            self.position += 1
            yield batch

    def state_dict(self) -> dict[str, int]:
        """Where the stream stands: the next position (and the seed that must match)."""
        return {"seed": self.seed, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from a state_dict(); the seed must be the one the state was saved with."""
        if int(state["seed"]) != self.seed:
            raise ValueError(f"state was saved with seed {state['seed']}, this {self.kind} has seed {self.seed}")
        self.position = self._check_position(state["position"])
