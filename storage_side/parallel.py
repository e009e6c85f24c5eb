"""How the daemon uses its cores: where it runs, who decodes, and turns at the prefix.

Three kinds of work share a node's cores: decoding images (split 0 is nothing else),
running the frozen prefix, and serving HTTP. Decoding runs either on threads of the
daemon's own process (torchvision's decoders and torch's resize release the GIL, but
reading headers and dispatching each op hold it) or in worker processes, one per core,
which hold no GIL of the daemon's at all. A sub-batch's encoded bytes go to the workers
in a file in shared memory, and each worker writes its samples' tensors straight into the
sub-batch's output buffer there: neither is pickled or pushed through the pool's one pipe,
which carries only names and offsets (through it, a worker would wait for its next task's
megabytes while the daemon's one feeder thread writes them).

Forward passes take turns, one per compute slot; each runs on its share of the cores.
"""

from __future__ import annotations

import contextlib
import io
import logging
import math
import mmap
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from itertools import accumulate, count
from typing import Protocol

import torch
from PIL import Image

from hapi.transforms import TransformSpec, decode_crop, preprocess
from storage_side.errors import Busy
from storage_side.memory import process_private_bytes, return_freed_memory_promptly

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"  # tmpfs: a sub-batch's buffers never touch a disk
IOV_MAX = os.sysconf("SC_IOV_MAX") if "SC_IOV_MAX" in os.sysconf_names else 16  # buffers per writev
INPUTS = ".in"  # the suffix of the file of a sub-batch's encoded bytes, beside its output buffer


def pin_cores(count: int) -> list[int]:
    """Pin this process, every thread it has, to ``count`` of the cores it may run on now (0: all).

    Threads started before (torch's, the logger's) are pinned too; processes started after
    (decode workers) inherit the cores. Returns the cores, in order.
    """
    allowed = sorted(os.sched_getaffinity(0))
    if count > len(allowed):
        raise ValueError(f"--cores {count}: this process may run on {len(allowed)} cores only ({allowed})")
    cores = allowed[:count] if count else allowed
    try:
        tasks = [int(task) for task in os.listdir("/proc/self/task")]
    except OSError:  # not Linux: the calling thread is all that can be pinned
        tasks = [0]
    for task in tasks:
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setaffinity(task, cores)
    return cores


@dataclass(eq=False)
class Place:
    """A request at the node, from its admission until it leaves. ``job`` None: a pass
    that belongs to no job's stream; ``order``: its batch's place in its job's stream;
    ``slots``: the most passes of its prefix that run fastest at once (None: every slot); ``whole``:
    it takes every slot, once none is busy."""

    job: str | None
    order: int
    slots: int | None = None
    whole: bool = False
    came: float = field(default_factory=time.monotonic)
    state: str = "fetching"  # then "waiting" for a compute turn, then "running"
    patience: float = math.inf  # until when it waits for earlier requests of its job
    behind_s: float = 0.0  # of its wait for a turn, the time it spent behind them


