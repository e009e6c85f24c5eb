"""StorageClient against a real daemon process (gunicorn), started by ``local_daemon``."""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import pytest
import requests
import torch

from compute_side import daemon_process
from compute_side.client import StorageClient, StorageNodeError
from compute_side.daemon_process import free_port, local_daemon
from compute_side.loader import Batch
from compute_side.profiling import (
    contenders_within,
    measure_profile,
    node_anchor,
    steady_pace_ms,
    time_contenders,
    trial_paces_ms,
)
from compute_side.trainer import HeadTrainer, TrainConfig
from hapi.datasets import Manifest, make_synthetic
from hapi.models import build_model
from hapi.planner import (
    PLAYOFF_READINGS,
    TRIAL_ITERATIONS,
    TRIAL_READINGS,
    TRIAL_SETS,
    Candidate,
    candidates,
    contenders,
    evaluate,
    storage_parts_ms,
)
from hapi.profile import Profile, TierTimes
from hapi.store import FileStore
from hapi.train import Sources
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
    torch.testing.assert_close(extracted.features, _local_features(node.store, keys))


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

    assert client.health() == {"status": "ok", "store": node.store.url}
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


def test_profile_times_the_node_with_requests_overlapping(client: StorageClient, node: Node, tmp_path: Path) -> None:
    model = build_model("resnet18", input_size=SPEC.crop_size)
    template = ExtractRequest(keys=(), model="resnet18", split=0, transform=SPEC)
    samples = node.manifest.split("train")[:4]
    profile = measure_profile(model, client, node.store, template, samples, 4, tmp_path, depth=4)
    split, pace_ms = profile.node_anchor
    assert split == profile.freeze_index  # resnet18's last frozen stage ships the fewest bytes
    # Paced against lone work: a wrong burst (counting the fill, or every reply as one
    # interval) lands far outside this on any machine.
    assert 0.3 < pace_ms / storage_parts_ms(profile, split) < 10
    assert profile.compute.fetch_ms > 0 and profile.compute.fetch_cpu_ms > 0  # all-in-compute's reads, from this tier
    saved_file = next(tmp_path.glob("*.json"))
    saved = Profile.from_json(saved_file.read_text())
    # Measured anew each time, like the link, never saved.
    assert saved.node_anchor is None and saved.compute.fetch_ms == saved.compute.fetch_cpu_ms == 0
    again = measure_profile(model, client, node.store, template, samples, 4, tmp_path, depth=4)
    assert again.node_anchor is not None and again.compute.fetch_ms > 0
    # A profile saved by another version, with a field this one lacks, is measured again.
    saved_file.write_text(saved_file.read_text().replace('"model"', '"retired_field": 1.3, "model"', 1))
    remeasured = measure_profile(model, client, node.store, template, samples, 4, tmp_path, depth=4)
    assert remeasured.stage_names == profile.stage_names and "retired_field" not in saved_file.read_text()


