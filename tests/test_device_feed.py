"""compute_side/device_feed.py: batches reach the device unchanged, one step ahead; the CPU is untouched."""

import pytest
import torch

from compute_side.device_feed import _copy_stream, to_device
from compute_side.loader import Batch

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this host")


def _batches(n: int, device: str = "cpu") -> list[Batch]:
    return [Batch(features=torch.randn(4, 3, 8, 8, device=device), labels=torch.arange(4) + i,
                  keys=tuple(f"k{i}-{j}" for j in range(4)), split=0, dtype="float32", wire_bytes=4 * 768,
                  raw_bytes=0, requests=1, wait_s=0.0, elapsed_ms=1.0) for i in range(n)]


def test_on_the_cpu_the_batches_pass_through_untouched() -> None:
    batches = _batches(3)
    fed = list(to_device(iter(batches), "cpu"))
    assert len(fed) == 3 and all(a is b for a, b in zip(fed, batches, strict=True))


def test_nothing_in_nothing_out() -> None:
    assert list(to_device([], "cpu")) == []


@CUDA
@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_on_a_gpu_every_batch_arrives_whole_in_order_on_the_device(device: str) -> None:
    batches = _batches(5)
    seen = []
    for batch, original in zip(to_device(iter(batches), device), batches, strict=True):
        assert batch.features.is_cuda and batch.labels.is_cuda
        # A step on the compute stream reads it while the next batch's copy is in flight.
        seen.append((batch.features * 2).sum().item())
        assert torch.equal(batch.features.cpu(), original.features)
        assert torch.equal(batch.labels.cpu(), original.labels)
        assert batch.keys == original.keys and batch.wire_bytes == original.wire_bytes
    assert seen == pytest.approx([(b.features * 2).sum().item() for b in batches], rel=1e-5)


@CUDA
def test_features_already_on_the_gpu_are_not_copied() -> None:
    batches = _batches(2, device="cuda")
    fed = list(to_device(iter(batches), "cuda"))
    assert all(a.features is b.features for a, b in zip(fed, batches, strict=True))
    assert all(b.labels.is_cuda for b in fed)


@CUDA
def test_every_pass_copies_on_the_same_side_stream() -> None:
    # A stream per pass would strand the caching allocator's blocks of the old ones.
    streams = []
    for _ in range(2):
        for batch in to_device(iter(_batches(2)), "cuda"):
            streams.append(_copy_stream(batch.features.device))
    assert all(s is streams[0] for s in streams) and streams[0] != torch.cuda.current_stream()
