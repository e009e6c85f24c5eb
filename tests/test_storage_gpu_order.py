"""GPU memory before host memory: on a CUDA daemon a request and a prefix load take their
reservations in the same order, so a load waiting for GPU memory never holds host memory
that a request keeping the prefix in use waits for.

No GPU is needed: admission is exercised with fake budgets, a stand-in model and memory
model, on a daemon whose device is named cuda but never touched.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from hapi.models import RANDOM_WEIGHTS
from storage_side import prefix_cache
from storage_side.admission import Admission
from storage_side.executor import Extractor, RequestCost, RequestStats
from storage_side.memory import PrefixMemory, SampleSizes, Staging
from storage_side.prefix_cache import PrefixCache

GPU = torch.device("cuda", 0)
LOAD_BOUND = 60  # what a load reserves, on the GPU and in host memory alike
WEIGHTS = 60  # what a loaded prefix keeps on the GPU
HOST, HOST_BLOCKED = 200, 50  # host memory, and what another party holds of it throughout


class WaitsFor:
    """The host admission as the extractor sees it: ``admit`` first waits for ``ready()``,
    so a test can line up what happens before a request asks for host memory."""

    def __init__(self, admission: Admission, ready) -> None:
        self._admission = admission
        self._ready = ready

    def admit(self, job: str, need: int, want: int, order: int = 0):
        deadline = time.monotonic() + 5
        while not self._ready():
            assert time.monotonic() < deadline, "the load never started waiting"
            time.sleep(0.01)
        return self._admission.admit(job, need, want, order)

    def __getattr__(self, name: str):
        return getattr(self._admission, name)


@pytest.fixture
def fake_models(monkeypatch: pytest.MonkeyPatch) -> None:
    memory = PrefixMemory(weights_bytes=WEIGHTS, input_bytes=1, stage_fixed=(1,), stage_per_sample=(1,),
                          output_numel=(1, 1))
    staged = SimpleNamespace(prefix=lambda index: nn.Sequential(nn.Identity()), spec=SimpleNamespace(freeze_index=1),
                             stage_names=("stage",))
    monkeypatch.setattr(prefix_cache, "load_bytes_bound", lambda *args, **kwargs: LOAD_BOUND)
    monkeypatch.setattr(prefix_cache, "build_model", lambda *args: staged)
    monkeypatch.setattr(prefix_cache, "calibrate", lambda *args: memory)


def test_a_load_waiting_for_gpu_memory_holds_no_host_memory_a_request_keeping_its_prefix_waits_for(
        fake_models: None) -> None:
    host = Admission(HOST, max_queue=8, queue_timeout_s=3)
    gpu = Admission(100, max_queue=8, queue_timeout_s=3)
    cache = PrefixCache(host, (), device=GPU, device_admission=gpu)
    with cache.lease("first", RANDOM_WEIGHTS, 8, "job-a"):
        pass  # loaded, idle: its weights keep 60 of the GPU's 100
    blocker = host.admit("other", HOST_BLOCKED, HOST_BLOCKED)
    # The request asks for host memory only once the load waits for GPU memory, which it
    # cannot get while the request keeps the first prefix (and its weights) in use.
    decoder = SimpleNamespace(workers=1, pids=list)
    extractor = Extractor(None, cache, WaitsFor(host, lambda: gpu.queue_depth == 1), 1, decoder, None,
                          min_sub_batch=1, max_sub_batch=10, device=GPU, device_admission=gpu)
    extractor.sample_sizes = SampleSizes(Staging(raw_per_sample=1, decode_peak=1))
    extractor.validate = lambda request: None
    extractor._run = lambda *args: b"features"
    request = SimpleNamespace(model="first", weights=RANDOM_WEIGHTS, transform=SimpleNamespace(crop_size=8),
                              job_id="job-a", split=1, keys=[f"k{i}" for i in range(10)], dtype="float32", order=0)
    cost = RequestCost(cache.loaded()[0].memory, 1, 10, 4, extractor.sample_sizes.estimate(), 1, on_device=True)
    host_need = extractor._host_range(request, cost)[0]
    # Were the load holding its host reservation while it waits, the request could not fit beside it.
    assert HOST - HOST_BLOCKED - LOAD_BOUND < host_need <= HOST - HOST_BLOCKED

    loaded: list[str] = []
    second = threading.Thread(target=lambda: loaded.append(_load(cache, "second")))
    served: list[bytes] = []

    def serve() -> None:
        blob, reservation = extractor.extract(request, RequestStats())
        reservation.release()
        served.append(blob)

    first = threading.Thread(target=serve)
    first.start()
    deadline = time.monotonic() + 5
    while gpu.running == 0 and time.monotonic() < deadline:  # the request has its prefix and GPU memory
        time.sleep(0.01)
    second.start()
    first.join(10)
    second.join(10)
    blocker.release()
    assert served == [b"features"]
    # Once the request was done with the first prefix, the load evicted it and went on.
    assert loaded == ["second"] and [p.key[0] for p in cache.loaded()] == ["second"]
    assert host.reserved == 0 and gpu.reserved == WEIGHTS


def test_a_load_takes_gpu_memory_before_host_memory(fake_models: None) -> None:
    order: list[str] = []

    class Recording(Admission):
        def __init__(self, name: str, capacity: int) -> None:
            super().__init__(capacity, max_queue=8, queue_timeout_s=1)
            self.name = name

        def admit(self, job: str, need: int, want: int, place: int = 0):
            order.append(self.name)
            return super().admit(job, need, want, place)

    cache = PrefixCache(Recording("host", HOST), (), device=GPU, device_admission=Recording("gpu", 100))
    with cache.lease("first", RANDOM_WEIGHTS, 8, "job-a"):
        pass
    assert order == ["gpu", "host"]


def _load(cache: PrefixCache, model: str) -> str:
    with cache.lease(model, RANDOM_WEIGHTS, 8, "job-b") as prefix:
        return prefix.key[0]
