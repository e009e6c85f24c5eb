"""Where to cut: a cost model of the overlapped pipeline, and the choice it implies.

Storage compute, transfer and compute-side training work on different batches at the
same time, so in steady state an iteration costs its slowest stage, not their sum; the
first batch pays for all three (fill) before the pipeline runs. Per sample:

    storage(s)  = the node's pace measured with requests overlapping at an anchor split a,
                  + forward of stages [0, s) - forward of stages [0, a) on the storage tier
                  (unmeasured: fetch + decode + forward of [0, s), each timed alone)
    transfer(s) = bytes of stage s-1's output in the wire dtype / bandwidth
    compute(s)  = forward of frozen stages [s, freeze) + train step of [freeze, end)
                  + a request's fixed cost / samples per request
                  (all-in-compute: storage = this tier's reads across the link; compute =
                  their client CPU + decode + every frozen stage + train step)
    pace(s)     = max(storage, transfer, compute) + loss x (sum - max)
    epoch(s)    = N x pace(s) + B x (sum - max)

Splits whose compute-side memory for one batch exceeds the budget are dropped. Where the
ranking is close, the model only shortlists: each contender is tried, a short training
run with its pipeline full, and the pace it measured (``trial_paces``) replaces the
model's for it; the choice is then made among the tried (and link-paced) ones. A twin of a
tried candidate (the same stages: a ReLU's split beside its convolution's) is not tried. The
``loss`` is the share of the other stages' time that the trials show was not hidden behind
the bottleneck: tiers that share CPUs, or a link whose transfers cost both ends CPU, overlap
less than the max says, and a split with small stages beside its bottleneck loses less. It
is measured per bottleneck tier, for the loss depends on which tier waits: a compute-bound
pipeline pays its client's work on the training core, while the node's anchored pace
already includes its own overlap (in sweep U, alexnet's compute-bound trials at 100 Mbit/s
lost a third of their other stages; charged as much, the storage-bound split that trained in
16% less time than the choice was never tried). A tier no trial has shown as the bottleneck
keeps 0: the max, an optimistic bound, so that a candidate it flatters is tried rather than
never looked at.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from hapi.profile import Profile
from hapi.wire import WIRE_DTYPES

ALL_IN_COMPUTE = -1  # the candidate that pushes nothing down: raw objects to the compute tier
FLOAT32_BYTES = 4
# Candidates predicted within this factor of the best are tried before the choice (at most
# TRIALS of them a round, in rounds while the budget lasts: a contender tried slower can
# bring another within reach), unless the link clearly paces them. Each gets TRIAL_READINGS
# readings, taken in turn with the round's others (A B B A: a steady drift of the machine in
# the meantime falls on all of them alike). At most TRIAL_SETS sets of readings, a playoff's
# included: eight contenders, for the model can misread a whole family of splits alike (in
# sweep W, alexnet's six trials at 25 and 100 Mbit/s all read 50-90% above the model's max,
# which put the split that the choice trained 19-20% slower than seventh in line).
TRIAL_WITHIN = 1.25
TRIALS = 2
TRIAL_READINGS = 2
TRIAL_SETS = 12
# A trial times at least TRIAL_ITERATIONS once its pipeline is full, and at least
# TRIAL_SECONDS by the model's pace: windows of 1-2 s misread paces by 10-20% (sweep M).
TRIAL_ITERATIONS = 4
TRIAL_SECONDS = 3.0
# Sized by a prediction, a trial stops once it runs this many times slower than predicted (its
# pace so far stands): a candidate that slow has lost, and a wrong model cannot stretch a trial.
TRIAL_OVERRUN = 5.0
TRIAL_SHARE = 0.1  # the trials read at most this share of the samples the run will train
# The two fastest tried candidates, when this close, were maybe read in different rounds,
# minutes apart, while the machine drifted: they are read again side by side (a playoff),
# PLAYOFF_READINGS each: in sweep N, playoffs of 2 readings each, taken in a noisy spell,
# overturned the rounds' order twice, and the rounds had it right (the choice confirmed 8.7% and
# 13.6% slower than the rounds' leader).
PLAYOFF_WITHIN = 1.1
PLAYOFF_READINGS = 4
# Candidates whose every stage is within this share of the slowest of another's are twins (a
# ReLU's split beside its convolution's): one trial speaks for both, and the budget goes
# further (in sweep V, alexnet at 25 Mbit/s spent its six trials on three pairs of twins and
# never tried the split that trained 19% faster than its choice).
TWIN_WITHIN = 0.02
LINK_BOUND = 1.5  # transfer / the slowest other stage, above which the link sets a candidate's pace


@dataclass(frozen=True)
class Candidate:
    split: int  # ALL_IN_COMPUTE, or stages [0, split) on the storage tier
    dtype: str
    bytes_per_sample: float
    storage_ms: float  # per sample
    transfer_ms: float
    compute_ms: float
    compute_memory: float  # bytes for one batch on the compute tier
    steady_ms: float  # per sample in steady state: the trial's pace, or the model's
    epoch_s: float
    feasible: bool
    trial_ms: float | None = None  # per sample, the pace a trial run measured

    @property
    def link_paced(self) -> bool:
        """The link clearly sets the pace: the model has it from the probe, no trial needed.
        All-in-compute's reads cross the link, so only its compute stage is another."""
        others = [self.compute_ms] if self.split == ALL_IN_COMPUTE else [self.storage_ms, self.compute_ms]
        return self.transfer_ms > LINK_BOUND * max(others)

    @property
    def bottleneck(self) -> str:
        costs = {"storage": self.storage_ms, "network": self.transfer_ms, "compute": self.compute_ms}
        return max(costs, key=costs.get)

    @property
    def slack(self) -> float:
        """How far the next slowest stage stays below the bottleneck (0: they tie). A pipeline
        of near-equal stages runs slower than its slowest one, each waiting on the other's
        jitter. All-in-compute's reads cross the link: its reads and link are one stage."""
        stages = sorted([max(self.storage_ms, self.transfer_ms), self.compute_ms] if self.split == ALL_IN_COMPUTE
                        else [self.storage_ms, self.transfer_ms, self.compute_ms])
        return 1 - stages[-2] / stages[-1] if stages[-1] else 0.0

    @property
    def label(self) -> str:
        return "all-in-compute" if self.split == ALL_IN_COMPUTE else f"split {self.split} {self.dtype}"


