"""Batches onto the training device one step ahead: the copy of batch i+1 overlaps step i.

On a CUDA device each batch's features are staged in pinned (page-locked) host memory,
the only memory a copy to the GPU can read while the host goes on, and copied on a side
stream with ``non_blocking=True`` as soon as the previous batch is handed out; the
compute stream waits for that copy (``wait_stream``) before it may read the batch, and
the tensor is marked as used by the compute stream (``record_stream``) so the caching
allocator does not hand its memory to another copy while a step still reads it. The
labels travel the same way. Features already on the device (decoded there by nvJPEG)
are handed on as they are. On the CPU the batches pass through unchanged.

On CUDA a batch is handed out only once the next one has come from ``batches`` (or
``batches`` has ended): one batch of lookahead, whatever the loader's own ``depth``, so
with ``--depth 0`` too the loader fetches batch i+1 before step i runs. One side stream
per device serves every pass (every call of ``to_device``): the caching allocator keeps
freed blocks per stream, so a new stream per pass would strand the blocks of the old ones.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from dataclasses import replace

import torch

from compute_side.loader import Batch

# The side stream of each CUDA device, made on its first pass.
_copy_streams: dict[torch.device, torch.cuda.Stream] = {}
_copy_streams_lock = threading.Lock()


def to_device(batches: Iterable[Batch], device: torch.device | str) -> Iterator[Batch]:
    """``batches`` with features and labels on ``device``, each copied while the previous one
    trains; on CUDA each is handed out once the next has been taken from ``batches``."""
    device = torch.device(device)
    if device.type != "cuda":
        yield from batches
        return
    if device.index is None:  # a tensor's device always has its index: compare like with like
        device = torch.device("cuda", torch.cuda.current_device())
    copies = _copy_stream(device)
    pending: tuple[Batch, torch.cuda.Event] | None = None
    for batch in batches:
        staged = _start_copy(batch, device, copies)
        if pending is not None:
            yield _ready(*pending, device)
        pending = staged
    if pending is not None:
        yield _ready(*pending, device)


def _copy_stream(device: torch.device) -> torch.cuda.Stream:
    with _copy_streams_lock:
        if device not in _copy_streams:
            _copy_streams[device] = torch.cuda.Stream(device)
        return _copy_streams[device]


def _start_copy(batch: Batch, device: torch.device, copies: torch.cuda.Stream) -> tuple[Batch, torch.cuda.Event]:
    """Queue the batch's copy to ``device`` on the ``copies`` stream; the event marks its end."""
    # The copy must not start before the compute stream has made whatever it reads (features
    # decoded on the GPU, or a pinned buffer still being filled by work queued there).
    copies.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(copies):
        features = _copy(batch.features, device)
        labels = _copy(batch.labels, device)
        done = torch.cuda.Event()
        done.record(copies)
    return replace(batch, features=features, labels=labels), done


def _copy(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    if tensor.device == device:
        return tensor
    # Pinning is itself a host copy, but one the copy engine can then read asynchronously.
    source = tensor if tensor.is_pinned() else tensor.pin_memory()
    return source.to(device, non_blocking=True)


def _ready(batch: Batch, done: torch.cuda.Event, device: torch.device) -> Batch:
    """The batch, once the compute stream waits for its copy; its memory is the compute stream's from now on."""
    compute = torch.cuda.current_stream(device)
    compute.wait_event(done)
    for tensor in (batch.features, batch.labels):
        tensor.record_stream(compute)
    return batch
