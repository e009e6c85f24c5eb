"""Turns an epoch of samples into batches of features fetched from storage daemons.

Each training batch is split into requests of at most ``request_size`` samples, spread
round-robin over the storage nodes; the features are reassembled in sample order, so
the trainer sees exactly the user's batch whatever the storage side did. ``prefetch``
batches are fetched ahead while the current one trains.
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace

import torch

from compute_side.client import StorageClient
from hapi.datasets import Sample
from hapi.wire import ExtractRequest


@dataclass(frozen=True)
class Batch:
    features: torch.Tensor
    labels: torch.Tensor
    keys: tuple[str, ...]
    wire_bytes: int  # bytes received for this batch
    raw_bytes: int  # bytes of the encoded images it covers
    wait_s: float = 0.0  # time the trainer waited for it


def epoch_order(samples: Sequence[Sample], epoch: int, seed: int, shuffle: bool) -> list[Sample]:
    """The samples of one epoch, shuffled reproducibly from (seed, epoch)."""
    order = list(samples)
    if shuffle:
        random.Random(f"{seed}/{epoch}").shuffle(order)
    return order


def batches_of(samples: Sequence[Sample], batch_size: int) -> list[list[Sample]]:
    return [list(samples[i: i + batch_size]) for i in range(0, len(samples), batch_size)]


class FeatureLoader:
    """Fetches batches of features through storage daemons, ``prefetch`` batches ahead."""

    def __init__(self, clients: Sequence[StorageClient], template: ExtractRequest,
                 request_size: int = 32, prefetch: int = 1) -> None:
        self.clients = list(clients)
        self.template = template
        self.request_size = request_size
        self.prefetch = prefetch
        self._next_client = 0

    def _fetch(self, batch: list[Sample], epoch: int) -> Batch:
        parts = []
        for start in range(0, len(batch), self.request_size):
            chunk = batch[start: start + self.request_size]
            client = self.clients[self._next_client % len(self.clients)]
            self._next_client += 1
            request = replace(self.template, keys=tuple(s.key for s in chunk), epoch=epoch)
            parts.append(client.extract(request))
        return Batch(
            features=torch.cat([p.features for p in parts]) if len(parts) > 1 else parts[0].features,
            labels=torch.tensor([s.label for s in batch]),
            keys=tuple(s.key for s in batch),
            wire_bytes=sum(p.wire_bytes for p in parts),
            raw_bytes=sum(s.size for s in batch),
        )

    def epoch(self, batches: Sequence[list[Sample]], epoch: int) -> Iterator[Batch]:
        """Yield the features of ``batches`` in order, keeping ``prefetch`` in flight."""
        with ThreadPoolExecutor(max(self.prefetch, 1), thread_name_prefix="fetch") as pool:
            pending: deque[Future[Batch]] = deque()
            upcoming = iter(batches)
            try:
                for batch in upcoming:
                    pending.append(pool.submit(self._fetch, batch, epoch))
                    if len(pending) > self.prefetch:
                        yield self._wait(pending.popleft())
                while pending:
                    yield self._wait(pending.popleft())
            finally:
                for future in pending:
                    future.cancel()

    @staticmethod
    def _wait(future: Future[Batch]) -> Batch:
        started = time.perf_counter()
        batch = future.result()
        return replace(batch, wait_s=time.perf_counter() - started)
