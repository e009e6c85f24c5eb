"""The pipelined loader: order, exactly-once, request cutting, in-flight depth."""

import threading
import time
from collections import Counter

import pytest
import torch

from compute_side.loader import PipelinedLoader, batches_of, epoch_order, requests_of
from compute_side.sources import Part
from hapi.datasets import Sample


def _plain(n: int) -> list[Sample]:
    return [Sample(f"train/{i:04d}.jpg", i % 3, 100) for i in range(n)]


def _sharded(shards: int, per_shard: int) -> list[Sample]:
    return [Sample(f"shards/{s:02d}.tar#train/{s}-{i}.jpg", i % 3, 100)
            for s in range(shards) for i in range(per_shard)]


class RecordingSource:
    """Returns each sample's index as its feature; records concurrency (a real daemon adds nothing here)."""

    split = 0

    def __init__(self, delay_s: float = 0.0, fail_on: str | None = None) -> None:
        self.delay_s = delay_s
        self.fail_on = fail_on
        self.requests: list[list[str]] = []
        self.orders: list[int] = []  # each request's batch's place in the stream
        self.in_flight = 0
        self.max_in_flight = 0
        self.lock = threading.Lock()

    def fetch(self, samples, epoch, order=0):
        with self.lock:
            self.requests.append([s.key for s in samples])
            self.orders.append(order)
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        time.sleep(self.delay_s)
        with self.lock:
            self.in_flight -= 1
        if self.fail_on in [s.key for s in samples]:
            raise RuntimeError(f"cannot read {self.fail_on}")
        rows = torch.tensor([[float(s.key.rsplit("/", 1)[1].split(".")[0].replace("-", ""))] for s in samples])
        return Part(rows, split=self.split, dtype="float32", wire_bytes=8 * len(samples), elapsed_ms=1.0,
                    link_interval=(0.0, 1e-3), timings={"forward_ms": 1.0})


def test_epoch_order_is_a_reproducible_permutation() -> None:
    samples = _plain(100)
    a = epoch_order(samples, epoch=1, seed=7)
    assert sorted(a, key=lambda s: s.key) == samples
    assert a == epoch_order(samples, epoch=1, seed=7)
    assert a != epoch_order(samples, epoch=2, seed=7) and a != epoch_order(samples, epoch=1, seed=8)
    assert epoch_order(samples, 1, 7, shuffle=False) == samples


def test_sharded_order_keeps_each_shard_together() -> None:
    order = epoch_order(_sharded(6, 10), epoch=0, seed=1)
    shards = [s.object_key for s in order]
    runs = [shards[0]] + [b for a, b in zip(shards, shards[1:]) if a != b]
    assert len(runs) == 6 and len(set(runs)) == 6  # each shard is one contiguous run
    assert [s.key for s in order[:10]] != sorted(s.key for s in order[:10])  # shuffled inside too


def test_requests_never_straddle_a_shard_and_respect_the_size() -> None:
    batch = _sharded(3, 5)[3:12]  # 2 from shard 0, 5 from shard 1, 2 from shard 2
    requests = requests_of(batch, request_size=4)
    assert [len(r) for r in requests] == [2, 4, 1, 2]
    assert all(len({s.object_key for s in r}) == 1 for r in requests)
    assert [len(r) for r in requests_of(_plain(10), 4)] == [4, 4, 2]


@pytest.mark.parametrize("depth", [0, 1, 3, 8])
def test_every_sample_arrives_once_in_order_with_the_users_batch(depth: int) -> None:
    samples = epoch_order(_plain(50), epoch=0, seed=3)
    source = RecordingSource()
    loader = PipelinedLoader(source, request_size=3, depth=depth)
    batches = list(loader.epoch(batches_of(samples, 8), epoch=2, first=14))
    assert [len(b.keys) for b in batches] == [8] * 6 + [2]
    # Each request carries its batch's place in the run's stream, from the pass's first.
    assert sorted(source.orders) == [14 + i for i, batch in enumerate(batches) for _ in range(batch.requests)]
    assert [k for b in batches for k in b.keys] == [s.key for s in samples]
    features = torch.cat([b.features for b in batches]).flatten().tolist()
    assert features == [float(s.key[6:10]) for s in samples]  # rows reassembled in sample order
    assert Counter(k for r in source.requests for k in r) == Counter(s.key for s in samples)
    assert batches[0].requests == 3 and batches[0].timings == {"forward_ms": 3.0}


@pytest.mark.parametrize("depth", [1, 4])
def test_depth_bounds_the_requests_in_flight(depth: int) -> None:
    source = RecordingSource(delay_s=0.02)
    loader = PipelinedLoader(source, request_size=2, depth=depth)
    for _ in loader.epoch(batches_of(_plain(40), 4), epoch=0):
        time.sleep(0.01)
    assert source.max_in_flight == depth


