"""The storage daemon's Flask application, built by ``create_app(config)``.

Every error is a JSON body ``{"error": code, "message": ..., ...}`` with an HTTP status,
never an HTML page or a traceback; the daemon stays up after any bad request, and under
load it shrinks sub-batches, queues, or answers 503 with Retry-After: it does not run
out of memory.
"""

from __future__ import annotations

import hmac
import logging
import time

import torch
from flask import Flask, Response, g, jsonify, request
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from werkzeug.exceptions import HTTPException

from hapi.models import MODELS
from hapi.store import MissingObjectError, ObjectTooLargeError, open_store
from hapi.transforms import CorruptImageError, ImageTooLargeError
from hapi.wire import FEATURES_CONTENT_TYPE, ExtractRequest, ProfileRequest, WireError, parse_json
from storage_side.admission import Admission
from storage_side.config import DaemonConfig
from storage_side.errors import RequestError
from storage_side.executor import Extractor, RequestStats
from storage_side.layout import LayoutBook, PassLayouts
from storage_side.memory import (
    KeptMemory,
    device_peak_bytes,
    device_work,
    process_rss_bytes,
)
from storage_side.metrics import Metrics
from storage_side.parallel import ComputeTurns, Decoder, make_decoder
from storage_side.prefix_cache import LoadedPrefix, PrefixCache
from storage_side.profile import profile_stages

log = logging.getLogger(__name__)

# Liveness probes must work without the token; /healthz says nothing but that the node is up.
UNAUTHENTICATED = ("/healthz",)
# Profiling work a request may ask for, in sample passes (batch x (repeats + warm-up)), per
# key an extract request may hold: a profile of the largest batch, three timed runs and a warm-up.
PROFILE_PASSES_PER_KEY = 4
STAGE_TIMINGS = ("load", "queue", "fetch", "decode_wait", "forward", "encode")


def _error(status: int, code: str, message: str, **extra: object) -> tuple[Response, int]:
    return jsonify(error=code, message=message, **extra), status


def _json_body() -> object:
    if not request.is_json:
        raise WireError("body must be JSON (Content-Type: application/json)")
    # Parsed strictly by the schema's own parser, not Flask's: finite numbers, text strings,
    # bounded nesting, every failure a 400 (the body's size is capped by MAX_CONTENT_LENGTH).
    return parse_json(request.get_data(cache=False))


def memory_capacity(config: DaemonConfig, workers_bytes: int = 0) -> tuple[int, int, int]:
    """(budget, baseline, capacity): what reservations may take is the budget less the
    headroom and what the idle daemon already uses: its process (interpreter, torch,
    server) and ``workers_bytes``, what its decode workers hold of their own."""
    budget = config.budget_bytes()
    baseline = process_rss_bytes() + workers_bytes
    capacity = int(budget * (1 - config.memory_headroom)) - baseline
    if config.adapt and capacity <= 0:
        raise ValueError(f"memory budget {budget} bytes leaves nothing to reserve: the idle daemon already uses "
                         f"{baseline} ({workers_bytes} of it in decode workers) and {config.memory_headroom:.0%} "
                         "is headroom (raise --memory-budget, or use fewer --decode-workers)")
    return budget, baseline, capacity


def gpu_memory_capacity(config: DaemonConfig, device: torch.device) -> tuple[int, int]:
    """(budget, capacity) of GPU memory: what reservations may take is the budget less the
    headroom and what this process holds on the device already."""
    budget = config.gpu_memory_budget or torch.cuda.mem_get_info(device)[0]
    capacity = int(budget * (1 - config.memory_headroom)) - torch.cuda.memory_allocated(device)
    if capacity <= 0:
        raise ValueError(f"GPU memory budget {budget} bytes leaves nothing to reserve on {device} "
                         "(raise --gpu-memory-budget, or free the device)")
    return budget, capacity


