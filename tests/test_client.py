"""StorageClient against a real daemon process (gunicorn), started by ``local_daemon``."""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import requests
import torch

from compute_side import client as client_module
from compute_side import daemon_process
from compute_side.client import Breaker, StorageClient, StorageNodeError
from compute_side.daemon_process import free_port, local_daemon
from hapi.datasets import Manifest, make_synthetic
from hapi.models import build_model
from hapi.store import FileStore
from hapi.transforms import TransformSpec, preprocess
from hapi.wire import ExtractRequest

SPEC = TransformSpec(crop_size=32, resize_size=40)
SPLIT = 11  # resnet18's freeze index: the deepest split the storage tier may run


@dataclass(frozen=True)
class Node:
    url: str
    store: FileStore
    manifest: Manifest
    log: Path

    def keys(self, n: int) -> tuple[str, ...]:
        return tuple(s.key for s in self.manifest.split("val")[:n])


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> tuple[FileStore, Manifest]:
    store = FileStore(tmp_path_factory.mktemp("store"))
    manifest = make_synthetic(store, 1, 1)
    store.put("bad/garbage.jpg", b"GIF89a but not really")
    return store, manifest


@pytest.fixture(scope="module")
def node(store: tuple[FileStore, Manifest], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    log = tmp_path_factory.mktemp("logs") / "daemon.log"
    with local_daemon(store[0].url, log, extra_args=("--server-threads", "2", "--io-threads", "2")) as url:
        yield Node(url, store[0], store[1], log)


@pytest.fixture(scope="module")
def client(node: Node) -> StorageClient:
    return StorageClient(node.url, timeout_s=60, retries=0)


def _request(keys: tuple[str, ...], **fields: object) -> ExtractRequest:
    return ExtractRequest(keys=keys, model="resnet18", split=SPLIT, transform=SPEC, **fields)


def _local_features(store: FileStore, keys: tuple[str, ...]) -> torch.Tensor:
    model = build_model("resnet18", input_size=SPEC.crop_size)
    inputs = torch.stack([preprocess(store.get(k), k, SPEC) for k in keys])
    with torch.inference_mode():
        return model.prefix(SPLIT)(inputs)


def test_extract_round_trip(client: StorageClient, node: Node) -> None:
    keys = node.keys(3)[::-1]
    extracted = client.extract(_request(keys))
    assert extracted.keys == keys
    assert extracted.features.shape == (3, 512, 1, 1) and extracted.features.dtype == torch.float32
    assert extracted.metadata["split"] == SPLIT and extracted.metadata["stage"] == "layer4.0"
    assert extracted.metadata["raw_bytes"] == sum(len(node.store.get(k)) for k in keys)
    # The whole safetensors body: the features plus a small JSON header.
    assert extracted.features.nbytes < extracted.wire_bytes < extracted.features.nbytes + 1024
    assert 0 < extracted.body_s < 5  # the body's own time, after the node's work
    assert extracted.body_started <= extracted.tail_started <= extracted.body_started + extracted.body_s
    assert extracted.link_bytes == extracted.wire_bytes  # alone on the link
    torch.testing.assert_close(extracted.features, _local_features(node.store, keys))


def test_a_reply_counts_the_bytes_the_link_carried_beside_it(client: StorageClient, node: Node,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    fill = client_module._fill

    def beside(response: requests.Response, view: memoryview, start: int, end: int) -> None:
        fill(response, view, start, end)
        client_module.RECEIVED.add(1000)  # another reply's bytes, read meanwhile by its own thread

    monkeypatch.setattr(client_module, "_fill", beside)
    extracted = client.extract(_request(node.keys(2)))
    # Read in two halves, each beside 1000 bytes of the other reply.
    assert extracted.link_bytes == extracted.wire_bytes + 2000


def test_bfloat16_over_the_wire(client: StorageClient, node: Node) -> None:
    keys = node.keys(2)
    full = client.extract(_request(keys))
    half = client.extract(_request(keys, dtype="bfloat16"))
    assert half.features.dtype == torch.bfloat16 and half.keys == keys
    assert half.wire_bytes < 0.75 * full.wire_bytes
    torch.testing.assert_close(half.features.float(), full.features, rtol=1.6e-2, atol=1e-3)


def test_missing_key_raises_with_status_code_and_key(client: StorageClient, node: Node) -> None:
    missing = "val/red-circle/424242.jpg"
    with pytest.raises(StorageNodeError) as caught:
        client.extract(_request((*node.keys(2), missing)))
    error = caught.value
    assert (error.status, error.code, error.key, error.node) == (404, "missing_object", missing, node.url)
    assert "answered 404" in str(error) and missing in str(error)


def test_corrupt_image_raises_422_with_key(client: StorageClient, node: Node) -> None:
    with pytest.raises(StorageNodeError) as caught:
        client.extract(_request((node.keys(1)[0], "bad/garbage.jpg")))
    assert (caught.value.status, caught.value.code, caught.value.key) == (422, "corrupt_image", "bad/garbage.jpg")


def test_refused_request_raises_400_without_key(client: StorageClient, node: Node) -> None:
    with pytest.raises(StorageNodeError) as caught:
        client.extract(replace(_request(node.keys(1)), model="resnet1000"))
    assert (caught.value.status, caught.value.code, caught.value.key) == (400, "unknown_model", None)
    assert "resnet1000" in str(caught.value)


def test_daemon_stays_healthy_after_bad_requests(client: StorageClient, node: Node) -> None:
    keys = node.keys(2)
    before = client.extract(_request(keys)).features.clone()
    bad = [_request(("nope.jpg",)), _request(("bad/garbage.jpg",)), replace(_request(keys), split=99),
           _request(keys, weights="sha256:" + "f" * 64)]
    for request in bad:
        with pytest.raises(StorageNodeError) as caught:
            client.extract(request)
        assert caught.value.status in (400, 404, 409, 422)
    raw = requests.post(node.url + "/v1/extract", data=b"{not json", timeout=10,
                        headers={"Content-Type": "application/json"})
    assert raw.status_code == 400 and raw.json()["error"] == "bad_request"
    assert requests.get(node.url + "/v1/extract", timeout=10).json()["error"] == "method_not_allowed"

    assert client.health() == {"status": "ok"}  # liveness only: nothing private
    # Still serving, concurrently, and still the same features.
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: client.extract(_request(keys)).features, range(4)))
    for features in results:
        torch.testing.assert_close(features, before, rtol=0, atol=0)
    assert "Traceback" not in node.log.read_text(errors="replace")


