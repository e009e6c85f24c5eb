"""Memory on this node: what the process uses, what it may use, and what a prefix costs.

The cost of a request is predicted by a model measured on this node, not hard-coded:
when a prefix is first loaded, it runs at two batch sizes under torch's allocator
profiler (on a GPU: the CUDA caching allocator's peak counter), and the peak bytes live
during each stage give, per stage, a fixed part and a part per sample; a split's peak is
the largest of its stages'. Linear fits hold because
frozen layers run in eval mode: a sample's activations do not depend on the others in
its batch.
"""

from __future__ import annotations

import ctypes
import logging
import os
import resource
import threading
import traceback
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

log = logging.getLogger(__name__)

# Batch sizes the memory model is measured at: two points fit a line, and 2 (not 1) keeps
# batch-1 special cases of the convolution kernels out of the fit.
CALIBRATION_BATCHES = (2, 8)
# A marker allocation of this size tells which profiler thread id is ours (the profiler
# also sees other requests' threads, which must not count).
_MARKER_BYTES = 123_457
_PROFILER_LOCK = threading.Lock()  # torch's profiler runs one session at a time
CPU = torch.device("cpu")
# Per CUDA device, the most bytes its caching allocator has held allocated, over this
# process's life: measuring a stage resets the device's own peak counter.
_device_peaks: dict[int, int] = {}


# --- the process ------------------------------------------------------------------


