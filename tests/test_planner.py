"""The cost model and the online policy, on toy profiles whose best split is known by construction."""

import itertools
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import replace

import pytest

from hapi.measure import SHIPPED_PROFILES, HostProfile
from hapi.planner import (
    ALL_IN_COMPUTE,
    EXPLORE_SHARE,
    Candidate,
    Conditions,
    OnlinePlanner,
    Plan,
    Reply,
    candidates,
    mix,
    price,
    safest,
    single,
)

# A toy 6-stage network, freeze index 4: outputs per sample (elements) shrink unevenly;
# stage 2's output is smaller than stage 3's (non-monotone, like DenseNet's transitions).
OUTPUTS = (40_000, 30_000, 2_000, 9_000, 1_000, 10)
FREEZE = 4
PROFILE = HostProfile("toy", "toy", 64, OUTPUTS, forward_ms=(1.0,) * FREEZE, train_ms=0.5, decode_ms=2.0)
RAW = 100_000.0  # bytes of an encoded object
BATCH = 8


def at(bandwidth: float, **known: float) -> Conditions:
    return Conditions(RAW, bandwidth=bandwidth, **known)


def best(conditions: Conditions) -> tuple[int, str]:
    return min(candidates(PROFILE, FREEZE, conditions, BATCH), key=lambda c: c.pace_ms).key


def test_a_slow_link_cuts_at_the_smallest_output_even_if_not_the_last() -> None:
    assert best(at(1e6)) == (3, "float32")  # stage 2's 2,000 elements: 8 KB, smaller than the freeze index's 36 KB


def test_a_fast_link_and_a_slow_storage_node_keep_work_on_the_compute_tier() -> None:
    assert best(at(1e10, node_scale=20.0, node_fixed_ms=40.0)) == (ALL_IN_COMPUTE, "float32")


def test_a_slow_compute_tier_pushes_every_frozen_stage_down() -> None:
    assert best(at(1e10, compute_scale=20.0)) == (FREEZE, "float32")


def test_a_narrower_wire_dtype_halves_the_bytes_when_allowed() -> None:
    options = candidates(PROFILE, FREEZE, at(1e6), BATCH, dtypes=("float32", "bfloat16"))
    assert min(options, key=lambda c: c.pace_ms).key == (3, "bfloat16")


def test_uint8_images_are_a_candidate_at_split_0_only_at_one_byte_an_element() -> None:
    options = candidates(PROFILE, FREEZE, at(1e6), BATCH, dtypes=("float32", "uint8"))
    uint8 = [c for c in options if c.dtype == "uint8"]
    assert [c.split for c in uint8] == [0]
    # The same pixels in float32 are no candidate beside them.
    assert uint8[0].bytes_per_sample == 3 * 64 * 64 and (0, "float32") not in {c.key for c in options}
    float32_at_0 = next(c for c in candidates(PROFILE, FREEZE, at(1e6), BATCH) if c.split == 0)
    assert float32_at_0.bytes_per_sample == 4 * uint8[0].bytes_per_sample


def test_only_uint8_allowed_leaves_all_in_compute_and_split_0() -> None:
    options = candidates(PROFILE, FREEZE, at(1e6), BATCH, dtypes=("uint8",))
    assert [c.key for c in options] == [(ALL_IN_COMPUTE, "float32"), (0, "uint8")]


def test_the_pace_is_the_slowest_stage_and_the_fill_the_others() -> None:
    c = price(PROFILE, FREEZE, at(1e8), 2, "float32", BATCH)
    # storage: decode 2 + 2 stages; network: 30,000 floats at 100 MB/s; compute: 2 stages + train
    assert (c.storage_ms, c.transfer_ms, c.compute_ms) == pytest.approx((4.0, 1.2, 2.5))
    assert c.pace_ms == pytest.approx(4.0) and c.fill_ms == pytest.approx(1.2 + 2.5)
    assert c.bottleneck == "storage"


def test_all_in_compute_ships_raw_objects_and_decodes_here() -> None:
    c = price(PROFILE, FREEZE, at(1e8), ALL_IN_COMPUTE, "float32", BATCH)
    assert c.bytes_per_sample == RAW and c.storage_ms == 0.0
    assert c.compute_ms == pytest.approx(2.0 + 4 * 1.0 + 0.5)
    # The store still serves each object: the storage host's cost beyond the node's timings.
    assert price(PROFILE, FREEZE, at(1e8, node_unseen_ms=3.0), ALL_IN_COMPUTE, "float32", BATCH).storage_ms == 3.0


def test_memory_budget_drops_candidates() -> None:
    options = candidates(PROFILE, FREEZE, at(1e8), BATCH, compute_memory_budget=BATCH * 4 * 45_000)
    # Splits 0 and 1 run stage 1 here, whose input and output take 70,000 floats a sample.
    assert {c.key for c in options if not c.feasible} == {(ALL_IN_COMPUTE, "float32"), (0, "float32"),
                                                         (1, "float32")}


def test_with_the_link_unknown_the_start_is_the_one_never_far_from_the_best() -> None:
    conditions = Conditions(RAW)
    start, worst = safest(candidates(PROFILE, FREEZE, conditions, BATCH), PROFILE, FREEZE, conditions, BATCH)
    # All-in-compute would be 12x slower than the best on a 1 Mbit/s link; split 3 is never
    # more than 2x slower than the best on any link.
    assert start.key == (3, "float32") and 1 < worst <= 2


def reply(split: int, samples: int, started: float, seconds: float, **timings: float) -> Reply:
    elements = 3 * 64 * 64 if split == 0 else RAW / 4 if split == ALL_IN_COMPUTE else OUTPUTS[split - 1]
    return Reply(split, "float32", samples, int(elements * 4 * samples), (started, started + seconds), timings)


def node_timings(split: int, samples: int, ms_per_stage: float, fixed_ms: float = 2.0) -> dict[str, float]:
    return {"forward_ms": split * ms_per_stage * samples, "decode_wait_ms": fixed_ms * samples}


SLOW_NODE = node_timings(3, BATCH, 30.0, fixed_ms=60.0)


def planner(run_samples: int = 10_000) -> OnlinePlanner:
    return OnlinePlanner(PROFILE, FREEZE, BATCH, run_samples, RAW, batches_in_flight=2)


def warm(p: OnlinePlanner, r: Reply) -> None:
    """``r`` after the node's first reply at its split, which reads the link only (its cold
    start); that one was on the link just before ``r``, at the same rate."""
    start, end = r.link_interval
    p.arrived(replace(r, link_interval=(2 * start - end, start)))
    p.arrived(r)


