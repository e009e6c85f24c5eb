"""Measuring the storage tier and the link from the compute tier, for the planner."""

from __future__ import annotations

import hashlib
import itertools
import logging
import math
import statistics
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing
from dataclasses import replace
from functools import partial
from pathlib import Path

from compute_side.client import Extracted, StorageClient
from compute_side.loader import Batch, PipelinedLoader, Source, batches_of
from compute_side.sources import IO_THREADS
from hapi.datasets import Sample
from hapi.models import StagedModel
from hapi.planner import (
    PLAYOFF_READINGS,
    PLAYOFF_WITHIN,
    TRIAL_ITERATIONS,
    TRIAL_OVERRUN,
    TRIAL_READINGS,
    TRIAL_SECONDS,
    TRIAL_SETS,
    TRIAL_SHARE,
    TRIALS,
    Candidate,
    contenders,
    storage_parts_ms,
)
from hapi.profile import Profile, TierTimes, host_name, output_elements, profile_tier
from hapi.store import ObjectStore
from hapi.wire import WIRE_DTYPES, ExtractRequest, ProfileRequest

log = logging.getLogger(__name__)

# Server-side timings that are work on the request, not waiting in a queue or loading a model.
_WORK_TIMINGS = ("fetch_ms", "decode_wait_ms", "forward_ms", "encode_ms")


def probe_link(client: StorageClient, template: ExtractRequest, samples: Sequence[Sample],
               rounds: int = 3) -> list[Extracted]:
    """Split-0 replies of decoded images: the largest payload, and nothing but fetch and
    decode on the node. They measure the link and, when a profile is taken, the node."""
    request = replace(template, keys=tuple(s.key for s in samples), split=0, dtype="float32")
    return [client.extract(request) for _ in range(rounds)]


def bandwidth_of(probes: Sequence[Extracted]) -> float:
    """Bytes/s: each reply's body timed from its headers to its last byte (the node sends
    once its work is done), median over the probes."""
    return statistics.median(p.wire_bytes / max(p.body_s, 1e-6) for p in probes)


def storage_tier_times(client: StorageClient, template: ExtractRequest, batch_size: int,
                       probes: Sequence[Extracted]) -> TierTimes:
    """The node's per-sample forward time per frozen stage (it times itself), and its fetch
    and decode time from the probe replies (median: the first also warms the store's
    connections and caches)."""
    body = client.profile(ProfileRequest(template.model, template.weights, template.transform.crop_size,
                                         (batch_size,), job_id=template.job_id))
    forward = tuple(stage["ms"][str(batch_size)] / batch_size for stage in body["stages"])
    samples = len(probes[0].keys)
    timings = [p.metadata["timings"] for p in probes]
    decode_ms = statistics.median(t.get("decode_wait_ms", 0.0) + t.get("forward_ms", 0.0) for t in timings)
    fetch_ms = statistics.median(t.get("fetch_ms", 0.0) for t in timings)
    host = f"storage node {client.url} ({body['cpu_count']} cpus, {body['torch_threads']} threads)"
    return TierTimes(host, batch_size, body["torch_threads"], decode_ms / samples, forward,
                     fetch_ms=fetch_ms / samples,
                     request_ms=request_overhead_ms(client, replace(template, keys=probes[0].keys[:1], split=0)))


def request_overhead_ms(client: StorageClient, request: ExtractRequest, rounds: int = 5) -> float:
    """What a request costs beyond the node's work and its body's time on the link: a
    one-sample request timed end to end, less both (median)."""
    costs = []
    for _ in range(rounds):
        started = time.perf_counter()
        extracted = client.extract(request)
        elapsed_ms = (time.perf_counter() - started) * 1e3
        work_ms = sum(extracted.metadata["timings"].get(name, 0.0) for name in _WORK_TIMINGS)
        costs.append(max(elapsed_ms - work_ms - extracted.body_s * 1e3, 0.0))
    return statistics.median(costs)


def steady_pace_ms(tasks: Sequence[Callable[[], object]], in_flight: int) -> float:
    """Milliseconds between completions of ``tasks`` run ``in_flight`` at a time, in steady
    state: the first ``in_flight`` to finish started together (part of their work overlapped
    nothing, or only each other), and the clock stops when the last task has started (from
    there the pipeline drains). Needs more than twice ``in_flight`` tasks."""
    if len(tasks) <= 2 * in_flight:
        raise ValueError(f"{len(tasks)} tasks cannot show a steady state with {in_flight} in flight")

    def finished(task: Callable[[], object]) -> float:
        task()
        return time.perf_counter()

    with ThreadPoolExecutor(in_flight) as pool:
        done = sorted(pool.map(finished, tasks))
    last_full = len(tasks) - in_flight - 1  # the completion that started the last task
    return (done[last_full] - done[in_flight - 1]) * 1e3 / (last_full - in_flight + 1)


