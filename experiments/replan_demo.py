"""Re-planning demonstration: the link is re-shaped in the middle of a run and the split follows.

Two emulated hosts (Swift + storage daemon on one core, the trainer on the other). The
run starts on a fast link; after ``--change-after`` training steps the link is throttled.
The trainer (``python -m hapi.train --split auto``) measures the link from its own
replies, and its planner moves to another split, at a batch boundary, when the move pays
over the rest of the run. The script then checks from the run's metrics that every
training sample was trained exactly once per epoch, and prints the timeline and the
planner's switches.

    sudo python -m experiments.replan_demo [--start-mbit 400 --end-mbit 4 --change-after 10] [--quick]
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import torch

from experiments import twohosts
from hapi.train import cli as train_cli

RESULTS = Path(__file__).parent / "results" / "replan"


def steps(metrics: Path) -> list[dict]:
    if not metrics.exists():
        return []
    return [r for r in map(json.loads, metrics.read_text().splitlines()) if "step" in r]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="resnet18")
    p.add_argument("--image-size", type=int, default=112)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--train-per-class", type=int, default=48)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--start-mbit", type=float, default=400)
    p.add_argument("--end-mbit", type=float, default=4)
    p.add_argument("--change-after", type=int, default=10, help="training steps before the link is throttled")
    p.add_argument("--quick", action="store_true", help="64 px, 240 samples (15 steps), throttled after 4 steps")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    if args.quick:
        args.image_size, args.train_per_class = 64, 24
        args.change_after = min(args.change_after, 4)  # most of the short run on the throttled link
    reason = twohosts.available()
    if reason:
        print(f"cannot emulate two hosts here: {reason}", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp, twohosts.TwoHosts() as hosts:
        work = Path(tmp)
        storage = hosts.start_storage_host(work, "demo", args.train_per_class, 2)
        hosts.shape(args.start_mbit)
        metrics = work / "run" / "metrics.jsonl"
        changed_at: list[int] = []

        def throttle() -> None:
            while len(steps(metrics)) < args.change_after and not done.is_set():
                time.sleep(0.2)
            if not done.is_set():
                hosts.shape(args.end_mbit)
                changed_at.append(len(steps(metrics)))
                print(f"link re-shaped: {args.start_mbit:g} -> {args.end_mbit:g} Mbit/s after step "
                      f"{changed_at[0]}", flush=True)

        done = threading.Event()
        watcher = threading.Thread(target=throttle, daemon=True)
        watcher.start()
        try:
            code = train_cli(["--model", args.model, "--image-size", str(args.image_size), "--batch-size",
                              str(args.batch_size), "--epochs", str(args.epochs), "--store", storage.store.url,
                              "--endpoint-url", storage.swift.endpoint_url, "--storage-node", storage.node,
                              "--split", "auto", "--explain", "--output-dir", str(work / "run"),
                              "--cache-dir", str(work)])
        finally:
            done.set()
            watcher.join()
        if code:
            return code
        train_keys = Counter(s.key for s in storage.manifest.split("train"))
        records = steps(metrics)
        switches = [r["switch"] for r in map(json.loads, metrics.read_text().splitlines()) if "switch" in r]

    exactly_once = all(Counter(k for r in records if r["epoch"] == e for k in r["keys"]) == train_keys
                       for e in range(args.epochs))
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "timeline.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["epoch", "step", "split", "kb_per_sample", "wait_s", "compute_s", "link_mbit"])
        for r in records:
            link = args.end_mbit if changed_at and (r["epoch"], r["step"]) >= (0, changed_at[0]) else args.start_mbit
            writer.writerow([r["epoch"], r["step"], r["split"], round(r["wire_bytes"] / r["samples"] / 1e3, 1),
                             round(r["wait_s"], 3), round(r["compute_s"], 3), link])
    print("\nstep  split  KB/sample  wait s   (split -1: all-in-compute, raw objects)")
    for r in records:
        print(f"{r['step']:4d}  {r['split']:5d}  {r['wire_bytes'] / r['samples'] / 1e3:9.1f}  {r['wait_s']:6.2f}")
    for c in switches:
        print(f"switch from sample {c['at_sample']} on: split {c['split']} {c['dtype']} ({c['why']})")
    print(f"every training sample trained exactly once per epoch: {exactly_once}")
    return 0 if exactly_once else 1


if __name__ == "__main__":
    sys.exit(main())
