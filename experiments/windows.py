"""Steady-state windows: how fast a loader feeds training once its pipeline is full.

Measurement tools of the experiments (the split sweep, paired windows). The clock starts
once the pipeline is full (after a warm-up) and stops while it still is: a window that
drains the pipeline would be flattered by work fetched before the clock started.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Sequence
from contextlib import closing

from compute_side.loader import Batch, PipelinedLoader, Source, batches_of
from hapi.datasets import Sample


def train_paces_ms(loader: PipelinedLoader, train_step: Callable[[Batch], object],
                   batches: Sequence[Sequence[Sample]], warmup: int, timed: int, windows: int = 1,
                   give_up_ms: float = float("inf")) -> tuple[list[float], bool]:
    """(milliseconds per iteration of ``loader`` feeding ``train_step`` in steady state, one
    per window; stopped early).

    ``windows`` clocks of ``timed`` iterations run back to back from the end of iteration
    ``warmup``; ``batches`` should hold the loader's depth more, so that the last window ends
    with the pipeline still full. A run that has spent ``give_up_ms`` per iteration stops
    there, and its time so far is kept, for every window, as a lower bound.
    """
    first = time.perf_counter()
    marks = [first] if warmup == 0 else []  # the clock's start, then each window's end
    iterations = warmup + windows * timed
    with closing(loader.epoch(batches, epoch=0)) as stream:  # closing waits for the requests in flight
        for i, batch in enumerate(stream):
            train_step(batch)
            now = time.perf_counter()
            # The clock covers waiting for and training each batch.
            if i + 1 >= warmup and (i + 1 - warmup) % timed == 0:
                marks.append(now)
            if now - first > give_up_ms / 1e3 * iterations:
                return [(now - first) * 1e3 / (i + 1)] * windows, True
            if i + 1 == iterations:
                return [(end - start) * 1e3 / timed for start, end in zip(marks, marks[1:])], False
    raise ValueError(f"{len(batches)} batches cannot cover {warmup} warm-up and {windows} x {timed} timed iterations")


def in_flight(batch_size: int, request_size: int, depth: int) -> int:
    """Batches in flight with ``depth`` requests of ``request_size`` samples."""
    return max(1, math.ceil(max(depth, 1) / math.ceil(batch_size / request_size)))


def window_ms(source: Source, train_step: Callable[[Batch], object], samples: Sequence[Sample], batch_size: int,
              request_size: int, depth: int, warmup: int, timed: int,
              give_up_ms: float = float("inf")) -> tuple[float, bool]:
    """(ms per iteration, stopped early) of training from ``source`` through ``depth``
    requests in flight: ``timed`` iterations after ``warmup``, with as many batches again in
    flight when the clock stops, ``samples`` cycled as often as that needs."""
    count = warmup + timed + in_flight(batch_size, request_size, depth)
    batches = batches_of(list(itertools.islice(itertools.cycle(samples), count * batch_size)), batch_size)
    paces, stopped = train_paces_ms(PipelinedLoader(source, request_size, depth), train_step, batches, warmup, timed,
                                    give_up_ms=give_up_ms)
    return paces[0], stopped
