"""Where a training batch's inputs come from: storage daemons (pushdown) or raw objects.

Both return the input of stage ``split`` for a list of samples, in order, so the loader
and the trainer run one code path whatever the mode.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

import torch

from compute_side.client import StorageClient, StorageNodeError
from hapi.datasets import Sample, read_samples
from hapi.planner import ALL_IN_COMPUTE, OnlinePlanner, Reply
from hapi.store import ObjectStore
from hapi.transforms import TransformSpec, preprocess
from hapi.wire import ExtractRequest

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Part:
    """The inputs of stage ``split`` for one request's samples."""

    features: torch.Tensor
    split: int  # the stage whose input these are; ALL_IN_COMPUTE: stage 0's, from raw objects
    dtype: str  # the wire dtype they crossed the network in (all-in-compute: float32 after decode)
    wire_bytes: int  # bytes that crossed the storage-compute network
    elapsed_ms: float  # wall time of the request, as the compute tier saw it
    link_interval: tuple[float, float]  # perf_counter times its bytes were on the link
    timings: dict[str, float] = field(default_factory=dict)  # where the source's time went, in ms


class PushdownSource:
    """Features extracted by storage daemons, spread round-robin over the nodes.

    A node that is unreachable or fails (5xx) is skipped for the next one, so one dead
    node loses nothing; a sample that cannot be read (404, 422) fails the run by its key.
    """

    def __init__(self, clients: Sequence[StorageClient], template: ExtractRequest) -> None:
        self.clients = list(clients)
        self.template = template
        self._turn = itertools.count()

    @property
    def split(self) -> int:
        return self.template.split

    def fetch(self, samples: Sequence[Sample], epoch: int) -> Part:
        request = replace(self.template, keys=tuple(s.key for s in samples), epoch=epoch)
        first = next(self._turn)
        for attempt in range(len(self.clients)):
            client = self.clients[(first + attempt) % len(self.clients)]
            started = time.perf_counter()
            try:
                extracted = client.extract(request)
            except StorageNodeError as exc:
                node_failed = exc.status is None or exc.status >= 500
                if not node_failed or attempt == len(self.clients) - 1:
                    raise
                log.warning("%s; retrying on another node", exc)
                continue
            body = (extracted.body_started, extracted.body_started + extracted.body_s)
            return Part(extracted.features, request.split, request.dtype, extracted.wire_bytes,
                        (time.perf_counter() - started) * 1e3, body, dict(extracted.metadata.get("timings", {})))
        raise AssertionError("unreachable: the loop returns or raises")


# GETs in flight in the all-in-compute baseline's loader.
IO_THREADS = 16


class RawObjectSource:
    """The all-in-compute baseline: raw objects fetched with concurrent GETs, decoded here.

    As fast as a good S3 loader: one shared client, ``io_threads`` GETs in flight, and
    decoding on the same threads (torchvision's decoders release the GIL).
    """

    split = ALL_IN_COMPUTE  # inputs of stage 0, from raw objects

    def __init__(self, store: ObjectStore, transform: TransformSpec, io_threads: int = IO_THREADS) -> None:
        self.store = store
        self.transform = transform
        self.pool = ThreadPoolExecutor(io_threads, thread_name_prefix="get")

    def fetch(self, samples: Sequence[Sample], epoch: int) -> Part:
        keys = [s.key for s in samples]
        started = time.perf_counter()
        blobs = read_samples(self.store, keys, self.pool)
        fetched = time.perf_counter()
        inputs = list(self.pool.map(lambda kb: preprocess(kb[1], kb[0], self.transform, epoch), zip(keys, blobs)))
        elapsed_ms = (time.perf_counter() - started) * 1e3
        timings = {"fetch_ms": (fetched - started) * 1e3, "decode_ms": elapsed_ms - (fetched - started) * 1e3}
        return Part(torch.stack(inputs), ALL_IN_COMPUTE, "float32", sum(len(b) for b in blobs), elapsed_ms,
                    (started, fetched), timings)


FeatureSource = PushdownSource | RawObjectSource


class Sources:
    """The (train, validation) sources of each candidate, built once and kept."""

    def __init__(self, clients: Sequence[StorageClient], store: ObjectStore, template: ExtractRequest,
                 eval_transform: TransformSpec) -> None:
        self.clients, self.store, self.template, self.eval_transform = list(clients), store, template, eval_transform
        self._built: dict[tuple[int, str], tuple[FeatureSource, FeatureSource]] = {}

    def build(self, split: int, dtype: str) -> tuple[FeatureSource, FeatureSource]:
        if (split, dtype) not in self._built:
            # Validation never augments: the same centre crop on every run.
            if split == ALL_IN_COMPUTE:
                pair = (RawObjectSource(self.store, self.template.transform),
                        RawObjectSource(self.store, self.eval_transform))
            else:
                train = replace(self.template, split=split, dtype=dtype)
                pair = (PushdownSource(self.clients, train),
                        PushdownSource(self.clients, replace(train, transform=self.eval_transform)))
            self._built[(split, dtype)] = pair
        return self._built[(split, dtype)]


class Planned:
    """Steers a loader by the online planner: each batch goes to the source of the
    candidate the planner picks for it, and every reply teaches the planner."""

    def __init__(self, planner: OnlinePlanner, sources: Sources, validation: bool = False) -> None:
        self.planner, self.sources, self.validation = planner, sources, validation

    @property
    def settled(self) -> bool:
        return self.planner.settled

    def pick(self, samples: int) -> FeatureSource:
        candidate = self.planner.pick(samples)
        return self.sources.build(candidate.split, candidate.dtype)[self.validation]

    def arrived(self, part: Part, samples: int) -> None:
        self.planner.arrived(Reply(part.split, part.dtype, samples, part.wire_bytes, part.link_interval,
                                   part.timings))
