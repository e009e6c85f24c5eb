"""Crafted objects that promise far more memory than they hold (invariant 3: bounded memory).

Each is a few kilobytes: a JPEG whose header claims 30000 x 30000 pixels, a GIF of 700
one-pixel frames on a 1000 x 1000 canvas, a tar whose sparse member declares 2 GiB, an
object over the size cap, an image as thin as a thread that resizes to gigapixels, and
profile requests that ask for minutes of CPU. Against the app in process, the daemon's
own accounting must stay within its capacity and each bomb must be answered 4xx before
it is decoded; against a real daemon, the kernel's count of its peak resident memory
must stay within the budget.
"""

from __future__ import annotations

import io
import struct
import tarfile
import time
import zlib
from collections.abc import Iterator

import pytest
import requests
from flask import Flask
from PIL import Image

from compute_side.daemon_process import local_daemon
from hapi.datasets import make_synthetic
from hapi.store import FileStore
from hapi.synthetic import render_jpeg
from hapi.transforms import TransformSpec
from storage_side.app import create_app
from storage_side.config import DaemonConfig
from storage_side.memory import process_rss_bytes

MB = 1 << 20
SPEC = TransformSpec(crop_size=32, resize_size=40)
SPLIT = 4


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


BOMBS = {
    "bomb/huge-header.jpg": jpeg_claiming(30_000, 30_000),
    "bomb/700-frames.gif": gif_of_frames(700),
    "bomb/huge-header.png": png_claiming(60_000, 60_000),
    "bomb/sparse.tar": sparse_tar("a.jpg", 2 << 30),
    "bomb/thread.png": png(1, 20_000),  # resized to a 40-pixel short side: 40 x 800000
}


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> FileStore:
    store = FileStore(tmp_path_factory.mktemp("store"))
    make_synthetic(store, 1, 0)
    for key, blob in BOMBS.items():
        store.put(key, blob)
    store.put("bomb/oversized.jpg", render_jpeg(1, 1) + b"\x00" * (300 << 10))
    return store


def _app(store: FileStore, **options: object) -> Flask:
    budget = process_rss_bytes() + 400 * MB
    options = {"max_image_pixels": 4_000_000, "max_object_bytes": 256 << 10, **options}
    return create_app(DaemonConfig(store_url=store.url, memory_budget=budget, memory_headroom=0, io_threads=2,
                                   **options))


def _extract(client, keys: list[str]):
    body = {"keys": keys, "model": "resnet18", "split": SPLIT, "transform": SPEC.to_dict()}
    return client.post("/v1/extract", json=body, buffered=True)


@pytest.fixture(scope="module")
def app(store: FileStore) -> Flask:
    return _app(store)


def _good_key(store: FileStore) -> str:
    return next(p.relative_to(store.root).as_posix() for p in sorted(store.root.glob("train/*/*.jpg")))


@pytest.mark.parametrize("key, status, code", [
    ("bomb/huge-header.jpg", 413, "image_too_large"),
    ("bomb/huge-header.png", 413, "image_too_large"),
    ("bomb/sparse.tar#a.jpg", 422, "corrupt_image"),
    ("bomb/oversized.jpg", 413, "object_too_large"),
    ("bomb/thread.png", 413, "image_too_large"),
])
def test_a_bomb_is_refused_before_it_is_decoded(app, store, key, status, code) -> None:
    client = app.test_client()
    admission = app.extensions["hapi"]["admission"]
    started = time.perf_counter()
    response = _extract(client, [_good_key(store), key])
    assert time.perf_counter() - started < 5
    body = response.get_json()
    assert (response.status_code, body["error"], body["key"]) == (status, code, key), body
    assert admission.peak_reserved <= admission.capacity and admission.reserved == app.extensions["hapi"][
        "cache"].resident_bytes()  # nothing held after the refusal but the loaded model
    assert _extract(client, [_good_key(store)]).status_code == 200  # still serving


