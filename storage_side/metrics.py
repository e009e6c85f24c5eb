"""The daemon's Prometheus metrics (``GET /metrics``), one registry per app.

A registry per app, not prometheus_client's global one, so several apps in one process
(tests, or one per store) count separately.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from storage_side.admission import Admission
from storage_side.memory import CPU, device_peak_bytes, peak_rss_bytes, process_rss_bytes
from storage_side.prefix_cache import PrefixCache

SUB_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
STAGE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Metrics:
    def __init__(self, budget: int, admission: Admission | None, cache: PrefixCache,
                 workers_bytes: Callable[[], int] = lambda: 0, device: torch.device = CPU,
                 gpu_budget: int | None = None, device_admission: Admission | None = None) -> None:
        self.registry = registry = CollectorRegistry()
        self.requests = Counter("hapi_storage_requests", "Requests answered, by endpoint and HTTP status",
                                ["endpoint", "status"], registry=registry)
        self.refused = Counter("hapi_storage_refused", "Requests refused for load (503) or size (413), by reason",
                               ["reason"], registry=registry)
        self.bytes_out = Counter("hapi_storage_response_bytes", "Bytes of features sent", registry=registry)
        self.raw_bytes = Counter("hapi_storage_object_bytes", "Bytes of objects read from the store",
                                 registry=registry)
        self.samples = Counter("hapi_storage_samples", "Samples run through a prefix", registry=registry)
        self.sub_batch = Histogram("hapi_storage_sub_batch", "Sub-batch chosen per request",
                                   buckets=SUB_BATCH_BUCKETS, registry=registry)
        self.stage_seconds = Histogram("hapi_storage_stage_seconds", "Time per request in each stage of the daemon",
                                       ["stage"], buckets=STAGE_BUCKETS, registry=registry)
        Gauge("hapi_storage_memory_budget_bytes", "The memory budget of this process",
              registry=registry).set(budget)
        Gauge("hapi_storage_process_resident_bytes", "Resident memory of this process now",
              registry=registry).set_function(process_rss_bytes)
        Gauge("hapi_storage_decode_workers_private_bytes", "Memory the decode worker processes hold of their own "
              "(counted in the budget)", registry=registry).set_function(workers_bytes)
        Gauge("hapi_storage_process_peak_resident_bytes", "The most resident memory this process has had",
              registry=registry).set_function(peak_rss_bytes)
        Gauge("hapi_storage_models_loaded", "Prefixes loaded", registry=registry).set_function(
            lambda: len(cache.loaded()))
        Gauge("hapi_storage_model_weights_bytes", "Bytes of the weights of loaded prefixes",
              registry=registry).set_function(cache.resident_bytes)
        Gauge("hapi_storage_model_evictions", "Prefixes evicted to free memory", registry=registry).set_function(
            lambda: cache.evictions)
        if admission is not None:
            Gauge("hapi_storage_memory_capacity_bytes", "Bytes reservations may take: budget less the idle "
                  "process and the headroom", registry=registry).set(admission.capacity)
            Gauge("hapi_storage_memory_reserved_bytes", "Bytes reserved now by requests and loaded prefixes",
                  registry=registry).set_function(lambda: admission.reserved)
            Gauge("hapi_storage_memory_reserved_peak_bytes", "The most bytes ever reserved at once",
                  registry=registry).set_function(lambda: admission.peak_reserved)
            Gauge("hapi_storage_queue_depth", "Requests waiting for memory", registry=registry).set_function(
                lambda: admission.queue_depth)
        if device.type == "cuda":
            Gauge("hapi_storage_gpu_memory_budget_bytes", "The GPU memory budget of the prefix on its device",
                  registry=registry).set(gpu_budget)
            Gauge("hapi_storage_gpu_memory_allocated_bytes", "Bytes this process holds allocated on the GPU now",
                  registry=registry).set_function(lambda: torch.cuda.memory_allocated(device))
            Gauge("hapi_storage_gpu_memory_peak_allocated_bytes", "The most bytes this process has held "
                  "allocated on the GPU", registry=registry).set_function(lambda: device_peak_bytes(device))
        if device_admission is not None:
            Gauge("hapi_storage_gpu_memory_capacity_bytes", "GPU bytes reservations may take",
                  registry=registry).set(device_admission.capacity)
            Gauge("hapi_storage_gpu_memory_reserved_bytes", "GPU bytes reserved now by requests and loaded prefixes",
                  registry=registry).set_function(lambda: device_admission.reserved)
            Gauge("hapi_storage_gpu_memory_reserved_peak_bytes", "The most GPU bytes ever reserved at once",
                  registry=registry).set_function(lambda: device_admission.peak_reserved)
