"""Admission control: memory reservations against the budget, granted fairly across jobs.

Everything that takes memory in proportion to load (a request's samples and
activations, a prefix being loaded) reserves its bytes first. A reservation is granted
at once when memory is free and nobody waits; otherwise it waits in a bounded queue,
one lane per job, served round-robin, so a job with many requests in flight cannot
starve a job with one. A request asks for a range: ``need`` (the least it will run
with) and ``want`` (its preferred sub-batch). It gets as much of that range as its job's
fair share allows: the memory not kept by loaded models, divided by the jobs active
(running or waiting), less what its job holds already. So memory is not handed whole to
whichever job came first, and a job's later requests run smaller, not its neighbours'.
At most ``max_running`` requests hold memory at once (about what the cores can keep
busy); more would only cut the same memory into smaller, slower sub-batches. The one
exception is a request of a job with a later batch running already: that later batch
waits for the earlier one's compute turn (``ComputeTurns``), so admitting it runs no
more at once, and refusing it would hold the batch the trainer needs first behind the
ones it needs after.
"""

from __future__ import annotations

import logging
import math
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from storage_side.errors import Busy

log = logging.getLogger(__name__)

# The order of a request outside its job's stream of batches (a profile): after them all.
OUTSIDE_STREAM = sys.maxsize


class Reservation:
    """Bytes held against the budget until released (also on ``with`` exit)."""

    def __init__(self, admission: Admission, job: str, nbytes: int, order: int) -> None:
        self._admission = admission
        self.job: str | None = job  # None once kept: no longer a job's running request
        self.order = order
        self.bytes = nbytes
        self._since = time.monotonic()
        self._released = False

    def keep(self) -> None:
        """Keep the bytes held, but no longer as a running request: a loaded model's
        weights, or a reply being sent. The request's turn passes to the next waiter."""
        self._admission._keep(self)

    def shrink(self, nbytes: int) -> None:
        """Give back all but ``nbytes``."""
        if nbytes < self.bytes:
            freed, self.bytes = self.bytes - nbytes, nbytes
            self._admission._give_back(self, freed)

    def try_grow(self, nbytes: int) -> bool:
        """Hold ``nbytes`` if the budget has them free now; never waits."""
        return nbytes <= self.bytes or self._admission._take_now(self, nbytes - self.bytes)

    def release(self) -> None:
        if not self._released:
            self._released = True
            freed, self.bytes = self.bytes, 0
            self._admission._give_back(self, freed, held_s=time.monotonic() - self._since)

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


@dataclass
class _Waiter:
    job: str
    need: int
    want: int
    woken: threading.Condition  # on the admission's lock: a grant wakes its own waiter only
    order: int  # its batch's place in the job's stream
    granted: int = 0