def raw_reads_ms(store: ObjectStore, samples: Sequence[Sample]) -> tuple[float, float]:
    """All-in-compute's object reads from this tier, per sample: the pace its loader keeps
    in steady state (``IO_THREADS`` GETs in flight across the link), and this process's CPU
    for them (the client's work, which competes with training)."""
    objects = list(dict.fromkeys(s.object_key for s in samples))  # a shard is read once for all its samples
    reads = [partial(store.get, key) for key in itertools.islice(itertools.cycle(objects), 4 * IO_THREADS)]
    per_sample = len(objects) / len(samples)
    cpu_started = time.process_time()
    pace_ms = steady_pace_ms(reads, IO_THREADS)
    cpu_ms = (time.process_time() - cpu_started) * 1e3 / len(reads)
    return pace_ms * per_sample, cpu_ms * per_sample


def node_pace_ms(client: StorageClient, template: ExtractRequest, samples: Sequence[Sample], split: int,
                 dtype: str, batch_size: int, depth: int) -> float:
    """Per sample, the pace at which the node serves requests of ``batch_size`` samples at
    ``split`` with ``depth`` in flight, each reply crossing the link, in steady state."""
    keys = [s.key for s in itertools.islice(itertools.cycle(samples), 3 * max(depth, 1) * batch_size)]
    requests = [replace(template, keys=tuple(keys[i: i + batch_size]), split=split, dtype=dtype)
                for i in range(0, len(keys), batch_size)]
    return steady_pace_ms([partial(client.extract, r) for r in requests], max(depth, 1)) / batch_size


ANCHOR_DTYPE = "bfloat16"  # the anchor's replies, at half the bytes, keep clear of the link's pace


def node_anchor(client: StorageClient, template: ExtractRequest, samples: Sequence[Sample], profile: Profile,
                batch_size: int, depth: int) -> tuple[int, float] | None:
    """(split, ms per sample): the node's pace with ``depth`` requests in flight, at the split
    that ships the fewest bytes, where the planner anchors its model of the node.

    Its fetches, decodes and forwards share its cores in training (the next request's
    objects are read while this one's prefix runs), which its parts timed one at a time
    cannot show. None when the link would set that pace instead, or when the run keeps at
    most one request in flight (nothing overlaps).
    """
    if depth < 2:
        return None
    split = min(range(1, profile.freeze_index + 1), key=lambda s: (profile.output_elements[s - 1], -s))
    alone_ms = storage_parts_ms(profile, split)
    link_ms = profile.output_elements[split - 1] * WIRE_DTYPES[ANCHOR_DTYPE].itemsize / profile.bandwidth * 1e3
    if link_ms > alone_ms * 0.8:
        log.info("node pace not measured: the link would pace the requests (%.1f ms vs %.1f ms a sample)",
                 link_ms, alone_ms)
        return None
    paced_ms = node_pace_ms(client, template, samples, split, ANCHOR_DTYPE, batch_size, depth)
    log.info("node at split %d: %.1f ms a sample with requests overlapping, %.1f ms its parts timed alone",
             split, paced_ms, alone_ms)
    return split, paced_ms


def train_paces_ms(loader: PipelinedLoader, train_step: Callable[[Batch], object],
                   batches: Sequence[Sequence[Sample]], warmup: int, timed: int, windows: int = 1,
                   give_up_ms: float = float("inf")) -> tuple[list[float], bool]:
    """(milliseconds per iteration of ``loader`` feeding ``train_step`` in steady state, one
    per window; stopped early).

    ``windows`` clocks of ``timed`` iterations run back to back from the end of iteration
    ``warmup``; ``batches`` should hold the loader's depth more, so that the last window ends
    with the pipeline still full (a drained pipeline would have fetched part of the window's
    work before the clock started, and flatter it). A run that has spent ``give_up_ms`` per
    iteration stops there, and its time so far is kept, for every window, as a lower bound.
    """
    first = time.perf_counter()
    marks = [first] if warmup == 0 else []  # the clock's start, then each window's end
    iterations = warmup + windows * timed
    with closing(loader.epoch(batches, epoch=0)) as stream:  # closing waits for the requests in flight
        for i, batch in enumerate(stream):
            train_step(batch)
            now = time.perf_counter()
            # The clock covers waiting for and training each batch.
            if i + 1 >= warmup and (i + 1 - warmup) % timed == 0:
                marks.append(now)
            if now - first > give_up_ms / 1e3 * iterations:
                return [(now - first) * 1e3 / (i + 1)] * windows, True
            if i + 1 == iterations:
                return [(end - start) * 1e3 / timed for start, end in zip(marks, marks[1:])], False
    raise ValueError(f"{len(batches)} batches cannot cover {warmup} warm-up and {windows} x {timed} timed iterations")