def test_the_first_replies_move_the_run_off_the_safe_start_when_the_link_is_fast_and_the_node_slow() -> None:
    p = planner()
    assert (p.pick(BATCH).key, p.settled) == ((3, "float32"), False)
    # 64 KB in 0.5 ms: 128 MB/s; the node is 30x slower than this host.
    warm(p, reply(3, BATCH, 0.0, 0.0005, **SLOW_NODE))
    assert p.settled and p.conditions.node_scale == pytest.approx(30.0)
    assert p.pick(BATCH).split == ALL_IN_COMPUTE
    assert "predicted" in p.switches[-1][2]


def test_a_reply_alone_on_the_link_reads_at_the_slower_of_its_whole_and_its_second_half() -> None:
    def rate(*replies: Reply) -> float:
        p = planner()
        for r in replies:
            p.arrived(r)
        return p.conditions.bandwidth

    # 1 MB whose first half rode a shaper's burst (0.1 s), the second at the link's 1 MB/s.
    assert rate(Reply(3, "float32", BATCH, 1_000_000, (0.0, 0.6), {}, 0.1)) == pytest.approx(1e6)
    # 10 KB that fitted in the burst whole: its second half alone reads faster still.
    assert rate(Reply(3, "float32", BATCH, 10_000, (1.0, 1.01), {}, 1.009)) == pytest.approx(1e6)


def test_the_scout_ships_what_the_safe_start_s_first_batch_would_and_goes_once() -> None:
    p = planner()
    image, count = p.scout(BATCH)
    # Split 3, the safe start, ships 8 KB a sample; split 0's images 49 KB: one of them
    # carries no more than a batch of 8 would there.
    assert (image.split, count) == (0, 1)
    assert p.scout(4 * BATCH) is None  # one scout a run
    p.arrived(reply(0, count, 0.0, 0.5, **node_timings(0, count, 1.0)))  # 98 KB/s
    assert p.settled and p.conditions.bandwidth == pytest.approx(count * 49_152 / 0.5)
    p.pick(BATCH - count)
    assert p.remaining == 10_000 - BATCH  # the scout's samples are the first batch's


def test_no_scout_goes_where_no_link_could_move_the_run_off_its_start() -> None:
    """Five epochs of 170 samples, the last four served by a feature cache: those cost this
    tier its work on their features alone, least at ResNet-50's deepest splits whatever the
    link, so the first batch goes whole to the safe start. Without the cache, it scouts."""
    profile = HostProfile.from_json((SHIPPED_PROFILES / "amd-epyc-x1" / "resnet50-112.json").read_text())

    def run(cached: int) -> OnlinePlanner:
        return OnlinePlanner(profile, 22, 32, 170, 101_000, dtypes=("float32", "uint8"), cached_samples=cached)

    cached = run(4 * 170)
    assert cached.plan.parts[0].split >= 21 and cached.scout(32) is None
    # Nor does the pipeline wait for the first reply: the plan stands until replies arrive.
    assert cached.settled and [cached.pick(32).key for _ in range(4)] == [cached.plan.parts[0].key] * 4
    assert run(0).scout(32)[1] == 6


def test_a_slow_link_keeps_the_run_where_it_started() -> None:
    p = planner()
    p.pick(BATCH)
    p.arrived(reply(3, BATCH, 0.0, 0.5, **node_timings(3, BATCH, 1.0)))  # 128 KB/s
    assert p.pick(BATCH).key == (3, "float32") and not p.switches


def test_the_node_s_pace_is_read_after_its_first_batch_at_a_split_and_never_from_a_scout() -> None:
    p = planner()
    _, count = p.scout(BATCH)
    # The scout's few samples wait 60 ms a sample for their reads: latency a batch spreads.
    p.arrived(reply(0, count, 0.0, 0.0001, decode_wait_ms=60.0 * count))
    assert p.settled and p.conditions.bandwidth and p.conditions.node_fixed_ms is None
    p.pick(BATCH - count)
    # The node's first batch at split 0 pays its cold start (10 ms a sample); the next reads 2.
    p.arrived(reply(0, BATCH, 0.001, 0.0001, decode_wait_ms=10.0 * BATCH))
    assert p.conditions.node_fixed_ms is None
    p.arrived(reply(0, BATCH, 0.002, 0.0001, decode_wait_ms=2.0 * BATCH))
    assert p.conditions.node_fixed_ms == pytest.approx(2.0)
    # So is its first at split 3, where the prefix was loaded: 30 ms a stage, then 2.
    p.arrived(reply(3, BATCH, 0.003, 0.0001, **node_timings(3, BATCH, 30.0)))
    assert p.conditions.node_scale == 1.0
    p.arrived(reply(3, BATCH, 0.004, 0.0001, **node_timings(3, BATCH, 2.0)))
    assert p.conditions.node_scale == pytest.approx(2.0)


def test_what_others_take_of_the_node_s_cores_prices_it_from_the_scout_s_reply_on() -> None:
    def start(shared_ms: float | None) -> tuple[tuple[int, str], Conditions]:
        p = planner(run_samples=300)  # too short to explore
        _, count = p.scout(BATCH)
        timings = {} if shared_ms is None else {"others_cpu_ms": shared_ms * count, "decode_wait_ms": 60.0 * count}
        p.arrived(reply(0, count, 0.0, count * 49_152 / 8e6, **timings))  # 8 MB/s
        return p.pick(BATCH - count).key, p.conditions

    # With the node priced as this host, split 3 (5 ms a sample on the node) beats split 0's
    # transfer (6.1) by more than the model's error ...
    assert start(None)[0] == (3, "float32")
    # ... but the node says a store beside it takes 5 ms a sample of its cores (its figure
    # over its recent requests): the node's 10 ms a sample at split 3 lose to split 0's 7.
    key, conditions = start(5.0)
    assert key == (0, "float32")
    assert (conditions.node_shared_ms, conditions.node_fixed_ms) == (5.0, 7.0)  # not the scout's cold decode


