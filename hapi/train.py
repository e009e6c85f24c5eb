"""``python -m hapi.train --model resnet50``: train a head on features extracted next to the store.

With no store given, it trains on the embedded default: a synthetic data set in a
``file://`` store under the cache directory, served by a storage daemon it starts on a
loopback port and stops at the end. With ``--store s3://bucket/prefix --endpoint-url URL
--storage-node URL`` it trains against a real deployment. ``--split all-in-compute`` is
the baseline without pushdown: raw objects fetched and run through the whole model here.

It is one user of ``hapi.data``'s ``Pipeline``, as a user's own training loop is: the
pipeline gives the batches, this script trains, validates, checkpoints and reports.

``torchrun --nproc-per-node N -m hapi.train ...`` trains one job on N ranks with
DistributedDataParallel (gloo on the CPU, NCCL on GPUs): each rank trains its slice of
every global batch (``--batch-size``), rank 0 plans the split for all and checkpoints, and
each rank logs its own steps in ``metrics.rank<R>.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from compute_side import deployment, distributed
from compute_side.client import StorageNodeError
from compute_side.distributed import World
from compute_side.feature_cache import parse_size
from compute_side.trainer import OPTIMIZERS, HeadTrainer, TrainConfig
from hapi.data import DEFAULT_DEPTH, DataConfig, Pipeline
from hapi.datasets import DatasetNotFoundError
from hapi.measure import cache_dir
from hapi.models import MODELS, StagedModel
from hapi.planner import ALL_IN_COMPUTE, Plan
from hapi.store import MissingObjectError
from hapi.transforms import CorruptImageError
from hapi.wire import WIRE_DTYPES

log = logging.getLogger("hapi.train")


def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m hapi.train", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="resnet50", help=f"one of {', '.join(MODELS)}")
    p.add_argument("--weights",
                   help="random (seeded), torchvision, package (weights shipped in an installed package), or a "
                        "state_dict file; default: the model's own (package for efficientnet_lite0, else random)")
    p.add_argument("--split", default="auto",
                   help="stages [0, split) run on the storage tier: auto (the planner chooses, and changes "
                        "its choice as the run measures itself), freeze (every frozen stage), all-in-compute "
                        "(no pushdown: raw objects, whole model here), or an index")
    p.add_argument("--explain", action="store_true", help="print the planner's table of candidates at the end")
    p.add_argument("--dtypes", help="wire dtypes the planner may choose, e.g. float32,bfloat16 (default: --dtype)")
    p.add_argument("--refresh-profile", action="store_true", help="measure this host's stage times even if saved")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=32, help="the optimiser's batch, whatever the storage side does")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="sgd")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0, help="shuffling and augmentation")
    p.add_argument("--device", default="auto",
                   help="where this tier trains: auto (cuda when present, else cpu), cpu, cuda or cuda:N")
    p.add_argument("--augment", action="store_true", help="random resized crop + flip, seeded per sample")
    p.add_argument("--image-size", type=int, help="crop size fed to the model (default: the model's)")
    p.add_argument("--dtype", choices=sorted(WIRE_DTYPES), default="float32",
                   help="features on the wire after split 0, which ships its decoded images as uint8 "
                        "(uint8: split 0 alone)")
    p.add_argument("--request-size", type=int, default=32, help="samples per request to a storage node")
    p.add_argument("--depth", type=int, default=DEFAULT_DEPTH,
                   help="requests in flight while the trainer works (0: no overlap)")
    p.add_argument("--feature-cache", type=parse_size, default=DataConfig.feature_cache, metavar="SIZE",
                   help="bytes of features kept in memory for the epochs after the first, e.g. 512M or 2G "
                        "(0: none); not for training features with --augment. Default 2G")
    p.add_argument("--feature-cache-dir", type=Path, metavar="DIR",
                   help="keep the cached features on local disk under DIR as safetensors, where later runs "
                        "find them too (default: in memory, for this run)")
    p.add_argument("--output-dir", type=Path, help="checkpoints and metrics.jsonl (default: CACHE/runs/...)")
    p.add_argument("--resume", type=Path, help="a checkpoint.pt to continue from, mid-epoch too")
    p.add_argument("--checkpoint-every", type=int, default=0, metavar="N",
                   help="also checkpoint every N steps (always at each epoch's end and on SIGTERM)")
    deployment.add_arguments(p, cache_dir())
    p.add_argument("-v", "--verbose", action="store_true")
    return p


@dataclass
class Totals:
    samples: int = 0
    loss_sum: float = 0.0
    correct: int = 0
    wire_bytes: int = 0
    raw_bytes: int = 0
    wait_s: float = 0.0  # waiting for data
    compute_s: float = 0.0  # running the model here
    seconds: float = 0.0

    def add(self, other: Totals) -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))


class MetricsLog:
    """One JSON line per iteration and per epoch, for plots and for the planner.

    Every line carries its ``attempt``: 1 for a fresh run, one more for each later run in
    the same directory (``--resume``).
    Each attempt opens with a header line ``{"attempt": a, "resumed_from": {"epoch": e,
    "batches_done": k} | null}``. A killed attempt's steps after its last checkpoint were
    lost with it and are trained again by the next; ``read_ledger`` counts them once.
    """

    def __init__(self, path: Path, attempt: int, resumed_from: dict | None) -> None:
        self.path = path
        self.attempt = attempt
        self.file = open(path, "a", buffering=1)
        self.write({"resumed_from": resumed_from})

    def write(self, record: dict) -> None:
        self.file.write(json.dumps({"attempt": self.attempt, **record}) + "\n")

    def close(self) -> None:
        self.file.close()


def last_attempt(path: Path) -> int:
    """The highest attempt in a run's metrics so far (lines from before attempts count as 1); 0 if none."""
    if not path.is_file():
        return 0
    return max((json.loads(line).get("attempt", 1) for line in path.read_text().splitlines()), default=0)


