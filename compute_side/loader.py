"""Turns an epoch of samples into training batches, with requests in flight ahead.

Each batch is cut into requests of at most ``request_size`` samples that never straddle
a shard object; ``depth`` requests stay in flight (across however many storage nodes)
while the trainer works, and features are reassembled in sample order, so the optimiser
sees exactly the user's batch whatever the storage side did.
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from itertools import groupby
from typing import Protocol, runtime_checkable

import torch

from compute_side.feature_cache import Advance, CacheScope
from compute_side.sources import Part
from hapi.datasets import Sample


class Source(Protocol):
    split: int

    def fetch(self, samples: Sequence[Sample], epoch: int, order: int = 0) -> Part:
        """``order``: the samples' batch's place in the run's stream, for a node to serve a
        job's requests in."""


@runtime_checkable
class Steering(Protocol):
    """Chooses the source of each batch as it is sent, and hears every reply."""

    settled: bool  # false: send nothing more until the batches in flight have arrived

    def pick(self, samples: int) -> Source: ...

    def arrived(self, part: Part, samples: int) -> None: ...

    def cached(self, samples: int) -> None:
        """A batch was served from the feature cache instead: no source was picked for it."""

    def scout(self, samples: int) -> tuple[Source, int] | None:
        """While unsettled, a source and a number of the first batch's samples to send it
        alone, ahead of the rest (which go where ``pick`` says once it has arrived); None:
        the first batch goes whole to ``pick``'s source."""


class Fixed:
    """One source for every batch."""

    settled = True

    def __init__(self, source: Source) -> None:
        self.source = source

    def pick(self, samples: int) -> Source:
        return self.source

    def arrived(self, part: Part, samples: int) -> None:
        pass

    def cached(self, samples: int) -> None:
        pass

    def scout(self, samples: int) -> None:
        return None


@dataclass(frozen=True)
class Batch:
    features: torch.Tensor
    labels: torch.Tensor
    keys: tuple[str, ...]
    split: int  # the stage whose input ``features`` are (ALL_IN_COMPUTE: raw objects, stage 0)
    dtype: str  # the wire dtype they came in (of its last request, where a scout went ahead)
    wire_bytes: int  # bytes received for this batch
    raw_bytes: int  # bytes of the encoded images it covers
    requests: int
    wait_s: float  # time the trainer waited for it
    elapsed_ms: float  # summed wall time of its requests
    timings: dict[str, float] = field(default_factory=dict)  # summed over its requests, ms
    cached: bool = False  # served from the feature cache: nothing crossed the network, no planner heard of it


def epoch_order(samples: Sequence[Sample], epoch: int, seed: int, shuffle: bool = True) -> list[Sample]:
    """The samples of one epoch, shuffled reproducibly from (seed, epoch).

    Sharded samples are shuffled in two levels, the order of shards and the order within
    each, so consecutive samples (one request) still come from one shard object.
    """
    order = list(samples)
    if not shuffle:
        return order
    rng = random.Random(f"{seed}/{epoch}")
    groups = [list(g) for _, g in groupby(sorted(order, key=lambda s: s.object_key), key=lambda s: s.object_key)]
    rng.shuffle(groups)
    for group in groups:
        rng.shuffle(group)
    return [s for group in groups for s in group]


def batches_of(samples: Sequence[Sample], batch_size: int) -> list[list[Sample]]:
    return [list(samples[i: i + batch_size]) for i in range(0, len(samples), batch_size)]


def requests_of(batch: Sequence[Sample], request_size: int) -> list[list[Sample]]:
    """Cut a batch into requests: runs of one shard object, at most ``request_size`` each."""
    out = []
    for _, run in groupby(batch, key=lambda s: s.object_key if "#" in s.key else ""):
        run = list(run)
        out += [run[i: i + request_size] for i in range(0, len(run), request_size)]
    return out


