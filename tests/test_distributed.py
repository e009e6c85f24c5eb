"""One job on many ranks: ``torchrun -m hapi.train`` trains what one process trains."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from compute_side.distributed import World, join, rank_slice, with_world_batch_norm
from hapi.data import DataConfig, Pipeline
from hapi.datasets import load_manifest
from hapi.store import open_store
from hapi.train import read_ledger

# 7 samples a class, 10 classes: batches of 23 leave a last batch of 1, which gives rank 1
# an empty slice (it must still step).
RUN = ["--model", "resnet50", "--image-size", "64", "--batch-size", "23", "--epochs", "2", "--request-size", "4",
       "--train-per-class", "7", "--val-per-class", "3"]


def _train(tmp_path: Path, ranks: int) -> Path:
    run_dir = tmp_path / f"ranks{ranks}"
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
                if ranks > 1 else [sys.executable])
    done = subprocess.run([*launcher, "-m", "hapi.train", *RUN, "--cache-dir", str(tmp_path / "cache"),
                           "--output-dir", str(run_dir)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return run_dir


def _steps(path: Path) -> list[dict]:
    return [record for record in map(json.loads, path.read_text().splitlines()) if "step" in record]


def test_two_ranks_train_the_head_one_rank_trains_each_sample_once_at_one_split_per_step(tmp_path) -> None:
    one, two = _train(tmp_path, 1), _train(tmp_path, 2)

    head = torch.load(one / "checkpoint.pt", weights_only=True)["trainer"]["trainable"]
    ranked = torch.load(two / "checkpoint.pt", weights_only=True)["trainer"]["trainable"]
    assert head.keys() == ranked.keys()
    for name in head:  # the same head, to float tolerance (sums in another order)
        torch.testing.assert_close(ranked[name], head[name], rtol=1e-4, atol=1e-4)

    manifest = load_manifest(open_store((tmp_path / "cache" / "datasets" / "synthetic-7x3").as_uri()))
    train_keys = sorted(s.key for s in manifest.split("train"))
    ledgers = [read_ledger(two / f"metrics.rank{rank}.jsonl") for rank in (0, 1)]
    for epoch in (0, 1):
        assert sorted(ledgers[0][epoch] + ledgers[1][epoch]) == train_keys  # every sample once, over the ranks

    steps = [_steps(two / f"metrics.rank{rank}.jsonl") for rank in (0, 1)]
    assert len(steps[0]) == len(steps[1]) == 2 * 4  # the same steps on each rank, an empty one included
    assert steps[1][3]["samples"] == 0 and steps[0][3]["samples"] == 1
    # Rank 0 planned; every step that fetched ran at one split on both ranks.
    assert all(a["split"] == b["split"] for a, b in zip(*steps) if a["samples"] and b["samples"] and a["requests"]
               and b["requests"])


def test_a_rank_s_slice_is_its_contiguous_share_and_the_slices_make_the_batch() -> None:
    batch = list(range(7))
    slices = [rank_slice(batch, World(rank, 3, store=None)) for rank in range(3)]
    assert slices == [[0, 1, 2], [3, 4], [5, 6]]
    assert [rank_slice([0], World(rank, 2, store=None)) for rank in (0, 1)] == [[0], []]
    assert rank_slice(batch, None) == batch


def _batch_norm_rank(rank: int, init: str, x: torch.Tensor, results: dict) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    torch.manual_seed(0)
    norm = with_world_batch_norm(torch.nn.Sequential(torch.nn.BatchNorm2d(3))).train()
    piece = x[:5] if rank == 0 else x[5:]  # uneven slices, as a last batch has
    piece = piece.clone().requires_grad_(True)
    (norm(piece) * torch.arange(3.0).view(1, 3, 1, 1)).sum().backward()
    results[rank] = (norm(piece.detach()).detach(), piece.grad, norm[0].running_var.clone())
    dist.destroy_process_group()


def test_world_batch_norm_is_batch_norm_over_the_global_batch_forward_and_backward(tmp_path) -> None:
    x = torch.randn(8, 3, 4, 4) * 3 + 100  # a mean that dwarfs the spread, as random features have
    results = mp.Manager().dict()
    mp.spawn(_batch_norm_rank, args=(f"file://{tmp_path / 'rendezvous'}", x, results), nprocs=2)

    reference = torch.nn.BatchNorm2d(3).train()
    whole = x.clone().requires_grad_(True)
    (reference(whole) * torch.arange(3.0).view(1, 3, 1, 1)).sum().backward()
    expected = reference(x)  # a second training step, as each rank took
    torch.testing.assert_close(torch.cat([results[0][0], results[1][0]]), expected.detach(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(torch.cat([results[0][1], results[1][1]]), whole.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(results[0][2], reference.running_var, rtol=1e-5, atol=1e-5)


def test_a_plain_run_joins_no_group(monkeypatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert join("cpu") is None


def test_a_global_batch_smaller_than_the_world_is_refused(tmp_path) -> None:
    with pytest.raises(ValueError, match="--batch-size 2 is smaller than the 4 ranks"):
        Pipeline(DataConfig(model="resnet18", batch_size=2, cache_dir=tmp_path), World(0, 4, store=None))
