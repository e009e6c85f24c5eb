"""What an attacker sends a storage daemon: crafted objects, fuzzed requests, slow clients.

Shared by the tests (tests/test_bombs.py, tests/test_fuzz_wire.py, tests/test_storage_serving.py)
and by ``experiments/faults.py``, which measures them against a real served daemon.

- bombs: objects of a few kilobytes that promise far more memory than they hold (a JPEG
  whose header claims 30000 x 30000 pixels, a GIF of 700 one-pixel frames on a 1000 x 1000
  canvas, a tar whose sparse member declares 2 GiB, an object over the size cap) and a
  profile request asking for minutes of CPU;
- fuzzing: hypothesis strategies for request bodies (near-valid ones, one field perturbed
  at a time, arbitrary JSON, raw bytes), and ``fuzzed_payloads`` to draw them outside a test;
- slow clients: half-open connections that send part of a request and never finish it.
"""

from __future__ import annotations

import io
import json
import socket
import struct
import tarfile
import time
import zlib
from collections.abc import Iterator
from contextlib import contextmanager

import requests
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st
from PIL import Image

from hapi.store import FileStore
from hapi.synthetic import render_jpeg

# --- bombs --------------------------------------------------------------------------------


def jpeg_claiming(width: int, height: int) -> bytes:
    """A real JPEG whose start-of-frame header is rewritten to ``width`` x ``height``, cut to its headers."""
    jpeg = bytearray(render_jpeg(0, 0))
    sof = jpeg.index(b"\xff\xc0")
    jpeg[sof + 5: sof + 9] = struct.pack(">HH", height, width)
    return bytes(jpeg[: jpeg.index(b"\xff\xda") + 20])  # headers and the start of the scan: ~700 bytes


def gif_of_frames(frames: int, width: int = 1000, height: int = 1000) -> bytes:
    """An animated GIF: ``frames`` one-pixel frames on a ``width`` x ``height`` canvas (~12 bytes a frame)."""
    out = bytearray(b"GIF89a" + struct.pack("<HHBBB", width, height, 0x80, 0, 0) + b"\x00\x00\x00\xff\xff\xff")
    for i in range(frames):
        out += b"\x21\xf9\x04\x00\x01\x00\x00\x00"  # graphic control: 1/100 s a frame
        out += b"\x2c" + struct.pack("<HHHHB", i % width, 0, 1, 1, 0)
        out += b"\x02\x02\x44\x01\x00"  # LZW, code size 2: clear, pixel 0, end
    return bytes(out + b"\x3b")


def sparse_tar(member: str, declared: int) -> bytes:
    """A tar whose one GNU sparse member declares ``declared`` bytes but stores 512."""
    info = tarfile.TarInfo(member)
    info.size, info.type = 512, tarfile.GNUTYPE_SPARSE
    header = bytearray(info.tobuf(tarfile.GNU_FORMAT))
    header[386:410] = b"%011o\x00%011o\x00" % (declared - 512, 512)  # one region: the last 512 bytes
    header[483:495] = b"%011o\x00" % declared  # the real size
    header[148:156] = b"        "
    header[148:156] = b"%06o\x00 " % sum(header)
    return bytes(header) + b"\x00" * 512 + b"\x00" * 1024


def png(width: int, height: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (10, 200, 30)).save(buffer, "PNG")
    return buffer.getvalue()


def png_claiming(width: int, height: int) -> bytes:
    """A 4x4 PNG whose header says ``width`` x ``height`` (with a valid header checksum)."""
    data = bytearray(png(4, 4))
    data[16:24] = struct.pack(">II", width, height)
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])))
    return bytes(data)


def oversized_jpeg(padding: int = 300 << 10) -> bytes:
    """A valid JPEG padded with ``padding`` bytes: over a 256 KiB ``--max-object-bytes``."""
    return render_jpeg(1, 1) + b"\x00" * padding