def parallel_capacity(config: DaemonConfig, decoder: Decoder, turns: ComputeTurns,
                      device: torch.device) -> dict[str, object]:
    """What this node can run at once, for planners: its cores, forward passes and decoders,
    and the device its prefix runs on. ``threads_per_pass`` None: the cores are shared among
    the passes running at once. ``GET /v1/models`` adds ``pass_layouts``: the passes of each
    prefix measured here that run at once (``storage_side.layout``), fewer than the slots
    where that is faster."""
    return {"cores": config.core_count(), "compute_slots": turns.slots or config.core_count(),
            "threads_per_pass": config.torch_threads or None,
            "decode_workers": decoder.workers, "decode_in": decoder.kind, "device": str(device),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}


def create_app(config: DaemonConfig) -> Flask:
    if config.torch_threads:
        torch.set_num_threads(config.torch_threads)
    compute_dtype = getattr(torch, config.compute_dtype)
    device = config.torch_device()
    if device.type == "cuda":
        # The CUDA context takes host memory too: made now, it is in the idle daemon's baseline.
        torch.zeros(1, device=device)
    app = Flask("storage_side")
    app.config["MAX_CONTENT_LENGTH"] = config.max_request_bytes
    store = open_store(config.store_url, config.endpoint_url)
    processes = config.decode_processes()
    # Started before the budget is split: their memory is the daemon's too.
    decoder = make_decoder(processes or config.core_count(), processes > 0)
    try:
        budget, baseline, capacity = memory_capacity(config, decoder.private_bytes())
    except ValueError:
        decoder.close()
        raise
    admission = (Admission(capacity, config.max_queue, config.queue_timeout_s, config.running_limit())
                 if config.adapt else None)
    # The headroom, which no request reserves, is what freed memory kept for reuse may take.
    kept = KeptMemory(process_rss_bytes(), config.headroom_bytes())
    gpu_budget = device_admission = None
    if device.type == "cuda":
        try:
            gpu_budget, gpu_capacity = gpu_memory_capacity(config, device)
        except ValueError:
            decoder.close()
            raise
        if config.adapt:
            # Turns are the host admission's to give: this one only sizes and queues GPU memory.
            device_admission = Admission(gpu_capacity, config.max_queue, config.queue_timeout_s)
        log.info("GPU memory budget %.0f MB on %s (%s), %.0f MB for models and requests", gpu_budget / 1e6,
                 device, torch.cuda.get_device_name(device), gpu_capacity / 1e6)
    cache = PrefixCache(admission, config.weights_files, compute_dtype, device, device_admission)
    turns = ComputeTurns(config.compute_slots() if config.adapt else None, config.core_count(), config.torch_threads)
    # The operator's --torch-threads fixes the layout; on a GPU one pass at a time keeps it busy.
    layouts = (PassLayouts(LayoutBook(config.layouts_file()), turns, admission, config.max_sub_batch, compute_dtype)
               if config.adapt and not config.torch_threads and device.type == "cpu" else None)
    extractor = Extractor(store, cache, admission, config.io_threads, decoder, turns, config.min_sub_batch,
                          config.max_sub_batch, compute_dtype, config.max_image_pixels, config.max_object_bytes,
                          config.dataset_prefixes, device, device_admission, layouts)
    metrics = Metrics(budget, admission, cache, decoder.private_bytes, device, gpu_budget, device_admission)
    capacity_now = parallel_capacity(config, decoder, turns, device)
    app.extensions["hapi"] = {"admission": admission, "cache": cache, "extractor": extractor, "metrics": metrics,
                              "decoder": decoder}
    log.info("memory budget %.0f MB: %.0f MB idle daemon, %.0f MB for models and requests (%s)",
             budget / 1e6, baseline / 1e6, capacity / 1e6, "adaptive" if admission else "NOT ADAPTIVE")
    log.info("parallel capacity", extra={"fields": capacity_now})

    def gpu_memory_now() -> dict[str, int | None]:
        """The GPU memory the prefix may use and has used, for /v1/models; nothing on the CPU."""
        if device.type != "cuda":
            return {}
        return {"gpu_memory_budget": gpu_budget,
                "gpu_memory_capacity": device_admission.capacity if device_admission else None,
                "gpu_memory_reserved_peak": device_admission.peak_reserved if device_admission else None,
                "gpu_memory_peak_allocated": device_peak_bytes(device)}

    def layout_of(prefix: LoadedPrefix) -> dict[str, object]:
        """The passes of ``prefix`` the node runs at once, and what it measured, once measured."""
        layout = layouts.layout(prefix) if layouts is not None else None
        return {"pass_layout": layout.to_json()} if layout is not None else {}

    @app.before_request
    def authenticate():
        g.started = time.perf_counter()
        if not config.token or request.path in UNAUTHENTICATED:
            return None
        scheme, _, presented = request.headers.get("Authorization", "").partition(" ")
        # Constant-time comparison: response times must not reveal how much of a guess was right.
        if scheme.lower() == "bearer" and hmac.compare_digest(presented.encode(), config.token.encode()):
            return None
        response, status = _error(401, "unauthorized", "missing or wrong bearer token (Authorization: Bearer "
                                  "<token>; the client sends $HAPI_STORAGE_TOKEN)")
        response.headers["WWW-Authenticate"] = 'Bearer realm="hapi-storage"'
        return response, status

    @app.after_request
    def count(response: Response) -> Response:
        endpoint = request.url_rule.rule if request.url_rule else "unmatched"
        metrics.requests.labels(endpoint, str(response.status_code)).inc()
        return response

    @app.get("/healthz")
    def healthz():
        return jsonify(status="ok")

    @app.get("/metrics")
    def prometheus():
        return Response(generate_latest(metrics.registry), content_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    def models():
        return jsonify(
            models=[{"name": s.name, "freeze_index": s.freeze_index, "input_size": s.input_size}
                    for s in MODELS.values()],
            loaded=[{**entry.describe(), **layout_of(entry)} for entry in cache.loaded()],
            node={**capacity_now, **gpu_memory_now(),
                  "pass_layouts": layouts.measured() if layouts is not None else {}},
        )


    @app.post("/v1/extract")
    def extract():
        req = ExtractRequest.from_json(_json_body())
        if len(req.keys) > config.max_keys_per_request:
            metrics.refused.labels("too_many_keys").inc()
            return _error(413, "too_many_keys",
                          f"{len(req.keys)} keys in one request; this node takes at most "
                          f"{config.max_keys_per_request}", limit=config.max_keys_per_request)
        stats = RequestStats()
        blob, reservation = extractor.extract(req, stats)
        response = Response(blob, content_type=FEATURES_CONTENT_TYPE)
        if reservation is not None:
            def sent() -> None:  # the blob's bytes are held until it is sent
                reservation.release()
                kept.check(admission.reserved)

            response.call_on_close(sent)
        metrics.bytes_out.inc(len(blob))
        metrics.raw_bytes.inc(stats.raw_bytes)
        metrics.samples.inc(len(req.keys))
        metrics.sub_batch.observe(stats.sub_batch)
        for stage in STAGE_TIMINGS:
            if f"{stage}_ms" in stats.timings:
                metrics.stage_seconds.labels(stage).observe(stats.timings[f"{stage}_ms"] / 1e3)
        log.info("extract", extra={"fields": {
            "job": req.job_id, "model": req.model, "split": req.split, "keys": len(req.keys),
            "sub_batch": stats.sub_batch, "reserved_bytes": stats.reserved_bytes, "bytes_out": len(blob),
            "ms": round((time.perf_counter() - g.started) * 1e3, 1), **stats.timings}})
        return response

    @app.post("/v1/profile")
    def profile():
        req = ProfileRequest.from_json(_json_body())
        extractor.validate_model(req.model, req.input_size)
        if max(req.batch_sizes) > config.max_keys_per_request:
            return _error(413, "batch_too_large", f"batch size {max(req.batch_sizes)} over this node's limit of "
                          f"{config.max_keys_per_request}", limit=config.max_keys_per_request)
        passes = sum(req.batch_sizes) * (req.repeats + 1)
        if passes > PROFILE_PASSES_PER_KEY * config.max_keys_per_request:
            limit = PROFILE_PASSES_PER_KEY * config.max_keys_per_request
            return _error(413, "profile_too_large", f"batch sizes {list(req.batch_sizes)} x ({req.repeats} repeats "
                          f"+ a warm-up) are {passes} sample passes; this node runs at most {limit}", limit=limit)
        reservation = None
        try:
            with cache.lease(req.model, req.weights, req.input_size, req.job_id) as prefix:
                need = prefix.memory.forward_bytes(len(prefix.stages), max(req.batch_sizes))
                # The passes run where the prefix does: their memory is the GPU's there.
                gate = device_admission if device.type == "cuda" else admission
                if gate is not None and need > gate.capacity:
                    raise RequestError(413, "exceeds_memory", f"batch {max(req.batch_sizes)} needs {need} bytes; "
                                       f"this node reserves at most {gate.capacity}")
                reservation = gate.admit(req.job_id, need, need) if gate is not None else None
                # A compute turn like an extract request's: profiling shares the cores, it does not add to them.
                with extractor.compute_turns.turn() as slot, device_work(device):
                    slot.take_share()
                    stages = profile_stages(prefix, req.batch_sizes, req.repeats, compute_dtype, device)
        finally:
            # Once the prefix is idle: this release lets a load waiting for memory evict it.
            if reservation is not None:
                reservation.release()
        return jsonify(model=req.model, weights=req.weights, input_size=req.input_size,
                       batch_sizes=list(req.batch_sizes), device=str(device),
                       compute_dtype="bfloat16" if device.type == "cuda" else config.compute_dtype,
                       torch_threads=torch.get_num_threads(), cpu_count=config.core_count(),
                       memory=prefix.memory.to_json(), stages=stages)

    @app.errorhandler(WireError)
    def bad_request(exc: WireError):
        return _error(400, "bad_request", str(exc))

    @app.errorhandler(RequestError)
    def request_error(exc: RequestError):
        if exc.status in (413, 503):
            metrics.refused.labels(exc.code).inc()
        response, status = _error(exc.status, exc.code, str(exc), **exc.extra)
        response.headers.update(exc.headers)
        return response, status

    @app.errorhandler(MissingObjectError)
    def missing_object(exc: MissingObjectError):
        return _error(404, "missing_object", str(exc), key=exc.key)

    @app.errorhandler(ImageTooLargeError)
    def image_too_large(exc: ImageTooLargeError):
        metrics.refused.labels("image_too_large").inc()
        return _error(413, "image_too_large", str(exc), key=exc.key, limit=exc.limit)

    @app.errorhandler(ObjectTooLargeError)
    def object_too_large(exc: ObjectTooLargeError):
        metrics.refused.labels("object_too_large").inc()
        return _error(413, "object_too_large", str(exc), key=exc.key, limit=exc.limit)

    @app.errorhandler(CorruptImageError)
    def corrupt_image(exc: CorruptImageError):
        return _error(422, "corrupt_image", str(exc), key=exc.key)

    @app.errorhandler(HTTPException)
    def http_error(exc: HTTPException):
        code = "request_too_large" if exc.code == 413 else exc.name.lower().replace(" ", "_")
        response, status = _error(exc.code or 500, code, exc.description or exc.name)
        # Keep what the exception says about the resource (a 405's Allow), not its Content-Type.
        response.headers.update({k: v for k, v in exc.get_headers() if k.lower() != "content-type"})
        return response, status

    @app.errorhandler(Exception)
    def internal_error(exc: Exception):
        log.exception("request failed")
        return _error(500, "internal_error", f"{type(exc).__name__}: {exc}")

    return app