class PipelinedLoader:
    """Yields batches in order while up to ``depth`` requests are in flight.

    ``depth`` 0 fetches each batch only when the trainer asks for it: no overlap, the
    baseline of the overlap benchmark. ``source`` is one source, or a ``Steering`` that
    picks each batch's source as it is sent (all of a batch's requests go to it).

    With a ``cache``, a batch whose samples it holds is served from it whole: none of its
    requests leave, and the steering neither picks a source for it nor hears of it (a
    cache hit says nothing of the link or a node). Every reply is kept in it.

    With ``advance`` (the model's frozen stages), an unsettled steering may send a scout:
    the first of the first batch's samples alone, to a source of its choosing, so that the
    rest of the batch and the next ones go where its reply says. The scout's features are
    run on here to the split the rest arrive at, and the optimiser still sees one batch.
    """

    def __init__(self, source: Source | Steering, request_size: int = 32, depth: int = 4,
                 cache: CacheScope | None = None, advance: Advance | None = None) -> None:
        self.steering = source if isinstance(source, Steering) else Fixed(source)
        self.request_size = request_size
        self.depth = depth
        self.cache = cache
        self.advance = advance

    def epoch(self, batches: Sequence[Sequence[Sample]], epoch: int, first: int = 0) -> Iterator[Batch]:
        """The batches, assembled in order; ``first``: the place of the first in the run's
        stream of batches (the order a node serves a job's requests in)."""
        plans = [requests_of(batch, self.request_size) for batch in batches]
        steering = self.steering
        if self.depth == 0:
            for index, (batch, plan) in enumerate(zip(batches, plans)):
                started = time.perf_counter()
                hit = self.cache.get(batch) if self.cache is not None else None
                if hit is not None:
                    steering.cached(len(batch))
                    yield _assemble(batch, [hit], time.perf_counter() - started, cached=True)
                    continue
                source = steering.pick(len(batch))
                parts = []
                for chunk in plan:
                    parts.append(source.fetch(chunk, epoch, first + index))
                    steering.arrived(parts[-1], len(chunk))
                self._keep(plan, parts)
                yield _assemble(batch, parts, time.perf_counter() - started)
            return
        queue = [(i, chunk) for i, plan in enumerate(plans) for chunk in plan]
        queue.reverse()  # popped from the end
        in_flight: deque[tuple[int, Future[Part], list[Sample], bool]] = deque()  # (batch, part, samples, cached)
        # A batch's requests all go to the source picked when its first one left, so a
        # switch of source takes effect at a batch boundary; a scout's go to its own.
        batch_source: dict[int, Source] = {}
        scouted: dict[int, int] = {}  # the batch whose scout went ahead: its samples
        with ThreadPoolExecutor(self.depth, thread_name_prefix="fetch") as pool:
            def send(source: Source, index: int, samples: list[Sample]) -> None:
                in_flight.append((index, pool.submit(source.fetch, samples, epoch, first + index), samples, False))

            def top_up() -> None:
                while len(in_flight) < self.depth and queue:
                    index, chunk = queue[-1]
                    if not steering.settled and in_flight and (scouted or index != in_flight[0][0]):
                        return  # unsettled: only the batch (or its scout) in flight until it has arrived
                    if index not in batch_source:
                        hit = self.cache.get(batches[index]) if self.cache is not None else None
                        if hit is not None:  # in line with the requests, so batches still come in order
                            steering.cached(len(batches[index]))
                            while queue and queue[-1][0] == index:
                                queue.pop()
                            served: Future[Part] = Future()
                            served.set_result(hit)
                            in_flight.append((index, served, list(batches[index]), True))
                            continue
                        scout = (steering.scout(len(batches[index]))
                                 if not steering.settled and not in_flight and self.advance is not None else None)
                        if scout is not None:
                            source, samples = scout
                            ahead, rest = chunk[:samples], chunk[samples:]
                            queue.pop()
                            if rest:
                                queue.append((index, rest))
                            scouted[index] = len(ahead)
                            send(source, index, ahead)
                            continue
                        batch_source[index] = steering.pick(len(batches[index]) - scouted.get(index, 0))
                    queue.pop()
                    send(batch_source[index], index, chunk)

            try:
                for index, batch in enumerate(batches):
                    top_up()
                    started = time.perf_counter()
                    parts, chunks, cached = [], [], False
                    while in_flight and in_flight[0][0] == index:
                        _, future, chunk, cached = in_flight.popleft()
                        parts.append(future.result())
                        chunks.append(chunk)
                        if not cached:
                            self.steering.arrived(parts[-1], len(chunk))
                        top_up()
                        if index in scouted and len(parts) == 1:
                            # The rest of the batch is on its way: meanwhile the scout's
                            # features run on to the split it comes at.
                            parts[0] = _advanced(parts[0], batch_source[index].split, self.advance)
                    if index in scouted:
                        parts = _on_one_device(parts)
                    if not cached:
                        self._keep(chunks, parts)
                    yield _assemble(batch, parts, time.perf_counter() - started, cached)
            finally:
                for _, future, _, _ in in_flight:
                    future.cancel()

    def _keep(self, chunks: Sequence[Sequence[Sample]], parts: Sequence[Part]) -> None:
        """Every reply goes into the cache, at the split its batch was trained at."""
        if self.cache is not None:
            for chunk, part in zip(chunks, parts):
                self.cache.put(chunk, part)


def _advanced(part: Part, split: int, advance: Advance) -> Part:
    """``part`` as the input of stage ``split``, run on through the frozen stages between
    (all-in-compute's decoded objects are stage 0's input, as split 0's images are)."""
    start, stop = max(part.split, 0), max(split, 0)
    return part if start >= stop else replace(part, features=advance(part.features, start, stop), split=stop)


def _on_one_device(parts: list[Part]) -> list[Part]:
    """The parts' features where the last part's are (a scout's, run on here, are on the CPU;
    the rest's may have been computed on a GPU here when no node answered)."""
    device = parts[-1].features.device
    return [p if p.features.device == device else replace(p, features=p.features.to(device)) for p in parts]


def _assemble(batch: Sequence[Sample], parts: list[Part], wait_s: float, cached: bool = False) -> Batch:
    timings: dict[str, float] = {}
    for part in parts:
        for name, ms in part.timings.items():
            timings[name] = timings.get(name, 0.0) + ms
    return Batch(
        features=torch.cat([p.features for p in parts]) if len(parts) > 1 else parts[0].features,
        labels=torch.tensor([s.label for s in batch]),
        keys=tuple(s.key for s in batch),
        split=parts[-1].split,
        dtype=parts[-1].dtype,
        wire_bytes=sum(p.wire_bytes for p in parts),
        raw_bytes=sum(s.size for s in batch),
        requests=0 if cached else len(parts),
        wait_s=wait_s,
        elapsed_ms=sum(p.elapsed_ms for p in parts),
        timings=timings,
        cached=cached,
    )
