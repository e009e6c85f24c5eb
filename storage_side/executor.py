"""Runs one extract request: admission, GET objects, decode, run the prefix in sub-batches, encode.

The sub-batch is the daemon's own choice: frozen stages run in eval mode, so a sample's
features do not depend on what it is batched with, and the daemon sizes sub-batches to
the memory it was granted without changing anything the trainer sees. Inside a request,
the next sub-batch is decoded (by worker processes, or threads: ``parallel``) while the
prefix runs on this thread.

Requests take turns to run their prefix, one per compute slot (and no more passes of a
prefix at once than its measured layout has, ``layout``), each pass on its share of the
cores (``parallel.ComputeTurns``), in about the order they came, and a job's own in
their order in its stream (``ExtractRequest.order``): requests sharing a core would all
finish late and together, leaving the link idle while they compute and then crowding it.
A request waiting for its turn has already fetched its objects and started decoding them.

On a CUDA device a request holds two reservations: host memory for its objects, decoded
sub-batches and features (as on the CPU), and GPU memory for the forward pass of one
sub-batch, from the prefix's memory model measured on the GPU; its sub-batch is the
largest both hold. GPU memory always comes first, host memory second: a request keeps
its prefix's weights (GPU memory) in use from the start, and a prefix load takes its
GPU memory before its host memory too, so nobody waits for GPU memory while holding
host memory, and a load never holds host memory that a request keeping a prefix the
load needs evicted waits for. The GPU reservation is released once the prefix is no
longer in use, so that release lets a load waiting for GPU memory evict it. (A request
waiting for GPU memory for its pass still keeps its prefix's weights: a load queued
ahead of it that needs them evicted waits until one of the two times out.) Forward
passes on the GPU run inside ``memory.device_work``, so a prefix's memory being
measured never sees their tensors come and go.

At split 0 with the uint8 wire dtype the decoded crops are shipped as they are, 0..255,
a quarter of their float32 bytes; the compute tier normalises them.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

import torch

from hapi.datasets import SHARD_SEPARATOR, read_samples
from hapi.models import ModelSpec, UnknownModelError, get_spec
from hapi.store import MissingObjectError, ObjectStore, is_plain_key
from hapi.transforms import check_pixels, preprocess_peak_bytes, read_header
from hapi.wire import IMAGE_WIRE_DTYPES, WIRE_DTYPES, ExtractRequest, encode_features
from storage_side.admission import Admission, Reservation
from storage_side.core_share import CoreShare
from storage_side.errors import Busy, RequestError
from storage_side.layout import PassLayouts
from storage_side.memory import CPU, PrefixMemory, SampleSizes, Staging, autocast_context, device_work
from storage_side.parallel import ComputeTurns, Decoder, PendingBatch, Place
from storage_side.prefix_cache import LoadedPrefix, PrefixCache

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RequestCost:
    """Bytes one request holds, by what it holds them for; linear in its sub-batch."""

    memory: PrefixMemory
    split: int
    samples: int
    wire_itemsize: int
    staging: Staging
    decoders: int  # decodes in flight at once, over the whole daemon
    on_device: bool = False  # the forward pass runs on a GPU: its bytes are ``device_bytes``

    def bytes(self, sub_batch: int) -> int:
        """Host memory."""
        out = self.memory.output_numel[self.split] * self.wire_itemsize
        # Held for the whole request: every sample's encoded bytes (freed as decoded, but
        # reserved throughout), its features, and their encoded copy for the response.
        resident = self.samples * (self.staging.raw_per_sample + 2 * out)
        # Held per sub-batch: the forward pass (on a GPU: the decoded sub-batch until it is
        # copied there), the next sub-batch being decoded, and the full-size images being
        # decoded for it (on threads or in worker processes).
        forward = (sub_batch * self.memory.input_bytes if self.on_device
                   else self.memory.forward_bytes(self.split, sub_batch))
        transient = (forward + sub_batch * self.memory.input_bytes
                     + min(sub_batch, self.decoders) * self.staging.decode_peak)
        return resident + transient

    def device_bytes(self, sub_batch: int) -> int:
        """GPU memory: one sub-batch's forward pass, its input included (0 on the CPU)."""
        return self.memory.forward_bytes(self.split, sub_batch) if self.on_device else 0

    def largest_device_sub_batch(self, nbytes: int, limit: int) -> int:
        """The largest sub-batch <= ``limit`` whose forward pass fits ``nbytes`` of GPU memory."""
        return max((k for k in range(1, limit + 1) if self.device_bytes(k) <= nbytes), default=0)

    def max_samples(self, nbytes: int) -> int:
        """The most samples a request can have and still fit ``nbytes`` one sample at a time."""
        one = replace(self, samples=1)
        per_sample = one.bytes(1) - replace(self, samples=0).bytes(1)
        return max(0, (nbytes - one.bytes(1)) // max(per_sample, 1) + 1)

    def largest_sub_batch(self, nbytes: int, limit: int) -> int:
        """The largest sub-batch <= ``limit`` whose cost fits ``nbytes``; 0 when not even one does."""
        low, high = 0, limit
        while low < high:
            mid = (low + high + 1) // 2
            low, high = (mid, high) if self.bytes(mid) <= nbytes else (low, mid - 1)
        return low


class FetchMeter:
    """Charges each object's bytes to a request's reservation before its body is read.

    The reservation was sized with an estimate of the samples' bytes; objects larger than
    estimated grow it while memory is free, and are refused otherwise: 413 when the
    request's objects could never fit this node, 503 + Retry-After when they could later.
    """

    def __init__(self, reservation: Reservation, admission: Admission, allowance: int, fixed: int,
                 max_object_bytes: int, shards: set[str]) -> None:
        self.reservation = reservation
        self.admission = admission
        self.allowance = allowance  # bytes of the reservation meant for the objects
        self.fixed = fixed  # the least the request needs besides its objects
        self.max_object_bytes = max_object_bytes
        self.shards = shards  # object keys held twice: whole, and as the members cut out of them
        self.charged = 0
        self._lock = threading.Lock()

    def __call__(self, object_key: str, size: int | None) -> None:
        # A store that does not say a size is read up to the cap: charge the cap.
        nbytes = (self.max_object_bytes if size is None else size) * (2 if object_key in self.shards else 1)
        with self._lock:
            self.charged += nbytes
            over = self.charged - self.allowance
            if over <= 0 or self.reservation.try_grow(self.reservation.bytes + over):
                self.allowance = max(self.allowance, self.charged)
                return
            most = self.admission.capacity - self.fixed
            if self.charged > most:
                raise RequestError(413, "objects_too_large",
                                   f"the request's objects hold over {self.charged} bytes (with shards counted "
                                   f"twice); this node has at most {max(most, 0)} for them: send fewer keys")
            raise Busy("memory_busy", f"the request's objects hold {self.charged} bytes, {over} more than "
                       "estimated, and that much memory is not free now; retry later",
                       self.admission.retry_after_s())


@dataclass
class RequestStats:
    """What one request did, for the response metadata, the metrics and the log."""

    sub_batch: int = 0
    threads: int = 0  # intra-op threads of its last forward pass
    reserved_bytes: int = 0
    raw_bytes: int = 0
    timings: dict[str, float] = field(default_factory=dict)


class Extractor:
    """Turns an ExtractRequest into an encoded features blob, within its memory reservation."""

    def __init__(self, store: ObjectStore, cache: PrefixCache, admission: Admission | None,
                 io_threads: int, decoder: Decoder, compute_turns: ComputeTurns, min_sub_batch: int,
                 max_sub_batch: int, compute_dtype: torch.dtype = torch.float32,
                 max_image_pixels: int = 1 << 26, max_object_bytes: int = 256 << 20,
                 dataset_prefixes: tuple[str, ...] = (), device: torch.device = CPU,
                 device_admission: Admission | None = None, layouts: PassLayouts | None = None) -> None:
        self.store = store
        self.core_share = CoreShare(os.sched_getaffinity(0), decoder.pids)  # what others take of its cores
        self.device = device
        self.device_admission = device_admission  # GPU memory, on a CUDA device with adaptation
        self.max_image_pixels = max_image_pixels
        self.max_object_bytes = max_object_bytes
        self.dataset_prefixes = tuple(p.rstrip("/") + "/" for p in dataset_prefixes)
        self.cache = cache
        self.admission = admission
        self.decoder = decoder
        self.compute_turns = compute_turns
        self.layouts = layouts  # passes of a prefix at once, measured; None: one per compute slot
        self.min_sub_batch = min_sub_batch
        self.max_sub_batch = max_sub_batch
        self.compute_dtype = compute_dtype
        self.pool = ThreadPoolExecutor(io_threads, thread_name_prefix="io")
        # Before any request has been seen: a ~100 KB JPEG of ~500x400 px, like ImageNet's.
        self.sample_sizes = SampleSizes(Staging(raw_per_sample=128 << 10, decode_peak=2 * 500 * 400 * 3))

    def servable(self, key: str) -> bool:
        """Whether this node serves ``key``: a plain key (its object's and its member's part)
        under one of the operator's data set prefixes, if any were configured."""
        object_key = key.split(SHARD_SEPARATOR, 1)[0]
        return (is_plain_key(object_key)
                and (not self.dataset_prefixes or object_key.startswith(self.dataset_prefixes)))

    def validate(self, request: ExtractRequest) -> None:
        for key in request.keys:
            if not self.servable(key):
                raise MissingObjectError(key)  # as a missing one: what lies outside is not told
        spec = self.validate_model(request.model, request.transform.crop_size)
        if not 0 <= request.split <= spec.freeze_index:
            raise RequestError(400, "bad_split",
                               f"split {request.split} out of range for {request.model}: 0..{spec.freeze_index} "
                               "(only frozen stages run on the storage tier)")

    @staticmethod
    def validate_model(model: str, input_size: int) -> ModelSpec:
        try:
            spec = get_spec(model)
        except UnknownModelError as exc:
            raise RequestError(400, "unknown_model", str(exc)) from None
        if spec.input_size_fixed_at_build and input_size % 16:
            raise RequestError(400, "bad_input_size", f"{model} needs a crop_size that is a multiple of 16")
        return spec

    def extract(self, request: ExtractRequest, stats: RequestStats) -> tuple[bytes, Reservation | None]:
        """The features blob, and the reservation still holding its bytes (release it once sent)."""
        self.validate(request)
        timings = stats.timings
        started = time.perf_counter()
        reservation = gpu_reservation = None
        try:
            with self.cache.lease(request.model, request.weights, request.transform.crop_size,
                                  request.job_id) as prefix:
                # Before the request holds memory: a first measurement of the prefix waits for its own.
                slots = self.layouts.slots(prefix, request.job_id) if self.layouts and request.split else None
                timings["load_ms"] = _ms_since(started)
                cost = RequestCost(prefix.memory, request.split, len(request.keys),
                                   WIRE_DTYPES[request.dtype].itemsize, self.sample_sizes.estimate(),
                                   self.decoder.workers, on_device=self.device.type == "cuda" and request.split > 0)
                # Both refusals for size come before any wait.
                host = self._host_range(request, cost)
                device = self._device_range(request, cost)
                started = time.perf_counter()
                # GPU memory before host memory, as a prefix load takes them: the lease
                # already keeps the prefix's weights on the GPU in use.
                if device is not None:
                    gpu_reservation = self.device_admission.admit(request.job_id, *device, request.order)
                if host is not None:
                    reservation = self.admission.admit(request.job_id, *host, request.order)
                timings["queue_ms"] = _ms_since(started)
                blob = self._run(request, prefix, cost, reservation, gpu_reservation, stats, slots)
        except BaseException:
            if reservation is not None:
                reservation.release()
            raise
        finally:
            # Once the prefix is idle: this release lets a load waiting for GPU memory evict it.
            if gpu_reservation is not None:
                gpu_reservation.release()
        if reservation is not None:
            # Until the response is sent, only the blob stays; the work is done, so the
            # request's turn passes on now, whenever the reply finishes going out.
            reservation.shrink(len(blob))
            reservation.keep()
        return blob, reservation

    def _host_range(self, request: ExtractRequest, cost: RequestCost) -> tuple[int, int] | None:
        """The (need, want) bytes of host memory to ask for; refuses a request that can never fit."""
        if self.admission is None:
            return None
        # The prefix's own weights stay loaded while it runs: the rest is all a request can ever get.
        most = self.admission.capacity - cost.memory.weights_bytes
        # Refused now only for what is known exactly (features, activations); the samples'
        # own bytes are an estimate until fetched, and are checked then.
        known = replace(cost, staging=Staging(0, 0))
        if known.bytes(1) > most:
            fits = cost.max_samples(most)  # with the samples' estimated bytes: a hint that should fit
            raise RequestError(413, "exceeds_memory",
                               f"{cost.samples} samples of {request.model} at split {request.split} need more "
                               f"than {known.bytes(1)} bytes even run one at a time; this node has at most {most} "
                               f"for a request: send at most {fits} keys per request", max_keys=fits)
        need = cost.bytes(min(self.min_sub_batch, self.max_sub_batch, cost.samples))
        if need > most:
            need = cost.bytes(1)  # the floor can never fit: smaller sub-batches beat a refusal
        need = min(need, most)
        want = max(need, cost.bytes(min(self.max_sub_batch, cost.samples)))
        return need, want

    def _device_range(self, request: ExtractRequest, cost: RequestCost) -> tuple[int, int] | None:
        """The (need, want) bytes of GPU memory for the forward pass; refuses a request that can never fit."""
        if self.device_admission is None or not cost.on_device:
            return None
        most = self.device_admission.capacity - cost.memory.weights_bytes
        if cost.device_bytes(1) > most:
            raise RequestError(413, "exceeds_gpu_memory",
                               f"one sample of {request.model} at split {request.split} needs {cost.device_bytes(1)} "
                               f"bytes of GPU memory; this node has at most {most} for a request (raise "
                               "--gpu-memory-budget)")
        need = cost.device_bytes(min(self.min_sub_batch, self.max_sub_batch, cost.samples))
        if need > most:
            need = cost.device_bytes(1)
        want = max(need, cost.device_bytes(min(self.max_sub_batch, cost.samples)))
        return need, want

    def _run(self, request: ExtractRequest, prefix: LoadedPrefix, cost: RequestCost, reservation: Reservation | None,
             gpu_reservation: Reservation | None, stats: RequestStats, slots: int | None) -> bytes:
        timings = stats.timings
        self.core_share.started()
        try:
            with self.compute_turns.place(request.job_id, request.order, slots) as place:
                features = self._features(request, prefix, cost, reservation, gpu_reservation, stats, place)
        except BaseException:
            self.core_share.finished(0)
            raise
        n = len(request.keys)
        others_ms = self.core_share.finished(n)
        if others_ms is not None:
            timings["others_cpu_ms"] = round(others_ms * n, 3)
        # Of the time this request waited, the part spent behind other jobs' requests (a
        # share by how many jobs are active, of what it did not wait for its own job's
        # earlier ones): what a busy node costs this job. The rest was its own requests
        # queueing behind each other, which the node's work already counts.
        jobs = self.admission.jobs_active if self.admission else 1
        waited_ms = timings.get("queue_ms", 0.0) + timings["turn_wait_ms"] - place.behind_s * 1e3
        timings["shared_wait_ms"] = round(waited_ms * (1 - 1 / max(jobs, 1)), 3)
        started = time.perf_counter()
        stage_name = prefix.stage_names[request.split - 1] if request.split else "input"
        metadata = {"split": request.split, "stage": stage_name, "timings": timings,
                    "raw_bytes": stats.raw_bytes, "sub_batch": stats.sub_batch, "threads": stats.threads}
        blob = encode_features(features, request.keys, metadata)
        timings["encode_ms"] = _ms_since(started)
        return blob

    def _features(self, request: ExtractRequest, prefix: LoadedPrefix, cost: RequestCost,
                  reservation: Reservation | None, gpu_reservation: Reservation | None,
                  stats: RequestStats, place: Place) -> torch.Tensor:
        """Fetch, decode and run the prefix over the request's samples, in sub-batches, the
        prefix when it is ``place``'s turn."""
        timings = stats.timings
        started = time.perf_counter()
        shards = {k.split(SHARD_SEPARATOR, 1)[0] for k in request.keys if SHARD_SEPARATOR in k}
        meter = None
        if reservation is not None:
            known = replace(cost, staging=Staging(0, cost.staging.decode_peak)).bytes(1)
            meter = FetchMeter(reservation, self.admission, cost.samples * cost.staging.raw_per_sample,
                               known + cost.memory.weights_bytes, self.max_object_bytes, shards)
        blobs: list[bytes | None] = list(read_samples(self.store, request.keys, self.pool,
                                                      self.max_object_bytes, meter))
        timings["fetch_ms"] = _ms_since(started)
        stats.raw_bytes = sum(len(b) for b in blobs)
        # Every header is read, and every image too large refused, before a pixel is decoded.
        peaks = []
        for key, blob in zip(request.keys, blobs, strict=True):
            header = read_header(blob, key)
            check_pixels(header, key, request.transform, self.max_image_pixels)
            peaks.append(preprocess_peak_bytes(header, request.transform))
        cost = replace(cost, staging=Staging.measure(map(len, blobs), peaks, bool(shards)))
        sub_batch = self._choose_sub_batch(cost, reservation)
        if gpu_reservation is not None:  # and the largest the GPU reservation holds
            sub_batch = max(1, min(sub_batch, cost.largest_device_sub_batch(gpu_reservation.bytes, sub_batch)))
            gpu_reservation.shrink(cost.device_bytes(sub_batch))
        self.sample_sizes.record(cost.staging)
        stats.sub_batch = sub_batch
        stats.reserved_bytes = reservation.bytes if reservation else 0

        n = len(request.keys)
        stages = prefix.stages[: request.split]
        features: torch.Tensor | None = None
        normalized = request.dtype not in IMAGE_WIRE_DTYPES

        def submit(start: int) -> PendingBatch:
            end = min(start + sub_batch, n)
            chunk, blobs[start:end] = blobs[start:end], [None] * (end - start)  # the decoder holds them now
            return self.decoder.submit(chunk, request.keys[start:end], request.transform, request.epoch,
                                       self.max_image_pixels, normalized)

        decode_wait = forward_s = others_s = 0.0
        pending: PendingBatch | None = submit(0)
        started = time.perf_counter()
        try:
            with self.compute_turns.turn(place):
                timings["turn_wait_ms"] = _ms_since(started)
                for start in range(0, n, sub_batch):
                    waited = time.perf_counter()
                    inputs = pending.result()
                    decode_wait += time.perf_counter() - waited
                    pending = submit(start + sub_batch) if start + sub_batch < n else None
                    # Others' work on the cores displaces a pass only where it runs on them.
                    others_before = None if cost.on_device else self.core_share.others_s()
                    ran = time.perf_counter()
                    stats.threads = self.compute_turns.take_share()
                    with device_work(self.device if cost.on_device else CPU):
                        features = self._forward(stages, inputs, features, start, n, WIRE_DTYPES[request.dtype],
                                                 cost.on_device)
                    del inputs
                    forward_s += time.perf_counter() - ran
                    others_after = None if others_before is None else self.core_share.others_s()
                    if others_after is not None:
                        others_s += others_after - others_before
        finally:
            if pending is not None:  # the request failed: what is not decoded yet never will be
                pending.cancel()
        timings["decode_wait_ms"] = round(decode_wait * 1e3, 3)
        timings["forward_ms"] = round(forward_s * 1e3, 3)
        # A pass on the CPU takes every core not given to another pass, so what others ran on
        # the cores meanwhile (a store beside the node) came out of the passes' wall time:
        # spread over the cores, it is the part of ``forward_ms`` that was not the prefix's work.
        cores = max(len(self.core_share.cores), 1)
        timings["others_in_forward_ms"] = round(min(max(others_s, 0.0) / cores, forward_s) * 1e3, 3)
        return features

    def _forward(self, stages: torch.nn.Module, inputs: torch.Tensor, features: torch.Tensor | None, start: int,
                 n: int, dtype: torch.dtype, on_device: bool) -> torch.Tensor:
        """Run one sub-batch and write its features into ``features[start:]`` (host memory,
        made for all ``n`` samples on the first call); return ``features``. Every GPU tensor
        lives in this frame only, so none outlives the call (``device_work`` clears it on an error)."""
        if on_device:
            inputs = inputs.to(self.device, memory_format=torch.channels_last)
        with torch.inference_mode(), autocast_context(self.compute_dtype, self.device):
            out = stages(inputs)
        del inputs  # on a GPU, its copy there is freed before the features are copied off
        if features is None and len(out) == n and out.dtype == dtype and out.device.type == "cpu":
            return out  # the whole request in one sub-batch (at split 0, the decoded crops): no copy
        if features is None:
            features = torch.empty((n, *out.shape[1:]), dtype=dtype)
        features[start: start + len(out)] = out
        return features

    def _choose_sub_batch(self, cost: RequestCost, reservation: Reservation | None) -> int:
        """The largest sub-batch the reservation holds, now that the samples' real sizes are known."""
        limit = min(self.max_sub_batch, cost.samples)
        if reservation is None:
            return cost.samples  # no adaptation: the whole request at once, as the reference did
        fitting = cost.largest_sub_batch(reservation.bytes, limit)
        most = self.admission.capacity - cost.memory.weights_bytes
        if fitting == 0 and cost.bytes(1) > most:  # e.g. an image whose header promises gigapixels
            raise RequestError(413, "exceeds_memory",
                               f"these samples need {cost.bytes(1)} bytes even one at a time (the largest "
                               f"takes {cost.staging.decode_peak} bytes to decode and resize); this node has "
                               f"at most {most}")
        if fitting == 0:
            # The samples are larger than estimated: take the difference if it is free now;
            # otherwise run one at a time over the reservation by the estimate's error, which
            # the headroom absorbs (waiting here, holding memory, could deadlock).
            if not reservation.try_grow(cost.bytes(1)):
                log.warning("request over its reservation by %d bytes (samples larger than estimated)",
                            cost.bytes(1) - reservation.bytes)
            return 1
        reservation.shrink(cost.bytes(fitting))  # what it will not use, others may
        return fitting


def _ms_since(started: float) -> float:
    return round((time.perf_counter() - started) * 1e3, 3)

