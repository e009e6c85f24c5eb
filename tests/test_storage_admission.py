"""storage_side/admission.py: reservations never exceed capacity; jobs are served round-robin."""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from storage_side.admission import OUTSIDE_STREAM, Admission, Reservation
from storage_side.errors import Busy


def _wait_for_depth(admission: Admission, depth: int) -> None:
    """Until ``depth`` requests wait: orders the test's threads without timing assertions."""
    deadline = time.monotonic() + 10
    while admission.queue_depth < depth:
        assert time.monotonic() < deadline, "a waiter never queued"
        time.sleep(0.005)


class Waiting:
    """A thread that asks for a reservation and records when it got one."""

    def __init__(self, admission: Admission, job: str, need: int, order: list[str], name: str,
                 place: int = OUTSIDE_STREAM) -> None:
        self.reservation: Reservation | None = None
        self.error: Exception | None = None
        self.done = threading.Event()

        def run() -> None:
            try:
                self.reservation = admission.admit(job, need, need, place)
                order.append(name)
            except Exception as exc:  # noqa: BLE001  recorded for the test to assert on
                self.error = exc
            self.done.set()

        threading.Thread(target=run, daemon=True).start()

    def result(self) -> Reservation:
        assert self.done.wait(10), "never granted"
        assert self.error is None, self.error
        return self.reservation


def test_grants_at_once_when_free_and_returns_bytes_on_release() -> None:
    admission = Admission(capacity=1000, max_queue=4, queue_timeout_s=5)
    with admission.admit("a", 100, 400) as reservation:
        assert reservation.bytes == 400 and admission.reserved == 400
        reservation.shrink(150)
        assert admission.reserved == 150
        assert reservation.try_grow(300) and admission.reserved == 300
        assert not reservation.try_grow(2000) and admission.reserved == 300
    assert admission.reserved == 0 and admission.peak_reserved == 400


def test_a_small_job_is_served_between_a_large_jobs_requests() -> None:
    """One job queues four requests, then another queues one: it goes second, not fifth."""
    admission = Admission(capacity=100, max_queue=16, queue_timeout_s=30)
    order: list[str] = []
    running = admission.admit("large", 100, 100)  # the large job's first request holds all memory
    waiters = []
    for i in range(2, 6):
        waiters.append(Waiting(admission, "large", 100, order, f"large-{i}"))
        _wait_for_depth(admission, i - 1)
    waiters.append(Waiting(admission, "small", 100, order, "small"))
    _wait_for_depth(admission, 5)

    running.release()
    for i in range(5):  # each needs all the memory, so they run one at a time: finish each in turn
        deadline = time.monotonic() + 10
        while len(order) <= i:
            assert time.monotonic() < deadline, "nobody was granted"
            time.sleep(0.002)
        assert len(order) == i + 1  # never two at once
        next(w for w in waiters if w.done.is_set() and w.reservation.bytes).result().release()
    assert order[:2] == ["large-2", "small"], order
    assert order.index("small") < order.index("large-3")
    assert admission.reserved == 0


def test_a_job_s_waiters_are_served_in_its_order_not_as_they_came() -> None:
    admission = Admission(capacity=100, max_queue=16, queue_timeout_s=30)
    granted: list[str] = []
    running = admission.admit("a", 100, 100, 0)
    waiters = []
    for depth, place in enumerate((3, 1, 2), start=1):
        waiters.append(Waiting(admission, "a", 100, granted, f"a{place}", place))
        _wait_for_depth(admission, depth)
    running.release()
    for i in range(3):
        deadline = time.monotonic() + 10
        while len(granted) <= i:
            assert time.monotonic() < deadline, "nobody was granted"
            time.sleep(0.002)
        next(w for w in waiters if w.done.is_set() and w.reservation.bytes).result().release()
    assert granted == ["a1", "a2", "a3"]


def test_memory_is_shared_between_active_jobs_not_handed_to_the_first() -> None:
    admission = Admission(capacity=1000, max_queue=8, queue_timeout_s=5)
    first = admission.admit("a", 100, 1000)  # alone: gets all it wants
    assert first.bytes == 1000
    first.shrink(400)
    second = admission.admit("b", 100, 1000)  # two jobs active: half each
    assert second.bytes == 500
    third = admission.admit("a", 50, 1000)  # job a holds 400 of its 500 already
    assert third.bytes == 100 and admission.free == 0
    for r in (first, second, third):
        r.release()


def test_full_queue_is_503_with_retry_after() -> None:
    admission = Admission(capacity=100, max_queue=0, queue_timeout_s=5)
    with admission.admit("a", 100, 100):
        with pytest.raises(Busy) as caught:
            admission.admit("b", 10, 10)
    assert caught.value.status == 503 and caught.value.code == "queue_full"
    assert int(caught.value.headers["Retry-After"]) >= 1
    assert admission.queue_depth == 0 and admission.reserved == 0