def test_a_gain_that_cannot_pay_for_the_switch_before_the_run_ends_is_not_taken() -> None:
    def second_pick(run_samples: int) -> tuple[int, str]:
        p = planner(run_samples)
        p.pick(BATCH)
        # 8 MB/s, a node 3x slower than this host: split 0 (6.1 ms a sample) beats split 3
        # (11 ms), but its first batch waits 6.5 ms a sample longer to fill the pipeline.
        warm(p, reply(3, BATCH, 0.0, BATCH * 8_000 / 8e6, **node_timings(3, BATCH, 3.0)))
        return p.pick(BATCH).key

    assert second_pick(run_samples=10_000) == (0, "float32")
    assert second_pick(run_samples=2 * BATCH) == (3, "float32")  # one batch left: 39 ms saved, 52 spent
    # 12 samples left: 58 ms saved pays the 52 ms fill, but not with the model's error on
    # the 132 ms they cost where the run is.
    assert second_pick(run_samples=BATCH + 12) == (3, "float32")


def test_a_predicted_move_the_rest_of_the_run_cannot_settle_is_not_taken() -> None:
    def second_pick(left: int, validation: int = 0) -> tuple[int, str]:
        p = OnlinePlanner(PROFILE, FREEZE, BATCH, BATCH + left, RAW, batches_in_flight=2,
                          train_samples=BATCH + left - validation)
        p.pick(BATCH)
        warm(p, reply(3, BATCH, 0.0, BATCH * 8_000 / 8e6, **node_timings(3, BATCH, 3.0)))
        return p.pick(BATCH).key

    # Split 0 is predicted to save 4.9 ms a sample against split 3, measured by nothing. Two
    # batches in flight: four batches left fill its pipeline and read its pace; three, not,
    # though the predicted gain pays its fill with the model's error to spare.
    assert second_pick(left=4 * BATCH) == (0, "float32")
    assert second_pick(left=3 * BATCH) == (3, "float32")
    # Validation's steps are not read: four batches left, one of them validation's, settle nothing.
    assert second_pick(left=4 * BATCH, validation=BATCH) == (3, "float32")


def test_after_a_scout_the_run_starts_at_the_best_however_close_the_safe_start() -> None:
    p = planner()
    _, count = p.scout(BATCH)
    # 10.46 MB/s: split 0 is predicted at 4.7 ms a sample (its images' transfer), within
    # the model's error of the safe start's 5; nothing was sent there, so it moves anyway.
    p.arrived(reply(0, count, 0.0, count * 49_152 / 10.46e6, **node_timings(0, count, 1.0)))
    assert p.pick(BATCH - count).key == (0, "float32")


def test_before_the_node_is_read_the_run_starts_where_the_model_s_near_best_leave_it_least_work() -> None:
    p = planner(run_samples=300)  # too short to explore
    _, count = p.scout(BATCH)
    # 9.27 MB/s: split 3 is predicted at 5 ms a sample, paced by the node (its decode and
    # three stages), split 0 at 5.3 (its images' transfer), within the model's error. The
    # node's price is a floor until it is read, so the run starts at split 0, which leaves
    # the node its decode only.
    p.arrived(reply(0, count, 0.0, count * 49_152 / 9.27e6, **node_timings(0, count, 1.0)))
    alone = [plan for plan in p.plans() if len(plan.parts) == 1]
    assert min(alone, key=p.run_ms).parts[0].split == 3
    assert p.pick(BATCH - count).key == (0, "float32")


def test_until_the_node_is_read_the_run_moves_where_the_model_s_near_best_leave_it_least_work() -> None:
    # Splits 2 and 3 ship 10.4 and 8 KB a sample, and leave the node 4 and 5 ms of work.
    profile = replace(PROFILE, output_elements=(40_000, 2_600, 2_000, 9_000, 1_000, 10))
    p = OnlinePlanner(profile, FREEZE, BATCH, 10_000, RAW, batches_in_flight=2)
    p.plan = single(next(c for c in p.options() if c.split == 0))
    assert p.pick(BATCH).split == 0
    # The first batch's reply reads 2 MB/s: split 3 is predicted at 5 ms a sample, paced by
    # the node, split 2 at 5.2 (its transfer), within the model's error. The node's first
    # batch at a split is its cold start, so its price is still a floor: the run moves to
    # split 2, which leaves the node less work.
    p.arrived(reply(0, BATCH, 1.0, BATCH * 49_152 / 2e6, **node_timings(0, BATCH, 1.0)))
    alone = [plan for plan in p.plans() if len(plan.parts) == 1]
    assert min(alone, key=p.run_ms).parts[0].split == 3
    assert p.pick(BATCH).split == 2


def test_the_link_is_read_at_what_it_carried_beside_each_reply_not_per_reply() -> None:
    p = planner()
    p.pick(BATCH)
    # Two replies of 64 KB that shared the link for the same 10 ms: 12.8 MB/s, not 6.4 each,
    # and so already from the first, read while the other is still in flight: its reading
    # counts the other's bytes, and its second half, slower for them, is no reading alone.
    shared = replace(reply(3, BATCH, 0.0, 0.010, **node_timings(3, BATCH, 1.0)), tail_started=0.004,
                     link_bytes=128_000)
    p.arrived(shared)
    assert p.conditions.bandwidth == pytest.approx(2 * 64_000 / 0.010)
    p.arrived(shared)
    assert p.conditions.bandwidth == pytest.approx(2 * 64_000 / 0.010)


def test_measuring_this_host_changes_nothing_a_run_learns(tmp_path) -> None:
    import torch

    from hapi.measure import HostProfile, host_profile
    from hapi.models import build_model

    model = build_model("resnet18", input_size=32)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.random.get_rng_state()
    profile = host_profile(model, 32, tmp_path)
    assert torch.equal(torch.random.get_rng_state(), rng)
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name  # BatchNorm running statistics included
    assert len(profile.forward_ms) == model.spec.freeze_index and profile.train_ms > 0
    saved = list(tmp_path.glob("*/resnet18-32.json"))
    assert len(saved) == 1 and HostProfile.from_json(saved[0].read_text()) == profile


def test_a_host_without_a_profile_starts_from_another_host_s_of_its_kind_at_once(tmp_path, monkeypatch) -> None:
    import torch

    from hapi import measure
    from hapi.models import build_model

    def saved(host: str, size: int = 32) -> HostProfile:
        profile = replace(PROFILE, host=host, model="resnet18", input_size=size)
        path = measure.profile_path(tmp_path, host, "resnet18", size)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(profile.to_json())
        return profile

    def measure_host(*args, **kwargs) -> HostProfile:
        raise AssertionError("measured before the first batch")

    threads = f"x{torch.get_num_threads()}"
    saved("Some GPU cuda bf16")  # a GPU's stages are in other proportions than a CPU's
    saved("Another CPU x999")
    same_threads = saved(f"Another CPU {threads}")
    monkeypatch.setattr(measure, "measure_host", measure_host)
    assert measure.host_profile(build_model("resnet18", input_size=32), 32, tmp_path) == same_threads
    saved("Some GPU cuda bf16", size=48)
    with pytest.raises(AssertionError, match="measured"):  # only a GPU's: this CPU is measured
        measure.host_profile(build_model("resnet18", input_size=48), 48, tmp_path)


