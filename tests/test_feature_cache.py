"""The feature cache: later epochs read it instead of the network, and never stale features."""

from __future__ import annotations

import json

import pytest
import torch

from compute_side.feature_cache import CacheScope, FeatureCache, parse_size
from compute_side.loader import PipelinedLoader, batches_of, epoch_order
from compute_side.sources import Part
from hapi.datasets import Sample
from hapi.train import cli
from hapi.transforms import TransformSpec

SMALL = ["--model", "resnet18", "--image-size", "64", "--train-per-class", "4", "--val-per-class", "2",
         "--batch-size", "8"]


def _samples(n: int, size: int = 100) -> list[Sample]:
    return [Sample(f"train/{i:04d}.jpg", i % 3, size) for i in range(n)]


def _part(samples: list[Sample], split: int = 3, dtype: str = "float32") -> Part:
    rows = torch.tensor([[float(int(s.key[6:10])), float(split)] for s in samples])
    return Part(rows, split, dtype, wire_bytes=8 * len(samples), elapsed_ms=1.0, link_interval=(0.0, 1e-3),
                timings={"forward_ms": 1.0})


def _scope(cache: FeatureCache, **changes) -> CacheScope:
    fields = {"model": "resnet18", "weights": "random", "transform": TransformSpec(crop_size=64), **changes}
    return CacheScope(cache, **fields)


def test_a_batch_comes_back_whole_in_order_without_the_network() -> None:
    scope, samples = _scope(FeatureCache()), _samples(6)
    assert scope.get(samples) is None
    scope.put(samples[:4], _part(samples[:4]))
    assert scope.get(samples) is None  # two of them were never received: the batch is no hit
    scope.put(samples[4:], _part(samples[4:]))
    shuffled = [samples[i] for i in (5, 0, 3, 1, 4, 2)]
    hit = scope.get(shuffled)
    assert hit.wire_bytes == 0 and hit.split == 3 and hit.dtype == "float32" and "cache_ms" in hit.timings
    assert hit.features[:, 0].tolist() == [5, 0, 3, 1, 4, 2]


def test_a_changed_object_is_never_served_stale() -> None:
    scope, samples = _scope(FeatureCache()), _samples(4)
    scope.put(samples, _part(samples))
    uploaded_again = [samples[0], samples[1], Sample(samples[2].key, samples[2].label, 101), samples[3]]
    assert scope.get(uploaded_again) is None  # the manifest's size of one object changed
    assert scope.get(samples) is not None


def test_other_model_weights_or_transform_miss() -> None:
    cache, samples = FeatureCache(), _samples(4)
    _scope(cache).put(samples, _part(samples))
    assert _scope(cache).get(samples) is not None
    assert _scope(cache, model="resnet50").get(samples) is None
    assert _scope(cache, weights="sha256:ab").get(samples) is None
    assert _scope(cache, transform=TransformSpec(crop_size=96)).get(samples) is None


def test_a_batch_is_served_at_one_split_and_the_newest_replaces_the_old() -> None:
    cache, samples = FeatureCache(), _samples(4)
    scope = _scope(cache)
    scope.put(samples, _part(samples, split=3))
    scope.put(samples[:2], _part(samples[:2], split=5))  # the planner moved: two came at split 5
    assert scope.get(samples) is None  # no single split holds all four
    assert scope.get(samples[:2]).split == 5 and scope.get(samples[2:]).split == 3
    assert cache.bytes == 4 * 2 * 4  # one entry per object: the old rows are gone


def test_the_budget_bounds_the_bytes_kept() -> None:
    cache, samples = FeatureCache(max_bytes=3 * 8), _samples(5)  # three rows of two floats
    _scope(cache).put(samples, _part(samples))
    assert cache.bytes == 24
    assert _scope(cache).get(samples[:3]) is not None and _scope(cache).get(samples[2:4]) is None


def test_on_disk_the_next_run_finds_them_and_still_never_stale(tmp_path) -> None:
    samples = _samples(4)
    first = FeatureCache(directory=tmp_path)
    _scope(first).put(samples, _part(samples, split=5))
    again = FeatureCache(directory=tmp_path)  # another run
    assert again.bytes == first.bytes > 4 * 8
    hit = _scope(again).get(samples)
    assert hit.split == 5 and torch.equal(hit.features, _part(samples, split=5).features)
    assert _scope(again, weights="sha256:ab").get(samples) is None
    assert _scope(again).get([Sample(samples[0].key, samples[0].label, 99)]) is None
    _scope(again).put(samples[:1], _part(samples[:1], split=3))  # the new features replace the old file
    assert _scope(FeatureCache(directory=tmp_path)).get(samples[:1]).split == 3
    assert len(list(tmp_path.rglob("*.safetensors"))) == 4


@pytest.mark.parametrize("text, size", [("0", 0), ("512", 512), ("2G", 2 * 1024 ** 3), ("1.5M", 1572864),
                                        ("64mb", 64 * 1024 ** 2), ("3 GiB", 3 * 1024 ** 3)])
def test_sizes_parse(text: str, size: int) -> None:
    assert parse_size(text) == size


def test_a_bad_size_says_what_is_expected() -> None:
    with pytest.raises(ValueError, match="size 'lots'"):
        parse_size("lots")


class CountingSteering:
    """A planner's stand-in: counts what it is asked and told; its own source, at split 3."""

    settled = True
    split = 3

    def __init__(self) -> None:
        self.picks, self.arrivals, self.cached_batches = 0, 0, 0

    def pick(self, samples: int):
        self.picks += 1
        return self

    def arrived(self, part: Part, samples: int) -> None:
        self.arrivals += 1

    def cached(self, samples: int) -> None:
        self.cached_batches += 1

    def scout(self, samples: int) -> None:
        return None

    def fetch(self, samples, epoch: int, order: int = 0) -> Part:
        return _part(list(samples))