def _in_flight(batch_size: int, request_size: int, depth: int) -> int:
    """Batches in flight with ``depth`` requests of ``request_size`` samples."""
    return max(1, math.ceil(max(depth, 1) / math.ceil(batch_size / request_size)))


def window_ms(source: Source, train_step: Callable[[Batch], object], samples: Sequence[Sample], batch_size: int,
              request_size: int, depth: int, warmup: int, timed: int,
              give_up_ms: float = float("inf")) -> tuple[float, bool]:
    """(ms per iteration, stopped early) of training from ``source`` through ``depth``
    requests in flight: ``timed`` iterations after ``warmup``, with as many batches again in
    flight when the clock stops, ``samples`` cycled as often as that needs."""
    batches = _cycled(samples, batch_size, warmup + timed + _in_flight(batch_size, request_size, depth))
    paces, stopped = train_paces_ms(PipelinedLoader(source, request_size, depth), train_step, batches, warmup, timed,
                                    give_up_ms=give_up_ms)
    return paces[0], stopped


def _cycled(samples: Sequence[Sample], batch_size: int, count: int) -> list[list[Sample]]:
    """``count`` batches of ``samples``, cycled as often as that needs."""
    return batches_of(list(itertools.islice(itertools.cycle(samples), count * batch_size)), batch_size)


def trial_iterations(pace_ms: float, batch_size: int, seconds: float = TRIAL_SECONDS) -> int:
    """Timed iterations of a trial at ``pace_ms`` a sample: ``TRIAL_ITERATIONS``, or more to last ``seconds``."""
    return max(TRIAL_ITERATIONS, math.ceil(seconds * 1e3 / (pace_ms * batch_size)))


def contenders_within(run_samples: int, batch_size: int, request_size: int, depth: int, pace_ms: float) -> int:
    """How many sets of ``TRIAL_READINGS`` trials (a contender's, or half a playoff's) a run
    of ``run_samples`` can afford when a sample takes about ``pace_ms``: the trials read at
    most ``TRIAL_SHARE`` of its samples (a short run is better served by the model than by
    trials longer than itself)."""
    trial_samples = (2 * _in_flight(batch_size, request_size, depth) + trial_iterations(pace_ms, batch_size)) \
        * batch_size
    return int(TRIAL_SHARE * run_samples) // (trial_samples * TRIAL_READINGS)


def trial_paces_ms(source: Source, train_step: Callable[[Batch], object], samples: Sequence[Sample],
                   batch_size: int, request_size: int, depth: int, predicted_ms: float,
                   seconds: float = TRIAL_SECONDS, readings: int = 1) -> list[float]:
    """Per sample, the paces of a short training run from ``source``: ``readings`` windows
    of ``trial_iterations`` back to back (one pipeline: readings of one candidate taken in a
    row pay its fill and drain once), timed once the pipeline is full (sized by
    ``predicted_ms`` a sample to last ``seconds`` each), as many in flight when the clock
    stops; stopped at ``TRIAL_OVERRUN`` times the prediction."""
    fill = _in_flight(batch_size, request_size, depth)
    timed = trial_iterations(predicted_ms, batch_size, seconds)
    paces, _ = train_paces_ms(PipelinedLoader(source, request_size, depth), train_step,
                              _cycled(samples, batch_size, 2 * fill + readings * timed), fill, timed, readings,
                              give_up_ms=TRIAL_OVERRUN * predicted_ms * batch_size)
    return [ms / batch_size for ms in paces]


def time_contenders(profile: Profile, options_for: Callable[[Profile], list[Candidate]],
                    try_candidate: Callable[[Candidate, int], list[float]],
                    max_contenders: int = TRIAL_SETS) -> Profile:
    """The profile with trial runs at the planner's contenders (``try_candidate(c, n)``: ms
    per sample of ``n`` readings of ``c`` taken back to back): where the model's ranking is
    close, a run of each decides. A contender tried slower can leave a new one in front; it
    is tried in another round, while the budget lasts. When the two fastest tried are within
    ``PLAYOFF_WITHIN`` of each other, they are read again side by side, ``PLAYOFF_READINGS``
    times each, and these readings replace theirs (a playoff; the others' are scaled by the
    drift it found on the finalists). At most ``max_contenders``
    sets of ``TRIAL_READINGS`` readings are taken, each in full; the playoff's sets are kept
    for it when the budget also has room for a full round."""
    playoff_sets = 2 * PLAYOFF_READINGS // TRIAL_READINGS
    rounds_budget = max_contenders - playoff_sets if max_contenders >= TRIALS + playoff_sets else max_contenders
    while picked := contenders(options_for(profile))[:max(0, rounds_budget - _tried(profile))]:
        profile = _read_in_turn(profile, picked, try_candidate, TRIAL_READINGS)
    finalists = sorted((c for c in options_for(profile) if c.feasible and c.trial_ms is not None),
                       key=lambda c: c.trial_ms)[:2]
    if len(finalists) == 2 and finalists[1].trial_ms <= PLAYOFF_WITHIN * finalists[0].trial_ms \
            and _tried(profile) + playoff_sets <= max_contenders:
        # Side by side, the machine's drift falls on both: these readings supersede theirs. The
        # others were read in the rounds' spell, and are scaled by the drift the playoff found
        # on the finalists: a slow spell in the playoff must not hand the choice to a third
        # that the rounds put behind both.
        keys = {(c.split, c.dtype) for c in finalists}
        others = tuple(reading for reading in profile.trial_paces if reading[:2] not in keys)
        played = _read_in_turn(replace(profile, trial_paces=()), finalists, try_candidate, PLAYOFF_READINGS)
        drift = statistics.mean(played.trial_pace(c.split, c.dtype) / c.trial_ms for c in finalists)
        log.info("playoff: the finalists read %.2fx their rounds' pace; the other readings are scaled alike", drift)
        profile = replace(profile, trial_paces=tuple((split, dtype, pace * drift) for split, dtype, pace in others)
                          + played.trial_paces)
    return profile


