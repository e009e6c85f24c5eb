"""Where to cut the network: a cost model of the pipeline, and the policy that runs it
online, on the job's own batches.

Every split trains the same head (frozen stages run in eval mode on both tiers, and the
optimiser steps on the user's batch whatever the split), so a batch extracted at any
candidate is a real training batch. Planning therefore has no probing phase. The run
starts at once: a few of the first batch's samples go ahead alone as a scout, at split 0
(images: many bytes for little of the node's work), and their reply measures the link;
the rest of the batch, and every batch after it, go where the calibrated model (or,
later, a measurement) says is fastest, and the run goes on learning the link, the node
and this tier from each reply and training step. (Until the node is read, its price is a
floor: where it paces the fastest, the run starts at the plan within the model's error
that leaves the node least work.) Where no scout can go (a job of many
ranks), the first batch goes alone to the candidate safest while the link is unknown.
It moves only when the time saved over the rest of the run exceeds what the move costs
and what it may lose where the prices it rests on err.

The cost model, per sample (a candidate is a split s, stages [0, s) on the storage node,
or all-in-compute, which ships the raw objects):

    storage(s)  = node_fixed / node_passes + node_scale x forward[0, s) / prefix_passes + node_unseen
                  (all-in-compute: node_shared / node_passes + node_unseen, the store's serving)
    transfer(s) = bytes of stage s-1's output / bandwidth        (all-in-compute: the objects)
    compute(s)  = compute_scale x (forward[s, freeze) + train)    (all-in-compute: + decode)
    pace(s)     = max(storage, transfer, compute)

The stages overlap (the next batches are read while this one trains), so the slowest sets
the pace. ``forward``, ``train`` and ``decode`` are a measured profile (``hapi.measure``;
this host's, or another's of its kind): a stage's share of the work is the model's, while
the node's speed (``node_scale``, ``node_fixed``: from the node's own timings) and the
bandwidth are learned from the replies, and this tier's speed (``compute_scale``) from its
training steps against the profile's price of their stages. The node's replies also say
what other processes took of its cores per sample (``node_shared``: a store beside it,
doing its part of every read there; the node's figure over its recent requests, so the
scout's reply carries it): that work and the prefix share the cores one after the other,
where a remote store's reads overlap the prefix; it is also what serving the raw objects
costs the node. In steady state the pace is the real cost of the slowest
stage, so what a run measures beyond the model's bottleneck is charged to a tier it can
calibrate (see ``_charge_unseen``): to the node as a cost per sample its timings leave out
(``node_unseen``: HTTP, the link's interrupts), to this tier as a further factor on its
work (the loader's threads and the GIL beside the training step, all-in-compute's decode).
A request's node time is its own wall time, so the nodes' pace divides it by how many
of the run's requests in flight the nodes run at once: ``node_passes``, from the compute
slots each node reports, for its decode; ``prefix_passes``, from the passes of this model
each node measured to run fastest at once (its pass layout), for the prefix. Where passes
share a node's cores, each request's measured time already shows it.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field, replace

from hapi.measure import HostProfile
from hapi.wire import IMAGE_WIRE_DTYPES, WIRE_DTYPES, wire_dtype_allowed

ALL_IN_COMPUTE = -1  # the candidate that pushes nothing down: raw objects to the compute tier
FLOAT32_BYTES = 4
# How far the model's price of a plan the run has not read may be from its pace, as a share:
# a move on a prediction is a bet sized against a price this much worse (``_risk_ms``), and a
# candidate predicted within it of the incumbent is one the model cannot separate
# (exploration measures those). The model's relative prices err by more (a median of 16-20%
# in the split sweeps' cases, predicted against measured ratio to the choice), so a bet is
# one the run's measurement of the new plan settles: a plan measured slower is left again.
MODEL_ERROR = 0.1
# At most this share of a run's samples goes to candidates explored to separate them.
EXPLORE_SHARE = 0.05
# The range of links the first choice must be safe on before any is measured, bytes/s:
# 1 Mbit/s to 10 Gbit/s.
LINKS = tuple(125e3 * 10 ** (i / 3) for i in range(13))
RECENT = 8  # readings a measurement is made of (a pace's: pipelines' worth of steps): recent enough to follow drift
# A pace measured at a candidate stands while the link stays within this share of what it
# was then (shaped and shared links read within about 10% from one window to the next);
# beyond it the link has changed, and the model prices the candidate again.
LINK_DRIFT = 0.25
# The kinds of reply the link is read from: a node's, and the store's own (all-in-compute).
# A read from the store waits on the store as well (its time to first byte, its service on
# a node's cores), so the two read the same link at different rates, and a change of link
# is a change in the readings of one kind.
READERS = ("node", "store")


@dataclass(frozen=True)
class Conditions:
    """What the planner knows of the deployment; learned as the run goes."""

    raw_bytes: float  # mean encoded object size per sample
    bandwidth: float | None = None  # bytes/s between the tiers; None until measured
    node_forward_ms: tuple[float, ...] | None = None  # the node's own profile per stage; None: this host's
    node_scale: float = 1.0  # the node's forward time per stage in the run / its profile
    node_fixed_ms: float | None = None  # the node's work per sample beside the prefix; None: this host's decode
    node_unseen_ms: float = 0.0  # per sample, the node's cost its timings leave out
    node_shared_ms: float = 0.0  # per sample, other processes' CPU on the node's cores (a store beside it)
    node_passes: int = 1  # the run's requests the nodes run at once (their compute slots, within those in flight)
    prefix_passes: int | None = None  # of those, the prefix passes at once (the nodes' layouts); None: node_passes
    compute_scale: float = 1.0  # this tier's cost in training / the profile's


@dataclass(frozen=True)
class Candidate:
    split: int  # ALL_IN_COMPUTE, or stages [0, split) on the storage tier
    dtype: str
    bytes_per_sample: float
    storage_ms: float  # per sample
    transfer_ms: float
    compute_ms: float
    pace_ms: float  # per sample, in steady state
    feasible: bool = True  # one batch fits the compute tier's memory

    @property
    def key(self) -> tuple[int, str]:
        return self.split, self.dtype

    @property
    def fill_ms(self) -> float:
        """Per sample, what the first batch after a (re)start waits beyond the pace: its
        stages run one after the other before the pipeline overlaps them."""
        stages = (self.storage_ms, self.transfer_ms, self.compute_ms)
        return sum(stages) - max(stages)

    @property
    def bottleneck(self) -> str:
        costs = {"storage": self.storage_ms, "network": self.transfer_ms, "compute": self.compute_ms}
        return max(costs, key=costs.get)

    @property
    def label(self) -> str:
        return "all-in-compute" if self.split == ALL_IN_COMPUTE else f"split {self.split} {self.dtype}"


def price(profile: HostProfile, freeze: int, conditions: Conditions, split: int, dtype: str,
          batch_size: int, compute_memory_budget: float = math.inf) -> Candidate:
    """The cost model's candidate at ``split`` (see the module's docstring)."""
    forward = profile.forward_ms
    bandwidth = conditions.bandwidth or math.inf
    work_ms = sum(forward[max(split, 0):freeze]) + profile.train_ms
    if split == ALL_IN_COMPUTE:
        # The store serves the objects: its work on the node's cores, and what every request
        # costs the storage host beyond the node's timings; the link and this tier's decode do the rest.
        storage_ms = conditions.node_shared_ms / conditions.node_passes + conditions.node_unseen_ms
        per_sample, work_ms = conditions.raw_bytes, work_ms + profile.decode_ms
    else:
        elements = 3 * profile.input_size ** 2 if split == 0 else profile.output_elements[split - 1]
        per_sample = elements * WIRE_DTYPES[dtype].itemsize
        fixed = profile.decode_ms if conditions.node_fixed_ms is None else conditions.node_fixed_ms
        node_forward = conditions.node_forward_ms or forward
        prefix_ms = conditions.node_scale * sum(node_forward[:split])
        storage_ms = (fixed / conditions.node_passes + prefix_ms / (conditions.prefix_passes or conditions.node_passes)
                      + conditions.node_unseen_ms)
    compute_ms = conditions.compute_scale * work_ms
    transfer_ms = per_sample / bandwidth * 1e3
    stages = (storage_ms, transfer_ms, compute_ms)
    pace_ms = max(stages)
    memory = compute_memory(profile, freeze, split, batch_size)
    return Candidate(split, dtype, per_sample, storage_ms, transfer_ms, compute_ms, pace_ms,
                     memory <= compute_memory_budget)


def compute_memory(profile: HostProfile, freeze: int, split: int, batch_size: int) -> float:
    """Peak bytes for one batch on the compute tier: frozen stages keep only a consecutive
    (input, output) pair alive; trainable ones keep every activation, and gradients double it."""
    elements = (3 * profile.input_size ** 2,) + profile.output_elements  # [i]: stage i's input
    frozen = max((elements[i] + elements[i + 1] for i in range(max(split, 0), freeze)), default=0)
    trainable = elements[freeze] + 2 * sum(elements[freeze + 1:])
    return batch_size * FLOAT32_BYTES * max(frozen, trainable)


def candidates(profile: HostProfile, freeze: int, conditions: Conditions, batch_size: int,
               dtypes: Iterable[str] = ("float32",), compute_memory_budget: float = math.inf) -> list[Candidate]:
    """All-in-compute, and every split up to the freeze index in every allowed wire dtype
    that split can ship. Split 0 ships uint8 images where allowed, and then only them: a
    float dtype would carry the same pixels in more bytes."""
    keys = [(ALL_IN_COMPUTE, "float32")] + [(s, d) for s in range(freeze + 1) for d in dtypes
                                            if wire_dtype_allowed(d, s)
                                            and (s > 0 or d in IMAGE_WIRE_DTYPES or IMAGE_WIRE_DTYPES[0] not in dtypes)]
    return [price(profile, freeze, conditions, s, d, batch_size, compute_memory_budget) for s, d in keys]


def safest(options: list[Candidate], profile: HostProfile, freeze: int, conditions: Conditions,
           batch_size: int, compute_memory_budget: float = math.inf,
           cached_per_sample: float = 0.0) -> tuple[Candidate, float]:
    """The candidate whose worst slowdown against the best, over every link in ``LINKS``,
    is least (minimax regret), and that slowdown: the choice to start with while the link
    is unknown. A candidate costs its pace, and ``cached_per_sample`` times this tier's
    work on a sample: the samples a feature cache will serve for each one sent. Ties go to
    the one that moves fewer bytes."""
    feasible = [c for c in options if c.feasible]
    if not feasible:
        raise ValueError("no split fits the compute tier's memory; lower --batch-size")
    worst = dict.fromkeys((c.key for c in feasible), 1.0)
    for bandwidth in LINKS:
        at = replace(conditions, bandwidth=bandwidth)
        priced = (price(profile, freeze, at, c.split, c.dtype, batch_size, compute_memory_budget) for c in feasible)
        costs = {c.key: c.pace_ms + cached_per_sample * c.compute_ms for c in priced}
        best = min(costs.values())
        for key, cost in costs.items():
            worst[key] = max(worst[key], cost / best)
    start = min(feasible, key=lambda c: (round(worst[c.key], 2), c.bytes_per_sample))
    return start, worst[start.key]


@dataclass(frozen=True)
class Plan:
    """What the run sends: one candidate, or two that share the batches (``shares``: the
    share of samples each gets), so that the node and this tier work at the same time."""

    parts: tuple[Candidate, ...]
    shares: tuple[float, ...]

    @property
    def loads(self) -> tuple[float, float, float]:
        """Per sample, the work of the node, the link and this tier: the shares' weighted sums."""
        return tuple(sum(share * stage for share, stage in zip(self.shares, column))
                     for column in zip(*((c.storage_ms, c.transfer_ms, c.compute_ms) for c in self.parts)))

    @property
    def pace_ms(self) -> float:
        """Per sample, in steady state: the busiest tier's load."""
        return max(self.loads)

    @property
    def key(self) -> tuple:
        return tuple((c.key, round(share, 2)) for c, share in zip(self.parts, self.shares))

    @property
    def fill_ms(self) -> float:
        return max(c.fill_ms for c in self.parts)

    @property
    def latency_ms(self) -> float:
        """Per sample, from a batch's request until its data is on this tier: its node's
        work and its transfer, one after the other (the slower part's, for a pair)."""
        return max(c.storage_ms + c.transfer_ms for c in self.parts)

    @property
    def bytes_per_sample(self) -> float:
        return sum(c.bytes_per_sample * share for c, share in zip(self.parts, self.shares))

    @property
    def label(self) -> str:
        if len(self.parts) == 1:
            return self.parts[0].label
        return " + ".join(f"{share:.0%} {c.label}" for c, share in zip(self.parts, self.shares))


