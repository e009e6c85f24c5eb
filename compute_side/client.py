"""HTTP client for one storage daemon."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import requests
import torch
import urllib3
from requests.adapters import HTTPAdapter
from urllib3.util.retry import Retry

from hapi.wire import TOKEN_ENV, ExtractRequest, ProfileRequest, decode_features

log = logging.getLogger(__name__)

BODY_RETRIES = 2
# A node answers a TCP connect at once or not at all; waiting longer only delays failover.
CONNECT_TIMEOUT_S = 3.0
# A /healthz that takes longer than this counts as a failed probe: the node is hung or swamped.
PROBE_TIMEOUT_S = 2.0
# A failed node is probed again after this long, doubling after every failed probe up to the cap.
BACKOFF_S = (1.0, 30.0)
# A request is hedged after this multiple of its node's slowest recent request (same split
# and dtype), and never before the floor: queueing behind the node's other requests, a
# node slowed by a neighbour or a slow link stretch a request a few times, a hung node forever.
HEDGE_MULTIPLE = 4.0
HEDGE_FLOOR_S = 2.0
PACE_WINDOW = 8  # recent requests per (split, dtype) that set the deadline
READ_CHUNK = 64 * 1024  # bytes of a body read at once: 50 ms of a 10 Mbit/s link, well under a reply's time


class LinkMeter:
    """The bytes this process has received from the storage tier, counted as they arrive
    by every reader at once. Replies share the link: what it carried while one reply was
    on it is what the meter gained meanwhile, the bytes of the replies beside it included."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._bytes = 0

    def add(self, nbytes: int) -> None:
        with self._lock:
            self._bytes += nbytes

    @property
    def total(self) -> int:
        return self._bytes


RECEIVED = LinkMeter()  # one per process: its readers all share its network


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
    tail_started: float  # perf_counter once the first half of the body had been read
    link_bytes: int  # bytes the process received while the body was read, its own included


class Breaker:
    """Whether a node is in rotation: out at once when it fails, back in once a probe of
    it succeeds. Probes run in the background, the first ``BACKOFF_S[0]`` after the
    failure and each next one twice as late, so a dead node costs no request any time."""

    def __init__(self, name: str, probe: Callable[[], bool]) -> None:
        self.name = name
        self._probe = probe
        self._lock = threading.Lock()
        self._out = False
        self._probing = False
        self._backoff = BACKOFF_S[0]
        self._retry_at = 0.0

    @property
    def out(self) -> bool:
        """Whether the node failed and no probe has brought it back yet."""
        return self._out

    def in_rotation(self) -> bool:
        """True if new requests may go to the node: it is neither out nor being probed (a
        late node gets no more work until its probe's verdict). Starts a due probe."""
        with self._lock:
            if self._probing:
                return False
            if not self._out:
                return True
            if time.monotonic() < self._retry_at:
                return False
            self._probing = True
        _start_detached(self._run_probe)
        return False

    def trip(self, why: str) -> None:
        """Take the node out of rotation now (it failed a request or a probe)."""
        with self._lock:
            if self._out:
                return
            self._out = True
            self._retry_at = time.monotonic() + self._backoff
        log.warning("storage node %s out of rotation (%s); probing it again in %.0f s", self.name, why, self._backoff)

    def suspect(self) -> None:
        """Probe the node now (a request to it is late), and take it out if the probe fails."""
        with self._lock:
            if self._out or self._probing:
                return
            self._probing = True
        _start_detached(self._run_probe)

    def _run_probe(self) -> None:
        healthy = self._probe()
        with self._lock:
            self._probing = False
            if healthy:
                if self._out:
                    log.warning("storage node %s answers again; back in rotation", self.name)
                self._out, self._backoff = False, BACKOFF_S[0]
                return
            if self._out:
                self._backoff = min(2 * self._backoff, BACKOFF_S[1])
                self._retry_at = time.monotonic() + self._backoff
                return
        self.trip("no answer to /healthz within its deadline")


