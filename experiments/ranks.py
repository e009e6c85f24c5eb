"""One job on 1 rank and on N ranks (``torchrun``), side by side: samples/s, the ledger, the head.

One storage daemon serves every run (started here on the embedded synthetic set), so the
runs differ only in their ranks. The runs alternate, 1 rank then N, for ``--repeats``
rounds, so a drift of the machine's speed falls on both. For each N-rank run the script
checks, from the run's own files, that every training sample was trained once per epoch
over the ranks (``metrics.rank<R>.jsonl``) and how far its head is from the 1-rank run's
of the same round (the largest absolute difference of any weight).

    python -m experiments.ranks [--ranks 2] [--model resnet50] [--split freeze] [--repeats 2]
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from compute_side.daemon_process import local_daemon
from hapi.datasets import load_manifest, make_synthetic
from hapi.store import FileStore
from hapi.train import read_ledger

RESULTS = Path(__file__).parent / "results" / "ranks"


def run(ranks: int, args: argparse.Namespace, store_url: str, node: str, out: Path) -> tuple[float, float]:
    """(wall seconds of one whole ``hapi.train`` command on ``ranks`` ranks, its samples/s while training)."""
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
                if ranks > 1 else [sys.executable])
    command = [*launcher, "-m", "hapi.train", "--model", args.model, "--image-size", str(args.image_size),
               "--batch-size", str(args.batch_size), "--epochs", str(args.epochs), "--split", args.split,
               "--store", store_url, "--storage-node", node, "--output-dir", str(out),
               "--cache-dir", str(out.parent / "cache")]
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
    if done.returncode:
        raise SystemExit(f"{ranks}-rank run failed:\n{done.stderr[-2000:]}")
    seconds = time.perf_counter() - started
    rate = float(re.search(r"([\d.]+) samples/s; waiting", done.stdout).group(1))
    print(f"{ranks} rank(s): {seconds:.1f} s, {rate:.1f} samples/s while training", flush=True)
    return seconds, rate


def head_difference(one: Path, many: Path) -> float:
    a = torch.load(one / "checkpoint.pt", weights_only=True)["trainer"]["trainable"]
    b = torch.load(many / "checkpoint.pt", weights_only=True)["trainer"]["trainable"]
    return max((a[name].double() - b[name].double()).abs().max().item() for name in a)


def every_sample_once(run_dir: Path, ranks: int, keys: list[str], epochs: int) -> bool:
    ledgers = [read_ledger(run_dir / f"metrics.rank{rank}.jsonl") for rank in range(ranks)]
    return all(sorted(k for ledger in ledgers for k in ledger.get(epoch, [])) == keys for epoch in range(epochs))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--model", default="resnet50")
    p.add_argument("--image-size", type=int, default=112)
    p.add_argument("--batch-size", type=int, default=32, help="the global batch")
    p.add_argument("--split", default="freeze")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--per-class", type=int, default=32, help="training samples per class (10 classes)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per run at most")
    args = p.parse_args()

    with tempfile.TemporaryDirectory(prefix="hapi-ranks-") as tmp:
        root = Path(tmp)
        store = FileStore(root / "data")
        make_synthetic(store, args.per_class, 4)
        keys = sorted(s.key for s in load_manifest(store).split("train"))
        rows = []
        with local_daemon(store.url, root / "daemon.log") as node:
            for repeat in range(args.repeats):
                one_dir, many_dir = root / f"r{repeat}-1", root / f"r{repeat}-{args.ranks}"
                one = run(1, args, store.url, node, one_dir)
                many = run(args.ranks, args, store.url, node, many_dir)
                rows.append((one, many, every_sample_once(many_dir, args.ranks, keys, args.epochs),
                             head_difference(one_dir, many_dir)))
    samples = len(keys) * args.epochs
    lines = [f"{args.model} at {args.image_size} px, --split {args.split}, global batch {args.batch_size}, "
             f"{samples} training samples; one daemon for all runs",
             f"| round | 1 rank: command s | training samples/s | {args.ranks} ranks: command s | training samples/s "
             "| command ratio | training ratio | every sample once | head max diff |",
             "|---|---|---|---|---|---|---|---|---|"]
    for i, ((one, one_rate), (many, many_rate), once, diff) in enumerate(rows):
        lines.append(f"| {i + 1} | {one:.1f} | {one_rate:.1f} | {many:.1f} | {many_rate:.1f} | {one / many:.2f} | "
                     f"{many_rate / one_rate:.2f} | {'yes' if once else 'NO'} | {diff:.1e} |")
    whole = statistics.median(one[0] / many[0] for one, many, _, _ in rows)
    training = statistics.median(many[1] / one[1] for one, many, _, _ in rows)
    lines.append(f"\n{args.ranks} ranks / 1 rank, median over {len(rows)} rounds: whole command {whole:.2f}x "
                 f"as fast, training {training:.2f}x the samples/s")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.model}-{args.ranks}ranks.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