def single(c: Candidate) -> Plan:
    return Plan((c,), (1.0,))


def mix(a: Candidate, b: Candidate) -> Plan:
    """``a`` and ``b`` sharing the batches in the proportion that makes the pace least: each
    tier's load per sample is the shares' weighted sum of the two candidates' (the node,
    the link and this tier serve both at once), and the slowest tier sets the pace. The
    best share is where two tiers' loads meet, or one candidate alone."""
    load_a = (a.storage_ms, a.transfer_ms, a.compute_ms)
    load_b = (b.storage_ms, b.transfer_ms, b.compute_ms)

    def pace(share: float) -> float:
        return max(share * x + (1 - share) * y for x, y in zip(load_a, load_b))

    shares = {0.0, 1.0}
    for i in range(3):
        for j in range(i + 1, 3):
            slope = (load_a[i] - load_b[i]) - (load_a[j] - load_b[j])
            if slope:
                meet = (load_b[j] - load_b[i]) / slope
                if 0 < meet < 1:
                    shares.add(meet)
    share = min(shares, key=pace)
    if share in (0.0, 1.0):
        return single(a if share else b)
    return Plan((a, b), (share, 1 - share))


@dataclass
class _Measured:
    """A plan's wall pace from the run, per sample: the mean of its recent steps' (each
    step's wait for data and compute, per sample), with the link as each kind of reply
    read it then, and the run's moves made before its latest reading.

    The mean, not a median: a pipeline's replies arrive in bursts (those in flight share
    the link and finish together), so most steps find their batch waiting and one waits
    for the burst; the median step reads the compute tier alone. For the same reason
    it is a pace only over a pipeline's worth of steps at least (``OnlinePlanner.read``),
    and the window holds ``RECENT`` pipelines' worth."""

    paces: deque[float]
    links: dict[str, float | None] = field(default_factory=dict)
    moves: int = 0
    fresh: int = 0  # its steps read since those moves

    @property
    def pace_ms(self) -> float:
        return statistics.fmean(self.paces)

    @property
    def error(self) -> float | None:
        """The relative standard error of ``pace_ms``; None under two steps. Two steps can
        show that the pace scatters, not that it does not: under three, the error is at
        least the model's."""
        if len(self.paces) < 2:
            return None
        error = statistics.stdev(self.paces) / math.sqrt(len(self.paces)) / self.pace_ms
        return error if len(self.paces) >= 3 else max(error, MODEL_ERROR)