class Pace:
    """Recent request latencies of one node, per (split, dtype): the deadline to hedge by."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._recent: dict[tuple[int, str], deque[float]] = {}

    def record(self, key: tuple[int, str], seconds: float) -> None:
        with self._lock:
            self._recent.setdefault(key, deque(maxlen=PACE_WINDOW)).append(seconds)

    def slowest(self, key: tuple[int, str]) -> float | None:
        """The slowest of the recent requests at ``key``; None before the first."""
        with self._lock:
            recent = self._recent.get(key)
            return max(recent) if recent else None


def hedge_deadline_s(slowest_s: float) -> float:
    return max(HEDGE_FLOOR_S, HEDGE_MULTIPLE * slowest_s)


class StorageClient:
    """Keep-alive session to one daemon, with its circuit breaker and its measured pace.

    Refusals (503, the daemon's back-pressure) are waited out here; a failed connection is
    not retried: the caller's failover sends the request to another node at once.
    """

    def __init__(self, url: str, timeout_s: float = 600.0, retries: int = 5, pool_size: int = 8,
                 token: str | None = None) -> None:
        """``token`` defaults to ``$HAPI_STORAGE_TOKEN``; sent as a bearer token when set.
        ``timeout_s`` bounds a wait for bytes; a hung node is hedged long before it."""
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        retry = Retry(
            total=None, connect=0, status=retries, backoff_factor=0.2,
            # extract is idempotent, so a POST may be retried once when a kept-alive connection
            # was closed under it (a read error); more would only delay failover from a dead node.
            read=1, status_forcelist=(503,), allowed_methods=None,
            respect_retry_after_header=True, raise_on_status=False,
        )
        self.breaker = Breaker(self.url, self._healthy)
        self.pace = Pace()
        self.session = _session(retry, pool_size, token or os.environ.get(TOKEN_ENV))
        # Probes are never retried: a late answer is the verdict.
        self._probes = _session(Retry(0), 1, token or os.environ.get(TOKEN_ENV))

    def health(self) -> dict:
        return self._json("GET", "/healthz")

    def _healthy(self) -> bool:
        try:
            response = self._probes.get(self.url + "/healthz", timeout=(CONNECT_TIMEOUT_S, PROBE_TIMEOUT_S))
        except requests.RequestException:
            return False
        return response.ok

    def capacity(self) -> dict:
        """What the node runs at once: its cores, compute slots, decoders, device (``GET /v1/models``)."""
        return self._json("GET", "/v1/models")["node"]

    def loaded(self) -> list[dict]:
        """The prefixes the node holds: each one's model, memory and pass layout (``GET /v1/models``)."""
        return self._json("GET", "/v1/models")["loaded"]

    def profile(self, request: ProfileRequest) -> dict:
        """The node's own timings of each frozen stage (``POST /v1/profile``)."""
        return self._json("POST", "/v1/profile", json=request.to_json())

    def _json(self, method: str, path: str, **kwargs: object) -> dict:
        try:
            response = self.session.request(method, self.url + path, timeout=(CONNECT_TIMEOUT_S, self.timeout_s),
                                            **kwargs)
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
                                             timeout=(CONNECT_TIMEOUT_S, self.timeout_s), stream=True)
            except requests.RequestException as exc:
                raise StorageNodeError(self.url, None, "unreachable", f"unreachable ({type(exc).__name__})") from None
            self._raise_for_error(response)
            started, received = time.perf_counter(), RECEIVED.total
            try:
                blob, tail_started = _read_body(response)
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
        return Extracted(features, keys, metadata, len(blob), started, body_s, tail_started,
                         RECEIVED.total - received)


def _session(retry: Retry, pool_size: int, token: str | None) -> requests.Session:
    session = requests.Session()
    session.mount("http://", HTTPAdapter(max_retries=retry, pool_maxsize=pool_size))
    session.mount("https://", HTTPAdapter(max_retries=retry, pool_maxsize=pool_size))
    if token:
        session.headers["Authorization"] = f"Bearer {token}"
    return session


def _read_body(response: requests.Response) -> tuple[bytearray, float]:
    """The body in one writable buffer, and when its first half had been read: the second
    half's pace is the link's, where the first may have come faster than it (a shaper's
    burst, buffers filled while it was idle)."""
    length = response.headers.get("Content-Length")
    if length is None:
        content = response.content
        RECEIVED.add(len(content))
        return bytearray(content), time.perf_counter()
    buffer = bytearray(int(length))
    view, half = memoryview(buffer), len(buffer) // 2
    _fill(response, view, 0, half)
    half_at = time.perf_counter()
    _fill(response, view, half, len(buffer))
    return buffer, half_at


def _fill(response: requests.Response, view: memoryview, start: int, end: int) -> None:
    """Read the body's bytes [start, end) into ``view``, a chunk at a time: urllib3 returns
    from a read only once all the bytes asked for have arrived, and the link meter counts
    them as they do."""
    while start < end:
        got = response.raw.readinto(view[start:min(start + READ_CHUNK, end)])
        if not got:
            raise requests.ConnectionError(f"body ended after {start} of {len(view)} bytes")
        RECEIVED.add(got)
        start += got


def _start_detached(work: Callable[[], None]) -> None:
    """Run ``work`` on a daemon thread: a probe hung on a stopped node holds up nothing,
    not even the interpreter's exit."""
    threading.Thread(target=work, daemon=True, name="probe").start()