def test_the_planner_s_contenders_are_tried_in_training_runs(client: StorageClient, node: Node,
                                                             tmp_path: Path) -> None:
    model = build_model("resnet18", input_size=SPEC.crop_size)
    model.replace_head(10)
    template = ExtractRequest(keys=(), model="resnet18", split=0, transform=SPEC)
    samples = node.manifest.split("train")[:4]
    profile = measure_profile(model, client, node.store, template, samples, 4, tmp_path, depth=2)
    trainer = HeadTrainer(model, TrainConfig())
    steps = []

    def options_for(p: Profile) -> list[Candidate]:
        return candidates(p, 4, 1000)

    sources = Sources([client], node.store, template, SPEC)

    def step(batch: Batch) -> None:
        steps.append(trainer.train_step(batch.features, batch.labels, batch.split))

    trials = []  # (candidate, readings in a row)

    def try_candidate(c: Candidate, readings: int) -> list[float]:
        trials.append((c, readings))
        return trial_paces_ms(sources.build(c.split, c.dtype)[0], step, samples, 4, 2, 2, c.steady_ms, seconds=0,
                              readings=readings)

    first = contenders(options_for(profile))
    assert first  # on loopback no candidate is link-paced, and several are within reach of the best
    tried = time_contenders(profile, options_for, try_candidate)
    # Every first-round contender got its readings (a playoff's, if it was a finalist); no more
    # were taken than the policy allows.
    assert all(sum((s, d) == (c.split, c.dtype) for s, d, _ in tried.trial_paces) in (TRIAL_READINGS, PLAYOFF_READINGS)
               for c in first)
    assert sum(n for _, n in trials) <= TRIAL_SETS * TRIAL_READINGS
    assert any(n > 1 for _, n in trials)  # A B B A: B's two readings were taken in one run
    # Each run trained its fill (2 requests in flight: one batch of 4) once and the timed
    # iterations of each reading, on the samples cycled; the batch in flight when the clock
    # stopped is not trained.
    assert len(steps) == sum(1 + n * TRIAL_ITERATIONS for _, n in trials)
    # What a trial measured is the pace the planner now charges that candidate.
    assert all(evaluate(tried, s, d, 4, 1000).trial_ms == tried.trial_pace(s, d) > 0 for s, d, _ in tried.trial_paces)
    # A trial sized by a prediction far too fast is stopped, not stretched: here after its first batch.
    steps.clear()
    assert trial_paces_ms(sources.build(first[0].split, first[0].dtype)[0], step, samples, 4, 2, 2, 1e-6,
                          seconds=0)[0] > 0
    assert len(steps) == 1
    # A budget of one contender tries the first one only, in full.
    once = time_contenders(profile, options_for, try_candidate, max_contenders=1)
    assert [(s, d) for s, d, _ in once.trial_paces] == [(first[0].split, first[0].dtype)] * TRIAL_READINGS


def test_a_short_run_affords_no_trials() -> None:
    # A trial reads 2 x 4 batches in flight + TRIAL_ITERATIONS (4) batches: 12 x 32 samples here at
    # 100 ms a sample, and a contender gets TRIAL_READINGS of them; the trials read a tenth of the
    # run's samples.
    assert contenders_within(10 * TRIAL_READINGS * 10 * 12 * 32, 32, 32, 4, pace_ms=100.0) == 10
    # At 1 ms a sample a trial times ceil(3 s / 32 ms) = 94 iterations, to last TRIAL_SECONDS.
    assert contenders_within(10 * TRIAL_READINGS * 10 * 102 * 32, 32, 32, 4, pace_ms=1.0) == 10
    assert contenders_within(960, 32, 32, 4, pace_ms=100.0) == 0  # the demo's epoch: the model alone decides


def test_steady_pace_leaves_out_the_fill() -> None:
    # Two in flight; the first two tasks open connections (200 ms), every later one takes
    # 20 ms: in steady state one finishes every 10 ms. Timed from start to end, the run
    # would average 28 ms a task.
    durations = [0.2, 0.2] + [0.02] * 8
    assert 5 < steady_pace_ms([partial(time.sleep, d) for d in durations], in_flight=2) < 20


def test_steady_pace_needs_more_than_a_fill_and_a_drain() -> None:
    with pytest.raises(ValueError, match="steady state"):
        steady_pace_ms([partial(time.sleep, 0)] * 4, in_flight=2)


def test_contention_is_not_measured_where_the_link_would_pace_the_burst(node: Node) -> None:
    tier = TierTimes("toy", 4, 1, 1.0, (1.0, 1.0))
    profile = Profile("resnet18", 32, ("a", "b"), 2, (100, 10), tier, tier, 1000.0, bandwidth=1.0)  # a byte/s
    assert node_anchor(None, ExtractRequest(keys=(), model="resnet18", split=0, transform=SPEC),
                              node.manifest.split("train")[:4], profile, batch_size=4, depth=4) is None


def test_nothing_overlaps_with_at_most_one_request_in_flight(node: Node) -> None:
    tier = TierTimes("toy", 4, 1, 1.0, (1.0, 1.0))
    profile = Profile("resnet18", 32, ("a", "b"), 2, (100, 10), tier, tier, 1000.0, bandwidth=1e12)
    request = ExtractRequest(keys=(), model="resnet18", split=0, transform=SPEC)
    assert all(node_anchor(None, request, node.manifest.split("train")[:4], profile, 4, depth) is None
               for depth in (0, 1))
