"""How many forward passes of a prefix the node runs at once: measured on its cores, once per host.

A node's cores can run a prefix as one pass on all of them or as several passes at once,
each on its share (``parallel.ComputeTurns`` divides the cores among the passes running).
Which is fastest depends on the host and the model: one-thread passes spend no time
synchronising threads, but passes side by side share the caches and the memory bus, and
a CPU's bf16 units may need more than one thread to a pass to be kept fed. So the node
times the prefix in each layout (1, 2, 4, ... passes at once, and one per core) on its
own cores the first time a model runs there, with every compute slot held, and takes the
fastest. The result is kept in a file per state directory, keyed by the CPU and the cores,
so later loads and restarts measure nothing.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from hapi.measure import cpu_name
from hapi.wire import layout_key
from storage_side.admission import Admission
from storage_side.memory import autocast_context
from storage_side.parallel import ComputeTurns
from storage_side.prefix_cache import LoadedPrefix

log = logging.getLogger(__name__)

TIMED_ROUNDS = 2  # timed passes each of a layout's passes runs, after its warm-up
# A pass's first call sets up its kernels and memory. A warm-up on this many samples does
# that for a whole sub-batch too (ResNet-50 at 224 px on one core: the next pass of 16 took
# 2.35 s, those after it 2.30 and 2.33), at a fraction of a whole pass's time.
WARM_UP_SAMPLES = 2


@dataclass(frozen=True)
class Layout:
    """The passes a prefix runs at once on this node, and what each layout measured."""

    slots: int
    samples_per_s: dict[int, float]  # by passes at once

    def to_json(self) -> dict:
        return {"slots": self.slots, "samples_per_s": {str(k): v for k, v in self.samples_per_s.items()}}

    @classmethod
    def from_json(cls, body: dict) -> Layout:
        return cls(int(body["slots"]), {int(k): float(v) for k, v in body["samples_per_s"].items()})


def layouts_to_try(cores: int) -> list[int]:
    """Passes at once to time on ``cores``: the powers of two below it, and one per core."""
    counts = {cores}
    passes = 1
    while passes < cores:
        counts.add(passes)
        passes *= 2
    return sorted(counts)


def time_layout(stages: nn.Module, input_size: int, sub_batch: int, passes: int, threads: int,
                compute_dtype: torch.dtype) -> float:
    """Samples per second of ``passes`` forward passes side by side, each of ``sub_batch``
    random images on ``threads`` intra-op threads, over ``TIMED_ROUNDS`` passes after a
    warm-up."""
    start = threading.Barrier(passes + 1)
    end = threading.Barrier(passes + 1)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            torch.set_num_threads(threads)  # the calling thread's own, as in a compute turn
            x = torch.randn(sub_batch, 3, input_size, input_size)
            with torch.inference_mode(), autocast_context(compute_dtype):
                stages(x[:WARM_UP_SAMPLES])
                start.wait()
                for _ in range(TIMED_ROUNDS):
                    stages(x)
            end.wait()
        except BaseException as exc:  # noqa: BLE001  (re-raised by the caller)
            errors.append(exc)
            start.abort()
            end.abort()

    workers = [threading.Thread(target=run, name=f"layout-{i}", daemon=True) for i in range(passes)]
    for worker in workers:
        worker.start()
    try:
        start.wait()
        began = time.perf_counter()
        end.wait()
        elapsed = time.perf_counter() - began
    except threading.BrokenBarrierError:
        elapsed = 0.0
    for worker in workers:
        worker.join()
    if errors:
        raise errors[0]
    return passes * sub_batch * TIMED_ROUNDS / elapsed


def measure_layout(stages: nn.Module, input_size: int, sub_batch: int, cores: int, compute_dtype: torch.dtype,
                   most_passes: int) -> Layout:
    """Time each layout of up to ``most_passes`` passes at once on ``cores`` cores; the fastest wins."""
    rates = {passes: round(time_layout(stages, input_size, sub_batch, passes, max(1, cores // passes),
                                       compute_dtype), 1)
             for passes in layouts_to_try(cores) if passes <= most_passes}
    return Layout(max(rates, key=rates.__getitem__), rates)


class LayoutBook:
    """Layouts measured on this host, in a JSON file (None: kept in memory only): per node
    (its CPU, cores, compute dtype and sub-batch), per model and input size.

    Two daemons sharing a file may each measure a model once; the last write keeps both
    of theirs only if one read the other's, and a lost entry costs one more measurement.
    """

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._nodes: dict[str, dict[str, Layout]] = {}
        if path is not None and path.is_file():
            try:
                body = json.loads(path.read_text())
                self._nodes = {node: {model: Layout.from_json(layout) for model, layout in models.items()}
                               for node, models in body.items()}
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
                log.warning("ignoring unreadable pass layouts in %s (%s): they are measured again", path, exc)

    def node(self, node: str) -> dict[str, Layout]:
        """Every layout measured for ``node``, by model and input size."""
        return dict(self._nodes.get(node, {}))

    def get(self, node: str, model: str) -> Layout | None:
        return self._nodes.get(node, {}).get(model)

    def put(self, node: str, model: str, layout: Layout) -> None:
        self._nodes.setdefault(node, {})[model] = layout
        if self.path is None:
            return
        body = {node: {model: layout.to_json() for model, layout in models.items()}
                for node, models in self._nodes.items()}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            partial = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
            partial.write_text(json.dumps(body, indent=1))
            partial.replace(self.path)  # whole or not at all, for a reader at the same time
        except OSError as exc:
            log.warning("pass layouts not saved to %s (%s): measured again at the next start", self.path, exc)


class PassLayouts:
    """The passes each prefix runs at once here: from the book, else measured on its first use.

    A measurement holds every compute slot (no request's pass shares the cores with it)
    and memory for its passes, as requests' passes hold theirs; layouts whose passes the
    memory granted cannot hold are not tried.
    """

    def __init__(self, book: LayoutBook, turns: ComputeTurns, admission: Admission | None, sub_batch: int,
                 compute_dtype: torch.dtype) -> None:
        self.book = book
        self.turns = turns
        self.admission = admission
        self.sub_batch = sub_batch
        self.compute_dtype = compute_dtype
        dtype = str(compute_dtype).removeprefix("torch.")
        self.node = f"{cpu_name()} x{turns.cores} {dtype} sub-batch {sub_batch}"  # what a pass's time depends on
        self._lock = threading.Lock()  # one measurement at a time: each needs every core

    def measured(self) -> dict[str, int]:
        """Passes at once, by model and input size, of every model measured on this node."""
        return {model: layout.slots for model, layout in self.book.node(self.node).items()}

    def layout(self, prefix: LoadedPrefix) -> Layout | None:
        model, _, input_size = prefix.key  # the weights' values do not change a pass's time
        return self.book.get(self.node, layout_key(model, input_size))

    def slots(self, prefix: LoadedPrefix, job: str) -> int:
        """Passes of ``prefix`` at once; measured now (seconds) on its first use on this host."""
        most = self.turns.slots or 1
        one = prefix.memory.forward_bytes(len(prefix.stages), self.sub_batch)
        if most == 1 or (self.admission is not None and one > self.admission.capacity - prefix.memory.weights_bytes):
            return most  # one layout only, or none this node's memory could time: requests shrink their sub-batches
        if (layout := self.layout(prefix)) is None:
            with self._lock:
                if (layout := self.layout(prefix)) is None:
                    started = time.perf_counter()
                    layout = self._measure(prefix, job, one, most)
                    self.book.put(self.node, layout_key(prefix.key[0], prefix.key[2]), layout)
                    log.info("pass layout of %s on %s, measured in %.1f s: %d passes at once (samples/s by passes "
                             "at once: %s)", prefix.key, self.node, time.perf_counter() - started, layout.slots,
                             layout.samples_per_s)
        return min(layout.slots, most)

    def _measure(self, prefix: LoadedPrefix, job: str, one: int, most: int) -> Layout:
        """Time the layouts whose passes fit the memory granted for up to ``most`` of them."""
        reservation = self.admission.admit(job, one, most * one) if self.admission is not None else None
        try:
            fits = reservation.bytes // max(one, 1) if reservation is not None else most
            with self.turns.every_slot():
                return measure_layout(prefix.stages, prefix.key[2], self.sub_batch, self.turns.cores,
                                      self.compute_dtype, max(1, min(most, fits)))
        finally:
            if reservation is not None:
                reservation.release()
