"""Where a training batch's inputs come from: storage daemons (pushdown) or raw objects.

Both return the input of stage ``split`` for a list of samples, in order, so the loader
and the trainer run one code path whatever the mode.

Images arrive here as float32 model inputs, whatever crossed the network: uint8 crops
from a storage node (split 0's image wire dtype) are normalised as they arrive, and raw
objects are decoded here, on the CPUs or (``decode_device`` cuda) on the GPU with nvJPEG,
which also normalises them there; so every consumer receives float features.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, replace

import torch

from compute_side.client import RECEIVED, Extracted, StorageClient, StorageNodeError, hedge_deadline_s
from hapi.datasets import Sample, read_samples
from hapi.models import StagedModel
from hapi.planner import ALL_IN_COMPUTE, OnlinePlanner, Reply
from hapi.store import ObjectStore, SizeCheck
from hapi.transforms import TransformSpec, decode_crops, normalize, preprocess
from hapi.wire import IMAGE_WIRE_DTYPES, WIRE_DTYPES, ExtractRequest

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Part:
    """The inputs of stage ``split`` for one request's samples."""

    features: torch.Tensor  # float: images that crossed the network as uint8 are normalised already
    split: int  # the stage whose input these are; ALL_IN_COMPUTE: stage 0's, from raw objects
    dtype: str  # the wire dtype they crossed the network in (all-in-compute: float32 after decode)
    wire_bytes: int  # bytes that crossed the storage-compute network
    elapsed_ms: float  # wall time of the request, as the compute tier saw it
    link_interval: tuple[float, float]  # perf_counter times its bytes were on the link
    timings: dict[str, float] = field(default_factory=dict)  # where the source's time went, in ms
    tail_started: float | None = None  # perf_counter once the first half of its bytes had arrived
    link_bytes: int | None = None  # bytes the process received meanwhile, its own included (client.LinkMeter)