BOMBS = {
    "bomb/huge-header.jpg": jpeg_claiming(30_000, 30_000),
    "bomb/700-frames.gif": gif_of_frames(700),
    "bomb/huge-header.png": png_claiming(60_000, 60_000),
    "bomb/sparse.tar": sparse_tar("a.jpg", 2 << 30),
    "bomb/thread.png": png(1, 20_000),  # resized to a 40-pixel short side: 40 x 800000
}
OVERSIZED_KEY = "bomb/oversized.jpg"
SPARSE_MEMBER_KEY = "bomb/sparse.tar#a.jpg"  # the tar's one member, as a request names it

# 100 batch sizes, 20 repeats: a 371-byte body that once cost 96 s of CPU.
PROFILE_ABUSE = {"model": "resnet18", "batch_sizes": [1] * 100, "repeats": 20}

# Protocol-level abuse, each answered 431 (JSON) before the app sees it: (path, headers).
LONG_URL = ("/" + "a" * 100_000, {})
MANY_HEADERS = ("/healthz", {f"X-{i}": "v" * 100 for i in range(1000)})


def put_bombs(store: FileStore) -> None:
    """Every bomb into ``store`` under ``bomb/``, the oversized object included."""
    for key, blob in BOMBS.items():
        store.put(key, blob)
    store.put(OVERSIZED_KEY, oversized_jpeg())


# --- fuzzing ------------------------------------------------------------------------------

# JSON values of every kind, with the surrogates, non-finite floats and huge numbers JSON text can carry.
scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text(st.characters(codec=None), max_size=8)
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=6), inner, max_size=4), max_leaves=20)

# Bodies close to a real request, one field perturbed at a time: where the bugs live.
REQUEST_FIELDS = ("keys", "model", "split", "weights", "transform", "dtype", "epoch", "job_id")
TRANSFORM_FIELDS = ("crop_size", "resize_size", "mean", "std", "augment", "seed")


@st.composite
def near_requests(draw) -> dict:
    body = {"keys": ["a.jpg"], "model": "resnet18", "split": 4,
            "transform": {"crop_size": 32, "resize_size": 40}}
    for _ in range(draw(st.integers(1, 3))):
        if draw(st.booleans()):
            body[draw(st.sampled_from(REQUEST_FIELDS) | st.text(max_size=4))] = draw(json_values)
        else:
            transform = body["transform"] if isinstance(body["transform"], dict) else {}
            transform[draw(st.sampled_from(TRANSFORM_FIELDS))] = draw(json_values)
            body["transform"] = transform
    return body


def encode_json(body: object) -> bytes:
    """JSON text as an attacker may write it: NaN and lone surrogates included."""
    return json.dumps(body, allow_nan=True).encode("utf-8", "surrogatepass")


# What the app's fuzz test and faults.py send to /v1/extract and /v1/profile.
request_payloads = near_requests().map(encode_json) | json_values.map(encode_json) | st.binary(max_size=100)


def fuzzed_payloads(count: int, random_seed: int = 0) -> list[bytes]:
    """Up to ``count`` distinct request bodies drawn from ``request_payloads`` (reproducible by seed)."""
    drawn: list[bytes] = []

    @seed(random_seed)
    @settings(max_examples=count, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(request_payloads)
    def draw(payload: bytes) -> None:
        drawn.append(payload)

    draw()
    return drawn


# --- slow clients -------------------------------------------------------------------------

HALF_OPEN_REQUEST = b"POST /v1/extract HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n"  # headers never finished


@contextmanager
def half_open_connections(port: int, count: int, host: str = "127.0.0.1") -> Iterator[list[socket.socket]]:
    """``count`` connections that each sent part of a request's headers and hold on; closed after."""
    stalled: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.create_connection((host, port), timeout=5)
            sock.sendall(HALF_OPEN_REQUEST)
            stalled.append(sock)
        yield stalled
    finally:
        for sock in stalled:
            sock.close()


def healthz_s(url: str, timeout_s: float = 5.0) -> float:
    """Seconds a ``GET /healthz`` takes; raises unless it answers 200 ``{"status": "ok"}``."""
    started = time.perf_counter()
    response = requests.get(url + "/healthz", timeout=timeout_s)
    if response.status_code != 200 or response.json() != {"status": "ok"}:
        raise RuntimeError(f"/healthz answered {response.status_code}: {response.text[:200]}")
    return time.perf_counter() - started