def _tried(profile: Profile) -> int:
    return len({(split, dtype) for split, dtype, _ in profile.trial_paces})


def _read_in_turn(profile: Profile, picked: Sequence[Candidate],
                  try_candidate: Callable[[Candidate, int], list[float]], readings: int) -> Profile:
    """``readings`` trials of each of ``picked``, taken in turn and in alternating order
    (A B B A ...), added to the profile; a candidate's readings in a row are taken in one go."""
    order = [c for i in range(readings) for c in (picked if i % 2 == 0 else picked[::-1])]
    paces = []
    for c, run in itertools.groupby(order):
        for pace in try_candidate(c, len(list(run))):
            log.info("trial of %s: %.1f ms a sample (predicted %.1f: storage %.1f, network %.1f, compute %.1f)",
                     c.label, pace, max(c.storage_ms, c.transfer_ms, c.compute_ms), c.storage_ms,
                     c.transfer_ms, c.compute_ms)
            paces.append((c.split, c.dtype, pace))
    return replace(profile, trial_paces=profile.trial_paces + tuple(paces))


def measure_profile(model: StagedModel, client: StorageClient, store: ObjectStore, template: ExtractRequest,
                    samples: Sequence[Sample], batch_size: int, profiles_dir: Path, depth: int,
                    refresh: bool = False) -> Profile:
    """Both tiers' stage times (from a saved profile when one matches) and a fresh link probe.

    Stage times depend on the hardware, model and input size, and are saved under
    ``profiles_dir``; the bandwidth, the node's anchoring pace, the compute tier's reads from
    ``store`` and the raw object size change, and are measured anew; the node's pace with
    ``depth`` requests in flight, as the run will. A saved profile that no longer loads
    (written by another version) is measured again.
    """
    input_size = template.transform.crop_size
    probes = probe_link(client, template, samples[:8])
    bandwidth = bandwidth_of(probes)
    raw_bytes = sum(s.size for s in samples) / len(samples)
    compute_host = host_name()
    node = client.url
    saved = profiles_dir / f"{model.spec.name}-{input_size}-b{batch_size}-{_digest(node, compute_host)}.json"
    profile = None if refresh else _load(saved)
    if profile is not None:
        profile = replace(profile, raw_bytes=raw_bytes, bandwidth=bandwidth)
        log.info("stage times from %s", saved)
    else:
        storage = storage_tier_times(client, template, batch_size, probes)
        compute = profile_tier(model, input_size, batch_size, model.spec.freeze_index, with_training=True)
        profile = Profile(model.spec.name, input_size, model.stage_names, model.spec.freeze_index,
                          output_elements(model, input_size), storage, compute, raw_bytes, bandwidth)
        profiles_dir.mkdir(parents=True, exist_ok=True)
        saved.write_text(profile.to_json())
        log.info("profile saved to %s", saved)
    reads_ms, reads_cpu_ms = raw_reads_ms(store, samples)
    return replace(profile, compute=replace(profile.compute, fetch_ms=reads_ms, fetch_cpu_ms=reads_cpu_ms),
                   node_anchor=node_anchor(client, template, samples, profile, batch_size, depth))


def _load(saved: Path) -> Profile | None:
    try:
        return Profile.from_json(saved.read_text())
    except FileNotFoundError:
        return None
    except (TypeError, KeyError, ValueError) as exc:
        log.warning("measuring again: %s does not load (%s)", saved, exc)
        return None


def _digest(*parts: str) -> str:
    return hashlib.sha1("|".join(parts).encode()).hexdigest()[:10]
