"""Runs one extract request: GET objects, decode, transform, run the prefix, encode."""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from hapi.datasets import read_samples
from hapi.models import RANDOM_WEIGHTS, build_model, file_weights_id, get_spec
from hapi.store import ObjectStore
from hapi.transforms import preprocess
from hapi.wire import WIRE_DTYPES, ExtractRequest, encode_features

log = logging.getLogger(__name__)


class RequestError(ValueError):
    """The request is well-formed JSON but asks for something this node cannot do."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


@dataclass(frozen=True)
class Prefix:
    """The frozen stages of one model, as loaded on this node."""

    stages: nn.Sequential
    stage_names: tuple[str, ...]


class PrefixCache:
    """Frozen prefixes loaded once and shared by every request and job, LRU-evicted."""

    def __init__(self, capacity: int, weights_files: tuple[Path, ...]) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[tuple[str, str, int], Prefix] = OrderedDict()
        self._lock = threading.Lock()
        self._files = {file_weights_id(p): p for p in weights_files}

    def _weights_source(self, model: str, weights_id: str) -> str:
        if weights_id == RANDOM_WEIGHTS:
            return RANDOM_WEIGHTS
        if weights_id == f"torchvision:{get_spec(model).torchvision_weights}":
            return "torchvision"
        if weights_id in self._files:
            return str(self._files[weights_id])
        raise RequestError(409, "weights_unavailable",
                           f"weights {weights_id!r} for {model} are not configured on this node "
                           "(start it with --weights-file PATH)")

    def get(self, model: str, weights_id: str, input_size: int) -> Prefix:
        # Only a model whose shape depends on the input size needs one entry per size.
        key = (model, weights_id, input_size if get_spec(model).input_size_fixed_at_build else 0)
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                return self._entries[key]
            source = self._weights_source(model, weights_id)
            # Loading under the lock: two requests for a new model must not both build it.
            staged = build_model(model, source, input_size)
            # Only frozen stages may run here; the rest (often the largest Linear) is dropped.
            prefix = Prefix(staged.prefix(staged.spec.freeze_index), staged.stage_names)
            self._entries[key] = prefix
            while len(self._entries) > self.capacity:
                evicted, _ = self._entries.popitem(last=False)
                log.info("evicted prefix %s", evicted)
            log.info("loaded prefix %s (%d frozen stages)", key, len(prefix.stages))
            return prefix


class Extractor:
    """Turns an ExtractRequest into an encoded features blob."""

    def __init__(self, store: ObjectStore, cache: PrefixCache, io_threads: int, sub_batch: int) -> None:
        self.store = store
        self.cache = cache
        self.sub_batch = sub_batch
        self.pool = ThreadPoolExecutor(io_threads, thread_name_prefix="io")

    def validate(self, request: ExtractRequest) -> None:
        try:
            spec = get_spec(request.model)
        except ValueError as exc:
            raise RequestError(400, "unknown_model", str(exc)) from None
        if not 0 <= request.split <= spec.freeze_index:
            raise RequestError(400, "bad_split",
                               f"split {request.split} out of range for {request.model}: 0..{spec.freeze_index} "
                               "(only frozen stages run on the storage tier)")
        if spec.input_size_fixed_at_build and request.transform.crop_size % 16:
            raise RequestError(400, "bad_input_size",
                               f"{request.model} needs a crop_size that is a multiple of 16")

    def extract(self, request: ExtractRequest) -> bytes:
        self.validate(request)
        timings: dict[str, float] = {}
        started = time.perf_counter()
        blobs = read_samples(self.store, request.keys, self.pool)
        timings["fetch_ms"] = _ms_since(started)

        started = time.perf_counter()
        inputs = torch.stack(list(self.pool.map(
            lambda kb: preprocess(kb[1], kb[0], request.transform, request.epoch),
            zip(request.keys, blobs))))
        timings["decode_ms"] = _ms_since(started)

        started = time.perf_counter()
        prefix = self.cache.get(request.model, request.weights, request.transform.crop_size)
        timings["load_ms"] = _ms_since(started)

        started = time.perf_counter()
        stages = prefix.stages[: request.split]
        with torch.inference_mode():
            outputs = [stages(chunk) for chunk in inputs.split(self.sub_batch)]
        features = torch.cat(outputs).to(WIRE_DTYPES[request.dtype])
        timings["forward_ms"] = _ms_since(started)

        stage_name = prefix.stage_names[request.split - 1] if request.split else "input"
        metadata = {"split": request.split, "stage": stage_name, "timings": timings,
                    "raw_bytes": sum(len(b) for b in blobs)}
        return encode_features(features, request.keys, metadata)


def _ms_since(started: float) -> float:
    return round((time.perf_counter() - started) * 1e3, 3)