@pytest.mark.parametrize("depth", [0, 3])
def test_the_second_epoch_neither_picks_nor_fetches_nor_teaches_the_planner(depth: int) -> None:
    samples, steering = _samples(20), CountingSteering()
    loader = PipelinedLoader(steering, request_size=3, depth=depth, cache=_scope(FeatureCache()))
    first = list(loader.epoch(batches_of(epoch_order(samples, 0, seed=1), 8), 0))
    assert steering.picks == 3 and steering.arrivals == 8 and not any(b.cached for b in first)
    second = list(loader.epoch(batches_of(epoch_order(samples, 1, seed=1), 8), 1))
    assert steering.picks == 3 and steering.arrivals == 8  # nothing sent, nothing heard
    assert steering.cached_batches == 3  # but told of each batch the cache served, in order
    assert all(b.cached and b.wire_bytes == 0 and b.requests == 0 for b in second)
    assert [k for b in second for k in b.keys] == [s.key for s in epoch_order(samples, 1, seed=1)]
    assert all(b.features[:, 0].tolist() == [int(k[6:10]) for k in b.keys] for b in second)


class ScoutAhead(CountingSteering):
    """Unsettled until the first reply; sends two samples of the first batch ahead at split 0."""

    settled = False

    def scout(self, samples: int):
        if self.arrivals:
            return None
        return ImageSource(), 2

    def arrived(self, part: Part, samples: int) -> None:
        super().arrived(part, samples)
        self.settled = True


class ImageSource:
    split = 0

    def fetch(self, samples, epoch: int, order: int = 0) -> Part:
        return _part(list(samples), split=0)


def test_a_scout_s_features_are_kept_at_the_split_its_batch_trained_at() -> None:
    advanced = []

    def advance(features: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        advanced.append((len(features), start, stop))
        return torch.stack([features[:, 0], torch.full((len(features),), float(stop))], dim=1)

    samples, steering = _samples(16), ScoutAhead()
    loader = PipelinedLoader(steering, request_size=4, depth=3, cache=_scope(FeatureCache()), advance=advance)
    first = list(loader.epoch(batches_of(samples, 8), 0))
    assert advanced == [(2, 0, 3)] and first[0].features[:, 1].tolist() == [3.0] * 8
    second = list(loader.epoch(batches_of(samples, 8), 1))
    assert all(b.cached for b in second) and advanced == [(2, 0, 3)]  # nothing run again
    assert [b.features[:, 1].tolist() for b in second] == [[3.0] * 8] * 2


def _steps(run_dir) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if '"step"' in line]


def _trained(run_dir) -> dict:
    return torch.load(run_dir / "checkpoint.pt", weights_only=True)["trainer"]["trainable"]


def test_later_epochs_move_no_bytes_and_train_the_same_head(tmp_path, capsys) -> None:
    # One sample a request: the daemon's sub-batch is one sample either way, so features
    # received again in the second epoch equal the cached ones up to the last bits, which on
    # AVX-512 hosts depend on the intra-op threads the daemon gives each pass (its share of
    # the cores at that moment). Features of another sample or split would miss by far more.
    common = [*SMALL, "--cache-dir", str(tmp_path / "cache"), "--split", "freeze", "--epochs", "2",
              "--request-size", "1"]
    cached, uncached = tmp_path / "cached", tmp_path / "uncached"
    assert cli([*common, "--output-dir", str(cached)]) == 0
    assert cli([*common, "--output-dir", str(uncached), "--feature-cache", "0"]) == 0
    capsys.readouterr()
    first, second = ([s for s in _steps(cached) if s["epoch"] == e] for e in (0, 1))
    assert all(s["wire_bytes"] > 0 and s["requests"] == 8 for s in first[:-1])
    assert all(s["wire_bytes"] == 0 and s["requests"] == 0 and "cache_ms" in s["source_ms"] for s in second)
    assert all(s["wire_bytes"] > 0 for s in _steps(uncached))
    for name, value in _trained(uncached).items():
        torch.testing.assert_close(_trained(cached)[name], value, rtol=1e-4, atol=1e-5, msg=name)


def test_augment_says_why_training_features_are_not_kept(tmp_path, capsys) -> None:
    run = tmp_path / "run"
    assert cli([*SMALL, "--cache-dir", str(tmp_path / "cache"), "--split", "freeze", "--epochs", "2", "--augment",
                "--output-dir", str(run)]) == 0
    assert "training features are not kept: --augment" in capsys.readouterr().out
    assert all(s["wire_bytes"] > 0 for s in _steps(run))


def test_a_batch_kept_at_two_splits_is_served_at_the_deeper_one_through_the_frozen_stages() -> None:
    samples = _samples(8)
    stages_run = []

    def advance(features: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        stages_run.append((start, stop, len(features)))
        return features + 10.0 * (stop - start)  # each stage adds 10 to every value

    cache = FeatureCache()
    with_stages, without = _scope(cache, advance=advance), _scope(cache)
    with_stages.put(samples[:3], _part(samples[:3], split=1))  # first kept before the planner moved
    with_stages.put(samples[3:], _part(samples[3:], split=3, dtype="bfloat16"))
    assert without.get(samples) is None  # no stages to run: a miss, as before
    part = with_stages.get(samples)
    assert (part.split, part.dtype, part.wire_bytes) == (3, "float32", 0)
    assert stages_run == [(1, 3, 3)]  # only the shallower rows, once, as a group
    assert part.features[:, 0].tolist() == [20.0, 21.0, 22.0, 3.0, 4.0, 5.0, 6.0, 7.0]
