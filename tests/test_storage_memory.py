"""storage_side/memory.py: the memory model measured on this node predicts what a forward pass takes."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
import weakref

import pytest
import torch

from hapi.models import build_model
from storage_side.config import parse_size
from storage_side.memory import (
    _device_lock,
    autocast_context,
    calibrate,
    default_memory_budget,
    device_peak_bytes,
    device_work,
    machine_memory_bytes,
    model_bytes,
    peak_device_bytes,
    peak_live_bytes,
    peak_rss_bytes,
    process_rss_bytes,
)
from storage_side.prefix_cache import load_bytes_bound

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this host")


@pytest.mark.parametrize("model, size", [("resnet18", 32), ("resnet18", 96), ("vgg11", 32)])
def test_calibrated_model_covers_the_measured_peak(model: str, size: int) -> None:
    staged = build_model(model, input_size=size)
    frozen = staged.prefix(staged.spec.freeze_index)
    memory = calibrate(frozen, size, torch.float32)
    assert memory.weights_bytes == model_bytes(frozen)
    for split in (4, staged.spec.freeze_index):
        prefix = staged.prefix(split)
        for batch in (3, 16, 33):  # neither calibration batch
            x = torch.randn(batch, 3, size, size)
            with torch.inference_mode():
                measured = x.nbytes + peak_live_bytes(lambda prefix=prefix, x=x: prefix(x))
            predicted = memory.forward_bytes(split, batch)
            # Never below what it takes; not wastefully above (that would cost concurrency).
            assert measured <= predicted <= 1.15 * measured + (1 << 20), (split, batch, measured, predicted)
        with torch.inference_mode():
            assert prefix(torch.randn(1, 3, size, size))[0].numel() == memory.output_numel[split]


@CUDA
@pytest.mark.parametrize("model, size", [("resnet18", 64), ("resnet50", 224)])
def test_calibrated_on_the_gpu_the_model_covers_the_gpu_peak(model: str, size: int) -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    staged = build_model(model, input_size=size)
    frozen = staged.prefix(staged.spec.freeze_index).to(device, memory_format=torch.channels_last)
    memory = calibrate(frozen, size, torch.float32, device)
    assert memory.weights_bytes == model_bytes(frozen)
    for split in (4, staged.spec.freeze_index):
        prefix = frozen[:split]
        for batch in (3, 16, 33):
            x = torch.randn(batch, 3, size, size, device=device).contiguous(memory_format=torch.channels_last)
            with torch.inference_mode(), autocast_context(torch.float32, device):
                measured = x.nbytes + peak_device_bytes(lambda prefix=prefix, x=x: prefix(x), device)
            predicted = memory.forward_bytes(split, batch)
            # Below what the GPU holds by no more than the daemon's headroom (a convolution's
            # workspace is cuDNN's choice per batch size, not a line); not wastefully above.
            assert measured <= 1.1 * predicted + (16 << 20), (split, batch, measured, predicted)
            assert predicted <= 1.25 * measured + (16 << 20), (split, batch, measured, predicted)


@CUDA
def test_the_gpu_peak_survives_the_counter_being_reset_for_a_measurement() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    base = torch.cuda.memory_allocated(device)
    big = torch.empty(64 << 20, dtype=torch.uint8, device=device)
    del big
    peak = device_peak_bytes(device)
    assert peak >= base + (64 << 20)
    peak_device_bytes(lambda: torch.empty(1 << 20, dtype=torch.uint8, device=device), device)
    assert torch.cuda.max_memory_allocated(device) < base + (64 << 20)  # torch's counter was reset...
    assert device_peak_bytes(device) >= peak  # ...the daemon's record of the peak was not


def test_load_bound_covers_loading_and_calibrating() -> None:
    bound = load_bytes_bound("resnet18", 64, from_file=False)
    staged = build_model("resnet18", input_size=64)
    memory = calibrate(staged.prefix(11), 64, torch.float32)
    # The whole model while it is built; then the prefix's weights while calibrating.
    assert bound >= max(model_bytes(staged), memory.weights_bytes + memory.forward_bytes(11, 8))
    assert load_bytes_bound("resnet18", 64, from_file=True) > bound  # a state_dict file is read in beside it


def test_process_memory_readings() -> None:
    rss, peak = process_rss_bytes(), peak_rss_bytes()
    assert 10 << 20 < rss <= peak < machine_memory_bytes()
    assert 0 < default_memory_budget() <= machine_memory_bytes() // 2


@pytest.mark.parametrize("text, value", [
    ("1000000", 1_000_000), ("512M", 512_000_000), ("2GiB", 2 << 30), ("1.5g", 1_500_000_000), ("64 KiB", 65536),
    ("800mb", 800_000_000),
])
def test_parse_size(text: str, value: int) -> None:
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "lots", "-1G", "2XB"])
def test_parse_size_refuses_nonsense(text: str) -> None:
    with pytest.raises(ValueError, match="not a size"):
        parse_size(text)


def test_a_measure_of_device_memory_never_overlaps_a_forward_pass() -> None:
    """Passes on one device overlap each other; a measure waits for those running, and
    passes arriving meanwhile wait for it (the lock is plain Python: no GPU needed)."""
    device = torch.device("cuda", 7)
    events: list[str] = []
    first_in, release_first = threading.Event(), threading.Event()

    def first_pass() -> None:
        with device_work(device):
            events.append("pass 1 in")
            first_in.set()
            release_first.wait(5)
            events.append("pass 1 out")

    def measure() -> None:
        with _device_lock(device).alone():
            events.append("measure")

    def later_pass() -> None:
        with device_work(device):
            events.append("pass 2")

    threads = [threading.Thread(target=first_pass)]
    threads[0].start()
    first_in.wait(5)
    with device_work(device):  # passes share the device
        events.append("pass 0")
    threads.append(threading.Thread(target=measure))
    threads[1].start()
    deadline = time.monotonic() + 5
    while not _device_lock(device)._measures_waiting and time.monotonic() < deadline:
        time.sleep(0.01)
    threads.append(threading.Thread(target=later_pass))
    threads[2].start()
    time.sleep(0.2)
    assert events == ["pass 1 in", "pass 0"]  # the measure waits for pass 1, pass 2 for the measure
    release_first.set()
    for thread in threads:
        thread.join(5)
    assert events == ["pass 1 in", "pass 0", "pass 1 out", "measure", "pass 2"]


def test_device_work_frees_what_a_failed_pass_held_before_it_ends() -> None:
    held: list[weakref.ref] = []

    def failing_pass() -> None:
        activations = torch.empty(1024)
        held.append(weakref.ref(activations))
        raise RuntimeError("out of memory")

    with pytest.raises(RuntimeError) as failure:
        with device_work(torch.device("cuda", 7)):
            failing_pass()
    assert failure.value.__traceback__ is not None and held[0]() is None  # the error lives on, the tensor does not


PASSES_PROGRAM = """
import resource, sys, torch
from storage_side import memory
policy = sys.argv[1]
if policy == "keep":
    assert memory.keep_freed_memory_within(slack=256 << 20, arenas=2)