CLOCK = itertools.count(1)  # seconds of a pretend clock: each reply on the link alone


def steps(p: OnlinePlanner, count: int, ms_per_sample: float, link_s: float, step_ms: float = 0.5,
          **timings: float) -> None:
    """``count`` batches sent, arrived (their replies taking ``link_s``) and trained at
    ``ms_per_sample``, of which the training step took ``step_ms``."""
    for _ in range(count):
        c = p.pick(BATCH)
        p.arrived(reply(c.split, BATCH, float(next(CLOCK)), link_s,
                        **(timings if c.split != ALL_IN_COMPUTE else {})))
        p.trained(BATCH, BATCH * (ms_per_sample - step_ms) / 1e3, BATCH * step_ms / 1e3)


def test_what_the_node_s_timings_leave_out_is_charged_to_the_node() -> None:
    p = planner()
    p.pick(BATCH)
    # A 100 KB/s link and a node 30x slower than this host by its own timings: split 3
    # alone (150 ms a sample) is best ...
    p.arrived(reply(3, BATCH, 0.0, 0.64, **SLOW_NODE))
    assert p.pick(BATCH).key == (3, "float32") and not p.switches
    # ... but it trains at 200 ms a sample: the node costs 50 ms a sample more than it
    # reports (the store beside it, HTTP), and a share of split 0's batches, which leave the
    # node only its decode, now pays (three steps read, after two that fill the pipeline).
    steps(p, 5, 200.0, 0.64, **SLOW_NODE)
    assert p.conditions.node_unseen_ms == pytest.approx(50.0)
    p.pick(BATCH)
    assert {c.split for c in p.plan.parts} == {0, 3}


def test_a_predicted_gain_within_the_running_plan_s_own_scatter_moves_nothing() -> None:
    p = planner()
    p.pick(BATCH)
    p.arrived(reply(3, BATCH, 0.0, 0.64, **SLOW_NODE))
    assert p.pick(BATCH).key == (3, "float32")
    # As above, split 3 trains at 200 ms a sample on the mean, but in bursts: its steps'
    # standard error (40%) is more than the pair's predicted gain, which does not move it.
    for ms in (200.0, 200.0, 380.0, 20.0, 380.0, 20.0, 200.0):
        p.pick(BATCH)
        p.arrived(reply(3, BATCH, float(next(CLOCK)), 0.64, **SLOW_NODE))
        p.trained(BATCH, BATCH * (ms - 0.5) / 1e3, BATCH * 0.5 / 1e3)
    assert p.conditions.node_unseen_ms == pytest.approx(50.0)
    p.pick(BATCH)
    assert p.plan.key == single(p.priced(p.plan.parts[0])).key and p.plan.parts[0].split == 3


def test_a_pace_the_link_explains_charges_nothing_to_the_node() -> None:
    # A 400 KB/s link paces split 0 at 123 ms a sample; the node (its profile known)
    # decodes in 60, and its deeper splits cost it 90 and more.
    node = replace(PROFILE, forward_ms=(30.0,) * FREEZE, decode_ms=60.0)
    p = OnlinePlanner(PROFILE, FREEZE, BATCH, 10_000, RAW, batches_in_flight=2, node_profile=node)
    split0 = next(c for c in p.options() if c.split == 0)
    p.plan = single(split0)
    link_s = BATCH * split0.bytes_per_sample / 400e3
    timings = node_timings(0, BATCH, 1.0, fixed_ms=60.0)
    warm(p, reply(0, BATCH, 0.0, link_s, **timings))
    steps(p, 6, 1e3 * link_s / BATCH, link_s, step_ms=4.5, **timings)
    # The node stays priced at its own 60 ms, not at the link's pace, so the run gives its
    # idle time a share of the batches at split 3, which ships a sixth of the bytes.
    assert p.conditions.node_unseen_ms == 0.0 and p.priced(split0).storage_ms == pytest.approx(60.0)
    assert {c.split for c in p.plan.parts} == {0, 3}


def test_a_mix_must_beat_either_of_its_candidates_alone_by_the_model_s_error() -> None:
    p = planner()
    p.pick(BATCH)
    warm(p, reply(3, BATCH, 0.0, 0.0005, **SLOW_NODE))
    # All-in-compute alone: 6.5 ms a sample; with 5% of the batches at split 2 the node
    # would take 6.3: within the model's error, so no mix is offered.
    assert all(len(plan.parts) == 1 for plan in p.plans())
    assert mix(p.priced(p.options()[0]), p.priced(p.options()[3])).pace_ms == pytest.approx(6.29, abs=0.01)


def test_the_node_and_this_tier_share_the_batches_when_both_are_needed() -> None:
    p = planner()
    p.pick(BATCH)
    # 8 MB/s, a node like this host: split 3 alone is node-bound (5 ms a sample), split 0
    # alone link-bound (6.1 ms); half the batches each keeps both busy at 3.5 ms. A pair
    # balances two tiers, so it waits for a steady-state pace to calibrate them: the first
    # reply leaves the run alone, and four steps (two fill the pipeline, two read its pace)
    # bring the pair.
    p.arrived(reply(3, BATCH, 0.0, BATCH * 8_000 / 8e6, **node_timings(3, BATCH, 1.0)))
    assert p.pick(BATCH).split == 3 and not p.switches
    steps(p, 4, 5.0, BATCH * 8_000 / 8e6, **node_timings(3, BATCH, 1.0))
    p.pick(BATCH)
    assert [c.split for c in p.plan.parts] == [0, 3] and p.plan.shares == pytest.approx((0.49, 0.51), abs=0.01)
    assert p.plan.pace_ms == pytest.approx(3.53, abs=0.01)
    # With four batches in flight and eight left, the pair would save more than its fill,
    # but the eight hold under four of split 0's share: too few for the parts to overlap,
    # so the run stays as it is.
    late = OnlinePlanner(PROFILE, FREEZE, BATCH, 14 * BATCH, RAW, batches_in_flight=4)
    late.pick(BATCH)
    late.arrived(reply(3, BATCH, 0.0, BATCH * 8_000 / 8e6, **node_timings(3, BATCH, 1.0)))
    steps(late, 5, 5.0, BATCH * 8_000 / 8e6, **node_timings(3, BATCH, 1.0))
    assert late.remaining == 8 * BATCH and late.pick(BATCH).split == 3 and not late.switches
    sent = [p.pick(BATCH).split for _ in range(100)]
    assert abs(sent.count(0) - 49) <= 1  # each batch goes to the part furthest behind its share