def test_an_animated_gif_decodes_its_first_frame_only(app, store) -> None:
    client = app.test_client()
    response = _extract(client, ["bomb/700-frames.gif"])
    assert response.status_code == 200, response.get_json()
    admission = app.extensions["hapi"]["admission"]
    assert admission.peak_reserved <= admission.capacity


def test_objects_larger_than_their_estimate_are_charged_before_they_are_read(store) -> None:
    # 16 objects of 250 KB under a 2 MB capacity: the request could never hold them all.
    for i in range(16):
        store.put(f"big/{i}.jpg", render_jpeg(i % 10, i) + b"\x00" * (250 << 10))
    app = create_app(DaemonConfig(store_url=store.url, memory_budget=process_rss_bytes() + 120 * MB,
                                  memory_headroom=0, io_threads=2, max_object_bytes=1 << 20))
    client = app.test_client()
    assert _extract(client, [_good_key(store)]).status_code == 200  # the model loads: ~45 MB of weights
    admission = app.extensions["hapi"]["admission"]
    admission.capacity = admission.reserved + 3 * MB  # what is left for requests: 3 MB
    response = _extract(client, [f"big/{i}.jpg" for i in range(16)])
    assert response.status_code in (413, 503), response.get_json()
    assert response.get_json()["error"] in ("objects_too_large", "exceeds_memory", "memory_busy")
    assert admission.peak_reserved <= admission.capacity + 45 * MB


@pytest.mark.parametrize("body, status, code", [
    ({"model": "resnet18", "batch_sizes": [1] * 100, "repeats": 20}, 400, "bad_request"),
    ({"model": "resnet18", "batch_sizes": [60, 59, 58, 57], "repeats": 10}, 413, "profile_too_large"),
    ({"model": "resnet18", "batch_sizes": [65], "repeats": 1}, 413, "batch_too_large"),
    ({"model": "resnet18", "batch_sizes": [1, 2, 4], "repeats": 2, "input_size": 64}, 200, None),
])
def test_profile_abuse_is_bounded(store, body, status, code) -> None:
    client = _app(store, max_keys_per_request=64).test_client()
    started = time.perf_counter()
    response = client.post("/v1/profile", json=body)
    assert response.status_code == status and response.get_json().get("error") == code, response.get_json()
    assert time.perf_counter() - started < 8


# --- a real daemon: the kernel's count of its memory --------------------------------

BUDGET = 1_300_000_000  # the idle daemon (python, torch, waitress) takes ~0.6 GB of it


@pytest.fixture(scope="module")
def daemon(store: FileStore, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("logs") / "daemon.log"
    args = ("--memory-budget", str(BUDGET), "--io-threads", "2", "--torch-threads", "1")
    with local_daemon(store.url, log, extra_args=args) as url:
        yield url


def test_bombs_keep_a_real_daemon_within_its_budget(daemon: str, store: FileStore) -> None:
    outcomes = {}
    for key in ["bomb/huge-header.jpg", "bomb/700-frames.gif", "bomb/huge-header.png", "bomb/sparse.tar#a.jpg",
                "bomb/thread.png"]:
        body = {"keys": [key], "model": "resnet18", "split": SPLIT, "transform": SPEC.to_dict()}
        response = requests.post(daemon + "/v1/extract", json=body, timeout=60)
        outcomes[key] = response.status_code
        assert response.status_code < 500, response.text
    metrics = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
               for line in requests.get(daemon + "/metrics", timeout=10).text.splitlines()
               if line and not line.startswith("#")}
    peak = metrics["hapi_storage_process_peak_resident_bytes"]
    print(f"bombs -> {outcomes}; peak resident {peak / 1e6:.0f} MB of a {BUDGET / 1e6:.0f} MB budget")
    assert peak <= BUDGET
    assert outcomes["bomb/700-frames.gif"] == 200 and outcomes["bomb/huge-header.jpg"] == 413