def storage_parts_ms(profile: Profile, split: int) -> float:
    """The storage node's work per sample for a split, from its parts timed one at a time."""
    storage = profile.storage
    return storage.fetch_ms + storage.decode_ms + sum(storage.forward_ms[:split])


def storage_work_ms(profile: Profile, split: int) -> float:
    """The storage node's time per sample for a split with requests overlapping: its pace at
    the anchor, plus the difference in forward time. The forward times repeat closely from
    run to run; the fetch timed alone does not (and overlaps other work in training), so it
    enters only through the anchor's pace. At least the decode and forward remain."""
    if profile.node_anchor is None:
        return storage_parts_ms(profile, split)
    anchor, pace_ms = profile.node_anchor
    forward = profile.storage.forward_ms
    return max(pace_ms - sum(forward[:anchor]), profile.storage.decode_ms) + sum(forward[:split])


def _compute_memory(profile: Profile, split: int, batch_size: int) -> float:
    """Peak bytes for one batch on the compute tier: frozen stages keep only a consecutive
    (input, output) pair alive; trainable ones keep every activation, and gradients double it."""
    elements = (3 * profile.input_size ** 2,) + profile.output_elements  # [i]: stage i's input
    freeze = profile.freeze_index
    frozen = max((elements[i] + elements[i + 1] for i in range(max(split, 0), freeze)), default=0)
    trainable = elements[freeze] + 2 * sum(elements[freeze + 1:])
    return batch_size * FLOAT32_BYTES * max(frozen, trainable)