def test_a_plan_measured_slower_than_predicted_is_left_though_the_model_preferred_it() -> None:
    p = planner()
    p.pick(BATCH)
    warm(p, reply(3, BATCH, 0.0, 0.0005, **SLOW_NODE))
    assert p.pick(BATCH).split == ALL_IN_COMPUTE  # predicted at 6.5 ms a sample
    steps(p, 6, 200.0, 0.001)  # two fill the new pipeline; four read 200 ms a sample
    aic = next(c for c in p.options() if c.split == ALL_IN_COMPUTE)
    assert p.expected_ms(single(aic)) == pytest.approx(200.0)
    p.pick(BATCH)
    assert p.plan.key != single(aic).key


def test_a_measured_pace_stands_while_the_kind_of_reply_that_read_its_link_reads_it_alike() -> None:
    p = planner()
    p.pick(BATCH)
    node_reply_s = BATCH * OUTPUTS[2] * 4 / 10e6
    warm(p, reply(3, BATCH, 0.0, node_reply_s, **SLOW_NODE))  # the node's replies read 10 MB/s
    assert p.pick(BATCH).split == ALL_IN_COMPUTE
    # The store's own reads wait on the store as well, and read the link at 2.5 MB/s; the run
    # trains at 5 ms a sample, faster than the model's 40 ms a sample of transfer at that rate
    # (the safe start's step, two that fill the new pipeline, and two read).
    steps(p, 5, 5.0, RAW * BATCH / 2.5e6)

    def aic() -> Plan:
        return single(next(c for c in p.options() if c.split == ALL_IN_COMPUTE))

    assert p.expected_ms(aic()) == pytest.approx(5.0) and aic().pace_ms == pytest.approx(40.0, rel=0.05)
    # The node's replies read the link as they did before: it is unchanged, and so is
    # all-in-compute's measured pace ...
    for t in range(8):
        p.arrived(reply(3, BATCH, 100.0 + t, node_reply_s, **SLOW_NODE))
    assert p.expected_ms(aic()) == pytest.approx(5.0)
    # ... but the node's replies at a quarter of their rate are a changed link: once the run
    # is on another plan, the model prices all-in-compute again.
    for t in range(8):
        p.arrived(reply(3, BATCH, 200.0 + t, 4 * node_reply_s, **SLOW_NODE))
    p.plan = single(next(c for c in p.options() if c.key == (3, "float32")))
    assert p.expected_ms(aic()) == aic().pace_ms == pytest.approx(40.0)


def test_the_running_plan_s_pace_stands_while_its_own_replies_read_the_link_otherwise() -> None:
    p = planner()
    p.pick(BATCH)
    warm(p, reply(3, BATCH, 0.0, BATCH * OUTPUTS[2] * 4 / 10e6, **SLOW_NODE))
    assert p.pick(BATCH).split == ALL_IN_COMPUTE
    steps(p, 5, 5.0, RAW * BATCH / 2.5e6)  # 5 ms a sample, the store's reads at 2.5 MB/s
    # The next replies in flight read the link at a quarter of that rate (a heavier step
    # beside them, other traffic) before the next step is read: the model's price of the
    # plan running, many times its pace, moves nothing while the run trains it at 5 ms a sample.
    for _ in range(4):
        c = p.pick(BATCH)
        p.arrived(reply(c.split, BATCH, float(next(CLOCK)), 4 * RAW * BATCH / 2.5e6))
    running = single(p.priced(p.plan.parts[0]))
    assert running.parts[0].split == ALL_IN_COMPUTE and running.pace_ms > 60.0
    assert p.expected_ms(running) == pytest.approx(5.0)
    assert [why for _, _, why in p.switches][1:] == []


def test_a_plan_s_pace_is_its_steps_mean_though_its_replies_arrive_in_bursts() -> None:
    p = planner()
    p.pick(BATCH)
    warm(p, reply(3, BATCH, 0.0, BATCH * OUTPUTS[2] * 4 / 10e6, **SLOW_NODE))
    p.trained(BATCH, 0.0, BATCH * 2.0 / 1e3)  # the safe start's batch
    assert p.pick(BATCH).split == ALL_IN_COMPUTE
    # The replies in flight arrive together: one step in four waits 30 ms a sample for
    # them, the others find their batch waiting; every step computes for 2 ms a sample.
    for i in range(12):
        c = p.pick(BATCH)
        p.arrived(reply(c.split, BATCH, float(next(CLOCK)), RAW * BATCH / 1e7))
        p.trained(BATCH, BATCH * (30.0 if i % 4 == 0 else 0.0) / 1e3, BATCH * 2.0 / 1e3)
    # Two steps fill the new pipeline; of the ten read, two waited: 2 + 30 x 2 / 10.
    assert p.expected_ms(single(p.priced(p.plan.parts[0]))) == pytest.approx(8.0)


def test_after_a_move_the_next_waits_for_the_new_plan_s_pace() -> None:
    p = planner()
    p.pick(BATCH)
    warm(p, reply(3, BATCH, 0.0, BATCH * OUTPUTS[2] * 4 / 10e6, **SLOW_NODE))
    assert p.pick(BATCH).split == ALL_IN_COMPUTE  # predicted, on the node's link reading
    # The new plan's replies read the link at 100 KB/s while its pipeline fills: the model
    # prices it at twice the best of the node's plans now, but the move is a bet its pace
    # settles, and the run stays until it is read.
    for _ in range(3):
        c = p.pick(BATCH)
        p.arrived(reply(c.split, BATCH, float(next(CLOCK)), RAW * BATCH / 1e5))
    assert p.priced(p.plan.parts[0]).pace_ms > 2 * min(c.pace_ms for c in p.options() if c.split >= 0)
    assert len(p.switches) == 1
    steps(p, 4, 5.0, RAW * BATCH / 1e5)  # two fill its pipeline; two read 5 ms a sample
    assert p.pick(BATCH).split == ALL_IN_COMPUTE and len(p.switches) == 1