def read_ledger(path: Path) -> dict[int, list[str]]:
    """The keys trained in each epoch, in order, over all attempts of a run.

    A header that resumes from (epoch e, k batches done) discards the step lines before it
    at or after step k of epoch e: the killed attempt trained those after its checkpoint,
    so what they did was lost, and the resumed attempt trains them again.
    """
    steps: dict[tuple[int, int], list[str]] = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        resumed = record.get("resumed_from", False)
        if resumed:
            point = (resumed["epoch"], resumed["batches_done"])
            steps = {at: keys for at, keys in steps.items() if at < point}
        elif "step" in record:
            steps[(record["epoch"], record["step"])] = record["keys"]
    ledger: dict[int, list[str]] = {}
    for (epoch, _), keys in sorted(steps.items()):
        ledger.setdefault(epoch, []).extend(keys)
    return ledger


class Stopped(Exception):
    """SIGTERM: the run saved a checkpoint at a step boundary and stops."""


class Checkpoints:
    """Saves ``checkpoint.pt`` at epoch ends, every ``every`` steps, and on SIGTERM.

    A checkpoint holds the epoch to continue and how many of its batches are done: the
    epoch's order comes back from (seed, epoch), so a resumed run trains exactly the
    batches that were not, and the RNG state, so a head with dropout draws the same masks.

    In a job of many ranks, rank 0 saves, and a SIGTERM to any rank stops them all at the
    same step (torchrun sends it to each, and each may see it at a different step).
    """

    def __init__(self, path: Path, setup: dict, trainer: HeadTrainer, every: int, world: World | None = None) -> None:
        self.path, self.setup, self.trainer, self.every, self.world = path, setup, trainer, every, world
        self.terminated = False

    @contextmanager
    def catching_sigterm(self) -> Iterator[None]:
        """While inside, SIGTERM asks for a checkpoint at the next step boundary."""
        def on_sigterm(signum: int, frame: object) -> None:
            self.terminated = True
        previous = signal.signal(signal.SIGTERM, on_sigterm)
        try:
            yield
        finally:
            signal.signal(signal.SIGTERM, previous)

    def step_done(self, epoch: int, batches_done: int, last: bool) -> None:
        """After each step; the epoch's last one is checkpointed with the epoch, after validation."""
        if last:
            return
        terminated = self._terminated()
        if terminated or (self.every and batches_done % self.every == 0):
            self.save(epoch, batches_done)
        if terminated:
            self._stop(epoch, batches_done)

    def stop_if_terminated(self, epoch: int, batches_done: int) -> None:
        if self._terminated():
            self._stop(epoch, batches_done)

    def _terminated(self) -> bool:
        return self.world.any(self.terminated) if self.world is not None else self.terminated

    def _stop(self, epoch: int, batches_done: int) -> None:
        raise Stopped(f"terminated: checkpoint saved after {batches_done} batches of epoch {epoch + 1}; "
                      f"continue with --resume {self.path}")

    def save(self, epoch: int, batches_done: int) -> None:
        if self.world is not None and not self.world.leader:
            return
        state = {"epoch": epoch, "batches_done": batches_done, "setup": self.setup,
                 "trainer": self.trainer.state_dict(), "rng": torch.get_rng_state()}
        # Written aside and renamed: a kill mid-save leaves the previous checkpoint whole.
        partial = self.path.with_suffix(".partial")
        torch.save(state, partial)
        os.replace(partial, self.path)