class Admission:
    """Reserves bytes out of ``capacity``; waiters queue per job and are served round-robin."""

    def __init__(self, capacity: int, max_queue: int, queue_timeout_s: float, max_running: int = 1 << 30) -> None:
        if capacity <= 0:
            raise ValueError(f"no memory left to reserve (capacity {capacity} bytes): raise the memory budget")
        self.capacity = capacity
        self.max_queue = max_queue
        self.queue_timeout_s = queue_timeout_s
        # Requests holding memory at once. More than the cores can run only splits the same
        # compute and memory into slower, smaller sub-batches.
        self.max_running = max_running
        self.running = 0
        self.reserved = 0
        self.peak_reserved = 0
        self.kept = 0  # bytes held but no longer by a running request (loaded models, replies being sent)
        self._running: dict[str, int] = {}  # job -> bytes its running requests hold
        self._orders: dict[str, list[int]] = {}  # job -> the orders of its running requests
        # Called with a number of bytes when waiters cannot fit: frees what it can (the
        # prefix cache evicts idle prefixes). It may release reservations re-entrantly.
        self.reclaim: Callable[[int], None] = lambda nbytes: None
        self._lock = threading.RLock()
        self._lanes: dict[str, deque[_Waiter]] = {}
        self._turns: deque[str] = deque()  # jobs with waiters, in round-robin order
        self._dispatching = False
        self._mean_hold_s = 1.0  # moving average of how long reservations are held

    @property
    def free(self) -> int:
        return self.capacity - self.reserved

    @property
    def queue_depth(self) -> int:
        with self._lock:
            return sum(len(lane) for lane in self._lanes.values())

    @property
    def jobs_active(self) -> int:
        """Jobs with a request running or waiting."""
        with self._lock:
            return len(self._running.keys() | self._lanes.keys())

    def retry_after_s(self) -> int:
        """When a refused request should come back: about when one running now will be done."""
        return max(1, min(60, math.ceil(self._mean_hold_s)))

    def admit(self, job: str, need: int, want: int, order: int = OUTSIDE_STREAM) -> Reservation:
        """Reserve between ``need`` and ``want`` bytes for ``job``, waiting for a fair turn;
        a job's own requests in ``order`` (their batches' places in its stream).

        Raises Busy (503) when the queue is full or the wait outlasts ``queue_timeout_s``.
        """
        if need > self.capacity:
            raise ValueError(f"{need} bytes can never fit in a capacity of {self.capacity}")
        waiter = _Waiter(job, need, max(need, want), threading.Condition(self._lock), order)
        deadline = time.monotonic() + self.queue_timeout_s
        with self._lock:
            waiting = sum(len(lane) for lane in self._lanes.values())
            self._enqueue(waiter)
            self._dispatch()
            if not waiter.granted and waiting >= self.max_queue:
                self._dequeue(waiter)
                raise Busy("queue_full", f"{waiting} requests already wait for memory on this node "
                           f"(at most {self.max_queue}); retry later", self.retry_after_s())
            while not waiter.granted:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self._dequeue(waiter)
                    raise Busy("queue_timeout", f"waited {self.queue_timeout_s:g} s for a turn with {need} bytes "
                               f"({self.free} of {self.capacity} free, {self.running} of {self.max_running} "
                               "requests running); retry later", self.retry_after_s())
                waiter.woken.wait(remaining)
        return Reservation(self, job, waiter.granted, order)

    def _enqueue(self, waiter: _Waiter) -> None:
        lane = self._lanes.setdefault(waiter.job, deque())
        if not lane:
            self._turns.append(waiter.job)
        lane.insert(next((i for i, w in enumerate(lane) if w.order > waiter.order), len(lane)), waiter)

    def _dequeue(self, waiter: _Waiter) -> None:
        lane = self._lanes[waiter.job]
        lane.remove(waiter)
        if not lane:
            del self._lanes[waiter.job]
            self._turns.remove(waiter.job)
        self._dispatch()  # a large waiter leaving may let smaller ones behind it in

    def _dispatch(self) -> None:
        """Grant waiters in round-robin order of jobs while the next one's ``need`` fits.

        Strict order (the next job's waiter first, even if a later one would fit) is what
        keeps a job with large requests from waiting forever behind a stream of small ones.
        """
        if self._dispatching:  # re-entered through reclaim -> release
            return
        self._dispatching = True
        try:
            while (job := self._next_job()) is not None:
                waiter = self._lanes[job][0]
                if self.free < waiter.need:
                    self.reclaim(waiter.need - self.free)
                    if self.free < waiter.need:
                        break
                active = min(len(self._running.keys() | self._lanes.keys()), self.max_running)
                share = (self.capacity - self.kept) // active - self._running.get(job, 0)
                waiter.granted = min(waiter.want, self.free, max(waiter.need, share))
                self._hold(waiter.granted)
                self._running[job] = self._running.get(job, 0) + waiter.granted
                self._orders.setdefault(job, []).append(waiter.order)
                self.running += 1
                lane = self._lanes[job]
                lane.popleft()
                self._turns.remove(job)
                if lane:
                    self._turns.append(job)
                else:
                    del self._lanes[job]
                waiter.woken.notify()
        finally:
            self._dispatching = False

    def _next_job(self) -> str | None:
        """The job whose first waiter is granted next: the round-robin's next while fewer than
        ``max_running`` run, else the first whose waiter a later running batch of its job waits on."""
        if self.running < self.max_running:
            return self._turns[0] if self._turns else None
        return next((job for job in self._turns
                     if self._lanes[job][0].order < max(self._orders.get(job, ()), default=-math.inf)), None)

    def _hold(self, nbytes: int) -> None:
        self.reserved += nbytes
        self.peak_reserved = max(self.peak_reserved, self.reserved)

    def _take_now(self, reservation: Reservation, extra: int) -> bool:
        with self._lock:
            if extra > self.free:
                return False
            self._hold(extra)
            reservation.bytes += extra
            if reservation.job is not None:
                self._running[reservation.job] += extra
            return True

    def _keep(self, reservation: Reservation) -> None:
        with self._lock:
            if reservation.job is None:
                return
            self._forget(reservation.job, reservation.bytes)
            self._stopped(reservation)
            reservation.job = None
            self.kept += reservation.bytes
            self._mean_hold_s += 0.1 * (time.monotonic() - reservation._since - self._mean_hold_s)
            self._dispatch()

    def _forget(self, job: str | None, nbytes: int) -> None:
        if job is None:
            self.kept -= nbytes
            return
        left = self._running.get(job, 0) - nbytes
        if left > 0:
            self._running[job] = left
        else:
            self._running.pop(job, None)

    def _give_back(self, reservation: Reservation, nbytes: int, held_s: float | None = None) -> None:
        with self._lock:
            self.reserved -= nbytes
            self._forget(reservation.job, nbytes)
            if held_s is not None and reservation.job is not None:
                self._mean_hold_s += 0.1 * (held_s - self._mean_hold_s)
                self._stopped(reservation)
            self._dispatch()

    def _stopped(self, reservation: Reservation) -> None:
        """``reservation`` no longer counts as its job's running request."""
        self.running -= 1
        orders = self._orders[reservation.job]
        orders.remove(reservation.order)
        if not orders:
            del self._orders[reservation.job]