class PushdownSource:
    """Features extracted by storage daemons, spread round-robin over the nodes in rotation.

    Nothing is lost when nodes fail: a node that fails a request (unreachable, 5xx) is
    taken out of rotation at once and the request goes to the next; a request past its
    node's deadline (a multiple of that node's recent latencies) is hedged to another
    node and the late node probed; when no node answers, ``fallback`` (if given) computes
    the same features here. A sample that cannot be read (404, 422) fails the run by its key.
    """

    def __init__(self, clients: Sequence[StorageClient], template: ExtractRequest,
                 fallback: LocalPrefix | None = None, decode_device: torch.device | str = "cpu") -> None:
        self.clients = list(clients)
        self.template = template
        self.fallback = fallback
        self.decode_device = torch.device(decode_device)  # where uint8 images are normalised
        self._turn = itertools.count()

    @property
    def split(self) -> int:
        return self.template.split

    def fetch(self, samples: Sequence[Sample], epoch: int, order: int = 0) -> Part:
        request = replace(self.template, keys=tuple(s.key for s in samples), epoch=epoch, order=order)
        started = time.perf_counter()
        attempts: list[_Attempt] = []
        tried: set[int] = set()  # each node gets one try per request
        failure: StorageNodeError | None = None
        while True:
            pending = [a for a in attempts if not a.future.done()]
            for attempt in (a for a in attempts if a.future.done()):
                attempts.remove(attempt)
                try:
                    return self._part(request, attempt, started)
                except StorageNodeError as exc:
                    if exc.status is not None and exc.status < 500:
                        raise  # the request or a sample is at fault, not the node
                    attempt.client.breaker.trip(str(exc))
                    failure = exc
            overdue = [a for a in pending if a.overdue()]
            for attempt in overdue:
                attempt.client.breaker.suspect()
            if not pending or len(overdue) == len(pending):
                client = self._next_node(tried)
                if client is not None:
                    tried.add(id(client))
                    attempts.append(_Attempt.start(client, request, self._deadline(client)))
                    continue
            if self._none_left(pending, tried):
                return self._no_node_answers(request, samples, started, failure)
            if not pending:  # a node is being probed: its verdict comes within the probe's timeout
                time.sleep(POLL_S)
                continue
            # Wake at the next deadline, or soon after one passed to see the probe's verdict.
            wait([a.future for a in pending], timeout=min(max(a.remaining(), POLL_S) for a in pending),
                 return_when=FIRST_COMPLETED)

    def _none_left(self, pending: list[_Attempt], tried: set[int]) -> bool:
        """Whether no node can answer: the pending attempts' nodes are out, and so is every
        node not yet tried (a merely late node being probed is still waited for)."""
        return (all(a.client.breaker.out for a in pending)
                and all(c.breaker.out for c in self.clients if id(c) not in tried))

    def _next_node(self, tried: set[int]) -> StorageClient | None:
        """The next node in rotation not yet tried for this request, round-robin."""
        first = next(self._turn)
        for i in range(len(self.clients)):
            client = self.clients[(first + i) % len(self.clients)]
            if id(client) not in tried and client.breaker.in_rotation():
                return client
        return None

    def _deadline(self, client: StorageClient) -> float:
        """When to hedge a request to ``client``: by its own pace at this split, else by the
        other nodes', else generously (a node's first request also loads the model)."""
        key = (self.template.split, self.template.dtype)
        slowest = client.pace.slowest(key)
        if slowest is None:
            others = [s for s in (c.pace.slowest(key) for c in self.clients) if s is not None]
            slowest = max(others) if others else None
        return hedge_deadline_s(slowest) if slowest is not None else FIRST_DEADLINE_S

    def _part(self, request: ExtractRequest, attempt: _Attempt, started: float) -> Part:
        extracted = attempt.future.result()
        # A node's first request also loads the model: its pace is what it took beyond that.
        load_s = float(extracted.metadata.get("timings", {}).get("load_ms", 0.0)) / 1e3
        attempt.client.pace.record((request.split, request.dtype), time.perf_counter() - attempt.started - load_s)
        body = (extracted.body_started, extracted.body_started + extracted.body_s)
        features = extracted.features
        if request.dtype in IMAGE_WIRE_DTYPES:
            features = normalize(features, request.transform, self.decode_device)
        return Part(features, request.split, request.dtype, extracted.wire_bytes,
                    (time.perf_counter() - started) * 1e3, body, dict(extracted.metadata.get("timings", {})),
                    extracted.tail_started, extracted.link_bytes)

    def _no_node_answers(self, request: ExtractRequest, samples: Sequence[Sample], started: float,
                         failure: StorageNodeError | None) -> Part:
        if self.fallback is None:
            if failure is not None:
                raise failure
            raise StorageNodeError(", ".join(c.url for c in self.clients), None, "unreachable",
                                   "no node in rotation answers")
        part = self.fallback.fetch(request, samples)
        return replace(part, elapsed_ms=(time.perf_counter() - started) * 1e3)


# The node's timings of a request that follow one another in its wall time (the others
# are CPU readings and shares of these). The reply's encoding is timed after its header
# is written, so it reaches the daemon's metrics only, and counts here as the link's.
NODE_PHASES = ("load_ms", "queue_ms", "fetch_ms", "turn_wait_ms", "decode_wait_ms", "forward_ms")

# A request to a node with no measured pace at its split is hedged after this long: its
# first request may load the model; a hung node at the very start costs this once.
FIRST_DEADLINE_S = 30.0
# How often a request past its deadline looks again whether its node was found dead.
POLL_S = 0.2


@dataclass
class _Attempt:
    """One node's try at a request, on a daemon thread: an attempt hung on a stopped node
    is abandoned, never joined, so it holds up neither the run nor the interpreter's exit."""

    client: StorageClient
    future: Future[Extracted]
    started: float  # perf_counter
    deadline_s: float

    @classmethod
    def start(cls, client: StorageClient, request: ExtractRequest, deadline_s: float) -> _Attempt:
        future: Future[Extracted] = Future()

        def run() -> None:
            future.set_running_or_notify_cancel()
            try:
                future.set_result(client.extract(request))
            except BaseException as exc:  # handed to the waiting fetch, which decides
                future.set_exception(exc)

        threading.Thread(target=run, daemon=True, name="extract").start()
        return cls(client, future, time.perf_counter(), deadline_s)

    def remaining(self) -> float:
        return self.started + self.deadline_s - time.perf_counter()

    def overdue(self) -> bool:
        return self.remaining() <= 0