def evaluate(profile: Profile, split: int, dtype: str, batch_size: int, samples: int,
             compute_memory_budget: float = float("inf"), request_size: int | None = None,
             overlap_loss: float = 0.0) -> Candidate:
    """Predicted cost of one candidate (requests of ``request_size`` samples, default the
    batch; ``overlap_loss`` of the non-bottleneck stages not hidden, see ``overlap_losses``)."""
    request_size = request_size or batch_size
    storage, compute = profile.storage, profile.compute
    frozen_here = sum(compute.forward_ms[max(split, 0): profile.freeze_index])
    # The storage host serves the objects in every mode; a request's fixed cost is paid on
    # the compute tier (client), spread over the samples of a request.
    if split == ALL_IN_COMPUTE:
        per_sample = profile.raw_bytes
        # The objects are read from the compute tier, across the link: slower than the
        # node's reads next to the store (a round trip and the client's work per object).
        storage_ms = compute.fetch_ms or storage.fetch_ms
        compute_ms = compute.fetch_cpu_ms + compute.decode_ms + frozen_here + compute.train_ms
    else:
        elements = 3 * profile.input_size ** 2 if split == 0 else profile.output_elements[split - 1]
        per_sample = elements * WIRE_DTYPES[dtype].itemsize
        storage_ms = storage_work_ms(profile, split)
        compute_ms = frozen_here + compute.train_ms + storage.request_ms / request_size
    transfer_ms = per_sample / profile.bandwidth * 1e3
    stages = (storage_ms, transfer_ms, compute_ms)
    others = sum(stages) - max(stages)
    trial_ms = profile.trial_pace(split, dtype)
    steady_ms = max(stages) + overlap_loss * others if trial_ms is None else trial_ms
    epoch_ms = samples * steady_ms + min(batch_size, samples) * others
    memory = _compute_memory(profile, split, batch_size)
    return Candidate(split, dtype, per_sample, storage_ms, transfer_ms, compute_ms, memory, steady_ms,
                     epoch_ms / 1e3, memory <= compute_memory_budget, trial_ms)


def overlap_losses(tried: list[Candidate]) -> dict[str, float]:
    """Per bottleneck tier, the share of the non-bottleneck stages' time that the trials of
    ``tried`` with that bottleneck did not hide (their median, within [0, 1]): the model's
    max assumes the stages overlap perfectly. Tiers without a trial are absent (no loss)."""
    losses: dict[str, list[float]] = {}
    for c in tried:
        stages = (c.storage_ms, c.transfer_ms, c.compute_ms)
        if c.trial_ms is not None and sum(stages) > max(stages):
            losses.setdefault(c.bottleneck, []).append((c.trial_ms - max(stages)) / (sum(stages) - max(stages)))
    return {tier: min(max(statistics.median(shares), 0.0), 1.0) for tier, shares in losses.items()}


def candidates(profile: Profile, batch_size: int, samples: int, dtypes: tuple[str, ...] = ("float32",),
               compute_memory_budget: float = float("inf"), request_size: int | None = None) -> list[Candidate]:
    """Every split up to the freeze index in every allowed wire dtype, and all-in-compute;
    those not tried are charged the overlap loss the tried ones with their bottleneck measured."""
    keys = [(ALL_IN_COMPUTE, "float32")] + [(split, dtype) for split in range(profile.freeze_index + 1)
                                             for dtype in dtypes]
    unpriced = [evaluate(profile, split, dtype, batch_size, samples, compute_memory_budget, request_size)
                for split, dtype in keys]
    losses = overlap_losses(unpriced)
    return [evaluate(profile, c.split, c.dtype, batch_size, samples, compute_memory_budget, request_size,
                     losses.get(c.bottleneck, 0.0)) for c in unpriced]


def contenders(options: list[Candidate]) -> list[Candidate]:
    """The candidates worth a trial run before choosing: the fastest predicted, within
    ``TRIAL_WITHIN`` of the best, not yet tried, whose pace the link does not clearly set,
    and no twin of one tried or picked before it."""
    feasible = [c for c in options if c.feasible]
    if not feasible:
        return []
    best = min(c.epoch_s for c in feasible)
    near = sorted((c for c in feasible if c.epoch_s <= best * TRIAL_WITHIN and c.trial_ms is None
                   and not c.link_paced), key=lambda c: c.epoch_s)
    seen = [c for c in feasible if c.trial_ms is not None]
    picked = []
    for c in near:
        if len(picked) < TRIALS and not any(twins(c, other) for other in seen):
            picked.append(c)
            seen.append(c)
    return picked


