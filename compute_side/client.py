"""HTTP client for one storage daemon."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import requests
import torch
import urllib3
from requests.adapters import HTTPAdapter
from urllib3.util.retry import Retry

from hapi.wire import TOKEN_ENV, ExtractRequest, ProfileRequest, decode_features

log = logging.getLogger(__name__)

BODY_RETRIES = 2


class StorageNodeError(RuntimeError):
    """A storage daemon refused a request or could not be reached."""

    def __init__(self, node: str, status: int | None, code: str, message: str, key: str | None = None) -> None:
        where = f"storage node {node}" + (f" answered {status}" if status else "")
        super().__init__(f"{where}: {message}")
        self.node = node
        self.status = status
        self.code = code
        self.key = key


@dataclass(frozen=True)
class Extracted:
    features: torch.Tensor  # rows in request key order
    keys: tuple[str, ...]
    metadata: dict[str, object]
    wire_bytes: int  # bytes of the response body
    body_started: float  # perf_counter when the response headers arrived
    body_s: float  # from the response headers to its last byte: the body's time on the link


class StorageClient:
    """Keep-alive session to one daemon; retries refused (503) and failed connections."""

    def __init__(self, url: str, timeout_s: float = 600.0, retries: int = 5, pool_size: int = 8,
                 token: str | None = None) -> None:
        """``token`` defaults to ``$HAPI_STORAGE_TOKEN``; sent as a bearer token when set."""
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        retry = Retry(
            total=retries, connect=retries, read=retries, status=retries, backoff_factor=0.2,
            # extract is idempotent, so a POST may be retried, also when a kept-alive connection
            # was closed under it (read errors).
            status_forcelist=(503,), allowed_methods=None,
            respect_retry_after_header=True, raise_on_status=False,
        )
        self.session = requests.Session()
        self.session.mount("http://", HTTPAdapter(max_retries=retry, pool_maxsize=pool_size))
        self.session.mount("https://", HTTPAdapter(max_retries=retry, pool_maxsize=pool_size))
        token = token or os.environ.get(TOKEN_ENV)
        if token:
            self.session.headers["Authorization"] = f"Bearer {token}"

    def health(self) -> dict:
        return self._json("GET", "/healthz")

    def profile(self, request: ProfileRequest) -> dict:
        """The node's own timings of each frozen stage (``POST /v1/profile``)."""
        return self._json("POST", "/v1/profile", json=request.to_json())

    def _json(self, method: str, path: str, **kwargs: object) -> dict:
        try:
            response = self.session.request(method, self.url + path, timeout=self.timeout_s, **kwargs)
        except requests.RequestException as exc:
            raise StorageNodeError(self.url, None, "unreachable", f"unreachable ({type(exc).__name__})") from None
        self._raise_for_error(response)
        return response.json()

    def _raise_for_error(self, response: requests.Response) -> None:
        if response.ok:
            return
        try:
            body = response.json()
        except ValueError:
            body = {"error": "http_error", "message": response.text[:200]}
        raise StorageNodeError(self.url, response.status_code, body.get("error", "http_error"),
                               body.get("message", ""), body.get("key"))

    def extract(self, request: ExtractRequest) -> Extracted:
        # urllib3 retries up to the response headers; a body cut short is retried here.
        for attempt in range(BODY_RETRIES + 1):
            try:
                response = self.session.post(self.url + "/v1/extract", json=request.to_json(),
                                             timeout=self.timeout_s, stream=True)
            except requests.RequestException as exc:
                raise StorageNodeError(self.url, None, "unreachable", f"unreachable ({type(exc).__name__})") from None
            self._raise_for_error(response)
            started = time.perf_counter()
            try:
                blob = _read_body(response)
                body_s = time.perf_counter() - started
                break
            except (requests.RequestException, urllib3.exceptions.HTTPError) as exc:
                if attempt == BODY_RETRIES:
                    raise StorageNodeError(self.url, None, "unreachable",
                                           f"response cut short ({type(exc).__name__})") from None
                log.warning("response from %s cut short; retrying", self.url)
        features, keys, metadata = decode_features(blob)
        if keys != request.keys:
            raise StorageNodeError(self.url, response.status_code, "bad_response", "features for other keys")
        return Extracted(features, keys, metadata, len(blob), started, body_s)


def _read_body(response: requests.Response) -> bytearray:
    """The body in a writable buffer, read straight from the socket (no extra copy)."""
    length = response.headers.get("Content-Length")
    if length is None:
        return bytearray(response.content)
    buffer = bytearray(int(length))
    view = memoryview(buffer)
    filled = 0
    while filled < len(buffer):
        got = response.raw.readinto(view[filled:])
        if not got:
            raise requests.ConnectionError(f"body ended after {filled} of {len(buffer)} bytes")
        filled += got
    return buffer
