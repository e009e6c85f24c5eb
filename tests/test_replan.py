"""Re-planning: measurements that drift from the plan switch the split, losing nothing."""

from collections import Counter
from dataclasses import replace

import pytest
import torch
from test_planner import profile

from compute_side.loader import Batch, PipelinedLoader, batches_of
from compute_side.replan import Replanner
from compute_side.sources import Part
from hapi.datasets import Sample
from hapi.planner import ALL_IN_COMPUTE, candidates, choose, evaluate


def _batch(split: int, n: int, wire_bytes: int, storage_ms: float, elapsed_ms: float, **waits: float) -> Batch:
    return Batch(torch.zeros(n, 1), torch.zeros(n, dtype=torch.long), tuple(f"k{i}" for i in range(n)), split,
                 wire_bytes, 100_000 * n, 1, 0.0, elapsed_ms, {"forward_ms": storage_ms, **waits})


def test_a_link_that_slows_down_moves_the_split_to_fewer_bytes() -> None:
    fast = profile(bandwidth=1e9, storage_ms=0.1, compute_ms=3.0)
    chosen = choose(candidates(fast, 32, 1000))
    assert chosen.split == 4  # compute-bound: push every frozen stage down
    planned = evaluate(fast, chosen.split, "float32", 32, 1000)
    replanner = Replanner(fast, chosen, 32, 1000, ("float32",), every=4)
    # The same 36 KB/sample batches now take 1 s each on the wire: about 1 MB/s.
    slow = _batch(4, 32, 32 * 36_000, planned.storage_ms * 32, 1000.0 + planned.storage_ms * 32)
    decisions = [replanner.observe(slow) for _ in range(4)]
    assert decisions[:3] == [None] * 3
    assert decisions[3] is not None and decisions[3].split == 3  # stage 2's 8 KB output
    assert replanner.profile.bandwidth < 2e6


def test_a_link_that_speeds_up_reprices_the_raw_reads_measured_across_the_old_one() -> None:
    # A slow node; raw objects read from the compute tier at 101 ms each, as fast as the
    # 1 MB/s link let them (the node reads them next to the store in 2 ms).
    p = profile(bandwidth=1e6, storage_ms=50.0, compute_ms=0.1, decode_ms=0.5, storage_decode_ms=20.0)
    p = replace(p, compute=replace(p.compute, fetch_ms=101.0), storage=replace(p.storage, fetch_ms=2.0))
    chosen = choose(candidates(p, 32, 1000))
    assert chosen.split == 0  # 49 KB of decoded pixels beat 100 KB of raw objects on the slow link
    planned = evaluate(p, 0, "float32", 32, 1000)
    replanner = Replanner(p, chosen, 32, 1000, ("float32",), every=2)
    # The link is now 100 MB/s: the batch's 1.6 MB cross in 16 ms.
    fast = _batch(0, 32, int(planned.bytes_per_sample * 32), planned.storage_ms * 32, planned.storage_ms * 32 + 16.0)
    decisions = [replanner.observe(fast) for _ in range(2)]
    # Priced at the old pace (101 ms a sample), all-in-compute would stay out of reach.
    assert decisions[1] is not None and decisions[1].split == ALL_IN_COMPUTE
    assert decisions[1].storage_ms == pytest.approx(2.0)


def test_measurements_that_match_the_plan_change_nothing() -> None:
    p = profile(bandwidth=1e6)
    chosen = choose(candidates(p, 32, 1000))
    planned = evaluate(p, chosen.split, "float32", 32, 1000)
    batch = _batch(chosen.split, 32, int(planned.bytes_per_sample * 32), planned.storage_ms * 32,
                   planned.storage_ms * 32 + planned.transfer_ms * 32)
    assert all(Replanner(p, chosen, 32, 1000, ("float32",), every=2).observe(batch) is None for _ in range(6))


def test_queueing_behind_the_jobs_own_requests_is_neither_storage_nor_link() -> None:
    p = profile(bandwidth=1e6)
    chosen = choose(candidates(p, 32, 1000))
    planned = evaluate(p, chosen.split, "float32", 32, 1000)
    # Deep prefetch: each request waited three times its work behind the job's own requests.
    own_wait = 3 * planned.storage_ms * 32
    batch = _batch(chosen.split, 32, int(planned.bytes_per_sample * 32), planned.storage_ms * 32,
                   planned.storage_ms * 32 + planned.transfer_ms * 32 + own_wait, queue_ms=own_wait,
                   shared_wait_ms=0.0)
    replanner = Replanner(p, chosen, 32, 1000, ("float32",), every=2)
    assert all(replanner.observe(batch) is None for _ in range(6))
    assert abs(replanner.profile.bandwidth - 1e6) / 1e6 < 0.01


def test_a_fetch_overlapped_with_the_previous_prefix_is_not_counted_twice() -> None:
    p = profile(bandwidth=1e6, storage_ms=30.0, compute_ms=40.0, decode_ms=10.0)
    chosen = choose(candidates(p, 32, 1000))
    planned = evaluate(p, chosen.split, "float32", 32, 1000)
    assert chosen.bottleneck == "storage"
    # The node reports its fetch and its prefix apart; in steady state the next request's
    # fetch runs under this one's prefix, so the node's pace is the slower of the two.
    work = planned.storage_ms * 32
    batch = _batch(chosen.split, 32, int(planned.bytes_per_sample * 32), work,
                   0.9 * work + work + planned.transfer_ms * 32, fetch_ms=0.9 * work)
    replanner = Replanner(p, chosen, 32, 1000, ("float32",), every=2)
    assert all(replanner.observe(batch) is None for _ in range(6))


def test_a_node_busy_with_other_jobs_is_slower_storage() -> None:
    p = profile(bandwidth=1e9, storage_ms=0.1, compute_ms=3.0)
    chosen = choose(candidates(p, 32, 1000))
    planned = evaluate(p, chosen.split, "float32", 32, 1000)
    shared = 100 * planned.compute_ms * 32  # the node now spends most of its time on other jobs
    batch = _batch(chosen.split, 32, int(planned.bytes_per_sample * 32), planned.storage_ms * 32,
                   planned.storage_ms * 32 + shared, queue_ms=shared, shared_wait_ms=shared)
    replanner = Replanner(p, chosen, 32, 1000, ("float32",), every=2)
    decisions = [replanner.observe(batch) for _ in range(2)]
    assert decisions[1] is not None and decisions[1].split < chosen.split  # less work pushed down


class SplitSource:
    def __init__(self, split: int) -> None:
        self.split = split

    def fetch(self, samples, epoch):
        return Part(torch.zeros(len(samples), 1), self.split, 8 * len(samples), 1.0)


def test_switching_source_mid_epoch_keeps_every_sample_once_and_batches_whole() -> None:
    samples = [Sample(f"train/{i:03d}.jpg", 0, 10) for i in range(60)]
    loader = PipelinedLoader(SplitSource(4), request_size=3, depth=5)
    seen, splits = [], []
    for i, batch in enumerate(loader.epoch(batches_of(samples, 8), epoch=0)):
        seen += batch.keys
        splits.append(batch.split)
        if i == 2:
            loader.source = SplitSource(7)
    assert Counter(seen) == Counter(s.key for s in samples) and len(seen) == 60
    assert splits[:3] == [4, 4, 4] and splits[-1] == 7
    assert splits == sorted(splits)  # one switch, at a batch boundary: no batch mixes splits