def test_wait_past_the_timeout_is_503_and_leaves_the_queue() -> None:
    admission = Admission(capacity=100, max_queue=4, queue_timeout_s=0.05)
    with admission.admit("a", 100, 100):
        with pytest.raises(Busy) as caught:
            admission.admit("b", 10, 10)
    assert caught.value.code == "queue_timeout" and "Retry-After" in caught.value.headers
    assert admission.queue_depth == 0
    assert admission.admit("b", 10, 10).bytes == 10  # nothing left behind blocks the next one


def test_reclaim_is_asked_for_the_shortfall() -> None:
    admission = Admission(capacity=100, max_queue=4, queue_timeout_s=5)
    kept = admission.admit("loader", 80, 80)
    kept.keep()  # like a loaded model's weights
    asked: list[int] = []

    def reclaim(nbytes: int) -> None:
        asked.append(nbytes)
        kept.release()

    admission.reclaim = reclaim
    assert admission.admit("a", 50, 50).bytes == 50
    assert asked == [30] and admission.kept == 0


def test_a_reservation_larger_than_capacity_is_refused_not_queued() -> None:
    with pytest.raises(ValueError, match="never fit"):
        Admission(capacity=100, max_queue=4, queue_timeout_s=5).admit("a", 101, 101)


def test_concurrent_reservations_never_exceed_capacity() -> None:
    admission = Admission(capacity=10_000, max_queue=64, queue_timeout_s=30)
    rng = random.Random(0)
    plans = [(f"job-{rng.randrange(5)}", rng.randrange(100, 4000), rng.randrange(4000, 12_000)) for _ in range(300)]

    def one(plan: tuple[str, int, int]) -> int:
        job, need, want = plan
        with admission.admit(job, need, min(want, 10_000)) as reservation:
            assert admission.reserved <= admission.capacity
            granted = reservation.bytes
            reservation.shrink(granted // 2)
        return granted

    with ThreadPoolExecutor(16) as pool:
        grants = list(pool.map(one, plans))
    assert all(g >= need for g, (_, need, _) in zip(grants, plans, strict=True))
    assert admission.peak_reserved <= admission.capacity and admission.reserved == 0


def test_at_most_max_running_requests_hold_memory_and_share_it() -> None:
    admission = Admission(capacity=1000, max_queue=8, queue_timeout_s=30, max_running=2)
    first = admission.admit("a", 100, 1000)
    first.shrink(400)
    second = admission.admit("b", 100, 1000)
    assert second.bytes == 500 and admission.running == 2
    order: list[str] = []
    third = Waiting(admission, "c", 10, order, "c")  # memory is free, but two already run
    _wait_for_depth(admission, 1)
    assert not third.done.is_set()
    first.release()
    assert third.result().bytes == 10 and admission.running == 2
    second.release()
    third.result().release()
    assert admission.running == 0 and admission.reserved == 0


def test_an_earlier_batch_of_a_job_is_admitted_past_the_running_limit_that_its_later_ones_fill() -> None:
    """Batches 2 and 3 took both running places before batch 1 came: batch 1 goes in at
    once (they wait for its compute turn), while another job and batch 4 still wait."""
    admission = Admission(capacity=1000, max_queue=8, queue_timeout_s=30, max_running=2)
    later = [admission.admit("a", 100, 100, order) for order in (2, 3)]
    granted: list[str] = []
    other = Waiting(admission, "b", 100, granted, "b", 0)
    fourth = Waiting(admission, "a", 100, granted, "a4", 4)
    _wait_for_depth(admission, 2)
    first = admission.admit("a", 100, 100, 1)
    assert admission.running == 3 and not other.done.is_set() and not fourth.done.is_set()
    first.release()
    later[0].release()  # below the limit again: the round-robin goes on, job b first
    assert other.result().bytes == 100 and not fourth.done.is_set()
    later[1].release()
    fourth.result().release()
    other.result().release()
    assert granted == ["b", "a4"] and admission.running == 0 and admission.reserved == 0


def test_a_request_outside_the_stream_waits_behind_the_running_limit() -> None:
    admission = Admission(capacity=1000, max_queue=8, queue_timeout_s=30, max_running=1)
    running = admission.admit("a", 100, 100, 5)
    profile = Waiting(admission, "a", 100, [], "profile")  # no order: never past the limit
    _wait_for_depth(admission, 1)
    assert not profile.done.is_set()
    running.release()
    profile.result().release()
    assert admission.running == 0