def test_a_failed_request_stops_the_epoch_with_its_error() -> None:
    source = RecordingSource(fail_on="train/0013.jpg")
    loader = PipelinedLoader(source, request_size=4, depth=4)
    seen = []
    with pytest.raises(RuntimeError, match="cannot read train/0013.jpg"):
        for batch in loader.epoch(batches_of(_plain(40), 8), epoch=0):
            seen += batch.keys
    assert seen == [s.key for s in _plain(8)]  # batches before the failure arrived intact


class SwitchingSteering:
    """Picks source ``a`` for the first ``switch_after`` batches, then ``b``; unsettled
    until the first reply, as the online planner is."""

    def __init__(self, a: RecordingSource, b: RecordingSource, switch_after: int) -> None:
        self.a, self.b, self.switch_after = a, b, switch_after
        self.picks = 0
        self.settled = False
        self.sent_when_settled: int | None = None  # requests sent when the first reply arrived

    def pick(self, samples: int) -> RecordingSource:
        self.picks += 1
        return self.a if self.picks <= self.switch_after else self.b

    def arrived(self, part: Part, samples: int) -> None:
        if not self.settled:
            self.sent_when_settled = len({id(r) for r in self.a.requests + self.b.requests})
        self.settled = True

    def cached(self, samples: int) -> None:
        pass

    def scout(self, samples: int) -> None:
        return None


def test_switching_source_mid_epoch_keeps_every_sample_once_and_batches_whole() -> None:
    samples = epoch_order(_plain(60), epoch=0, seed=1)
    a, b = RecordingSource(delay_s=0.005), RecordingSource(delay_s=0.005)
    b.split = 7
    steering = SwitchingSteering(a, b, switch_after=3)
    batches = list(PipelinedLoader(steering, request_size=4, depth=4).epoch(batches_of(samples, 8), epoch=0))
    assert [k for batch in batches for k in batch.keys] == [s.key for s in samples]
    assert Counter(k for r in a.requests + b.requests for k in r) == Counter(s.key for s in samples)
    # A batch's requests all went to one source: the first three batches' to a, the rest to b.
    assert sorted(k for r in a.requests for k in r) == sorted(s.key for s in samples[:24])
    assert steering.picks == len(batches)


def test_until_settled_only_the_first_batch_is_in_flight() -> None:
    a = RecordingSource(delay_s=0.02)
    steering = SwitchingSteering(a, a, switch_after=99)
    loader = PipelinedLoader(steering, request_size=2, depth=8)
    list(loader.epoch(batches_of(_plain(24), 4), epoch=0))
    # The first batch is two requests: both were sent, and nothing of the second batch,
    # before the first reply came back.
    assert steering.sent_when_settled == 2
    assert a.max_in_flight == 8  # once settled, the pipeline fills to its depth


class ScoutingSteering(SwitchingSteering):
    """Sends ``count`` samples of the first batch ahead to ``scout_source``, once."""

    def __init__(self, scout_source: RecordingSource, rest: RecordingSource, count: int) -> None:
        super().__init__(rest, rest, switch_after=99)
        self.scout_source, self.count, self.scouts = scout_source, count, 0

    def scout(self, samples: int) -> tuple[RecordingSource, int] | None:
        self.scouts += 1
        return (self.scout_source, self.count) if self.scouts == 1 else None


def test_a_scout_goes_alone_and_its_features_join_the_first_batch_at_the_rest_s_split() -> None:
    scout_source, rest = RecordingSource(delay_s=0.02), RecordingSource(delay_s=0.005)
    rest.split = 3
    advanced: list[tuple[int, int, int]] = []

    def advance(features: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        advanced.append((len(features), start, stop))
        return features - 1000  # stand-in for the frozen stages: marks the rows it ran

    steering = ScoutingSteering(scout_source, rest, count=3)
    samples = _plain(24)
    loader = PipelinedLoader(steering, request_size=4, depth=8, advance=advance)
    batches = list(loader.epoch(batches_of(samples, 8), epoch=0))
    assert [k for b in batches for k in b.keys] == [s.key for s in samples]  # each sample once, in order
    assert scout_source.requests == [[s.key for s in samples[:3]]]
    assert scout_source.orders == [0] and sorted(rest.orders) == [0, 0, 1, 1, 2, 2]  # the scout is of batch 0
    assert steering.sent_when_settled == 0  # nothing but the scout had left when it arrived
    assert advanced == [(3, 0, 3)]
    first = batches[0]
    assert first.split == 3 and len(first.features) == 8
    assert (first.features[:3] < 0).all() and (first.features[3:] >= 0).all()
    assert steering.picks == 3  # the rest of the first batch, and the two others


def test_without_the_model_s_stages_the_loader_sends_no_scout() -> None:
    source = RecordingSource(delay_s=0.005)
    steering = ScoutingSteering(source, source, count=3)
    list(PipelinedLoader(steering, request_size=4, depth=8).epoch(batches_of(_plain(16), 8), epoch=0))
    assert steering.scouts == 0 and steering.sent_when_settled == 2