else:
    assert memory.return_freed_memory_promptly()
torch.set_num_threads(1)
stages = torch.nn.Sequential(*[torch.nn.Conv2d(16, 16, 3, padding=1) for _ in range(4)]).eval()
x = torch.randn(8, 16, 96, 96)  # 4.7 MB activations
with torch.inference_mode():
    stages(x)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(5):
        stages(x)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")
def test_kept_freed_memory_serves_the_next_passes_without_faulting_pages_in_again() -> None:
    """Activations returned on free fault in again, zeroed, on every pass; kept within the
    slack, the next pass reuses them."""
    faults = {policy: int(subprocess.run([sys.executable, "-c", PASSES_PROGRAM, policy], check=True,
                                         capture_output=True, text=True).stdout)
              for policy in ("prompt", "keep")}
    pages_per_pass = 8 * 16 * 96 * 96 * 4 // 4096
    assert faults["prompt"] > 5 * pages_per_pass  # every pass's activations, page by page
    assert faults["keep"] * 10 < faults["prompt"]  # (here: 0 to one activation's pages, against ~69,000)


KEPT_PROGRAM = """
from storage_side import memory
assert memory.keep_freed_memory_within(slack=16 << 20, arenas=1)
baseline = memory.process_rss_bytes()
blocks = [bytearray(8 << 20) for _ in range(20)]  # heap blocks, each below the mmap threshold
del blocks[:-1]  # freed below a live one: the arena cannot return them from its top
kept = memory.KeptMemory(baseline, slack=16 << 20)
held = memory.process_rss_bytes() - baseline
assert not kept.check(reserved=held)  # a request's reservation covers them: nothing to give back
trimmed = kept.check(reserved=0)
print(held >> 20, (memory.process_rss_bytes() - baseline) >> 20, trimmed)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim: Linux only")
def test_freed_memory_kept_beyond_the_slack_goes_back_once_no_reservation_covers_it() -> None:
    held_mb, after_mb, trimmed = subprocess.run([sys.executable, "-c", KEPT_PROGRAM], check=True,
                                                capture_output=True, text=True).stdout.split()
    assert int(held_mb) >= 150 and trimmed == "True"
    assert int(after_mb) <= 16 + 8 + 4  # the slack, the live block, and the interpreter's own churn