class LocalPrefix:
    """The storage tier's work done here, for when no node answers: the raw objects read
    with the store client and preprocessed exactly as ``RawObjectSource`` does, then the
    model's frozen stages [0, split) in eval mode. Invariant 1 makes these the features a
    node would have sent, so the part keeps the request's split and dtype and the trainer
    and loader see no difference. It says so once per run."""

    def __init__(self, store: ObjectStore, model: StagedModel, decode_device: torch.device | str = "cpu") -> None:
        self.store = store
        self.model = model
        self.decode_device = torch.device(decode_device)
        self._lock = threading.Lock()
        self._raw: dict[TransformSpec, RawObjectSource] = {}
        self._warned = False

    def fetch(self, request: ExtractRequest, samples: Sequence[Sample]) -> Part:
        self._warn_once(request.split)
        raw = self._raw_source(request.transform).fetch(samples, request.epoch)
        started = time.perf_counter()
        # The frozen stages are shared with the trainer, which keeps them in eval mode and
        # never trains them (check_split: the split is never past the freeze index).
        prefix = self.model.prefix(request.split).eval()
        with torch.no_grad():  # not inference_mode: the trainer's head may take these as input
            features = prefix(raw.features)
        if request.dtype not in IMAGE_WIRE_DTYPES:  # an image dtype's crops arrive normalised: as these are
            features = features.to(WIRE_DTYPES[request.dtype])
        timings = {**raw.timings, "local_forward_ms": (time.perf_counter() - started) * 1e3}
        return Part(features, request.split, request.dtype, raw.wire_bytes, raw.elapsed_ms, raw.link_interval,
                    timings)

    def _raw_source(self, transform: TransformSpec) -> RawObjectSource:
        with self._lock:
            if transform not in self._raw:
                self._raw[transform] = RawObjectSource(self.store, transform, decode_device=self.decode_device)
            return self._raw[transform]

    def _warn_once(self, split: int) -> None:
        with self._lock:
            if self._warned:
                return
            self._warned = True
        log.warning("no storage node answers: reading raw objects and running stages [0, %d) here "
                    "until one does", split)


# GETs in flight in the all-in-compute baseline's loader.
IO_THREADS = 16


class RawObjectSource:
    """The all-in-compute baseline: raw objects fetched with concurrent GETs, decoded here.

    As fast as a good S3 loader: one shared client, ``io_threads`` GETs in flight, and
    decoding on the same threads (torchvision's decoders release the GIL). With a CUDA
    ``decode_device`` a request's JPEGs are decoded together on the GPU (nvJPEG), cropped
    and normalised there, and its features stay there: a GPU node's own CPUs decode
    slower than its GPU trains.
    """

    split = ALL_IN_COMPUTE  # inputs of stage 0, from raw objects

    def __init__(self, store: ObjectStore, transform: TransformSpec, io_threads: int = IO_THREADS,
                 decode_device: torch.device | str = "cpu") -> None:
        self.store = store
        self.transform = transform
        self.decode_device = torch.device(decode_device)
        self.pool = ThreadPoolExecutor(io_threads, thread_name_prefix="get")

    def fetch(self, samples: Sequence[Sample], epoch: int, order: int = 0) -> Part:
        """``order``: the store serves reads as they come."""
        keys = [s.key for s in samples]
        started, received = time.perf_counter(), RECEIVED.total
        blobs = read_samples(_Metered(self.store), keys, self.pool)
        fetched, link_bytes = time.perf_counter(), RECEIVED.total - received
        if self.decode_device.type == "cuda":
            crops = decode_crops(blobs, keys, self.transform, epoch, self.decode_device)
            features = normalize(crops, self.transform)
        else:
            features = torch.stack(list(self.pool.map(lambda kb: preprocess(kb[1], kb[0], self.transform, epoch),
                                                      zip(keys, blobs))))
        elapsed_ms = (time.perf_counter() - started) * 1e3
        timings = {"fetch_ms": (fetched - started) * 1e3, "decode_ms": elapsed_ms - (fetched - started) * 1e3}
        return Part(features, ALL_IN_COMPUTE, "float32", sum(len(b) for b in blobs), elapsed_ms,
                    (started, fetched), timings, link_bytes=link_bytes)


