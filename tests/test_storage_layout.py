"""The node's pass layout: how many passes of a prefix run at once, timed on its cores and kept."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from hapi.datasets import make_synthetic
from hapi.store import FileStore
from hapi.transforms import TransformSpec
from storage_side.app import create_app
from storage_side.config import DaemonConfig
from storage_side.layout import Layout, LayoutBook, layouts_to_try, measure_layout, time_layout
from storage_side.parallel import ComputeTurns

SPEC = TransformSpec(crop_size=32, resize_size=40)
PASS_S = 0.05


class SleepingStage(nn.Module):
    """A stage whose pass sleeps ``PASS_S`` times (passes inside it at once) ** ``crowding``:
    0, passes side by side cost nothing more each; 2, each costs more the more run beside it."""

    def __init__(self, crowding: int) -> None:
        super().__init__()
        self.crowding = crowding
        self.inside = 0
        self.lock = threading.Lock()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with self.lock:
            self.inside += 1
            crowd = self.inside
        time.sleep(PASS_S * crowd ** self.crowding)
        with self.lock:
            self.inside -= 1
        return x


def test_layouts_to_try_are_powers_of_two_and_one_pass_per_core() -> None:
    assert layouts_to_try(1) == [1]
    assert layouts_to_try(2) == [1, 2]
    assert layouts_to_try(6) == [1, 2, 4, 6]
    assert layouts_to_try(16) == [1, 2, 4, 8, 16]


def test_the_fastest_layout_is_the_one_measured_fastest() -> None:
    free = measure_layout(SleepingStage(crowding=0), 8, 2, cores=4, compute_dtype=torch.float32, most_passes=4)
    assert free.slots == 4 and free.samples_per_s[4] > 3 * free.samples_per_s[1]
    crowded = measure_layout(SleepingStage(crowding=2), 8, 2, cores=4, compute_dtype=torch.float32, most_passes=4)
    assert crowded.slots == 1 and crowded.samples_per_s[1] > 3 * crowded.samples_per_s[4]
    # Layouts whose passes the memory granted cannot hold are not tried.
    assert set(measure_layout(SleepingStage(0), 8, 2, 4, torch.float32, most_passes=2).samples_per_s) == {1, 2}


def test_a_failing_pass_fails_the_measurement() -> None:
    class Broken(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("no kernel for this")

    with pytest.raises(RuntimeError, match="no kernel"):
        time_layout(Broken(), 8, 2, passes=2, threads=1, compute_dtype=torch.float32)


def test_the_book_keeps_layouts_across_starts_and_ignores_an_unreadable_file(tmp_path: Path, caplog) -> None:
    path = tmp_path / "node" / "layouts.json"
    LayoutBook(path).put("cpu x2", "resnet18 112px", Layout(2, {1: 140.0, 2: 151.5}))
    assert LayoutBook(path).node("cpu x2") == {"resnet18 112px": Layout(2, {1: 140.0, 2: 151.5})}
    path.write_text("{not json")
    with caplog.at_level(logging.WARNING):
        assert LayoutBook(path).node("cpu x2") == {}
    assert "measured again" in caplog.text


def test_a_prefix_measured_fastest_alone_takes_its_turn_only_while_no_other_pass_runs() -> None:
    turns = ComputeTurns(slots=2, cores=2)
    ran = threading.Event()

    def alone() -> None:
        with turns.place("b", 0, slots=1) as place, turns.turn(place):
            ran.set()

    with turns.place("a", 0) as first, turns.turn(first):
        waiting = threading.Thread(target=alone)
        waiting.start()
        assert not ran.wait(0.3)  # a slot is free, but its prefix runs fastest alone
    waiting.join(timeout=5)
    assert ran.is_set()


def test_a_measurement_waits_for_the_passes_running_and_holds_every_slot() -> None:
    turns = ComputeTurns(slots=2, cores=2)
    measuring, measured, ran = threading.Event(), threading.Event(), threading.Event()

    def measure() -> None:
        with turns.every_slot():
            measuring.set()
            assert turns.busy == 2
            measured.wait(5)

    def request() -> None:
        with turns.place("b", 0) as place, turns.turn(place):
            ran.set()

    with turns.place("a", 0) as first, turns.turn(first):
        measurement = threading.Thread(target=measure)
        measurement.start()
        assert not measuring.wait(0.3)  # a pass is running
    assert measuring.wait(5)
    later = threading.Thread(target=request)
    later.start()
    assert not ran.wait(0.3)  # no pass beside a measurement
    measured.set()
    assert ran.wait(5)
    for thread in (measurement, later):
        thread.join(5)
    assert turns.busy == 0


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one core has one layout: nothing to time")
def test_a_daemon_times_its_layout_on_a_model_s_first_request_and_keeps_it(tmp_path: Path) -> None:
    store = FileStore(tmp_path / "store")
    keys = [s.key for s in make_synthetic(store, 2, 0).split("train")][:8]
    body = {"keys": keys, "model": "resnet18", "split": 11, "transform": SPEC.to_dict(), "job_id": "j"}
    config = DaemonConfig(store_url=store.url, decode_workers=0, io_threads=2, state_dir=tmp_path / "state")

    client = create_app(config).test_client()
    assert client.post("/v1/extract", json=body, buffered=True).status_code == 200
    [loaded] = client.get("/v1/models").get_json()["loaded"]
    cores = config.core_count()
    assert set(loaded["pass_layout"]["samples_per_s"]) == {str(n) for n in layouts_to_try(cores)}
    [saved] = json.loads((tmp_path / "state" / "layouts.json").read_text()).values()
    assert saved == {"resnet18 32px": loaded["pass_layout"]}
    node = client.get("/v1/models").get_json()["node"]
    assert node["pass_layouts"] == {"resnet18 32px": loaded["pass_layout"]["slots"]}

    # A restart reads it back and times nothing.
    written = (tmp_path / "state" / "layouts.json").stat().st_mtime_ns
    again = create_app(config).test_client()
    assert again.post("/v1/extract", json=body, buffered=True).status_code == 200
    assert again.get("/v1/models").get_json()["loaded"][0]["pass_layout"] == loaded["pass_layout"]
    assert (tmp_path / "state" / "layouts.json").stat().st_mtime_ns == written


def test_an_operator_s_torch_threads_fix_the_layout(tmp_path: Path) -> None:
    store = FileStore(tmp_path / "store")
    keys = [s.key for s in make_synthetic(store, 1, 0).split("train")][:4]
    body = {"keys": keys, "model": "resnet18", "split": 11, "transform": SPEC.to_dict(), "job_id": "j"}
    config = DaemonConfig(store_url=store.url, decode_workers=0, io_threads=2, torch_threads=1,
                          state_dir=tmp_path / "state")
    client = create_app(config).test_client()
    assert client.post("/v1/extract", json=body, buffered=True).status_code == 200
    assert "pass_layout" not in client.get("/v1/models").get_json()["loaded"][0]
    assert not (tmp_path / "state").exists()