@dataclass(frozen=True)
class Reply:
    """What one reply tells the planner (a request's part of a batch, as it arrived)."""

    split: int
    dtype: str
    samples: int
    wire_bytes: int
    link_interval: tuple[float, float]  # perf_counter times it was on the link
    timings: dict[str, float]  # the node's own timings (pushdown) or the reads' (all-in-compute)
    tail_started: float | None = None  # perf_counter once the first half of its body had arrived
    # Bytes the link carried while it was on it, its own and those of replies beside it
    # (in flight or not); None: its own alone.
    link_bytes: int | None = None

    @property
    def alone(self) -> bool:
        """Whether it had the link to itself: the link carried its own bytes only."""
        return self.link_bytes is None or self.link_bytes <= self.wire_bytes


class OnlinePlanner:
    """Chooses the candidate for each batch the loader sends, from what the run measured.

    The loader calls ``scout()`` and ``pick()`` before sending a batch, ``arrived()``
    with each reply; the training loop calls ``trained()`` after each step. Until the
    first reply (the scout's, or the first batch's) has arrived (``settled`` false), the
    loader sends nothing else: it measures the link before the pipeline commits to a plan.
    Where the link cannot move the run off its start (``scouts`` false), the pipeline fills
    at once, and the run re-plans from the first reply on.
    """

    def __init__(self, profile: HostProfile, freeze: int, batch_size: int, run_samples: int, raw_bytes: float,
                 dtypes: tuple[str, ...] = ("float32",), batches_in_flight: int = 1,
                 compute_memory_budget: float = math.inf, node_profile: HostProfile | None = None,
                 cached_samples: int = 0, node_passes: int = 1, step_ratio: Future[float] | None = None,
                 passes: int = 0, train_samples: int | None = None, prefix_passes: int | None = None) -> None:
        """``profile``: this host's, or another's of its kind with ``step_ratio``: this host's
        prefix and step against the profile's, being timed (the first move waits for it);
        ``node_profile``: the storage node's, where known (else the node is priced as this
        host until its replies say otherwise); ``run_samples``: the samples the run will
        send; ``cached_samples``: those of later epochs that a feature cache will serve
        instead (they cost this tier's work on them alone); ``node_passes``: the run's
        requests the nodes run at once, ``prefix_passes`` those whose prefix they run at
        once (None: as many); ``passes``: its passes over batches that send
        requests (each epoch's training and validation, less those the cache serves);
        ``train_samples``: of ``run_samples``, those of training batches (default: all)."""
        self.profile, self.freeze, self.batch_size = profile, freeze, batch_size
        self.dtypes, self.memory_budget = dtypes, compute_memory_budget
        self.batches_in_flight = batches_in_flight
        self.conditions = Conditions(raw_bytes, node_passes=node_passes, prefix_passes=prefix_passes)
        if node_profile is not None:
            self.conditions = replace(self.conditions, node_forward_ms=node_profile.forward_ms,
                                      node_fixed_ms=node_profile.decode_ms)
        self._profile_fixed_ms = (node_profile or profile).decode_ms  # the node's work beside its prefix, unread
        self.run_samples = run_samples  # validation included
        self.remaining = run_samples  # samples the run has yet to send
        # Of those, the ones whose steps will be read (``trained`` hears training steps only).
        self.train_left = run_samples if train_samples is None else train_samples
        self.cached_samples = cached_samples
        self.passes_left = passes  # passes over batches still to start that send requests
        self.explore_left = EXPLORE_SHARE * run_samples
        start, worst = safest(self.options(), profile, freeze, self.conditions, batch_size, compute_memory_budget,
                              cached_samples / max(run_samples, 1))
        self.plan = single(start)
        # The scout reads the link where the link decides: where the start may be slower
        # than the best on some link by more than the model's error.
        self.scouts = worst > 1 + MODEL_ERROR
        self.settled = not self.scouts
        self.switches: list[tuple[int, Plan, str]] = []  # (samples sent before it, plan, why)
        self._dealt = [0.0]  # samples sent to each part of the plan
        self._exploring: tuple[Candidate, int] | None = None  # (candidate, batches still to send)
        self._explored: set[tuple[int, str]] = set()
        self._measured: dict[tuple, _Measured] = {}
        self._training_picks: deque[tuple[tuple, int]] = deque()  # (plan, split) of each training batch sent, in order
        self._links: deque[Reply] = deque(maxlen=RECENT)
        self._links_by_reader: dict[str, deque[Reply]] = {
            reader: deque(maxlen=RECENT) for reader in READERS}
        self._readings: dict[str, float | None] = dict.fromkeys(READERS)  # the link as each kind reads it now
        self._node_scales: deque[float] = deque(maxlen=RECENT)
        self._node_fixed: deque[float] = deque(maxlen=RECENT)
        self._node_shared: deque[float] = deque(maxlen=RECENT)
        self._step_scales: deque[float] = deque(maxlen=RECENT)  # this tier's steps / the profile's
        self._loader_factor = 1.0  # this tier's pace beyond its steps (see ``_charge_unseen``)
        self._step_ratio, self._host_scale = step_ratio, 1.0  # this host's speed against the profile's
        self._previous_plan: tuple | None = None
        self._filling = 0  # steps still to come before the pipeline runs in steady state
        self._arrived = 0  # samples whose replies arrived
        self._moves = 0  # moves made (explorations are not)
        self._calibrated = False  # a steady-state pace has been charged to the model
        self._sharing = 1.0  # the latest pair read: its measured pace over its model's (see ``expected_ms``)
        # The link as each kind of reply read it when the latest move, to more bytes a sample, was priced
        self._bet_links: dict[str, float | None] = {}
        self._scouted = False  # the first batch's scout has gone
        self._scout_bytes = math.inf  # per sample, what the scout shipped
        self._node_served: set[int] = set()  # the splits the nodes served a batch at

    def options(self) -> list[Candidate]:
        return candidates(self.profile, self.freeze, self.conditions, self.batch_size, self.dtypes, self.memory_budget)

    def priced(self, c: Candidate) -> Candidate:
        return price(self.profile, self.freeze, self.conditions, c.split, c.dtype, self.batch_size, self.memory_budget)

    def plans(self) -> list[Plan]:
        """Every feasible candidate alone, and every pair of them sharing the batches where
        the pair is predicted faster than either alone by more than the model's error.
        Where a feature cache will serve later epochs, only single candidates: a later
        epoch's batch would hold features of two splits, which the cache cannot serve together."""
        feasible = [c for c in self.options() if c.feasible]
        if self.cached_samples:
            return [single(c) for c in feasible]
        pairs = [mix(a, b) for i, a in enumerate(feasible) for b in feasible[i + 1:]]
        return [single(c) for c in feasible] + [
            p for p in pairs if len(p.parts) == 2 and p.pace_ms < min(c.pace_ms for c in p.parts) * (1 - MODEL_ERROR)]

    # -- what the run measured -------------------------------------------------------

    def arrived(self, reply: Reply) -> None:
        """Learn the link and the node from one reply."""
        self._arrived += reply.samples
        self._links.append(reply)
        reader = _reader(reply.split)
        self._links_by_reader[reader].append(reply)
        self._readings = {**self._readings, reader: _link_rate(self._links_by_reader[reader])}
        bandwidth = _link_rate(self._links)
        # The node's pace is read from batches after its first at a split, which pays its
        # cold start (the prefix's load and first passes, the store's first reads), and
        # never from the scout: its few samples' reads are mostly latency that a batch spreads.
        scout = self._scouted and not self.settled
        first = reply.split not in self._node_served
        if not scout:
            self._node_served.add(reply.split)
        elif "others_cpu_ms" in reply.timings:
            # What others take of the node's cores per sample is the node's figure over its
            # recent requests, any job's, not the scout's own few reads: it prices the node
            # from the start, beside the decode (they take the cores in turn), until the
            # node's own batches read both.
            shared = reply.timings["others_cpu_ms"] / reply.samples
            self.conditions = replace(self.conditions, node_shared_ms=shared,
                                      node_fixed_ms=self._profile_fixed_ms + shared)
        if reply.split != ALL_IN_COMPUTE and not scout and not first:
            t = reply.timings
            # The prefix's own time: what others ran on its cores meanwhile is counted once, below.
            forward_ms = t.get("forward_ms", 0.0) - t.get("others_in_forward_ms", 0.0)
            forward = forward_ms / reply.samples
            # The next request's objects are fetched while this one's prefix runs, except the
            # work others do for them on the node's cores (a store beside the node): the cores
            # do that and the prefix one after the other, while the reads' waits overlap them.
            # A wait behind other jobs makes it a slower node.
            shared = t.get("others_cpu_ms", 0.0)
            turn = t.get("decode_wait_ms", 0.0) + forward_ms
            busy = (max(t.get("fetch_ms", 0.0) - shared, turn + shared) + t.get("shared_wait_ms", 0.0)) / reply.samples
            self._node_shared.append(shared / reply.samples)
            prefix_ms = sum((self.conditions.node_forward_ms or self.profile.forward_ms)[:reply.split])
            if prefix_ms > 0 and forward > 0:
                self._node_scales.append(forward / prefix_ms)
            self._node_fixed.append(max(busy - forward, 0.0))
        self.conditions = replace(
            self.conditions, bandwidth=bandwidth,
            node_scale=_median(self._node_scales, self.conditions.node_scale),
            node_fixed_ms=_median(self._node_fixed, self.conditions.node_fixed_ms),
            node_shared_ms=_median(self._node_shared, self.conditions.node_shared_ms))
        self.settled = True

    def trained(self, samples: int, wait_s: float, compute_s: float) -> None:
        """Learn the plan's wall pace from one training step (its wait for data and its
        compute), and charge what the model does not explain to its bottleneck tier."""
        plan, split = self._training_picks.popleft() if self._training_picks else (None, None)
        first_step = plan != self._previous_plan
        if first_step:
            self._filling = self.batches_in_flight
        self._previous_plan = plan
        # A plan's first step also creates its stages' kernels: no reading of this tier's speed.
        # Nor is a step that is mostly the head's: the time of one small layer says little of
        # the frozen convolutions the scale also prices.
        work_ms = self._step_work_ms(split) if split is not None else 0.0
        if (work_ms >= 2 * self.profile.train_ms and samples == self.batch_size and not first_step
                and compute_s > 0):
            self._step_scales.append(compute_s * 1e3 / samples / work_ms)
            self._rescale_compute()
        # The steps of a pipeline that (re)started waited for it to fill as well: while the
        # batches in flight are those sent when it started, a step is no reading of the pace.
        if self._filling > 0:
            self._filling -= 1
            return
        if samples == self.batch_size and plan is not None:
            measured = self._measured.setdefault(plan, _Measured(deque(maxlen=RECENT * self.batches_in_flight)))
            if measured.moves != self._moves:
                measured.moves, measured.fresh = self._moves, 0
            measured.paces.append((wait_s + compute_s) * 1e3 / samples)
            measured.fresh += 1
            measured.links = self._readings
            if plan == self.plan.key and self.read(plan):
                self._charge_unseen(measured.pace_ms)

    def restarted(self) -> None:
        """A pass over batches starts (an epoch's training, a validation), its pipeline empty:
        its first steps are no readings."""
        self._previous_plan = None
        self._training_picks.clear()
        self.passes_left = max(self.passes_left - 1, 0)

    def _charge_unseen(self, wall_ms: float) -> None:
        """Charge what the measured pace shows beyond the model's to a tier it can calibrate,
        never the link (its rate is measured directly): the node as a cost per sample it
        works on, this tier as a factor on its profiled work.

        What is charged is the measured pace less the model's (its busiest tier's load),
        which a pace below the model's takes back, so a tier is never priced at a pace that
        another tier explains: a run paced by the link says nothing of the node's speed.
        A plan of one candidate charges the busier of the node and this tier. A plan that
        shares the batches charges only this tier, which works on every sample, and only
        where the model says it paces the plan: the node works on a share of the samples,
        and a cost per node sample read there would be multiplied by the inverse of that
        share when a plan of the node alone is priced, though what slowed the shared plan
        need not grow with the node's samples at all. What a pair's pace shows beyond its
        model after that is the cost of sharing itself (``_sharing``): the model prices a
        pair at its tiers' perfect balance, which whole batches taking turns on them miss;
        that price is the least its parts' prices allow, so a pair read faster adds nothing.
        """
        self._calibrated = True
        model = self._repriced(self.plan)
        loads = model.loads
        if len(model.parts) == 1:
            node_works = model.parts[0].split != ALL_IN_COMPUTE
            tier = 0 if node_works and loads[0] >= loads[2] else 2
        else:
            tier = 2 if loads[2] >= max(loads) else None
        excess = wall_ms - max(loads)
        if tier == 0:
            unseen = self.conditions.node_unseen_ms + excess
            self.conditions = replace(self.conditions, node_unseen_ms=max(unseen, 0.0))
        elif tier == 2 and loads[2] > 0:
            self._loader_factor = max(self._loader_factor * (loads[2] + excess) / loads[2], 1.0)
            self._rescale_compute()
        if len(model.parts) == 2:
            self._sharing = max(wall_ms / self._repriced(self.plan).pace_ms, 1.0)

    def _step_work_ms(self, split: int) -> float:
        """Per sample, the profile's price of what a training step on a batch extracted at
        ``split`` runs: the frozen stages after it, and the trainable ones. A pair's batches
        go whole to one part, so a step runs one part's stages, not the shares' mean."""
        return sum(self.profile.forward_ms[max(split, 0):self.freeze]) + self.profile.train_ms

    def _rescale_compute(self) -> None:
        """This tier's factor on its profiled work: what its steps measure against the
        profile (this host may not be the profile's), times what the pace showed beyond
        them (the loader's threads and the GIL beside the step, and all-in-compute's decode)."""
        step_scale = _median(self._step_scales, self._host_scale)
        self.conditions = replace(self.conditions, compute_scale=step_scale * self._loader_factor)

    # -- the choice ------------------------------------------------------------------

    def expected_ms(self, plan: Plan) -> float:
        """Per sample: the pace the run measured for ``plan`` while the world was as it is
        now, else the model's. A pair the run has not measured is priced at the model's
        pace times what sharing cost the latest pair read (``_charge_unseen``): the cost
        comes of sharing, not of which two candidates share, and without it the model would
        move the run from one measured pair to the next on gains none of them reaches.

        The plan running is read as it runs (a decision after a move waits for a
        pipeline's worth of its steps), so its pace stands whatever the link reads
        meanwhile: a plan changes how its own replies read the link (their size, what they
        share the link and this tier's cores with), with no change in the link. Another
        plan's pace stands while the link as each kind of reply read it then reads within
        ``LINK_DRIFT`` now: a move between the node's replies and the store's own changes
        which kind reads it, not the link."""
        model_ms = plan.pace_ms * (self._sharing if len(plan.parts) == 2 else 1.0)
        measured = self.read(plan.key)
        if measured is None:
            return model_ms
        return measured.pace_ms if plan.key == self.plan.key or self._link_alike(measured.links) else model_ms

    def _link_alike(self, then: dict[str, float | None]) -> bool:
        """Whether each kind of reply reads the link within ``LINK_DRIFT`` of ``then``."""
        return all(_close(rate, self._readings[reader]) for reader, rate in then.items() if rate is not None)

    def _link_slower(self, then: dict[str, float | None]) -> bool:
        """Whether some kind of reply reads the link slower than ``then`` by more than ``LINK_DRIFT``."""
        now = self._readings
        return any(rate is not None and now[reader] is not None and now[reader] < rate * (1 - LINK_DRIFT)
                   for reader, rate in then.items())

    def read(self, plan: tuple) -> _Measured | None:
        """The measurement of ``plan`` (a plan's key), where it holds a pipeline's worth of
        steps: the replies in flight arrive in bursts, and fewer steps may miss or catch one."""
        measured = self._measured.get(plan)
        return measured if measured is not None and len(measured.paces) >= self.batches_in_flight else None

    def run_ms(self, plan: Plan) -> float:
        """What the rest of the run costs on ``plan``: the samples still to send at its pace,
        the fill of each pass still to start (its first batch waits for every stage, one
        after another), and the samples a feature cache will serve at this tier's work on them."""
        cached_ms = sum(c.compute_ms * share for c, share in zip(plan.parts, plan.shares))
        fills_ms = plan.fill_ms * self.batch_size * self.passes_left
        return self.expected_ms(plan) * self.remaining + fills_ms + cached_ms * self.cached_samples

    def pick(self, samples: int, training: bool = True) -> Candidate:
        """The candidate for the next batch of ``samples`` samples (a training batch, whose
        step will be reported to ``trained``, or not)."""
        if self._arrived:
            self._replan()
        self.remaining -= samples
        if training:
            self.train_left -= samples
        if self._exploring is not None:
            candidate, left = self._exploring
            self._exploring = (candidate, left - 1) if left > 1 else None
            self.explore_left -= samples
            chosen, plan_key = candidate, single(candidate).key
        else:
            part = deal(self.plan.shares, self._dealt, samples)
            chosen, plan_key = self.plan.parts[part], self.plan.key
        if training:
            self._training_picks.append((plan_key, chosen.split))
        return chosen

    def scout(self, samples: int) -> tuple[Candidate, int] | None:
        """The first of the first batch's samples to send ahead alone while nothing is
        measured, and where: at split 0, the most bytes a node ships for the least of its
        work, so that their reply reads the link and arrives soon; the rest of the batch
        goes where that reading says. As many as put on the link the bytes the whole batch
        would at the safe start, so that on the slowest link the scout waits no longer than
        that batch would, and reads the link as well. None once one has gone, where the
        batch has no samples to spare for it, and where the safe start is within the model's
        error of the best on every link (a run whose later epochs a feature cache serves
        starts at a deep split, the best whatever the link): there it would only delay the batch."""
        if self.settled or self._scouted:  # settled from the start where it ``scouts`` not
            return None
        image = min((c for c in self.options() if c.split == 0), key=lambda c: c.bytes_per_sample)
        count = min(int(self.plan.bytes_per_sample * samples / image.bytes_per_sample), samples - 1)
        if count < 1:
            return None
        self._scouted = True
        self._scout_bytes = image.bytes_per_sample
        self.remaining -= count
        self.train_left -= count
        return image, count

    def _replan(self) -> None:
        if self._step_ratio is not None:
            self._host_scale, self._step_ratio = self._step_ratio.result(), None
            self._rescale_compute()
        # After a move, the next waits for the new plan's pace, read once its pipeline has
        # filled: a move on a prediction is a bet that this reading settles, and the replies
        # of a pipeline changing plans read the link and the node as neither plan does
        # alone. The first move, on the first reply, is the one that cannot wait.
        # A move to more bytes a sample is priced at the link read then: where the link now
        # reads slower by more than ``LINK_DRIFT`` (a scout's few bytes can ride a shaper's
        # burst; the link changed), the price the move rested on is gone, and the run decides
        # again at once. A link reading faster only makes such a move cheaper, and a move to
        # fewer bytes loses nothing as the link slows.
        running = self.read(self.plan.key)
        settled = running and running.moves == self._moves and running.fresh >= self.batches_in_flight
        waiting = self._moves and not settled and not self._link_slower(self._bet_links)
        if self._exploring is not None or waiting:
            return
        # A pair's gain is a balance of two tiers' loads over many batches: the run moves to
        # one only once a steady-state pace has calibrated the tiers (``_charge_unseen``), and
        # while the rest of the run holds a pipeline's worth of batches of its smaller share
        # (with fewer, its parts' whole batches take turns on the tiers instead of overlapping).
        plans = [p for p in self.plans() if len(p.parts) == 1 or (
            self._calibrated and min(p.shares) * self.remaining >= self.batches_in_flight * self.batch_size)]
        incumbent = self._repriced(self.plan)
        incumbent_ms = self.expected_ms(incumbent)
        started = any(self._dealt)
        if not started:
            # A scout's short reply reads the link fast (a shaper's burst, an unthrottled
            # first window), so the first plan ships no more bytes a sample than the scout did.
            plans = [p for p in plans if p.bytes_per_sample <= self._scout_bytes] or plans
        best = min(plans, key=self.run_ms)
        if not self._node_fixed and best.loads[0] >= max(best.loads):
            # Until the node is read (not from a scout's reply, which reads the link only, nor
            # from a split's first batch, its cold start), its price is a floor: this host's
            # speed, with nothing for the store beside it, other jobs or HTTP, all of which
            # only add. Where it paces the best, the plan is the one of those the model cannot
            # separate from the best that leaves the node least work; where the node proves
            # faster, its readings move the run deeper.
            near = [p for p in plans if self.run_ms(p) <= self.run_ms(best) * (1 + MODEL_ERROR)]
            best = min(near, key=lambda p: p.loads[0])
        if best.key != self.plan.key:
            measured = self.read(best.key) is not None
            # A plan nothing was sent to yet (only a scout went ahead) is a prediction too,
            # and leaving it refills no pipeline: the run starts at the best. Otherwise the
            # move must save, over the rest of the run and beyond its own cost, more than
            # the prices compared may err by (``_risk_ms``). With fewer samples left to train
            # than fill a new plan's pipeline and read its pace (a pipeline's worth of
            # batches each; validation's steps are not read), a bet could not be undone,
            # and only a measured plan is moved to.
            settles = measured or self.train_left >= self._bet_samples
            gain_ms = self.run_ms(incumbent) - self.run_ms(best) - self._move_ms(best, incumbent)
            if not started or settles and gain_ms > self._risk_ms(best, incumbent):
                self._switch(best, f"{'measured' if measured else 'predicted'} {self.expected_ms(best):.1f} "
                                   f"ms/sample against {incumbent_ms:.1f}")
                return
        self._maybe_explore([p.parts[0] for p in plans if len(p.parts) == 1], incumbent_ms)

    @property
    def _bet_samples(self) -> int:
        """The samples a move sends before its plan's pace is read: a pipeline's worth of
        batches fills it, a pipeline's worth more are read."""
        return 2 * self.batches_in_flight * self.batch_size

    def _move_ms(self, to: Plan, leaving: Plan) -> float:
        """What moving from ``leaving`` to ``to`` costs beyond ``to``'s pace: its first
        batch's wait for its node and the link that the batches already in flight do not
        cover (this tier trains them meanwhile, at ``leaving``'s pace)."""
        covered_ms = (self.batches_in_flight - 1) * self.expected_ms(leaving)
        return max(to.latency_ms - covered_ms, 0.0) * self.batch_size

    def _risk_ms(self, best: Plan, incumbent: Plan) -> float:
        """What a move to ``best`` may lose where the prices compared err. A measured pace
        errs by its standard error (a pace read in bursts scatters widely, and a cold
        start's slow steps are among its readings): between two measured paces (the
        incumbent's, and ``best``'s while the link reads as it did), the two combined, over
        the rest of the run.

        A move on a prediction is a bet that the run reads the new plan's pace and leaves
        it again where it is slower: beside the incumbent's own error over the rest of the
        run, the bet may lose the samples sent until that reading at the model's worst (its
        error beyond the prediction), and the move back. The model errs either way, so its
        prediction is the likelier outcome, and a bet that saves more when right than it
        loses when wrong gains on average."""
        incumbent_error = self._error(incumbent.key) if self.read(incumbent.key) else 0.0
        if self.read(best.key) is not None:
            return math.hypot(self._error(best.key), incumbent_error) * self.run_ms(incumbent)
        worst_ms = self.expected_ms(best) * (1 + MODEL_ERROR) - self.expected_ms(incumbent)
        return (incumbent_error * self.run_ms(incumbent) + self._bet_samples * max(worst_ms, 0.0)
                + self._move_ms(incumbent, best))

    def _repriced(self, plan: Plan) -> Plan:
        """``plan`` as the model prices it now (its shares kept)."""
        return Plan(tuple(self.priced(c) for c in plan.parts), plan.shares)

    def _maybe_explore(self, feasible: list[Candidate], incumbent_ms: float) -> None:
        """Give real batches to a candidate the model cannot separate from the plan and the
        run never measured, when the exploration budget holds enough of them to read it
        with its pipeline full: a pipeline's worth of batches fills it, and a pipeline's
        worth and one more are read."""
        batches = 2 * self.batches_in_flight + 1
        if self.explore_left < batches * self.batch_size or self.remaining < 10 * batches * self.batch_size:
            return
        current = {c.key for c in self.plan.parts}
        measured = {key[0][0] for key in self._measured if len(key) == 1}
        unmeasured = [c for c in feasible if c.key not in self._explored | measured | current
                      and c.pace_ms <= incumbent_ms * (1 + MODEL_ERROR)]
        if unmeasured:
            candidate = min(unmeasured, key=lambda c: c.pace_ms)
            self.switches.append((self.run_samples - self.remaining, single(candidate),
                                  "exploring: the model cannot separate it from the current plan"))
            self._exploring = (candidate, batches)
            self._explored.add(candidate.key)

    def _error(self, plan: tuple) -> float:
        """The relative error of the price of ``plan`` (a plan's key): its measured pace's
        standard error; the model's where it is not read."""
        measured = self.read(plan)
        error = measured.error if measured is not None else None
        return MODEL_ERROR if error is None else error

    def _switch(self, plan: Plan, why: str) -> None:
        sent = self.run_samples - self.remaining
        self.switches.append((sent, plan, why))
        self._bet_links = self._readings if plan.bytes_per_sample > self.plan.bytes_per_sample else {}
        self.plan, self._dealt = plan, [0.0] * len(plan.parts)
        self._moves += 1

    def explain(self, stage_names: tuple[str, ...]) -> str:
        """Every candidate as the planner sees it now, one line each, then the plan."""
        lines = [f"{'candidate':22s} {'after stage':18s} {'KB/sample':>10s} {'storage':>9s} {'network':>9s} "
                 f"{'compute':>9s} {'model':>9s} {'measured':>9s}  bottleneck   (ms per sample)"]
        current = {c.key for c in self.plan.parts}
        for c in self.options():
            stage = "-" if c.split <= 0 else stage_names[c.split - 1]
            measured = self._measured.get(single(c).key)
            reading = f"{measured.pace_ms:.2f}" if measured and measured.paces else "-"
            mark = "  <- current" if c.key in current else ("  (out of memory)" if not c.feasible else "")
            lines.append(f"{c.label:22s} {stage:18s} {c.bytes_per_sample / 1e3:10.1f} {c.storage_ms:9.2f} "
                         f"{c.transfer_ms:9.2f} {c.compute_ms:9.2f} {c.pace_ms:9.2f} {reading:>9s}  "
                         f"{c.bottleneck:10s}{mark}")
        plan = self._repriced(self.plan)
        measured = self._measured.get(plan.key)
        lines.append(f"plan: {plan.label}, model {plan.pace_ms:.2f} ms/sample"
                     + (f", measured {measured.pace_ms:.2f}" if measured and measured.paces else ""))
        return "\n".join(lines)