class _Metered:
    """``store``, its reads counted on the link meter as each object arrives."""

    def __init__(self, store: ObjectStore) -> None:
        self.store = store

    def get(self, key: str, max_bytes: int | None = None, on_size: SizeCheck | None = None) -> bytes:
        data = self.store.get(key, max_bytes=max_bytes, on_size=on_size)
        RECEIVED.add(len(data))
        return data


FeatureSource = PushdownSource | RawObjectSource


class Sources:
    """The (train, validation) sources of each candidate, built once and kept.

    Given the ``model``, pushdown sources fall back to running its prefix here when no
    storage node answers; without it, they fail then. ``decode_device`` is where this tier
    turns images into model inputs: raw objects decoded (CUDA: nvJPEG on the GPU) and uint8
    crops from storage nodes normalised; pass the trainer's device on a GPU host.
    """

    def __init__(self, clients: Sequence[StorageClient], store: ObjectStore, template: ExtractRequest,
                 eval_transform: TransformSpec, model: StagedModel | None = None,
                 decode_device: torch.device | str = "cpu") -> None:
        self.clients, self.store, self.template, self.eval_transform = list(clients), store, template, eval_transform
        self.decode_device = torch.device(decode_device)
        self.fallback = LocalPrefix(store, model, self.decode_device) if model is not None else None
        self._built: dict[tuple[int, str], tuple[FeatureSource, FeatureSource]] = {}

    def build(self, split: int, dtype: str) -> tuple[FeatureSource, FeatureSource]:
        if (split, dtype) not in self._built:
            # Validation never augments: the same centre crop on every run.
            if split == ALL_IN_COMPUTE:
                pair = (RawObjectSource(self.store, self.template.transform, decode_device=self.decode_device),
                        RawObjectSource(self.store, self.eval_transform, decode_device=self.decode_device))
            else:
                train = replace(self.template, split=split, dtype=dtype)
                pair = (PushdownSource(self.clients, train, self.fallback, self.decode_device),
                        PushdownSource(self.clients, replace(train, transform=self.eval_transform), self.fallback,
                                       self.decode_device))
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
        candidate = self.planner.pick(samples, training=not self.validation)
        return self.sources.build(candidate.split, candidate.dtype)[self.validation]

    def cached(self, samples: int) -> None:
        pass  # a cache hit tells the planner nothing of the link or a node

    def scout(self, samples: int) -> tuple[FeatureSource, int] | None:
        if self.validation:
            return None
        scout = self.planner.scout(samples)
        return None if scout is None else (self.sources.build(scout[0].split, scout[0].dtype)[0], scout[1])

    def arrived(self, part: Part, samples: int) -> None:
        if "local_forward_ms" in part.timings:
            return  # computed here, with no node answering: it tells nothing of the link or a node
        # The link's share of a request alone on it is all its time but the node's own work:
        # the request and the reply's headers, too, cross the link, and a short reply's body
        # alone is read at the rate of a shaper's burst or of an unthrottled first window.
        # A reply sharing the link is read over its body, while the meter counted the link's bytes.
        reply = Reply(part.split, part.dtype, samples, part.wire_bytes, part.link_interval, part.timings,
                      part.tail_started, part.link_bytes)
        if part.split != ALL_IN_COMPUTE and reply.alone:
            start, end = part.link_interval
            node_ms = sum(part.timings.get(name, 0.0) for name in NODE_PHASES)
            reply = replace(reply, link_interval=(min(start, end - max(part.elapsed_ms - node_ms, 0.0) / 1e3), end))
        self.planner.arrived(reply)