def test_dead_port_is_unreachable_quickly() -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    client = StorageClient(url, timeout_s=5, retries=1)
    started = time.monotonic()
    with pytest.raises(StorageNodeError) as caught:
        client.extract(_request(("a.jpg",)))
    assert time.monotonic() - started < 3
    assert (caught.value.status, caught.value.code, caught.value.node) == (None, "unreachable", url)
    with pytest.raises(StorageNodeError) as caught:
        client.health()
    assert caught.value.code == "unreachable"


# --- the daemon's lifetime is the context manager's -------------------------------------


@pytest.fixture
def spawned(monkeypatch: pytest.MonkeyPatch) -> list[subprocess.Popen]:
    """Records the processes local_daemon starts, to check they are gone afterwards."""
    started: list[subprocess.Popen] = []
    real_popen = subprocess.Popen

    def recording_popen(*args, **kwargs) -> subprocess.Popen:
        process = real_popen(*args, **kwargs)
        started.append(process)
        return process

    monkeypatch.setattr(daemon_process.subprocess, "Popen", recording_popen)
    return started


def _group_alive(pgid: int) -> bool:
    """Whether any process (gunicorn's master or its worker) is left in the daemon's session."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _assert_gone(url: str, process: subprocess.Popen) -> None:
    assert process.poll() is not None
    assert not _group_alive(process.pid)
    with pytest.raises(StorageNodeError) as caught:
        StorageClient(url, timeout_s=2, retries=0).health()
    assert caught.value.code == "unreachable"


def _daemon_lifetime(store_url: str, log: Path, spawned: list[subprocess.Popen],
                     body_raises: bool) -> tuple[str, subprocess.Popen]:
    """Runs one daemon through local_daemon; returns its URL and process once the context has exited."""
    body = pytest.raises(KeyError, match="boom") if body_raises else contextlib.nullcontext()
    with body, local_daemon(store_url, log) as url:
        port = url.rsplit(":", 1)[1]
        (process,) = [p for p in spawned if p.args[p.args.index("--port") + 1] == port]
        assert _group_alive(process.pid)
        assert StorageClient(url, retries=0).health()["status"] == "ok"
        if body_raises:
            raise KeyError("boom")
    return url, process


def test_daemon_is_gone_after_the_context_exits(store, spawned, tmp_path: Path) -> None:
    # Two daemons at once, as for two storage nodes on one host: one body returns, one raises.
    with ThreadPoolExecutor(2) as pool:
        lifetimes = [pool.submit(_daemon_lifetime, store[0].url, tmp_path / f"daemon-{raises}.log", spawned, raises)
                     for raises in (False, True)]
        exited = [lifetime.result() for lifetime in lifetimes]
    assert len(spawned) == 2 and exited[0][0] != exited[1][0]
    for url, process in exited:
        _assert_gone(url, process)


def test_daemon_that_cannot_start_reports_its_log(spawned, tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="exited with 2") as caught:
        with local_daemon("ftp://nowhere/x", tmp_path / "daemon.log"):
            pytest.fail("a daemon for an ftp:// store must not come up")
    assert "ftp://nowhere/x" in str(caught.value)  # the log tail says why
    assert not _group_alive(spawned[0].pid)


# --- circuit breaker -----------------------------------------------------------------


def _until(condition, timeout_s: float = 2.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


def test_a_failed_node_is_out_at_once_and_probed_back_in(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(client_module, "BACKOFF_S", (0.05, 0.2))
    healthy = {"now": False, "probes": 0}

    def probe() -> bool:
        healthy["probes"] += 1
        return healthy["now"]

    breaker = Breaker("node", probe)
    assert breaker.in_rotation()
    breaker.trip("unreachable")
    assert breaker.out and not breaker.in_rotation()  # no probe before the backoff
    assert healthy["probes"] == 0
    time.sleep(0.06)
    assert not breaker.in_rotation()  # starts the due probe, which fails: the backoff doubles
    assert _until(lambda: healthy["probes"] == 1) and breaker.out
    healthy["now"] = True
    assert _until(lambda: breaker.in_rotation())  # the next due probe brings it back
    assert not breaker.out


def test_a_late_node_is_probed_and_gets_no_work_meanwhile() -> None:
    answer = {"ready": False}
    breaker = Breaker("node", lambda: _until(lambda: answer["ready"]) and False)
    breaker.suspect()
    assert not breaker.in_rotation() and not breaker.out  # under probe: not out yet, but no new requests
    answer["ready"] = True
    assert _until(lambda: breaker.out)  # the probe failed


def test_a_dead_node_costs_no_retries(node: Node) -> None:
    # Connection refused is final at once: failover, not retries with backoff, handles it.
    dead = StorageClient(f"http://127.0.0.1:{free_port()}")  # the defaults, as a run uses them
    started = time.monotonic()
    with pytest.raises(StorageNodeError):
        dead.extract(_request(node.keys(1)))
    assert time.monotonic() - started < 0.5