def train_one_epoch(trainer: HeadTrainer, data: Pipeline, epoch: int, args: argparse.Namespace, metrics: MetricsLog,
                    moves: Moves, checkpoints: Checkpoints | None = None, done: int = 0) -> Totals:
    """Trains the epoch's batches after the first ``done`` (trained by an earlier attempt);
    the totals count this attempt's steps only."""
    samples, world = data.train_samples, data.world
    batches = -(-len(samples) // args.batch_size)
    totals = Totals()
    started = time.perf_counter()
    with tqdm(total=len(samples), initial=min(done * args.batch_size, len(samples)),
              desc=f"epoch {epoch + 1}/{args.epochs}", unit="img", leave=False,
              disable=world is not None and not world.leader) as bar:
        for step, batch in enumerate(data.train(epoch, done), start=done):
            step_started = time.perf_counter()
            loss = trainer.train_step(batch.features, batch.labels, batch.split,
                                      data.batch_samples(step) if world else 0)
            compute_s = time.perf_counter() - step_started
            n = len(batch.keys)
            totals.add(Totals(n, loss * n, 0, batch.wire_bytes, batch.raw_bytes, batch.wait_s, compute_s))
            metrics.write({"epoch": epoch, "step": step, "samples": n, "split": batch.split, "dtype": batch.dtype,
                           "loss": loss, "wait_s": batch.wait_s, "compute_s": compute_s,
                           "wire_bytes": batch.wire_bytes, "raw_bytes": batch.raw_bytes, "requests": batch.requests,
                           "elapsed_ms": batch.elapsed_ms, "source_ms": batch.timings, "keys": batch.keys})
            moves.announce()
            bar.update(data.batch_samples(step))
            bar.set_postfix(loss=f"{loss:.3f}")
            if checkpoints is not None:
                checkpoints.step_done(epoch, step + 1, last=step + 1 == batches)
    totals.seconds = time.perf_counter() - started
    return totals


def evaluate(trainer: HeadTrainer, data: Pipeline, moves: Moves) -> Totals:
    totals = Totals()
    started = time.perf_counter()
    with tqdm(total=len(data.val_samples), desc="validate", unit="img", leave=False,
              disable=data.world is not None and not data.world.leader) as bar:
        for batch in data.validation():
            loss_sum, correct = trainer.evaluate_batch(batch.features, batch.labels, batch.split)
            totals.add(Totals(len(batch.keys), loss_sum, correct, batch.wire_bytes, batch.raw_bytes, batch.wait_s))
            moves.announce()
            bar.update(len(batch.keys))
    totals.seconds = time.perf_counter() - started
    return totals


class Moves:
    """Writes each of the planner's moves once, to the console and the metrics log, as the
    run trains and validates."""

    def __init__(self, data: Pipeline, metrics: MetricsLog) -> None:
        self.data, self.metrics, self.announced = data, metrics, 0

    def announce(self) -> None:
        if self.data.planner is None:
            return
        for sent, plan, why in self.data.planner.switches[self.announced:]:
            tqdm.write(f"planner: from sample {sent} on, {describe_plan(self.data.model, plan)} ({why})")
            self.metrics.write({"switch": {"at_sample": sent, "why": why, "plan": plan.label,
                                           "parts": [asdict(c) for c in plan.parts], "shares": plan.shares}})
        self.announced = len(self.data.planner.switches)


def job_totals(totals: Totals, world: World | None) -> Totals:
    """The whole job's totals from each rank's: sums, over the slowest rank's seconds."""
    if world is None:
        return totals
    summed = Totals(*world.sum([getattr(totals, name) for name in Totals.__dataclass_fields__]))
    summed.samples, summed.correct = int(summed.samples), int(summed.correct)
    summed.seconds = world.max(totals.seconds)
    return summed


def load_checkpoint(path: Path, expected: dict) -> dict:
    """A checkpoint saved by this script, refusing one from a different run setup."""
    if not path.is_file():
        raise ValueError(f"--resume {path}: no such checkpoint")
    checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    for name, value in expected.items():
        if checkpoint["setup"].get(name) != value:
            raise ValueError(f"--resume {path}: checkpoint has {name}={checkpoint['setup'].get(name)!r}, "
                             f"this run {value!r}")
    return checkpoint


def main(args: argparse.Namespace) -> int:
    args.device = resolve_device(args.device)  # checked before anything is built or read
    world = distributed.join(args.device)
    try:
        code = run_job(args, world)
    except BaseException:
        distributed.leave(world, together=False)
        raise
    distributed.leave(world)
    return code


def run_job(args: argparse.Namespace, world: World | None) -> int:
    if world is not None and args.device.startswith("cuda"):
        args.device = f"cuda:{torch.cuda.current_device()}"  # this rank's own GPU
    say = print if world is None or world.leader else (lambda *_: None)
    data = Pipeline(DataConfig.from_args(args), world)  # the model with its new head, the data set; nothing started
    model, manifest = data.model, data.manifest
    trainer = HeadTrainer(model, TrainConfig(optimizer=args.optimizer, lr=args.lr, device=args.device),
                          distributed=world is not None)
    # The split is not part of it: where features were computed never changes what is learned.
    setup = {"model": args.model, "weights": model.weights_id, "classes": len(manifest.classes),
             "batch_size": args.batch_size, "seed": args.seed}
    start_epoch, done, resumed_from = 0, 0, None
    if args.resume:
        checkpoint = load_checkpoint(args.resume, setup)
        trainer.load_state_dict(checkpoint["trainer"])
        # Checkpoints from before mid-epoch ones have no batches_done or rng.
        start_epoch, done = checkpoint["epoch"], checkpoint.get("batches_done", 0)
        if "rng" in checkpoint:
            torch.set_rng_state(checkpoint["rng"])
        resumed_from = {"epoch": start_epoch, "batches_done": done}
    def new_run_dir() -> str:
        return str(args.cache_dir / "runs" / f"{args.model}-{time.strftime('%Y%m%d-%H%M%S')}")
    run_dir = args.output_dir or (args.resume.parent if args.resume else
                                  Path(world.shared("run_dir", new_run_dir) if world else new_run_dir()))
    run_dir.mkdir(parents=True, exist_ok=True)

    metrics_path = run_dir / (f"metrics.rank{world.rank}.jsonl" if world else "metrics.jsonl")
    metrics = MetricsLog(metrics_path, last_attempt(metrics_path) + 1, resumed_from)
    checkpoints = Checkpoints(run_dir / "checkpoint.pt", setup, trainer, args.checkpoint_every, world)
    total = Totals()
    val = Totals()
    with ExitStack() as stack:
        stack.callback(metrics.close)
        stack.enter_context(checkpoints.catching_sigterm())
        stack.enter_context(data.running(epochs=args.epochs - start_epoch))
        if data.planner is not None and world is None and data.planner.scouts:
            say("planner: a few of the first batch's samples (at split 0), or the first batch, go ahead alone to "
                "measure the link; the rest go where the model then says is fastest, and the run measures itself "
                "and moves when a move pays")
        elif data.planner is not None:
            say(f"planner: starting at {describe_split(model, data.split)}, the safest while the link is "
                "unmeasured; the run measures itself from its first batch on and moves when a move pays")
        if data.cache_note:
            say(data.cache_note)
        ranks = f", {world.size} ranks" if world else ""
        say(f"HAPI: {args.model}, {describe_split(model, data.split)} (freeze index {model.spec.freeze_index}); "
            f"data set {manifest.name!r} at {data.store_url}; run in {run_dir}{ranks}")

        moves = Moves(data, metrics)
        for epoch in range(start_epoch, args.epochs):
            stats = train_one_epoch(trainer, data, epoch, args, metrics, moves, checkpoints,
                                    done if epoch == start_epoch else 0)
            val = job_totals(evaluate(trainer, data, moves), world)
            checkpoints.save(epoch + 1, 0)
            metrics.write({"epoch": epoch, "train": asdict(stats), "val": asdict(val)})
            stats = job_totals(stats, world)
            say(f"epoch {epoch + 1}: train loss {stats.loss_sum / stats.samples:.4f}, "
                f"{stats.samples / stats.seconds:.1f} samples/s | "
                f"val loss {val.loss_sum / val.samples:.4f}, accuracy {val.correct / val.samples:.3f}")
            total.add(stats)
            if epoch + 1 < args.epochs:  # a SIGTERM in the last validation stops nothing left to do
                checkpoints.stop_if_terminated(epoch + 1, 0)
        if data.planner is not None and args.explain:
            say(data.planner.explain(model.stage_names))
    if total.samples:
        say(report(total, val))
    return 0


def resolve_device(name: str) -> str:
    """``auto``: CUDA when this host has it, else the CPU; anything else as given, checked."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"--device {name!r}: expected auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: this host has no CUDA device")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {name!r}: expected auto, cpu, cuda or cuda:N")
    return name


def describe_plan(model: StagedModel, plan: Plan) -> str:
    """The plan in words: its candidates and the share of the batches each gets."""
    if len(plan.parts) == 1:
        return f"{describe_split(model, plan.parts[0].split)}, {plan.parts[0].dtype}"
    return " + ".join(f"{share:.0%} of the batches at {describe_split(model, c.split)}, {c.dtype}"
                      for c, share in zip(plan.parts, plan.shares))


def describe_split(model: StagedModel, split: int) -> str:
    """The split in words."""
    if split == ALL_IN_COMPUTE:
        return "all-in-compute: raw objects, every stage here"
    return f"split {split}/{len(model)}: storage runs up to {model.stage_names[split - 1] if split else 'input'!r}"


def report(total: Totals, val: Totals) -> str:
    ratio = total.raw_bytes / total.wire_bytes if total.wire_bytes else float("nan")
    busy = total.wait_s + total.compute_s
    # An early split on a fast link can move more than the JPEGs: say so rather than "0.0x less".
    moved = f"{1 / ratio:.1f}x more" if ratio < 1 else f"{ratio:.1f}x less"
    return "\n".join([
        f"trained {total.samples} samples in {total.seconds:.1f} s: {total.samples / total.seconds:.1f} samples/s; "
        f"waiting for data {total.wait_s / busy:.0%}, computing {total.compute_s / busy:.0%}",
        f"over the network: {total.wire_bytes / 1e6:.1f} MB vs {total.raw_bytes / 1e6:.1f} MB of raw objects "
        f"for the same samples: {moved}",
        f"final validation: loss {val.loss_sum / val.samples:.4f}, accuracy {val.correct / val.samples:.3f}",
    ])


def cli(argv: list[str] | None = None) -> int:
    args = get_args_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    # Retries are the client's business; a failure that outlasts them is reported in one line.
    logging.getLogger("urllib3").setLevel(logging.INFO if args.verbose else logging.ERROR)
    try:
        return main(args)
    except KeyboardInterrupt:
        print("interrupted; storage daemon stopped", file=sys.stderr)
        return 130
    except Stopped as stopped:
        print(stopped, file=sys.stderr)
        return 128 + signal.SIGTERM
    except (StorageNodeError, MissingObjectError, CorruptImageError, DatasetNotFoundError, ValueError,
            RuntimeError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(cli())
