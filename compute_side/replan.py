"""Re-planning: the loader's own measurements, compared with the plan, while training runs.

Every ``every`` batches the measured storage time per sample and the measured bandwidth
update the profile; the planner runs again, and the run switches split (at the next
batch boundary) when the new choice is predicted to be clearly faster. Nothing is lost or
repeated by a switch: each batch carries the split it was cut at.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

from compute_side.loader import Batch
from hapi.planner import ALL_IN_COMPUTE, Candidate, candidates, choose, evaluate
from hapi.profile import Profile

log = logging.getLogger(__name__)

# What the node reports of a request: its work, and its waits (behind its own job's requests
# or, the share in shared_wait_ms, behind other jobs').
_WORK_TIMINGS = ("fetch_ms", "decode_wait_ms", "forward_ms", "encode_ms")
_WAIT_TIMINGS = ("queue_ms", "turn_wait_ms")
# A read pace within this factor of the objects' time on the link was paced by the link.
_READS_AT_LINK_PACE = 1.1


def node_busy_ms(timings: dict[str, float]) -> float:
    """The node's time per request in steady state, as the planner costs it: a request's
    objects are fetched while the one before runs its prefix (so the slower of the two
    paces the node), plus its wait behind other jobs' requests (a busy node is slower
    storage). A wait behind the job's own requests is neither storage nor link."""
    turn = timings.get("decode_wait_ms", 0.0) + timings.get("forward_ms", 0.0)
    return (timings.get("shared_wait_ms", 0.0) + max(timings.get("fetch_ms", 0.0), turn)
            + timings.get("encode_ms", 0.0))


def reads_beyond_link_ms(profile: Profile) -> float:
    """All-in-compute's object reads per sample without the link's share, so that a new
    bandwidth reprices them (the planner takes the slower of these and the link).

    The compute tier measured its read pace across the link as it was then. A pace clearly
    slower than the link is the store's and the client's work, whatever the link does. A
    pace the link set says only that this work takes no longer; the node's own reads of the
    objects next to the store (the same serving work, no link) stand in for it.
    """
    pace, link = profile.compute.fetch_ms, profile.raw_bytes / profile.bandwidth * 1e3
    if not pace or pace > _READS_AT_LINK_PACE * link:
        return pace
    return min(pace, profile.storage.fetch_ms)


@dataclass
class _Window:
    samples: int = 0
    storage_ms: float = 0.0
    wire_bytes: int = 0
    transfer_ms: float = 0.0
    best_rate: float = 0.0  # bytes/s of the least contended request


class Replanner:
    def __init__(self, profile: Profile, chosen: Candidate, batch_size: int, samples: int,
                 dtypes: tuple[str, ...], every: int = 8, min_gain: float = 0.15,
                 request_size: int | None = None) -> None:
        # Trials ran across the link as it was and go stale when it changes; the node's times
        # measured in training correct the model instead (see _replan).
        self.profile = replace(profile, compute=replace(profile.compute, fetch_ms=reads_beyond_link_ms(profile)),
                               trial_paces=())
        self.chosen = chosen
        self.batch_size = batch_size
        self.samples = samples
        self.dtypes = dtypes
        self.every = every
        self.min_gain = min_gain
        self.request_size = request_size
        self._window = _Window()
        self._batches = 0

    def observe(self, batch: Batch) -> Candidate | None:
        """Account one trained batch; a new candidate when the run should switch to it."""
        if batch.split != self.chosen.split:
            return None  # cut before the last switch: it measures the old plan
        w = self._window
        n = len(batch.keys)
        if self.chosen.split == ALL_IN_COMPUTE:
            transfer_ms, storage_ms = batch.timings.get("fetch_ms", 0.0), 0.0
        else:
            storage_ms = node_busy_ms(batch.timings)
            at_node_ms = sum(batch.timings.get(name, 0.0) for name in _WORK_TIMINGS + _WAIT_TIMINGS)
            transfer_ms = max(batch.elapsed_ms - at_node_ms, 1e-3)
        w.samples += n
        w.storage_ms += storage_ms
        w.wire_bytes += batch.wire_bytes
        w.transfer_ms += transfer_ms
        w.best_rate = max(w.best_rate, batch.wire_bytes / (transfer_ms / 1e3))
        self._batches += 1
        if self._batches % self.every:
            return None
        return self._replan()

    def _evaluate(self, profile: Profile, candidate: Candidate) -> Candidate:
        return evaluate(profile, candidate.split, candidate.dtype, self.batch_size, self.samples,
                        request_size=self.request_size)

    def _replan(self) -> Candidate | None:
        w, self._window = self._window, _Window()
        measured_bandwidth = max(w.best_rate, w.wire_bytes / (w.transfer_ms / 1e3))
        profile = replace(self.profile, bandwidth=measured_bandwidth)
        if self.chosen.split != ALL_IN_COMPUTE and self.chosen.storage_ms > 0:
            # Scale the node's stage times by how much slower (busier) it measured than planned.
            scale = (w.storage_ms / w.samples) / self._evaluate(self.profile, self.chosen).storage_ms
            storage, anchor = self.profile.storage, self.profile.node_anchor
            profile = replace(profile, storage=replace(
                storage, decode_ms=storage.decode_ms * scale,
                forward_ms=tuple(ms * scale for ms in storage.forward_ms)),
                node_anchor=anchor and (anchor[0], anchor[1] * scale))
        self.profile = profile
        current = self._evaluate(profile, self.chosen)
        best = choose(candidates(profile, self.batch_size, self.samples, self.dtypes, request_size=self.request_size))
        log.info("re-plan: bandwidth %.1f MB/s; current %s %.1f s/epoch, best %s %.1f s/epoch",
                 measured_bandwidth / 1e6, current.label, current.epoch_s, best.label, best.epoch_s)
        if (best.split, best.dtype) != (self.chosen.split, self.chosen.dtype) \
                and best.epoch_s < current.epoch_s * (1 - self.min_gain):
            self.chosen = best
            return best
        return None
