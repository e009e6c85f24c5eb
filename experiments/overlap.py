"""Overlap benchmark: iteration time without and with requests in flight, side by side.

The storage daemon is pinned to core 0 and the trainer to core 1 (two emulated hosts on
loopback), one torch thread each. Measured in one run, interleaved per round:

- storage alone: a batch's requests served back to back, nothing training;
- compute alone: the trainer's step on features already in memory;
- training with the pipelined loader at each depth (0 = no overlap).

Pipeline efficiency = max(storage alone, compute alone) / measured iteration time; 1.0
means the iteration costs only its slowest stage.

    python -m experiments.overlap [--model resnet18 --split 6 --image-size 112 ...]
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from compute_side.client import StorageClient
from compute_side.daemon_process import local_daemon
from compute_side.loader import PipelinedLoader, batches_of
from compute_side.sources import PushdownSource
from compute_side.trainer import HeadTrainer, TrainConfig
from hapi.datasets import make_synthetic
from hapi.models import build_model
from hapi.store import FileStore
from hapi.transforms import TransformSpec
from hapi.wire import ExtractRequest

RESULTS = Path(__file__).parent / "results" / "overlap"


def per_iteration(loader: PipelinedLoader, batches: list, trainer: HeadTrainer | None, warmup: int) -> float:
    """Seconds per iteration after ``warmup`` iterations (trainer None: fetch only)."""
    started = None
    for i, batch in enumerate(loader.epoch(batches, epoch=0)):
        if trainer is not None:
            trainer.train_step(batch.features, batch.labels, batch.split)
        if i == warmup - 1:  # the clock covers waiting for and training each timed batch
            started = time.perf_counter()
    return (time.perf_counter() - started) / (len(batches) - warmup)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="resnet18")
    p.add_argument("--split", type=int, default=6, help="stages pushed down (balance the two tiers)")
    p.add_argument("--image-size", type=int, default=112)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--request-size", type=int, default=16)
    p.add_argument("--iterations", type=int, default=10, help="per measurement, after 2 warm-up iterations")
    p.add_argument("--depths", default="0,1,2,4,8")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="64 px, 4 iterations, 1 round, depths 0 and 2")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    if args.quick:
        args.image_size, args.iterations, args.rounds, args.depths = 64, 4, 1, "0,2"
    depths = [int(d) for d in args.depths.split(",")]
    warmup = 2

    # The compute host; the daemon gets core 0 (on a one-core machine both share it).
    cores = sorted(os.sched_getaffinity(0))
    storage_core, compute_core = cores[0], cores[-1]
    os.sched_setaffinity(0, {compute_core})
    torch.set_num_threads(1)
    model = build_model(args.model, input_size=args.image_size)
    model.replace_head(10)
    trainer = HeadTrainer(model, TrainConfig())
    transform = TransformSpec(crop_size=args.image_size, resize_size=round(args.image_size * 256 / 224))
    template = ExtractRequest(keys=(), model=args.model, split=args.split, transform=transform)

    with tempfile.TemporaryDirectory() as tmp:
        n = args.batch_size * (args.iterations + warmup)
        samples = make_synthetic(FileStore(Path(tmp) / "data"), -(-n // 10), 0).split("train")[:n]
        batches = batches_of(samples, args.batch_size)
        with local_daemon(Path(tmp, "data").as_uri(), Path(tmp) / "daemon.log", ("--torch-threads", "1"),
                          cpus={storage_core}) as url:
            source = PushdownSource([StorageClient(url)], template)
            source.fetch(samples[:2], epoch=0)  # load the prefix before timing anything
            cached = list(PipelinedLoader(source, args.request_size, depth=0).epoch(batches, epoch=0))
            wire_kb = sum(b.wire_bytes for b in cached) / len(samples) / 1e3
            rows: dict[str, list[float]] = {"storage alone": [], "compute alone": []}
            rows.update({f"depth {d}": [] for d in depths})
            for _ in range(args.rounds):
                rows["storage alone"].append(
                    per_iteration(PipelinedLoader(source, args.request_size, 0), batches, None, warmup))
                started = time.perf_counter()
                for batch in cached[warmup:]:
                    trainer.train_step(batch.features, batch.labels, batch.split)
                rows["compute alone"].append((time.perf_counter() - started) / (len(cached) - warmup))
                for d in depths:
                    rows[f"depth {d}"].append(
                        per_iteration(PipelinedLoader(source, args.request_size, d), batches, trainer, warmup))

    median = {name: statistics.median(v) for name, v in rows.items()}
    slowest = max(median["storage alone"], median["compute alone"])
    table = [{"measurement": name, "ms_per_iteration": round(t * 1e3, 1),
              "efficiency": round(slowest / t, 3) if name.startswith("depth") else "",
              "speedup_vs_depth0": round(median["depth 0"] / t, 2) if name.startswith("depth") else ""}
             for name, t in median.items()]
    args.out.mkdir(parents=True, exist_ok=True)
    name = f"overlap-{args.model}-split{args.split}-request{args.request_size}.csv"
    with open(args.out / name, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(table[0]))
        writer.writeheader()
        writer.writerows(table)
    print(f"{args.model} split {args.split} ({model.stage_names[args.split - 1]}), {args.image_size} px, "
          f"batch {args.batch_size}, {args.request_size} samples/request, {wire_kb:.0f} KB/sample on the wire; "
          f"median of {args.rounds} rounds x {args.iterations} iterations; storage on core 0, compute on core 1")
    print(f"{'measurement':16s} {'ms/iter':>9s} {'efficiency':>11s} {'vs depth 0':>11s}")
    for r in table:
        print(f"{r['measurement']:16s} {r['ms_per_iteration']:9.1f} {str(r['efficiency']):>11s} "
              f"{str(r['speedup_vs_depth0']):>11s}")


if __name__ == "__main__":
    main()
