"""The CPU time other processes take on the daemon's cores while it serves, per sample.

A store on the same cores as the daemon (Swift beside it on a storage node) does its part
of every read there: its work for the next request's objects runs on the cores the prefix
needs, so the node's pace is the sum of the two, not the slower of them. Only the node can
see that, and it tells the planner: each reply carries what others took of its cores per
sample over its recent requests. A store elsewhere (a remote S3) costs the node's cores
nothing, and its reads overlap the prefix.

Counted only while requests run, so what others do while the daemon is idle is not
charged to the samples it serves; the kernel's busy time of the cores (``/proc/stat``) less
the daemon's own processes' CPU time (its threads and its decode workers).
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable

TICKS_PER_S = os.sysconf("SC_CLK_TCK") if "SC_CLK_TCK" in os.sysconf_names else 100
RECENT = 8  # requests the reported share is summed over: recent enough to follow a change of load


def cores_busy_s(cores: Iterable[int]) -> float | None:
    """Seconds the kernel counts ``cores`` busy since boot (user, nice, system, interrupts);
    None where ``/proc/stat`` is not there to read (not Linux)."""
    wanted = {f"cpu{c}" for c in cores}
    try:
        with open("/proc/stat") as f:
            lines = [line.split() for line in f if line.startswith("cpu")]
    except OSError:
        return None
    ticks = sum(int(v) for fields in lines if fields[0] in wanted for v in (fields[1], fields[2], fields[3],
                                                                            fields[6], fields[7]))
    return ticks / TICKS_PER_S


def process_cpu_s(pid: int) -> float:
    """User and system seconds of process ``pid`` (0 if it has gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICKS_PER_S


class CoreShare:
    """Tracks others' CPU time on ``cores`` while requests run. ``helpers``: the pids of the
    daemon's other processes (its decode workers), whose time is its own."""

    def __init__(self, cores: Iterable[int], helpers: Callable[[], Iterable[int]] = tuple) -> None:
        self.cores = tuple(cores)
        self.helpers = helpers
        self._lock = threading.Lock()
        self._running = 0
        self._mark: float | None = None  # others' seconds when the last request ended (or the first began)
        self._recent: deque[tuple[float, int]] = deque(maxlen=RECENT)  # (others' seconds, samples) per request

    def others_s(self) -> float | None:
        """Others' CPU seconds on the cores since boot; None where not measurable here."""
        busy = cores_busy_s(self.cores)
        if busy is None:
            return None
        return busy - time.process_time() - sum(process_cpu_s(pid) for pid in self.helpers())

    def started(self) -> None:
        with self._lock:
            if self._running == 0:
                self._mark = self.others_s()
            self._running += 1

    def finished(self, samples: int) -> float | None:
        """A request of ``samples`` ended (0: it failed): returns others' milliseconds of the
        node's cores per sample over the recent requests (None: not measurable here). The time
        since the last request ended is charged to this one: between them, the requests
        running overlap."""
        with self._lock:
            self._running -= 1
            now = self.others_s()
            if now is None or self._mark is None:
                return None
            if samples:  # a failed request's share goes to no sample
                self._recent.append((now - self._mark, samples))
            self._mark = now
            if not self._recent:
                return None
            # The tick counts are coarse (10 ms): one interval may read below zero, the sum not.
            return max(sum(s for s, _ in self._recent), 0.0) * 1e3 / sum(n for _, n in self._recent)