def twins(a: Candidate, b: Candidate) -> bool:
    """Whether two candidates run at one pace: the same kind, every stage within
    ``TWIN_WITHIN`` of the slowest of either."""
    stages_a, stages_b = (a.storage_ms, a.transfer_ms, a.compute_ms), (b.storage_ms, b.transfer_ms, b.compute_ms)
    scale = max(stages_a + stages_b)
    return ((a.split == ALL_IN_COMPUTE) == (b.split == ALL_IN_COMPUTE)
            and all(abs(x - y) <= TWIN_WITHIN * scale for x, y in zip(stages_a, stages_b)))


def choose(options: list[Candidate]) -> Candidate:
    """The fastest feasible candidate; among near-ties (1%), the one whose stages are least
    balanced (most slack), then the one that moves fewer bytes. Once trials have run, only
    the tried candidates and those the link paces are chosen from: the model flatters what
    was not tried (alexnet's trials at 25 Mbit/s read 13-51% slower than its max), and a
    measured pace beats a predicted one."""
    feasible = [c for c in options if c.feasible]
    if not feasible:
        raise ValueError("no split fits the compute tier's memory; lower --batch-size")
    if any(c.trial_ms is not None for c in feasible):
        feasible = [c for c in feasible if c.trial_ms is not None or c.link_paced]
    best = min(c.epoch_s for c in feasible)
    near_ties = [c for c in feasible if c.epoch_s <= best * 1.01]
    return min(near_ties, key=lambda c: (-c.slack, c.bytes_per_sample, c.epoch_s))


def explain(profile: Profile, options: list[Candidate], chosen: Candidate) -> str:
    """The whole table of candidates, one line each; a trial's pace is shown beside the model's stages."""
    lines = [f"{'candidate':22s} {'after stage':18s} {'KB/sample':>10s} {'storage':>9s} {'network':>9s} "
             f"{'compute':>9s} {'trial':>9s} {'epoch s':>9s}  bottleneck   (ms per sample)"]
    for c in options:
        stage = "-" if c.split <= 0 else profile.stage_names[c.split - 1]
        mark = "  <- chosen" if c == chosen else ("  (out of memory)" if not c.feasible else "")
        trial = "-" if c.trial_ms is None else f"{c.trial_ms:.2f}"
        lines.append(f"{c.label:22s} {stage:18s} {c.bytes_per_sample / 1e3:10.1f} {c.storage_ms:9.2f} "
                     f"{c.transfer_ms:9.2f} {c.compute_ms:9.2f} {trial:>9s} {c.epoch_s:9.1f}  {c.bottleneck:10s}{mark}")
    return "\n".join(lines)


def summary(profile: Profile, chosen: Candidate) -> str:
    """The choice in one line: split, predicted stage times, byte reduction."""
    reduction = profile.raw_bytes / chosen.bytes_per_sample
    where = chosen.label if chosen.split <= 0 else f"{chosen.label} (after {profile.stage_names[chosen.split - 1]})"
    return (f"planner: {where}; predicted per sample storage {chosen.storage_ms:.2f} ms, network "
            f"{chosen.transfer_ms:.2f} ms, compute {chosen.compute_ms:.2f} ms ({chosen.bottleneck}-bound)"
            + ("" if chosen.trial_ms is None else f", tried at {chosen.trial_ms:.2f} ms")
            + f"; {bytes_versus_raw(reduction)} than the raw objects")


def bytes_versus_raw(reduction: float) -> str:
    """Raw bytes / moved bytes in words; a fast link may make moving more bytes the better plan."""
    return f"{reduction:.1f}x fewer bytes" if reduction >= 1 else f"{1 / reduction:.1f}x more bytes"