def _status_kib(field_name: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    raise OSError(f"/proc/self/status has no {field_name}")


def process_rss_bytes() -> int:
    """Resident memory of this process now."""
    try:
        return _status_kib("VmRSS") * 1024
    except OSError:  # not Linux: the peak is the best we have
        return peak_rss_bytes()


def process_private_bytes(pid: int) -> int:
    """Memory only process ``pid`` holds (its private pages): what it adds to the node beyond
    the libraries it maps, which the daemon's own resident memory counts already."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            return 1024 * sum(int(line.split()[1]) for line in f
                              if line.startswith(("Private_Clean:", "Private_Dirty:", "Swap:")))
    except OSError:  # no smaps_rollup (before Linux 4.14), or the process has ended
        try:
            with open(f"/proc/{pid}/status") as f:
                return 1024 * next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        except (OSError, StopIteration):
            return 0


def peak_rss_bytes() -> int:
    """The most resident memory this process has had."""
    try:
        return _status_kib("VmHWM") * 1024
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _cgroup_limit_bytes() -> int | None:
    """The memory limit of this process's cgroup (v2 or v1), if it has one."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    candidates = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2
            candidates += [Path("/sys/fs/cgroup", path.lstrip("/"), "memory.max"), Path("/sys/fs/cgroup/memory.max")]
        elif "memory" in controllers.split(","):  # v1
            root = Path("/sys/fs/cgroup/memory")
            candidates += [root / path.lstrip("/") / "memory.limit_in_bytes", root / "memory.limit_in_bytes"]
    for candidate in candidates:
        try:
            text = candidate.read_text().strip()
        except OSError:
            continue
        # v1 spells "no limit" as a huge number, v2 as "max".
        return None if text == "max" or int(text) >= 1 << 60 else int(text)
    return None


def return_freed_memory_promptly(threshold: int = 1 << 20) -> bool:
    """Make glibc serve allocations from ``threshold`` bytes up with their own mappings.

    glibc raises its mmap threshold (up to 32 MB) each time a large block is freed, after
    which tensors of that size come from heap arenas that keep freed memory, one arena per
    thread: resident memory then drifts far above what is live, and the budget, which
    counts what is live, stops describing the process. A fixed threshold returns every
    large tensor's pages on free. False where this is not glibc.
    """
    return _mallopt((M_MMAP_THRESHOLD, threshold))


def keep_freed_memory_within(slack: int, arenas: int) -> bool:
    """Let glibc keep at most ``slack`` bytes of freed memory for reuse, in ``arenas`` arenas.

    A forward pass allocates and frees the same activations, pass after pass. Returned to
    the kernel on free, each comes back as fresh pages that fault in zeroed on the next
    pass: ResNet-18's prefix at 112 px ran 64 samples/s on a core so, 83 when its blocks
    are kept. What glibc keeps must stay bounded, or resident memory drifts above what the
    budget counts: blocks below 32 MB (glibc's own ceiling for heap blocks) come from at
    most ``arenas`` arenas instead of one per allocating thread, and each returns what lies
    free at its top beyond ``slack / arenas``; larger blocks get their own mappings,
    returned on free. False where this is not glibc.
    """
    return _mallopt((M_ARENA_MAX, arenas), (M_MMAP_THRESHOLD, 32 << 20),
                    (M_TRIM_THRESHOLD, max(slack // max(arenas, 1), 128 << 10)))


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8  # glibc's malloc.h


class KeptMemory:
    """Holds what glibc keeps of freed memory to ``slack`` bytes beyond what the budget counts.

    An arena returns only what lies free at its top; blocks freed below a live one stay
    resident. So once a request is done, where this process holds more than its idle
    ``baseline``, the reservations still held and the ``slack``, every arena gives back
    what it has free (``malloc_trim``): a few milliseconds, and only when it is over.
    """

    def __init__(self, baseline: int, slack: int) -> None:
        self.baseline = baseline
        self.slack = slack
        try:
            self._trim = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):  # not glibc: nothing to give back this way
            self._trim = None

    def check(self, reserved: int) -> bool:
        """Give back freed memory if this process holds more than ``reserved`` allows; whether it did."""
        if self._trim is None or process_rss_bytes() <= self.baseline + reserved + self.slack:
            return False
        self._trim(0)
        return True


def _mallopt(*settings: tuple[int, int]) -> bool:
    try:
        libc = ctypes.CDLL("libc.so.6")
        return all(libc.mallopt(option, value) for option, value in settings)
    except (OSError, AttributeError):
        return False


def machine_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def default_memory_budget() -> int:
    """Half of the machine's or the cgroup's memory: the object store and the OS need the rest."""
    limits = [machine_memory_bytes()]
    cgroup = _cgroup_limit_bytes()
    if cgroup:
        limits.append(cgroup)
    return min(limits) // 2


# --- what one prefix costs ---------------------------------------------------------


@dataclass(frozen=True)
class PrefixMemory:
    """Measured memory of one frozen prefix, for every split it allows.

    Stage ``i`` of stages ``[0, s)`` peaks at ``stage_fixed[i] + batch * stage_per_sample[i]``
    bytes live (its input included); a split's peak is the largest of its stages'. A line
    per stage, not one per split, because a max of lines is not a line: a stage with a large
    fixed workspace dominates small batches, one with large activations large batches.
    """

    weights_bytes: int  # parameters and buffers of the frozen stages, kept while loaded
    input_bytes: int  # one decoded, transformed sample (float32)
    stage_fixed: tuple[int, ...]
    stage_per_sample: tuple[int, ...]
    output_numel: tuple[int, ...]  # index s: elements of one sample's features at split s

    def forward_bytes(self, split: int, batch: int) -> int:
        """Peak bytes of running stages [0, split) on ``batch`` samples, input included."""
        peaks = (fixed + batch * per for fixed, per in zip(self.stage_fixed[:split], self.stage_per_sample[:split]))
        return max(peaks, default=batch * self.input_bytes)

    def to_json(self) -> dict:
        return asdict(self)


def model_bytes(module: nn.Module) -> int:
    tensors = [*module.parameters(), *module.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


def peak_live_bytes(run: Callable[[], object]) -> int:
    """Peak bytes allocated (and not yet freed) by this thread while ``run()`` runs."""
    with _PROFILER_LOCK, profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        marker = torch.empty(_MARKER_BYTES, dtype=torch.uint8)
        del marker
        run()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    ours = next(e.start_thread_id() for e in events if e.nbytes() == _MARKER_BYTES)
    live = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        if event.start_thread_id() == ours and abs(event.nbytes()) != _MARKER_BYTES:
            live += event.nbytes()
            peak = max(peak, live)
    return peak


class _DeviceLock:
    """Shared by the forward passes on one device, held alone by a measure of its memory.

    A measure reads the device's allocator counters, which count every thread's tensors:
    alone, nothing but the measured run allocates or frees there, so no other pass's
    memory coming and going shifts the reading. A measure waiting goes ahead of passes
    not yet started: passes come and go all the time and would keep it out for good.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._passes = 0
        self._measuring = False
        self._measures_waiting = 0

    @contextmanager
    def shared(self) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: not self._measuring and not self._measures_waiting)
            self._passes += 1
        try:
            yield
        finally:
            with self._cond:
                self._passes -= 1
                if not self._passes:
                    self._cond.notify_all()

    @contextmanager
    def alone(self) -> Iterator[None]:
        with self._cond:
            self._measures_waiting += 1
            try:
                self._cond.wait_for(lambda: not self._measuring and not self._passes)
                self._measuring = True
            finally:
                self._measures_waiting -= 1
        try:
            yield
        finally:
            with self._cond:
                self._measuring = False
                self._cond.notify_all()


_device_locks: dict[int, _DeviceLock] = {}
_device_locks_guard = threading.Lock()


def _device_lock(device: torch.device) -> _DeviceLock:
    with _device_locks_guard:
        return _device_locks.setdefault(device.index, _DeviceLock())


@contextmanager
def device_work(device: torch.device) -> Iterator[None]:
    """Around anything in the daemon that allocates or frees memory on CUDA ``device`` (a
    forward pass, an eviction): it never overlaps a measure of the device's memory
    (``peak_device_bytes``). Passes overlap each other. Nothing on the CPU, whose measure
    counts its own thread's allocations only.

    Every GPU tensor the block made must be gone when it ends. On an error, the frames of
    the traceback that have returned (the modules' forwards, a helper the block called)
    are cleared here, so the tensors they held are freed now, not whenever the error is
    dropped; tensors in the block's own frame are the caller's to drop.
    """
    if device.type != "cuda":
        yield
        return
    with _device_lock(device).shared():
        try:
            yield
        except BaseException as exc:
            traceback.clear_frames(exc.__traceback__)
            raise


def peak_device_bytes(run: Callable[[], object], device: torch.device) -> int:
    """Peak bytes the CUDA caching allocator held allocated on ``device``, beyond what it held
    before, while ``run()`` runs. The counter is the device's, not the thread's, so the run
    holds the device alone: the daemon allocates and frees GPU memory only inside
    ``device_work`` (forward passes, evictions), which waits meanwhile, or in the prefix
    load this measure is part of (loads run one at a time). No other tensor is freed
    during the run, so the reading cannot come out low; anything allocating there at the
    same time only adds to it: the measure errs high, never low."""
    with _device_lock(device).alone():
        torch.cuda.synchronize(device)
        _record_device_peak(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        run()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device)
        _device_peaks[device.index] = max(_device_peaks.get(device.index, 0), peak)
    return max(0, peak - before)


def _record_device_peak(device: torch.device) -> None:
    _device_peaks[device.index] = max(_device_peaks.get(device.index, 0), torch.cuda.max_memory_allocated(device))


def device_peak_bytes(device: torch.device) -> int:
    """The most bytes this process has held allocated on CUDA ``device`` (0 for the CPU)."""
    if device.type != "cuda":
        return 0
    _record_device_peak(device)
    return _device_peaks[device.index]


def autocast_context(compute_dtype: torch.dtype, device: torch.device = CPU):
    """On CUDA, bf16 autocast, as the compute tier's trainer runs; on the CPU, autocast for
    reduced-precision compute and nothing for float32."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    if compute_dtype == torch.float32:
        return nullcontext()
    return torch.autocast("cpu", dtype=compute_dtype)


def calibrate(stages: nn.Sequential, input_size: int, compute_dtype: torch.dtype,
              device: torch.device = CPU) -> PrefixMemory:
    """Measure each stage at two batch sizes and fit peak bytes = fixed + per_sample * batch.

    Each stage is profiled on its own with what a forward pass holds alive around it: its
    input, and the batch's input, which the caller holds until the pass returns. The fit
    errs high: the line is at or above the measured peak at both batch sizes. On a CUDA
    ``device`` (where ``stages`` must already be) the bytes are the device's, with the input
    in channels_last under bf16 autocast, as requests run there.
    """
    input_bytes = 3 * input_size * input_size * torch.float32.itemsize
    peaks: list[list[int]] = []
    numel = [3 * input_size * input_size]
    cuda = device.type == "cuda"
    layout = {"memory_format": torch.channels_last} if cuda else {}
    measure = partial(peak_device_bytes, device=device) if cuda else peak_live_bytes
    for batch in CALIBRATION_BATCHES:
        x = inputs = torch.randn(batch, 3, input_size, input_size).to(device, **layout)
        stage_peaks = []
        with torch.inference_mode(), autocast_context(compute_dtype, device):
            for stage in stages:
                held = x.numel() * x.element_size() + (batch * input_bytes if x is not inputs else 0)
                result: list[torch.Tensor] = []
                stage_peaks.append(held + measure(lambda stage=stage, x=x, result=result: result.append(stage(x))))
                x = result[0]
                if batch == CALIBRATION_BATCHES[0]:
                    numel.append(x[0].numel())
        peaks.append(stage_peaks)
    (b1, b2), fixed, per_sample = CALIBRATION_BATCHES, [], []
    for p1, p2 in zip(*peaks, strict=True):
        slope = max(0, -(-(p2 - p1) // (b2 - b1)))
        intercept = max(0, p1 - slope * b1)
        if intercept == 0:  # a line through the origin must still cover the first point
            slope = max(slope, -(-p1 // b1))
        fixed.append(intercept)
        per_sample.append(slope)
    return PrefixMemory(model_bytes(stages), input_bytes, tuple(fixed), tuple(per_sample), tuple(numel))


# --- what the samples of a request cost before they reach the prefix --------------


@dataclass(frozen=True)
class Staging:
    """Bytes per sample between the store and the prefix."""

    raw_per_sample: int  # encoded bytes held from GET until decoded
    decode_peak: int  # the largest preprocess in flight: the decoded image, its resized copy, the crop

    @classmethod
    def measure(cls, raw_sizes: Iterable[int], decode_peaks: Iterable[int], sharded: bool) -> Staging:
        """What these samples weigh, from their encoded sizes and what their headers say decoding costs."""
        raw_sizes = list(raw_sizes)
        raw = -(-sum(raw_sizes) // max(len(raw_sizes), 1))
        # A shard is held whole while its members are cut out of it: twice the bytes.
        return cls(raw * (2 if sharded else 1), max(decode_peaks, default=0))


class SampleSizes:
    """What recent requests' samples weighed: the estimate a new request is admitted with.

    The largest of the last ``window`` observations, so an estimate errs high; ``first_guess``
    until there is one. A request corrects its reservation with its own sizes once its
    objects are fetched, so a wrong estimate costs concurrency, not memory.
    """

    def __init__(self, first_guess: Staging, window: int = 32) -> None:
        self._first_guess = first_guess
        self._seen: deque[Staging] = deque(maxlen=window)
        self._lock = threading.Lock()

    def estimate(self) -> Staging:
        with self._lock:
            if not self._seen:
                return self._first_guess
            return Staging(max(s.raw_per_sample for s in self._seen), max(s.decode_peak for s in self._seen))

    def record(self, staging: Staging) -> None:
        """Count a served request's samples (not a refused one's: one bad image must not
        inflate every estimate after it)."""
        with self._lock:
            self._seen.append(staging)