def deal(shares: Sequence[float], dealt: list[float], samples: int) -> int:
    """The part of a plan a batch of ``samples`` goes to: the one furthest behind its share of
    the samples dealt (``dealt``, which this updates)."""
    total = sum(dealt) + samples
    part = max(range(len(shares)), key=lambda i: shares[i] * total - dealt[i])
    dealt[part] += samples
    return part


def _link_rate(replies: Iterable[Reply]) -> float | None:
    """Bytes/s while the link was busy: what it carried while each of ``replies`` was on it
    (``Reply.link_bytes``) over their times. Each reply counts the bytes beside it, those of
    replies still in flight included, so replies sharing the link are not each read as the
    link's whole rate, nor one as a share of it.

    A reply alone on the link counts at the slower of its whole and its second half: a
    reply's head may ride a shaper's burst or buffers filled while the link was idle (its
    second half reads slower then), and a short one may fit in them whole (its second half
    reads faster). A reply sharing the link may read slower in its second half only because
    others joined, so it counts whole."""
    carried, busy = 0.0, 0.0
    for r in replies:
        (start, end), nbytes, half = r.link_interval, r.wire_bytes, r.tail_started
        if r.alone and half is not None and start <= half < end:
            carried += min(nbytes, (nbytes - nbytes // 2) * (end - start) / (end - half))
        else:
            carried += nbytes if r.alone else r.link_bytes
        busy += end - start
    return carried / busy if busy > 0 and carried > 0 else None


def _reader(split: int) -> str:
    """The kind of reply a candidate's requests read the link with."""
    return "store" if split == ALL_IN_COMPUTE else "node"


def _median(values: deque[float], default: float | None) -> float | None:
    return statistics.median(values) if values else default


def _close(a: float, b: float | None) -> bool:
    """Two link readings that differ by no more than the noise of one window on a shared link."""
    return b is not None and abs(a - b) <= LINK_DRIFT * max(a, b)
