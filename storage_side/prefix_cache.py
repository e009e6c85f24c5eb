"""Frozen prefixes, loaded once and shared by every request and job, evicted LRU within the budget.

A prefix's weights hold a reservation for as long as it stays loaded; when a request or
a load cannot fit, the admission controller asks the cache to evict idle prefixes, least
recently used first. A prefix in use is never evicted (its memory would not come back).
Loading a prefix measures its memory model (``storage_side.memory.calibrate``).

On a CUDA device the weights live on the GPU: a model is built in host memory (reserved
there while it is built), moved to the device in channels_last and calibrated there,
and from then on holds a reservation of GPU memory only, evicted to make room on the GPU.
A load reserves its GPU memory before its host memory, as a request does (a request's
lease keeps its prefix's weights on the GPU in use before it asks for host memory): a
load holding host memory while it waited for GPU memory could wait for a prefix that a
request keeps in use while it waits for that host memory.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
import traceback
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import torch
import torchvision
from torch import nn

from hapi.models import (
    PACKAGE_WEIGHTS,
    RANDOM_WEIGHTS,
    ModelUnavailableError,
    build_model,
    file_weights_id,
    get_spec,
)
from storage_side.admission import Admission, Reservation
from storage_side.errors import RequestError
from storage_side.memory import CALIBRATION_BATCHES, CPU, PrefixMemory, calibrate, device_work, model_bytes

log = logging.getLogger(__name__)

PrefixKey = tuple[str, str, int]  # model, weights id, input size


@dataclass
class LoadedPrefix:
    """The frozen stages of one model as loaded on this node, and what they cost."""

    key: PrefixKey
    stages: nn.Sequential
    stage_names: tuple[str, ...]
    memory: PrefixMemory
    reservation: Reservation | None  # the weights' bytes, where they live; None when memory is not accounted
    load_s: float
    users: int = 0
    last_used: float = 0.0

    def describe(self) -> dict:
        model, weights, input_size = self.key
        return {"model": model, "weights": weights, "input_size": input_size, "in_use": self.users,
                "load_s": round(self.load_s, 3), "memory": self.memory.to_json()}


def load_bytes_bound(model: str, input_size: int, from_file: bool) -> int:
    """A bound on the bytes loading and calibrating a prefix takes, from shapes alone.

    The model is built on the meta device (no memory): the whole model exists while it is
    built (twice when a state_dict file is read), and calibration runs each frozen stage
    on the larger calibration batch with, at worst, every layer's output of a stage alive.
    Both are counted together though they do not coexist: the slack covers kernel
    workspaces, which shapes do not show.
    """
    spec = get_spec(model)
    batch = CALIBRATION_BATCHES[-1]
    with torch.device("meta"):
        full = spec.builder(weights=None, **spec.build_kwargs(input_size))
        x = torch.empty(batch, 3, input_size, input_size)
        input_bytes, worst = x.nbytes, 0
        for _, stage in spec.to_stages(full)[: spec.freeze_index]:
            outputs: list[int] = []
            leaves = [m for m in stage.modules() if not any(m.children())]
            hooks = [m.register_forward_hook(
                lambda _m, _i, out, outputs=outputs: outputs.append(out.nbytes if isinstance(out, torch.Tensor) else 0))
                for m in leaves]
            held = x.nbytes
            x = stage(x)
            for hook in hooks:
                hook.remove()
            worst = max(worst, input_bytes + held + sum(outputs) + x.nbytes)
    return model_bytes(full) * (2 if from_file else 1) + worst


def torchvision_weights_cached(enum_name: str) -> bool:
    """Whether torchvision's weights ``enum_name`` are in torch's hub cache, where loading
    them reads the file and downloads nothing."""
    url = torchvision.models.get_weight(enum_name).url
    return (Path(torch.hub.get_dir()) / "checkpoints" / Path(urlparse(url).path).name).is_file()


class PrefixCache:
    def __init__(self, admission: Admission | None, weights_files: tuple[Path, ...],
                 compute_dtype: torch.dtype = torch.float32, device: torch.device = CPU,
                 device_admission: Admission | None = None) -> None:
        self.admission = admission  # host memory: models are built there
        self.compute_dtype = compute_dtype
        self.device = device
        # The weights' memory once loaded: the GPU's on a CUDA device, else the host's.
        self.weights_admission = device_admission if device.type == "cuda" else admission
        self._files = {file_weights_id(p): p for p in weights_files}
        self._entries: OrderedDict[PrefixKey, LoadedPrefix] = OrderedDict()
        self._lock = threading.Lock()
        self._load_lock = threading.Lock()  # one load at a time: two requests must not both build a model
        self.evictions = 0
        if self.weights_admission is not None:
            self.weights_admission.reclaim = self.evict_idle

    def _weights_source(self, model: str, weights_id: str) -> str:
        if weights_id == RANDOM_WEIGHTS:
            return RANDOM_WEIGHTS
        if weights_id == f"torchvision:{get_spec(model).torchvision_weights}":
            if not torchvision_weights_cached(get_spec(model).torchvision_weights):
                # Never downloaded at request time: a request must not make the node reach the network.
                raise RequestError(409, "weights_unavailable",
                                   f"weights {weights_id!r} for {model} are not on this node (not in torch's "
                                   f"cache {torch.hub.get_dir()}); give it a state_dict with --weights-file "
                                   "PATH and request them by its sha256")
            return "torchvision"
        packaged = get_spec(model).packaged_weights
        if packaged is not None and weights_id == packaged.weights_id:
            try:
                packaged.locate()  # only where the operator installed the package; never fetched here
            except ModelUnavailableError as exc:
                raise RequestError(409, "weights_unavailable", str(exc)) from None
            return PACKAGE_WEIGHTS
        if weights_id in self._files:
            return str(self._files[weights_id])
        raise RequestError(409, "weights_unavailable",
                           f"weights {weights_id!r} for {model} are not configured on this node "
                           "(start it with --weights-file PATH)")

    def loaded(self) -> list[LoadedPrefix]:
        with self._lock:
            return list(self._entries.values())

    def resident_bytes(self) -> int:
        with self._lock:
            return sum(e.memory.weights_bytes for e in self._entries.values())

    @contextmanager
    def lease(self, model: str, weights_id: str, input_size: int, job: str) -> Iterator[LoadedPrefix]:
        """The prefix, loaded if needed; it cannot be evicted until the ``with`` block ends."""
        entry = self._acquire(model, weights_id, input_size, job)
        try:
            yield entry
        finally:
            with self._lock:
                entry.users -= 1
                entry.last_used = time.monotonic()

    def _acquire(self, model: str, weights_id: str, input_size: int, job: str) -> LoadedPrefix:
        # Only a model whose shape depends on the input size needs one entry per size;
        # the memory model does, so every size is its own entry.
        key = (model, weights_id, input_size)
        if (entry := self._use(key)) is not None:
            return entry
        source = self._weights_source(model, weights_id)
        with self._load_lock:
            if (entry := self._use(key)) is not None:  # loaded while we waited
                return entry
            try:
                entry = self._load(key, source, job)
            except ModelUnavailableError as exc:
                # The model's code package is not installed on this node: the operator's choice, as for weights.
                raise RequestError(409, "model_unavailable", str(exc)) from None
            with self._lock:
                entry.users = 1
                self._entries[key] = entry
            return entry

    def _use(self, key: PrefixKey) -> LoadedPrefix | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                entry.users += 1
                self._entries.move_to_end(key)
            return entry

    def _load(self, key: PrefixKey, source: str, job: str) -> LoadedPrefix:
        model, _, input_size = key
        started = time.perf_counter()
        on_device = self.device.type == "cuda"
        # The weights' own reservation, and the host memory the model is built in: one and
        # the same on the CPU.
        reservation = building = None
        if self.admission is not None:
            bound = load_bytes_bound(model, input_size, from_file=source not in (RANDOM_WEIGHTS, "torchvision"))
            if bound > self.admission.capacity:
                raise RequestError(507, "model_exceeds_memory",
                                   f"loading {model} at {input_size} px needs up to {bound} bytes; this node "
                                   f"reserves at most {self.admission.capacity} (raise --memory-budget)")
            # The same bound on the GPU: the whole prefix moves there and calibrates there.
            if on_device and bound > self.weights_admission.capacity:
                raise RequestError(507, "model_exceeds_memory",
                                   f"loading {model} at {input_size} px needs up to {bound} bytes of GPU "
                                   f"memory; this node reserves at most {self.weights_admission.capacity} "
                                   "(raise --gpu-memory-budget)")
        stages = None
        try:
            if self.admission is not None:
                # GPU memory first, host memory second (see the module's docstring).
                if on_device:
                    reservation = self.weights_admission.admit(job, bound, bound)
                building = self.admission.admit(job, bound, bound)
                if not on_device:
                    reservation = building
            staged = build_model(model, source, input_size)
            # Only frozen stages may run here; the rest (often the largest Linear) is dropped.
            stages = staged.prefix(staged.spec.freeze_index)
            names = staged.stage_names
            del staged
            if on_device:
                stages = stages.to(self.device, memory_format=torch.channels_last)
            memory = calibrate(stages, input_size, self.compute_dtype, self.device)
        except BaseException as exc:
            if on_device:
                # The failed load's GPU tensors go now, before the next load, whose measure of
                # GPU memory must not see them freed: its own, and those the frames of the
                # traceback hold (calibration's batches), which would otherwise live on
                # until the error is answered.
                stages = None
                traceback.clear_frames(exc.__traceback__)
                gc.collect()
            for held in {id(r): r for r in (building, reservation) if r is not None}.values():
                held.release()
            raise
        if building is not None and building is not reservation:
            building.release()  # the host copy is gone: the weights are on the GPU now
        if reservation is not None:
            reservation.shrink(memory.weights_bytes)
            reservation.keep()
        load_s = time.perf_counter() - started
        log.info("loaded prefix %s on %s: %d frozen stages, %.1f MB of weights, calibrated at batches %s in %.2f s",
                 key, self.device, len(stages), memory.weights_bytes / 1e6, CALIBRATION_BATCHES, load_s)
        return LoadedPrefix(key, stages, names, memory, reservation, load_s)

    def evict_idle(self, nbytes: int) -> None:
        """Evict idle prefixes, least recently used first, until ``nbytes`` are freed or none is idle.

        Called by admission with its lock held, so it never waits for the cache's lock: a
        cache busy elsewhere frees nothing this time, and the waiter tries again later.
        """
        if not self._lock.acquire(blocking=False):
            return
        try:
            victims = []
            for key, entry in self._entries.items():
                if nbytes <= 0:
                    break
                if entry.users == 0 and entry.reservation is not None:
                    victims.append(key)
                    nbytes -= entry.reservation.bytes
            evicted = [self._entries.pop(key) for key in victims]
        finally:
            self._lock.release()
        for entry in evicted:
            with device_work(self.device):  # freed while no measure of the GPU's memory runs
                del entry.stages
                gc.collect()  # modules can sit in reference cycles; their memory must be back now
            entry.reservation.release()
            self.evictions += 1
            log.info("evicted prefix %s (idle, least recently used) to free memory", entry.key)
