"""Two candidate splits timed alternately on two emulated hosts: each one's windows, and the
ratio of each adjacent pair.

The machine's speed drifts by tens of percent within a minute; a ratio of adjacent windows
cancels most of it, which absolute times taken a minute apart cannot. This is the evidence
behind the split sweep's bracketed verdict, and a way to check a case it called.

    sudo python -m experiments.paired_windows --model alexnet --bandwidth 100 --splits 3,9 \
        --pairs 6 --iterations 25
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from compute_side.client import StorageClient
from compute_side.sources import Sources
from compute_side.trainer import HeadTrainer, TrainConfig
from experiments import twohosts
from experiments.windows import window_ms
from hapi.models import build_model
from hapi.train import DEFAULT_DEPTH
from hapi.transforms import TransformSpec
from hapi.wire import ExtractRequest


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="alexnet")
    p.add_argument("--bandwidth", type=float, default=100.0, help="Mbit/s of the shaped link")
    p.add_argument("--splits", default="3,9", help="the two splits (-1: all-in-compute)")
    p.add_argument("--pairs", type=int, default=6)
    p.add_argument("--iterations", type=int, default=25, help="timed iterations per window")
    p.add_argument("--image-size", type=int, default=112)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--samples", type=int, default=144, help="distinct samples, cycled as needed")
    p.add_argument("--quick", action="store_true", help="2 pairs of 2-iteration windows at 64 px")
    args = p.parse_args()
    if args.quick:
        args.pairs, args.iterations, args.image_size, args.samples = 2, 2, 64, 40
    logging.basicConfig(level=logging.WARNING)
    reason = twohosts.available()
    if reason:
        print(f"cannot emulate two hosts here: {reason}", file=sys.stderr)
        return 2
    first, second = (int(s) for s in args.splits.split(","))
    torch.set_num_threads(1)  # one core per host
    windows: dict[int, list[float]] = {first: [], second: []}
    with tempfile.TemporaryDirectory() as tmp, twohosts.TwoHosts() as hosts:
        storage = hosts.start_storage_host(Path(tmp), "paired", train_per_class=-(-args.samples // 10),
                                           daemon_args=("--torch-threads", "1"))
        samples = list(storage.manifest.split("train")[: args.samples])
        hosts.shape(args.bandwidth)
        model = build_model(args.model, input_size=args.image_size)
        model.replace_head(10)
        trainer = HeadTrainer(model, TrainConfig())
        transform = TransformSpec(crop_size=args.image_size, resize_size=round(args.image_size * 256 / 224))
        template = ExtractRequest(keys=(), model=args.model, split=0, transform=transform, job_id="paired")
        sources = Sources([StorageClient(storage.node)], storage.store, template, transform)
        for pair in range(args.pairs):
            for split in (first, second) if pair % 2 == 0 else (second, first):  # neither always goes first
                ms, _ = window_ms(sources.build(split, "float32")[0],
                                  lambda b: trainer.train_step(b.features, b.labels, b.split), samples,
                                  args.batch_size, args.batch_size, DEFAULT_DEPTH, DEFAULT_DEPTH, args.iterations)
                windows[split].append(ms)
    ratios = [a / b for a, b in zip(windows[first], windows[second])]
    for split, times in windows.items():
        print(f"split {split:3d} ms/iter: {' '.join(f'{t:.0f}' for t in times)}  median {statistics.median(times):.1f}")
    print(f"split {first} / split {second}, pair by pair: {' '.join(f'{r:.3f}' for r in ratios)}  "
          f"median {statistics.median(ratios):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
