"""Crafted objects that promise far more memory than they hold (invariant 3: bounded memory).

Each is a few kilobytes: a JPEG whose header claims 30000 x 30000 pixels, a GIF of 700
one-pixel frames on a 1000 x 1000 canvas, a tar whose sparse member declares 2 GiB, an
object over the size cap, an image as thin as a thread that resizes to gigapixels, and
profile requests that ask for minutes of CPU. Against the app in process, the daemon's
own accounting must stay within its capacity and each bomb must be answered 4xx before
it is decoded; against a real daemon, the kernel's count of its peak resident memory
must stay within the budget. The bombs are built in ``experiments/attacks.py``, which
``experiments/faults.py`` also measures against a served daemon.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import requests
from flask import Flask

from compute_side.daemon_process import local_daemon
from experiments.attacks import PROFILE_ABUSE, put_bombs
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


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> FileStore:
    store = FileStore(tmp_path_factory.mktemp("store"))
    make_synthetic(store, 1, 0)
    put_bombs(store)
    return store


def _app(store: FileStore, **options: object) -> Flask:
    # Decoding on threads: the budgets in this file are sized for the daemon's one process.
    budget = process_rss_bytes() + 400 * MB
    options = {"max_image_pixels": 4_000_000, "max_object_bytes": 256 << 10, **options}
    return create_app(DaemonConfig(store_url=store.url, memory_budget=budget, memory_headroom=0, io_threads=2,
                                   decode_workers=0, **options))


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
                                  memory_headroom=0, io_threads=2, max_object_bytes=1 << 20, decode_workers=0))
    client = app.test_client()
    assert _extract(client, [_good_key(store)]).status_code == 200  # the model loads: ~45 MB of weights
    admission = app.extensions["hapi"]["admission"]
    admission.capacity = admission.reserved + 3 * MB  # what is left for requests: 3 MB
    response = _extract(client, [f"big/{i}.jpg" for i in range(16)])
    assert response.status_code in (413, 503), response.get_json()
    assert response.get_json()["error"] in ("objects_too_large", "exceeds_memory", "memory_busy")
    assert admission.peak_reserved <= admission.capacity + 45 * MB


@pytest.mark.parametrize("body, status, code", [
    (PROFILE_ABUSE, 400, "bad_request"),
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

BUDGET = 1_300_000_000  # the idle daemon (python, torch, waitress; decoding on threads) takes ~0.6 GB of it


@pytest.fixture(scope="module")
def daemon(store: FileStore, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("logs") / "daemon.log"
    args = ("--memory-budget", str(BUDGET), "--io-threads", "2", "--torch-threads", "1", "--decode-workers", "0")
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