class ComputeTurns:
    """Forward passes run at once, one per slot, each on its share of the cores.

    A free slot goes to the waiting request that came first, except that a job's requests
    take their turns in their order: a request waits while an earlier one of its job is at
    the node and has not had its turn yet (it is still fetching or decoding). The trainer
    needs that one first, and would otherwise wait for a whole pass of a later one that
    happened to fetch sooner. It waits at most as long again as it took itself to come to
    its turn: an earlier request slower than that is stuck or slow, not merely behind, and
    holds up nothing.

    A pass takes ``threads`` intra-op threads when that is set; otherwise the cores divided
    among the passes running now, read at each sub-batch: a request alone gets every core,
    and when every slot is busy each pass runs on one core, where a convolution spends no
    time synchronising threads. torch's thread count belongs to the calling thread (OpenMP's
    does), so each pass sets its own. ``slots`` None: passes run whenever they come
    (no adaptation, for comparison only). A request whose prefix runs fastest as fewer
    passes at once (``storage_side.layout``) takes its turn only while fewer are running.
    """

    def __init__(self, slots: int | None, cores: int, threads: int = 0) -> None:
        self.slots = slots
        self.cores = cores
        self.threads = threads
        self.busy = 0
        self._changed = threading.Condition()
        self._present: list[Place] = []  # in the order they came

    @contextlib.contextmanager
    def place(self, job: str | None, order: int, slots: int | None = None, whole: bool = False) -> Iterator[Place]:
        """Hold a request's place at the node (from its admission: one not admitted holds
        none, so that no admitted request waits for it) while it is here."""
        place = Place(job, order, slots, whole)
        with self._changed:
            self._present.append(place)
        try:
            yield place
        finally:
            with self._changed:
                self._present.remove(place)
                self._changed.notify_all()

    @contextlib.contextmanager
    def turn(self, place: Place | None = None) -> Iterator[ComputeTurns]:
        """A compute slot for ``place``'s request (None: a pass of no stream), once it is its turn."""
        with contextlib.ExitStack() as stack:
            if place is None:
                place = stack.enter_context(self.place(None, 0))
            with self._changed:
                now = started = time.monotonic()
                place.state, place.patience = "waiting", 2 * started - place.came
                cleared = None  # when it was first behind no earlier request of its job
                while self.slots is not None:
                    behind = self._behind(place, now)
                    if cleared is None and not behind:
                        cleared = now
                    if self._next(now) is place:
                        break
                    self._changed.wait(place.patience - now if behind else None)
                    now = time.monotonic()
                place.behind_s = (cleared or started) - started
                place.state = "running"
                taken = self.slots if place.whole and self.slots is not None else 1
                self.busy += taken
                self._changed.notify_all()  # those behind it wait no more, and a slot may be left
            try:
                yield self
            finally:
                with self._changed:
                    self.busy -= taken
                    self._changed.notify_all()

    @contextlib.contextmanager
    def every_slot(self) -> Iterator[ComputeTurns]:
        """Every slot at once, in turn, once the passes running now have ended: for timing the cores."""
        with self.place(None, 0, whole=True) as place, self.turn(place):
            yield self

    def _next(self, now: float) -> Place | None:
        """The request the next free slot goes to, if one is free (for a whole place: every one)."""
        first = next((p for p in self._present if p.state == "waiting" and not self._behind(p, now)), None)
        if first is None:
            return None
        if first.whole:
            return first if self.busy == 0 else None
        return first if self.busy < min(first.slots or self.slots, self.slots) else None

    def _behind(self, place: Place, now: float) -> bool:
        """Whether ``place`` still waits for an earlier request of its job to have its turn."""
        return place.job is not None and now < place.patience and any(
            p.job == place.job and p.order < place.order and p.state != "running" for p in self._present)

    def take_share(self) -> int:
        """Set this thread's intra-op threads to its share of the cores now; returns it."""
        threads = self.threads or max(1, self.cores // max(self.busy, 1))
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        return threads


class PendingBatch(Protocol):
    def result(self) -> torch.Tensor:
        """The sub-batch's inputs, (n, 3, crop, crop): float32 normalised, or the uint8 crops
        when submitted with ``normalized=False``; raises the first sample's error."""

    def cancel(self) -> None:
        """Drop what has not started; the buffer is freed once nothing uses it."""


class Decoder(Protocol):
    workers: int  # decodes in flight at once
    kind: str  # "threads" or "processes"

    def submit(self, blobs: Sequence[bytes], keys: Sequence[str], spec: TransformSpec, epoch: int,
               max_pixels: int, normalized: bool = True) -> PendingBatch: ...

    def pids(self) -> list[int]:
        """The decoder's own processes (none for threads)."""

    def private_bytes(self) -> int:
        """Memory this decoder's processes hold beyond the daemon's own (0 for threads)."""

    def start(self) -> None:
        """Start again after ``close``: in a process forked from the one that closed it."""

    def close(self) -> None: ...


def _results(futures: Sequence[Future]) -> list:
    """Every result, in order; on an error, the first one raised, and the rest cancelled."""
    try:
        return [f.result() for f in futures]
    except BaseException:
        for f in futures:
            f.cancel()
        raise


def _one_thread() -> None:
    # A decode is one core's work: torch's resize would otherwise start a team of threads
    # per decoding thread, many times more threads than cores.
    torch.set_num_threads(1)


class _ThreadBatch:
    def __init__(self, futures: list[Future[torch.Tensor]]) -> None:
        self.futures = futures

    def result(self) -> torch.Tensor:
        return torch.stack(_results(self.futures))

    def cancel(self) -> None:
        for f in self.futures:
            f.cancel()


class ThreadDecoder:
    """Decodes on ``workers`` threads of the daemon's own process."""

    kind = "threads"

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self.pool: ThreadPoolExecutor | None = None
        self.start()

    def submit(self, blobs: Sequence[bytes], keys: Sequence[str], spec: TransformSpec, epoch: int,
               max_pixels: int, normalized: bool = True) -> _ThreadBatch:
        if self.pool is None:
            raise RuntimeError("the decode threads are not started")
        decode = preprocess if normalized else decode_crop
        return _ThreadBatch([self.pool.submit(decode, blob, key, spec, epoch, max_pixels)
                             for blob, key in zip(blobs, keys, strict=True)])

    def pids(self) -> list[int]:
        return []

    def private_bytes(self) -> int:
        return 0

    def start(self) -> None:
        if self.pool is None:
            self.pool = ThreadPoolExecutor(self.workers, thread_name_prefix="decode", initializer=_one_thread)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(cancel_futures=True)
            self.pool = None


# --- worker processes --------------------------------------------------------------


def _init_worker() -> None:
    _one_thread()
    return_freed_memory_promptly()  # what a decode frees goes back to the system, as in the daemon
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the daemon's to handle, then ours


def _warm_up() -> int:
    """Load the decoders' code paths once (the first decode allocates their tables)."""
    image = io.BytesIO()
    Image.new("RGB", (16, 16), (120, 80, 40)).save(image, format="JPEG")
    preprocess(image.getvalue(), "warm-up", TransformSpec(crop_size=8, resize_size=8))
    return os.getpid()


def _decode_into(path: str, shape: tuple[int, ...], start: int, extents: Sequence[tuple[int, int]],
                 keys: Sequence[str], spec: TransformSpec, epoch: int, max_pixels: int, normalized: bool) -> None:
    """Decode samples ``start...`` of a sub-batch, whose encoded bytes lie at ``extents``
    (offset, length) of the file ``path + INPUTS``, into its buffer at ``path``; runs in a worker."""
    with open(path, "r+b") as f:
        buffer = mmap.mmap(f.fileno(), 0)
    out = torch.frombuffer(buffer, dtype=_buffer_dtype(normalized)).view(shape)
    decode = preprocess if normalized else decode_crop
    try:
        inputs = os.open(path + INPUTS, os.O_RDONLY)
        try:
            for i, ((offset, length), key) in enumerate(zip(extents, keys, strict=True)):
                out[start + i] = decode(os.pread(inputs, length, offset), key, spec, epoch, max_pixels)
        finally:
            os.close(inputs)
    finally:
        del out  # no view of the mapping may outlive it, not even in a traceback
        buffer.close()


def _buffer_dtype(normalized: bool) -> torch.dtype:
    return torch.float32 if normalized else torch.uint8


class _SharedBatch:
    """A sub-batch being decoded by workers from a file on tmpfs (its encoded bytes, one
    after another) into another (its tensors), mapped here too."""

    def __init__(self, path: str, shape: tuple[int, ...], dtype: torch.dtype, blobs: Sequence[bytes]) -> None:
        self.path = path
        self.shape = shape
        self.dtype = dtype
        self.futures: list[Future[None]] = []
        offsets = list(accumulate(map(len, blobs), initial=0))
        self.extents = list(zip(offsets, map(len, blobs)))
        nbytes = max(1, torch.Size(shape).numel() * dtype.itemsize)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            # Allocated now: a full tmpfs fails here, not as a SIGBUS in a worker writing to it.
            os.posix_fallocate(fd, 0, nbytes)
            self.buffer = mmap.mmap(fd, nbytes)
            inputs = os.open(path + INPUTS, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        try:
            _write_all(inputs, blobs)  # a full tmpfs fails here, as ENOSPC
        except OSError:
            self._unlink()
            raise
        finally:
            os.close(inputs)

    def result(self) -> torch.Tensor:
        try:
            _results(self.futures)
        except BrokenProcessPool:
            raise Busy("decoder_restarted", "a decode worker died (a decoder crashed on an image); the "
                       "workers were restarted: retry", 1) from None
        finally:
            self._unlink()
        # The tensor keeps the mapping alive; its pages are freed when the tensor is.
        return torch.frombuffer(self.buffer, dtype=self.dtype).view(self.shape)

    def cancel(self) -> None:
        for f in self.futures:
            f.cancel()
        self._unlink()

    def _unlink(self) -> None:
        # Workers open the files by name only while decoding: once they are done, the names go.
        for path in (self.path, self.path + INPUTS):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


def _write_all(fd: int, blobs: Sequence[bytes]) -> None:
    """Write ``blobs`` one after another, in as few system calls as the kernel takes them."""
    views = [memoryview(blob) for blob in blobs if blob]
    while views:
        written = os.writev(fd, views[:IOV_MAX])
        while written and written >= len(views[0]):
            written -= len(views.pop(0))
        if written:
            views[0] = views[0][written:]


class ProcessDecoder:
    """Decodes in ``workers`` processes; a sub-batch is cut into one run of samples per worker."""

    kind = "processes"

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self._names = count()
        self._lock = threading.Lock()
        self.pool: ProcessPoolExecutor | None = None
        self._in_process: ThreadDecoder | None = None  # where shared memory runs out
        self.start()

    def _start(self) -> ProcessPoolExecutor:
        # spawn, not fork: the daemon has threads (the server's, torch's), and a forked
        # child of a threaded process may inherit a lock held by one of them.
        pool = ProcessPoolExecutor(self.workers, multiprocessing.get_context("spawn"), initializer=_init_worker)
        # Each submit before a worker is idle starts another: all of them start now, not
        # under the first request, and their memory can be measured.
        for f in [pool.submit(_warm_up) for _ in range(self.workers)]:
            f.result()
        return pool

    def submit(self, blobs: Sequence[bytes], keys: Sequence[str], spec: TransformSpec, epoch: int,
               max_pixels: int, normalized: bool = True) -> PendingBatch:
        n = len(keys)
        try:
            batch = _SharedBatch(f"{SHM_DIR}/hapi-decode-{os.getpid()}-{next(self._names)}",
                                 (n, 3, spec.crop_size, spec.crop_size), _buffer_dtype(normalized), blobs)
        except OSError as exc:
            # A container's /dev/shm is often 64 MB: decode here, on threads, rather than fail.
            with self._lock:
                if self._in_process is None:
                    log.warning("no room in %s for a sub-batch (%s): decoding on threads of this process; "
                                "give the daemon a larger %s (docker run --shm-size)", SHM_DIR, exc, SHM_DIR)
                    self._in_process = ThreadDecoder(self.workers)
            return self._in_process.submit(blobs, keys, spec, epoch, max_pixels, normalized)
        runs = min(n, self.workers)
        bounds = [n * i // runs for i in range(runs + 1)]
        pool = self.pool
        if pool is None:
            raise RuntimeError("the decode workers are not started")
        try:
            for lo, hi in zip(bounds, bounds[1:]):
                batch.futures.append(pool.submit(_decode_into, batch.path, batch.shape, lo, batch.extents[lo:hi],
                                                 keys[lo:hi], spec, epoch, max_pixels, normalized))
        except BrokenProcessPool:
            batch.cancel()
            self._restart(pool)
            raise Busy("decoder_restarted", "the decode workers were restarting; retry", 1) from None
        for f in batch.futures:
            f.add_done_callback(lambda f, pool=pool: self._restart_if_broken(pool, f))
        return batch

    def _restart_if_broken(self, pool: ProcessPoolExecutor, future: Future[None]) -> None:
        if not future.cancelled() and isinstance(future.exception(), BrokenProcessPool):
            # Off the pool's own thread, which is still failing the rest of its futures.
            threading.Thread(target=self._restart, args=(pool,), daemon=True).start()

    def _restart(self, broken: ProcessPoolExecutor) -> None:
        with self._lock:
            if self.pool is not broken:
                return  # another request restarted it already
            log.error("a decode worker died; restarting the %d workers", self.workers)
            broken.shutdown(wait=False, cancel_futures=True)
            self.pool = self._start()

    def pids(self) -> list[int]:
        # The executor's own table of its workers: it has no public one.
        return list(self.pool._processes) if self.pool is not None else []

    def private_bytes(self) -> int:
        return sum(process_private_bytes(pid) for pid in self.pids())

    def start(self) -> None:
        with self._lock:
            if self.pool is None:
                self.pool = self._start()

    def close(self) -> None:
        with self._lock:
            if self.pool is not None:
                self.pool.shutdown(wait=True, cancel_futures=True)
                self.pool = None
            if self._in_process is not None:
                self._in_process.close()
                self._in_process = None


def make_decoder(workers: int, processes: bool) -> Decoder:
    return ProcessDecoder(workers) if processes else ThreadDecoder(workers)

