"""The real daemon (gunicorn, its own process) under concurrent jobs: it stays within its
memory budget, as measured by the kernel, and up after every refused request."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import requests
import torch

from compute_side.client import StorageClient, StorageNodeError
from compute_side.daemon_process import local_daemon
from hapi.datasets import make_synthetic
from hapi.store import FileStore
from hapi.transforms import TransformSpec
from hapi.wire import TOKEN_ENV, ExtractRequest

TOKEN = "daemon-test-token"
BUDGET = 1_400_000_000  # the idle daemon (python, torch, gunicorn; decoding on threads) takes ~0.6 GB of it
SPEC = TransformSpec(crop_size=128, resize_size=136)


@dataclass(frozen=True)
class Node:
    url: str
    keys: tuple[str, ...]
    log: Path


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    store = FileStore(tmp_path_factory.mktemp("store"))
    keys = tuple(s.key for s in make_synthetic(store, 7, 0).split("train"))
    log = tmp_path_factory.mktemp("logs") / "daemon.log"
    # As many running requests as jobs: memory, not the running limit, is what must hold them back.
    # Decoding on threads: the budget is sized for the daemon's one process.
    args = ("--memory-budget", str(BUDGET), "--decode-workers", "0", "--max-sub-batch", "16", "--io-threads", "2",
            "--torch-threads", "2", "--max-running", "12", "--max-keys-per-request", "64", "--log-format", "json")
    with local_daemon(store.url, log, extra_args=args, env={TOKEN_ENV: TOKEN}) as url:
        yield Node(url, keys, log)


def _metrics(url: str) -> dict[str, float]:
    text = requests.get(url + "/metrics", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10).text
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line and not line.startswith("#")}


def _request(keys, job: str) -> ExtractRequest:
    return ExtractRequest(keys=tuple(keys), model="resnet18", split=11, transform=SPEC, job_id=job)


def test_concurrent_jobs_stay_within_the_budget(node: Node) -> None:
    client = StorageClient(node.url, timeout_s=300, token=TOKEN, pool_size=16)
    reference = client.extract(_request(node.keys[:32], "reference")).features.clone()

    def job(i: int) -> list[int]:
        sub_batches = []
        for _ in range(2):
            got = client.extract(_request(node.keys[:32], f"job-{i}"))
            torch.testing.assert_close(got.features, reference, rtol=1e-5, atol=1e-5)
            sub_batches.append(got.metadata["sub_batch"])
        return sub_batches

    with ThreadPoolExecutor(12) as pool:
        sub_batches = [b for result in pool.map(job, range(12)) for b in result]

    metrics = _metrics(node.url)
    # The kernel's count of the daemon's memory, at its highest, not the daemon's own accounting.
    assert metrics["hapi_storage_process_peak_resident_bytes"] <= BUDGET
    assert metrics["hapi_storage_memory_reserved_peak_bytes"] <= metrics["hapi_storage_memory_capacity_bytes"]
    # The load was more than fits at once: requests shrank their sub-batches or waited their turn.
    assert min(sub_batches) < 16 or metrics["hapi_storage_stage_seconds_sum{stage=\"queue\"}"] > 0
    assert metrics["hapi_storage_memory_reserved_peak_bytes"] > metrics["hapi_storage_memory_capacity_bytes"] / 2
    assert metrics["hapi_storage_queue_depth"] == 0


def test_refused_requests_leave_the_daemon_serving(node: Node) -> None:
    good = _request(node.keys[:4], "good")
    client = StorageClient(node.url, timeout_s=60, token=TOKEN, retries=0)
    before = client.extract(good).features.clone()

    no_token = StorageClient(node.url, timeout_s=60, token="wrong", retries=0)
    with pytest.raises(StorageNodeError) as caught:
        no_token.extract(good)
    assert (caught.value.status, caught.value.code) == (401, "unauthorized")
    raw = requests.post(node.url + "/v1/extract", json=good.to_json(), timeout=10)
    assert raw.status_code == 401 and raw.headers["WWW-Authenticate"].startswith("Bearer")

    with pytest.raises(StorageNodeError) as caught:
        client.extract(_request(node.keys[:65], "too-many"))
    assert (caught.value.status, caught.value.code) == (413, "too_many_keys")
    huge = requests.post(node.url + "/v1/extract", data=b"{" + b" " * (2 << 20) + b"}", timeout=10,
                         headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"})
    assert huge.status_code == 413 and huge.json()["error"] == "request_too_large"
    for bad in (replace(good, split=12), replace(good, keys=("nope.jpg",)), replace(good, model="resnet1000")):
        with pytest.raises(StorageNodeError) as caught:
            client.extract(bad)
        assert caught.value.status in (400, 404)

    assert client.health()["status"] == "ok"
    torch.testing.assert_close(client.extract(good).features, before, rtol=0, atol=0)
    log = node.log.read_text(errors="replace")
    assert "Traceback" not in log
    assert '"message": "extract"' in log and '"sub_batch":' in log  # one structured line per request
