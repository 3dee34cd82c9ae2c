"""The request queue: size-classed lanes, each a FIFO with one worker thread that runs model calls.

- Off the event loop: a request handler submits a Job and awaits its concurrent Future; the
  lane's thread runs the call (torch releases the GIL), so the loop keeps accepting and answering.
- Size classes: a job's cost (cells the model reads) picks its lane (config.LANE_BASE,
  LANE_FACTOR: lane i spans a factor of 8 in cost), so a request waits only behind requests of
  its own class, never behind the backlog of a class far larger than itself.
- Merging: the worker takes the oldest job of its lane, waits up to max_wait for more jobs of the
  same *group* (same fitted context, same operation and options) and runs up to max_batch_cells
  query cells of them as one call. Only such jobs merge, because only they keep the in-process
  estimators' answers exactly: their query rows go through the same members' passes, padded to
  chunk_size rows, where a row's answer does not depend on the rows beside it. Tables of other
  contexts are never stacked into one forward (padding them to a common shape, or a different
  batch size, changes the last bits of the model's arithmetic).
- A queued job whose client went away (its Future cancelled) is skipped.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable

from .config import LANE_BASE, LANE_FACTOR, N_LANES
from .errors import ApiError
from .metrics import Metrics

# runs one batch: the jobs' payloads -> one result (or exception) per job
Runner = Callable[[list[Any]], list[Any]]


@dataclass
class Job:
    group: Hashable  # jobs of one group may share a call
    cost: int  # cells the model reads for it (its lane)
    cells: int  # query cells (the batch cap)
    payload: Any
    future: Future = field(default_factory=Future)
    enqueued: float = field(default_factory=time.monotonic)


def request_cost(context_rows: int, query_rows: int, columns: int, members: int, chunk_size: int) -> int:
    """Cells the model reads for a request (its lane): context rows plus the query rows padded to
    whole `chunk_size` passes, times the columns (target included) and the ensemble members."""
    passes = -(-query_rows // chunk_size)
    return (context_rows + passes * chunk_size) * columns * members


def lane_of(cost: int, n_lanes: int = N_LANES) -> int:
    """The size class of a job that reads `cost` cells."""
    lane, bound = 0, LANE_BASE
    while cost >= bound and lane < n_lanes - 1:
        lane, bound = lane + 1, bound * LANE_FACTOR
    return lane


class Lane:
    """One size class: a FIFO and the thread that drains it."""

    def __init__(self, index: int, runner: Runner, max_wait_s: float, max_batch_cells: int, metrics: Metrics) -> None:
        self.index, self.runner, self.metrics = index, runner, metrics
        self.max_wait_s, self.max_batch_cells = max_wait_s, max_batch_cells
        self.queue: deque[Job] = deque()
        self.cond = threading.Condition()
        self.closed = False
        self.thread = threading.Thread(target=self._loop, name=f"tabfm-lane-{index}", daemon=True)

    def put(self, job: Job) -> None:
        with self.cond:
            self.queue.append(job)
            self._gauge()
            self.cond.notify()

    def _gauge(self) -> None:
        self.metrics.queue_depth.set(len(self.queue), lane=str(self.index))

    def _mergeable(self, first: Job) -> list[Job]:
        """The oldest job and the queued jobs of its group that fit in one call, in queue order."""
        batch, cells = [first], first.cells
        if self.max_batch_cells <= 0:
            return batch
        for job in self.queue:
            if job is not first and job.group == first.group and cells + job.cells <= self.max_batch_cells:
                batch.append(job)
                cells += job.cells
        return batch

    def _next_batch(self) -> list[Job] | None:
        with self.cond:
            while not self.queue and not self.closed:
                self.cond.wait()
            if not self.queue:
                return None
            first = self.queue[0]
            if self.max_batch_cells > 0 and self.max_wait_s > 0:
                deadline = first.enqueued + self.max_wait_s
                while not self.closed:
                    batch = self._mergeable(first)
                    left = deadline - time.monotonic()
                    if left <= 0 or sum(j.cells for j in batch) >= self.max_batch_cells:
                        break
                    self.cond.wait(left)
            batch = self._mergeable(first)
            for job in batch:
                self.queue.remove(job)
            self._gauge()
            return batch

    def _loop(self) -> None:
        while True:
            batch = self._next_batch()
            if batch is None:
                return
            live = [job for job in batch if job.future.set_running_or_notify_cancel()]
            if not live:
                continue
            now = time.monotonic()
            for job in live:
                self.metrics.queue_seconds.observe(now - job.enqueued)
            try:
                results = self.runner([job.payload for job in live])
            except BaseException as err:  # noqa: BLE001 - the runner's failure is every job's answer
                results = [err] * len(live)
            self.metrics.batch_requests.observe(len(live))
            for job, result in zip(live, results):
                if isinstance(result, BaseException):
                    job.future.set_exception(result)
                else:
                    job.future.set_result(result)

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()


class Batcher:
    """The lanes of one server process."""

    def __init__(self, runner: Runner, metrics: Metrics, max_wait_ms: float, max_batch_cells: int,
                 max_queue: int, n_lanes: int = N_LANES) -> None:
        self.max_queue = max_queue
        self.lanes = [Lane(i, runner, max_wait_ms / 1000.0, max_batch_cells, metrics) for i in range(n_lanes)]
        self.started = False

    def start(self) -> None:
        for lane in self.lanes:
            lane.thread.start()
        self.started = True

    def queued(self) -> int:
        return sum(len(lane.queue) for lane in self.lanes)

    def submit(self, group: Hashable, cost: int, cells: int, payload: Any) -> Future:
        """Queue a job in the lane of its cost; its Future gets the runner's result. 503 when full."""
        if self.queued() >= self.max_queue:
            raise ApiError(503, "overloaded", f"{self.max_queue} requests are queued already (tabfm serve "
                           "--max-queue); retry shortly", limit=self.max_queue, headers={"Retry-After": "1"})
        job = Job(group, cost, cells, payload)
        self.lanes[lane_of(cost, len(self.lanes))].put(job)
        return job.future

    def close(self, timeout: float | None = None) -> None:
        """Finish what is queued, then stop the threads."""
        for lane in self.lanes:
            lane.close()
        if self.started:
            for lane in self.lanes:
                lane.thread.join(timeout)