# Splits 3 and 4 ship 2,000 and 2,100 floats: on a 100 KB/s link the model prices them at 80
# and 84 ms a sample, closer than it can separate.
TWINS = replace(PROFILE, output_elements=(40_000, 30_000, 2_000, 2_100, 1_000, 10))


def run_twins(samples: int, step_ms: Callable[[OnlinePlanner, Candidate], tuple[float, float]]
              ) -> tuple[OnlinePlanner, int]:
    """A run of ``samples`` samples over ``TWINS``, on a 100 KB/s link and a node like this
    host, each batch trained at ``step_ms`` (its wait and its compute, per sample); the
    planner, and the samples sent to candidates outside the plan (explored)."""
    p = OnlinePlanner(TWINS, FREEZE, BATCH, samples, RAW, batches_in_flight=2)
    explored = 0
    for step in range(samples // BATCH):
        c = p.pick(BATCH)
        explored += BATCH if c.key not in {part.key for part in p.plan.parts} else 0
        wire_bytes = int(c.bytes_per_sample * BATCH)
        timings = node_timings(c.split, BATCH, 1.0) if c.split != ALL_IN_COMPUTE else {}
        p.arrived(Reply(c.split, c.dtype, BATCH, wire_bytes, (step, step + wire_bytes / 1e5), timings))
        wait_ms, compute_ms = step_ms(p, c)
        p.trained(BATCH, BATCH * wait_ms / 1e3, BATCH * compute_ms / 1e3)
    return p, explored


def test_exploration_stays_within_its_share_of_the_run_and_a_short_run_never_explores() -> None:
    def at_the_model_s_pace(p: OnlinePlanner, c: Candidate) -> tuple[float, float]:
        model = p.priced(c)
        return model.pace_ms - model.compute_ms, model.compute_ms

    p, explored = run_twins(10_000, at_the_model_s_pace)
    assert 0 < explored <= EXPLORE_SHARE * 10_000
    assert any("exploring" in why for _, _, why in p.switches)
    p, explored = run_twins(20 * BATCH, at_the_model_s_pace)
    assert explored == 0 and not any("exploring" in why for _, _, why in p.switches)


def test_a_move_within_the_model_s_error_is_a_bet_taken_where_the_run_repays_it_and_undone_if_it_loses() -> None:
    def moves(samples: int, ms: dict[int, float]) -> list[int]:
        """The splits a run of ``samples`` samples moves to, where split s trains at ms[s]."""
        p, _ = run_twins(samples, lambda p, c: (ms[c.split] - 1.0, 1.0))
        return [plan.parts[0].split for _, plan, _ in p.switches]

    # The run starts at split 3, and its steps read 88 ms a sample. Split 4, predicted 4.5%
    # faster (within the model's error), is a bet: a run long enough to repay what it may
    # lose takes it, reads split 4, and stays where it is faster ...
    assert moves(600, {3: 88.0, 4: 84.0}) == [4]
    # ... and goes back where it is slower.
    assert moves(600, {3: 88.0, 4: 92.0}) == [4, 3]
    # A run with fewer samples left than the bet needs to be read stays.
    assert moves(40, {3: 88.0, 4: 84.0}) == []


# An H200 compute tier and the same host's 16 CPU cores (or the H200 itself) as the storage
# node, ResNet-50 at 224 px: per-stage times measured there (profiles/README.md).
H200 = HostProfile.from_json((SHIPPED_PROFILES / "nvidia-h200-cuda-bf16" / "resnet50-224.json").read_text())
CPU16 = HostProfile.from_json((SHIPPED_PROFILES / "h200-host-cpu-x16" / "resnet50-224.json").read_text())
R50_FREEZE = 22


def h200_best(bandwidth_bits: float, node: HostProfile) -> Plan:
    p = OnlinePlanner(H200, R50_FREEZE, 256, 100_000, 110_000, dtypes=("float32", "bfloat16"), node_profile=node)
    p.conditions = replace(p.conditions, bandwidth=bandwidth_bits / 8)
    return min(p.plans(), key=lambda plan: plan.pace_ms)


def deepest(plan: Plan) -> int:
    return max(c.split for c in plan.parts)


def test_an_h200_on_a_fast_link_keeps_the_deep_prefix_off_a_cpu_node() -> None:
    plan = h200_best(10e9, CPU16)
    # The GPU runs the prefix 380x faster than 16 cores: at most the decode moves to the node.
    assert deepest(plan) <= 0, plan.label


def test_an_h200_on_a_slow_link_pushes_the_deep_prefix_down_even_to_a_cpu_node() -> None:
    plan = h200_best(10e6, CPU16)
    # Most batches come as pooled features (4 KB in bf16, against 110 KB of JPEG); the
    # node's 16 cores are then the bottleneck, and the link's spare time carries a share of
    # raw objects for the GPU.
    deep = sum(share for c, share in zip(plan.parts, plan.shares) if c.split >= R50_FREEZE - 2)
    assert deep > 0.7, plan.label


def test_a_gpu_storage_node_takes_a_deeper_prefix_than_a_cpu_one() -> None:
    for bits in (1e9, 10e9):
        assert deepest(h200_best(bits, H200)) > deepest(h200_best(bits, CPU16))


def test_when_a_feature_cache_serves_later_epochs_the_deepest_split_pays_for_itself() -> None:
    def settled(cached_samples: int) -> Plan:
        p = OnlinePlanner(PROFILE, FREEZE, BATCH, 1_000, RAW, batches_in_flight=2, cached_samples=cached_samples)
        p.pick(BATCH)
        # 128 MB/s, a node like this host: for one epoch, splitting early and training here
        # is fastest ...
        p.arrived(reply(3, BATCH, 0.0, 0.0005, **node_timings(3, BATCH, 1.0)))
        p.pick(BATCH)
        return p.plan

    assert max(c.split for c in settled(0).parts) < FREEZE
    # ... but when nine more epochs are read from the cache, each costs only this tier's
    # work on the cached features: nothing after the freeze index beats the freeze index.
    cached = settled(9_000)
    assert len(cached.parts) == 1 and cached.parts[0].split == FREEZE


def test_a_node_running_several_of_the_run_s_requests_at_once_serves_them_that_much_faster() -> None:
    slow_node = {"node_scale": 20.0, "node_fixed_ms": 40.0}
    one, eight = (price(PROFILE, FREEZE, at(1e10, **slow_node, node_passes=n), FREEZE, "float32", BATCH)
                  for n in (1, 8))
    assert eight.storage_ms == pytest.approx(one.storage_ms / 8)
    # One request at a time, the slow node loses to decoding here; 32 at once, it takes the
    # first two stages, where its pace and this tier's meet: (40 + 2 x 20) / 32 = 2 + 0.5 ms.
    assert best(at(1e10, **slow_node)) == (ALL_IN_COMPUTE, "float32")
    assert best(at(1e10, **slow_node, node_passes=32)) == (2, "float32")


def test_a_node_whose_prefix_runs_fastest_alone_runs_only_its_decode_side_by_side() -> None:
    """Eight requests at once decode side by side, but their prefix passes run one at a time
    (the node's pass layout): each pass then has every core, and its measured time shows it."""
    slow_node = {"node_scale": 20.0, "node_fixed_ms": 40.0}
    prefix = sum(PROFILE.forward_ms[:FREEZE]) * 20.0
    layout = price(PROFILE, FREEZE, at(1e10, **slow_node, node_passes=8, prefix_passes=1), FREEZE, "float32", BATCH)
    assert layout.storage_ms == pytest.approx(40.0 / 8 + prefix)
    unknown = price(PROFILE, FREEZE, at(1e10, **slow_node, node_passes=8), FREEZE, "float32", BATCH)
    assert unknown.storage_ms == pytest.approx((40.0 + prefix) / 8)


def sharing_splits_0_and_3() -> OnlinePlanner:
    """A run on an 8 MB/s link that, after four steps at split 3 paced at 5 ms a sample, has
    moved to half the batches each at splits 0 and 3 (as in the test of the pair above)."""
    p = planner()
    p.pick(BATCH)
    p.arrived(reply(3, BATCH, 0.0, BATCH * 8_000 / 8e6, **node_timings(3, BATCH, 1.0)))
    steps(p, 4, 5.0, BATCH * 8_000 / 8e6, **node_timings(3, BATCH, 1.0))
    p.pick(BATCH)
    assert [c.split for c in p.plan.parts] == [0, 3]
    return p


def test_a_shared_plan_measured_slow_never_makes_the_node_look_slower() -> None:
    p = sharing_splits_0_and_3()
    # As above, half the batches each at split 0 and 3 (3.5 ms a sample predicted) ...
    # ... trains at 20 ms a sample. The node works on half the samples: charged per node
    # sample, that would price split 3 alone at 33 ms, though nothing says the node slowed.
    steps(p, 6, 20.0, BATCH * 8_000 / 8e6, **node_timings(3, BATCH, 1.0))
    assert p.conditions.node_unseen_ms == 0.0


def train(p: OnlinePlanner, count: int, ms_per_sample: float | None = None) -> None:
    """``count`` batches on an 8 MB/s link and a node like this host, each step taking the
    profile's price of its own batch's stages, trained at ``ms_per_sample`` (default: that
    step alone, with no wait for data)."""
    for _ in range(count):
        c = p.pick(BATCH)
        r = reply(c.split, BATCH, float(next(CLOCK)), 1.0,
                  **(node_timings(c.split, BATCH, 1.0) if c.split != ALL_IN_COMPUTE else {}))
        p.arrived(replace(r, link_interval=(r.link_interval[0], r.link_interval[0] + r.wire_bytes / 8e6)))
        step_ms = sum(PROFILE.forward_ms[max(c.split, 0):FREEZE]) + PROFILE.train_ms
        wait_ms = 0.0 if ms_per_sample is None else ms_per_sample - step_ms
        p.trained(BATCH, BATCH * wait_ms / 1e3, BATCH * step_ms / 1e3)


def test_what_sharing_cost_a_measured_pair_prices_the_pairs_not_yet_measured() -> None:
    p = sharing_splits_0_and_3()
    # As above, the run shares the batches between splits 0 and 3 (3.53 ms a sample
    # predicted), and trains at 4.6: 1.3x the model's pace for it.
    train(p, 8, 4.6)
    assert p._sharing == pytest.approx(4.6 / 3.53, abs=0.01)
    # All-in-compute sharing with split 3 is priced at 3.79 by the model: 18% faster than
    # the pair measured, a move. Sharing costs it what it cost the measured pair (4.94), so
    # the run stays; a candidate alone is priced as before.
    other = next(plan for plan in p.plans() if [c.split for c in plan.parts] == [ALL_IN_COMPUTE, 3])
    assert other.pace_ms == pytest.approx(3.79, abs=0.01)
    assert p.expected_ms(other) == pytest.approx(other.pace_ms * 4.6 / 3.53, abs=0.02)
    alone = single(next(c for c in p.options() if c.split == 4))
    assert p.expected_ms(alone) == alone.pace_ms
    p.pick(BATCH)
    assert [c.split for c in p.plan.parts] == [0, 3] and len(p.switches) == 1


def test_a_shared_plan_s_steps_read_this_tier_at_the_stages_each_batch_ran() -> None:
    p = sharing_splits_0_and_3()
    # As above, half the batches each at split 0 and 3 ...
    # ... each step at the profile's price of its own batch's stages: split 0's run the four
    # frozen stages, split 3's one (and the head's). This tier is as fast as the profile, and
    # every step reads it so; priced at the shares' mean, split 0's steps would read it 1.5x
    # slower and split 3's 2x faster, and the scale would follow whichever part had more batches.
    train(p, 12)
    assert len(p._step_scales) == 8 and p._step_scales == pytest.approx([1.0] * 8)
    assert p.conditions.compute_scale == pytest.approx(1.0)


def test_a_store_on_the_node_s_cores_is_priced_beside_its_prefix_not_under_it() -> None:
    # A fast link (128 MB/s) and a node as fast as this host, whose reads (4 ms a sample)
    # overlap its decode and prefix (5 ms a sample at split 3): split 1 is best.
    timings = {**node_timings(3, BATCH, 1.0), "fetch_ms": 4.0 * BATCH}
    remote = planner()
    remote.pick(BATCH)
    warm(remote, reply(3, BATCH, 0.0, 0.0005, **timings))
    assert remote.pick(BATCH).split == 1 and remote.conditions.node_shared_ms == 0.0
    # The same reads done by a store on the node's cores (the node says others took 4 ms a
    # sample of them): its cores do them and the prefix one after the other, so the node is
    # 4 ms a sample slower at every split, and split 0, the least prefix, is best.
    beside = planner()
    beside.pick(BATCH)
    warm(beside, reply(3, BATCH, 0.0, 0.0005, **timings, others_cpu_ms=4.0 * BATCH))
    assert beside.conditions.node_shared_ms == pytest.approx(4.0)
    assert beside.conditions.node_fixed_ms == pytest.approx(6.0)
    assert beside.pick(BATCH).split == 0
    # Serving the raw objects costs the node the store's part of the reads too.
    aic = price(PROFILE, FREEZE, beside.conditions, ALL_IN_COMPUTE, "float32", BATCH)
    assert aic.storage_ms == pytest.approx(4.0)


def test_a_store_s_work_during_the_prefix_is_counted_once_not_in_the_prefix_s_speed_too() -> None:
    # The store's 4 ms a sample ran on the node's one core while the prefix did (1 ms a
    # stage), so the passes' wall time holds them: they are the store's, not the prefix's.
    timings = {**node_timings(3, BATCH, 1.0), "others_cpu_ms": 4.0 * BATCH}
    timings["forward_ms"] += 4.0 * BATCH
    p = planner()
    p.pick(BATCH)
    warm(p, reply(3, BATCH, 0.0, 0.0005, **timings, others_in_forward_ms=4.0 * BATCH))
    assert p.conditions.node_scale == pytest.approx(1.0)
    assert p.conditions.node_fixed_ms == pytest.approx(6.0)  # decode and the store's part, as above


def test_this_tier_is_priced_at_the_speed_its_own_steps_measure_not_the_profile_s_host() -> None:
    # The profile may be another host's (hapi.measure lends one rather than measure before
    # the first batch): at split 3 a step runs stage 3 and the head, 1.5 ms a sample by the
    # profile; this host's steps take 0.75, read at split 3.
    p = planner()
    p.pick(BATCH)
    p.arrived(reply(3, BATCH, 0.0, 0.64, **node_timings(3, BATCH, 1.0)))
    p.trained(BATCH, 0.0, BATCH * 20.0 / 1e3)  # the plan's first step creates its kernels: no reading
    assert p.conditions.compute_scale == 1.0
    steps(p, 3, 640.0, 0.64, step_ms=0.75, **node_timings(3, BATCH, 1.0))
    assert p.plan.parts[0].split == 3 and p.conditions.compute_scale == pytest.approx(0.5)
    aic = next(c for c in p.options() if c.split == ALL_IN_COMPUTE)
    assert aic.compute_ms == pytest.approx(0.5 * (4 * 1.0 + 0.5 + 2.0))


def test_with_another_host_s_profile_the_first_move_waits_for_this_host_s_step() -> None:
    # A fast link and a node 3x slower than the profile: with this tier at the profile's
    # speed, the node decoding (split 0) pays; with it 4x faster, this tier decodes too.
    ratio = Future()
    p = OnlinePlanner(PROFILE, FREEZE, BATCH, 10_000, RAW, batches_in_flight=2, step_ratio=ratio)
    p.pick(BATCH)
    warm(p, reply(3, BATCH, 0.0, 0.0005, **node_timings(3, BATCH, 3.0)))
    ratio.set_result(0.25)  # timed while the first batch was in flight
    assert p.pick(BATCH).split == ALL_IN_COMPUTE and p.conditions.compute_scale == 0.25
    same = OnlinePlanner(PROFILE, FREEZE, BATCH, 10_000, RAW, batches_in_flight=2)
    same.pick(BATCH)
    warm(same, reply(3, BATCH, 0.0, 0.0005, **node_timings(3, BATCH, 3.0)))
    assert same.pick(BATCH).split == 0


def test_timing_this_host_s_step_beside_a_job_draws_nothing_from_its_generator() -> None:
    import torch

    from hapi.measure import step_ratio
    from hapi.models import build_model

    model = build_model("resnet18", input_size=32)
    rng = torch.random.get_rng_state()
    assert step_ratio(model, replace(PROFILE, input_size=32, train_ms=1.0)).result() > 0
    assert torch.equal(torch.random.get_rng_state(), rng)


def test_the_training_step_on_given_features_runs_no_frozen_stage() -> None:
    # The step ratio times the head on its timed pass's features: a third pass of the
    # prefix would cost as much again as the two it times.
    import torch
    from torch import nn

    from hapi.measure import time_training

    class Counted(nn.Module):
        calls = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            Counted.calls += 1
            return x.flatten(1)

    stages = nn.Sequential(Counted(), nn.Linear(3 * 4 * 4, 10))
    assert time_training(stages, 1, 4, 2, repeats=1, beside_a_job=True) > 0
    assert Counted.calls == 1  # without features, once, to make them
    features = torch.zeros(5, 3 * 4 * 4)
    assert time_training(stages, 1, 4, 2, repeats=1, beside_a_job=True, features=features) > 0
    assert Counted.calls == 1


def test_a_move_priced_on_a_link_that_reads_otherwise_since_is_decided_again_at_once() -> None:
    p = planner()
    _, count = p.scout(BATCH)
    # The scout's one image reads 20 MB/s (a shaper's burst): split 0 is the best, paced by this tier.
    p.arrived(reply(0, count, 0.0, count * 49_152 / 20e6, **node_timings(0, count, 1.0)))
    assert p.pick(BATCH - count).key == (0, "float32")
    # The rest of the batch reads the link at 2.3 MB/s: split 0's images take 21 ms a sample
    # on it, split 3's 8 KB 3.5. Nothing has read split 0's pace yet, but the link it was
    # priced at is gone, so the run moves without waiting for that pace.
    rest = BATCH - count
    p.arrived(reply(0, rest, 1.0, rest * 49_152 / 2e6, **node_timings(0, rest, 1.0)))
    assert p.pick(BATCH).key == (3, "float32")


def test_the_first_plan_after_a_scout_ships_no_more_a_sample_than_the_scout_did() -> None:
    p = planner()
    _, count = p.scout(BATCH)
    # A very fast reading and a slow node: the model prices all-in-compute best, but 100 KB
    # a sample is more than the scout's 49 KB could have read the link for.
    p.arrived(reply(0, count, 0.0, 1e-4, **node_timings(0, count, 1.0, fixed_ms=20.0)))
    assert min(p.plans(), key=p.run_ms).parts[0].split == ALL_IN_COMPUTE
    assert p.pick(BATCH - count).key == (0, "float32")
