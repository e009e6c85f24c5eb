"""The storage daemon's Flask application, built by ``create_app(config)``.

Every error is a JSON body ``{"error": code, "message": ..., ...}`` with an HTTP status,
never an HTML page or a traceback; the daemon stays up after any bad request.
"""

from __future__ import annotations

import logging

import torch
from flask import Flask, Response, jsonify, request
from werkzeug.exceptions import HTTPException

from hapi.models import MODELS
from hapi.store import MissingObjectError, open_store
from hapi.transforms import CorruptImageError
from hapi.wire import FEATURES_CONTENT_TYPE, ExtractRequest, WireError
from storage_side.config import DaemonConfig
from storage_side.executor import Extractor, PrefixCache, RequestError

log = logging.getLogger(__name__)


def _error(status: int, code: str, message: str, **extra: object) -> tuple[Response, int]:
    return jsonify(error=code, message=message, **extra), status


def create_app(config: DaemonConfig) -> Flask:
    if config.torch_threads:
        torch.set_num_threads(config.torch_threads)
    app = Flask("storage_side")
    app.config["MAX_CONTENT_LENGTH"] = config.max_request_bytes
    store = open_store(config.store_url, config.endpoint_url)
    extractor = Extractor(store, PrefixCache(config.model_cache_size, config.weights_files),
                          config.io_threads, config.sub_batch)

    @app.get("/healthz")
    def healthz():
        return jsonify(status="ok", store=store.url)

    @app.get("/v1/models")
    def models():
        return jsonify(models=[
            {"name": s.name, "freeze_index": s.freeze_index, "input_size": s.input_size} for s in MODELS.values()
        ])

    @app.post("/v1/extract")
    def extract():
        body = request.get_json(silent=True)
        if body is None:
            return _error(400, "bad_request", "body must be JSON (Content-Type: application/json)")
        req = ExtractRequest.from_json(body)
        if len(req.keys) > config.max_keys_per_request:
            return _error(413, "too_many_keys",
                          f"{len(req.keys)} keys in one request; this node takes at most "
                          f"{config.max_keys_per_request}", limit=config.max_keys_per_request)
        blob = extractor.extract(req)
        return Response(blob, content_type=FEATURES_CONTENT_TYPE)

    @app.errorhandler(WireError)
    def bad_request(exc: WireError):
        return _error(400, "bad_request", str(exc))

    @app.errorhandler(RequestError)
    def request_error(exc: RequestError):
        return _error(exc.status, exc.code, str(exc))

    @app.errorhandler(MissingObjectError)
    def missing_object(exc: MissingObjectError):
        return _error(404, "missing_object", str(exc), key=exc.key)

    @app.errorhandler(CorruptImageError)
    def corrupt_image(exc: CorruptImageError):
        return _error(422, "corrupt_image", str(exc), key=exc.key)

    @app.errorhandler(HTTPException)
    def http_error(exc: HTTPException):
        code = "request_too_large" if exc.code == 413 else exc.name.lower().replace(" ", "_")
        return _error(exc.code or 500, code, exc.description or exc.name)

    @app.errorhandler(Exception)
    def internal_error(exc: Exception):
        log.exception("request failed")
        return _error(500, "internal_error", f"{type(exc).__name__}: {exc}")

    return app
