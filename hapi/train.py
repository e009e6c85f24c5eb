"""``python -m hapi.train --model resnet50``: train a head on features extracted next to the store.

With no store given, it trains on the embedded default: a synthetic data set in a
``file://`` store under the cache directory, served by a storage daemon it starts on a
loopback port and stops at the end. With ``--store s3://bucket/prefix --endpoint-url URL
--storage-node URL`` it trains against a real deployment. ``--split all-in-compute`` is
the baseline without pushdown: raw objects fetched and run through the whole model here.
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
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from tqdm import tqdm

from compute_side import deployment
from compute_side.client import StorageNodeError
from compute_side.loader import PipelinedLoader, batches_of, epoch_order
from compute_side.sources import Planned, Sources
from compute_side.trainer import OPTIMIZERS, HeadTrainer, TrainConfig
from hapi.datasets import DatasetNotFoundError, Sample
from hapi.measure import host_profile
from hapi.models import MODELS, StagedModel, build_model
from hapi.planner import ALL_IN_COMPUTE, OnlinePlanner, Plan
from hapi.store import MissingObjectError, open_store
from hapi.transforms import CorruptImageError, TransformSpec
from hapi.wire import WIRE_DTYPES, ExtractRequest

log = logging.getLogger("hapi.train")

DEFAULT_DEPTH = 4  # requests in flight; see the overlap benchmark in experiments/overlap.py


def default_cache_dir() -> Path:
    return Path(os.environ.get("HAPI_CACHE", Path.home() / ".cache" / "hapi"))


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
    p.add_argument("--dtype", choices=sorted(WIRE_DTYPES), default="float32", help="features on the wire")
    p.add_argument("--request-size", type=int, default=32, help="samples per request to a storage node")
    p.add_argument("--depth", type=int, default=DEFAULT_DEPTH,
                   help="requests in flight while the trainer works (0: no overlap)")
    p.add_argument("--output-dir", type=Path, help="checkpoints and metrics.jsonl (default: CACHE/runs/...)")
    p.add_argument("--resume", type=Path, help="a checkpoint.pt to continue from, mid-epoch too")
    p.add_argument("--checkpoint-every", type=int, default=0, metavar="N",
                   help="also checkpoint every N steps (always at each epoch's end and on SIGTERM)")
    deployment.add_arguments(p, default_cache_dir())
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
    """

    def __init__(self, path: Path, setup: dict, trainer: HeadTrainer, every: int) -> None:
        self.path, self.setup, self.trainer, self.every = path, setup, trainer, every
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
        if self.terminated or (self.every and batches_done % self.every == 0):
            self.save(epoch, batches_done)
        self.stop_if_terminated(epoch, batches_done)

    def stop_if_terminated(self, epoch: int, batches_done: int) -> None:
        if self.terminated:
            raise Stopped(f"terminated: checkpoint saved after {batches_done} batches of epoch {epoch + 1}; "
                          f"continue with --resume {self.path}")

    def save(self, epoch: int, batches_done: int) -> None:
        state = {"epoch": epoch, "batches_done": batches_done, "setup": self.setup,
                 "trainer": self.trainer.state_dict(), "rng": torch.get_rng_state()}
        # Written aside and renamed: a kill mid-save leaves the previous checkpoint whole.
        partial = self.path.with_suffix(".partial")
        torch.save(state, partial)
        os.replace(partial, self.path)


def train_one_epoch(trainer: HeadTrainer, loader: PipelinedLoader, samples: tuple[Sample, ...], epoch: int,
                    args: argparse.Namespace, metrics: MetricsLog, planner: OnlinePlanner | None = None,
                    model: StagedModel | None = None, checkpoints: Checkpoints | None = None,
                    done: int = 0) -> Totals:
    """Trains the epoch's batches after the first ``done`` (trained by an earlier attempt);
    the totals count this attempt's steps only."""
    batches = batches_of(epoch_order(samples, epoch, args.seed), args.batch_size)
    announced = len(planner.switches) if planner else 0
    if planner is not None:
        planner.restarted()
    totals = Totals()
    started = time.perf_counter()
    with tqdm(total=len(samples), initial=sum(map(len, batches[:done])), desc=f"epoch {epoch + 1}/{args.epochs}",
              unit="img", leave=False) as bar:
        for step, batch in enumerate(loader.epoch(batches[done:], epoch), start=done):
            step_started = time.perf_counter()
            loss = trainer.train_step(batch.features, batch.labels, batch.split)
            compute_s = time.perf_counter() - step_started
            n = len(batch.keys)
            totals.add(Totals(n, loss * n, 0, batch.wire_bytes, batch.raw_bytes, batch.wait_s, compute_s))
            metrics.write({"epoch": epoch, "step": step, "samples": n, "split": batch.split, "dtype": batch.dtype,
                           "loss": loss, "wait_s": batch.wait_s, "compute_s": compute_s,
                           "wire_bytes": batch.wire_bytes, "raw_bytes": batch.raw_bytes, "requests": batch.requests,
                           "elapsed_ms": batch.elapsed_ms, "source_ms": batch.timings, "keys": batch.keys})
            if planner is not None:
                planner.trained(n, batch.wait_s, compute_s)
                for sent, plan, why in planner.switches[announced:]:
                    tqdm.write(f"planner: from sample {sent} on, {describe_plan(model, plan)} ({why})")
                    metrics.write({"switch": {"at_sample": sent, "why": why, "plan": plan.label,
                                              "parts": [asdict(c) for c in plan.parts], "shares": plan.shares}})
                announced = len(planner.switches)
            bar.update(n)
            bar.set_postfix(loss=f"{loss:.3f}")
            if checkpoints is not None:
                checkpoints.step_done(epoch, step + 1, last=step + 1 == len(batches))
    totals.seconds = time.perf_counter() - started
    return totals


def evaluate(trainer: HeadTrainer, loader: PipelinedLoader, samples: tuple[Sample, ...],
             args: argparse.Namespace) -> Totals:
    totals = Totals()
    started = time.perf_counter()
    with tqdm(total=len(samples), desc="validate", unit="img", leave=False) as bar:
        for batch in loader.epoch(batches_of(samples, args.batch_size), epoch=0):
            loss_sum, correct = trainer.evaluate_batch(batch.features, batch.labels, batch.split)
            totals.add(Totals(len(batch.keys), loss_sum, correct, batch.wire_bytes, batch.raw_bytes, batch.wait_s))
            bar.update(len(batch.keys))
    totals.seconds = time.perf_counter() - started
    return totals


def resolve_split(model: StagedModel, value: str) -> int:
    """A fixed split index, or ALL_IN_COMPUTE (raw objects, every stage here)."""
    if value == "all-in-compute":
        return ALL_IN_COMPUTE
    split = model.spec.freeze_index if value == "freeze" else _int(value, "--split")
    model.check_split(split)
    return split


def _int(value: str, flag: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{flag} {value!r}: expected auto, freeze, all-in-compute or an integer") from None


def make_planner(args: argparse.Namespace, model: StagedModel, train: tuple[Sample, ...],
                 val: tuple[Sample, ...], epochs: int) -> OnlinePlanner:
    """The online planner for this run, from this host's profile of the model (shipped,
    saved, or measured now on copies of the stages, touching nothing the run trains)."""
    crop = args.image_size or model.spec.input_size
    profile = host_profile(model, crop, args.cache_dir / "profiles", refresh=args.refresh_profile,
                           device=torch.device(args.device))
    requests_per_batch = -(-args.batch_size // args.request_size)
    return OnlinePlanner(profile, model.spec.freeze_index, args.batch_size, epochs * (len(train) + len(val)),
                         raw_bytes=sum(s.size for s in train) / len(train), dtypes=wire_dtypes(args),
                         batches_in_flight=max(1, -(-args.depth // requests_per_batch)))


def wire_dtypes(args: argparse.Namespace) -> tuple[str, ...]:
    return tuple(args.dtypes.split(",")) if args.dtypes else (args.dtype,)


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
    model = build_model(args.model, args.weights, args.image_size)
    fixed_split = None if args.split == "auto" else resolve_split(model, args.split)
    store_url, manifest = deployment.open_dataset(args)
    train_samples = manifest.split("train")
    torch.manual_seed(args.seed)  # the new head's init and any dropout: same seed, same run
    model.replace_head(len(manifest.classes))
    trainer = HeadTrainer(model, TrainConfig(optimizer=args.optimizer, lr=args.lr,
                                             device=args.device))
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
    run_dir = args.output_dir or (args.resume.parent if args.resume else
                                  args.cache_dir / "runs" / f"{args.model}-{time.strftime('%Y%m%d-%H%M%S')}")
    run_dir.mkdir(parents=True, exist_ok=True)

    crop = args.image_size or model.spec.input_size
    eval_transform = TransformSpec(crop_size=crop, resize_size=round(crop * 256 / 224), seed=args.seed)
    template = ExtractRequest(keys=(), model=args.model, split=0, weights=model.weights_id,
                              transform=replace(eval_transform, augment=args.augment),
                              dtype=args.dtype, job_id=f"train-{os.getpid()}")
    attempt = last_attempt(run_dir / "metrics.jsonl") + 1
    metrics = MetricsLog(run_dir / "metrics.jsonl", attempt, resumed_from)
    checkpoints = Checkpoints(run_dir / "checkpoint.pt", setup, trainer, args.checkpoint_every)
    total = Totals()
    val = Totals()
    with ExitStack() as stack:
        stack.callback(metrics.close)
        stack.enter_context(checkpoints.catching_sigterm())
        clients = ([] if fixed_split == ALL_IN_COMPUTE else
                   stack.enter_context(deployment.storage_nodes(args, store_url)))
        store = open_store(store_url, args.endpoint_url)
        sources = Sources(clients, store, template, eval_transform, model)
        val_samples = manifest.split("val")
        planner = None
        if fixed_split is None:
            planner = make_planner(args, model, train_samples, val_samples, args.epochs - start_epoch)
            train_source, val_source = Planned(planner, sources), Planned(planner, sources, validation=True)
            split = planner.plan.parts[0].split
            print(f"planner: starting at {describe_split(model, split)}, the safest while the link is unmeasured; "
                  "the run measures itself from its first batch on and moves when a move pays")
        else:
            split = fixed_split
            train_source, val_source = sources.build(split, args.dtype)
        train_loader = PipelinedLoader(train_source, args.request_size, args.depth)
        val_loader = PipelinedLoader(val_source, args.request_size, args.depth)
        print(f"HAPI: {args.model}, {describe_split(model, split)} (freeze index {model.spec.freeze_index}); "
              f"data set {manifest.name!r} at {store_url}; run in {run_dir}")

        for epoch in range(start_epoch, args.epochs):
            stats = train_one_epoch(trainer, train_loader, train_samples, epoch, args, metrics, planner, model,
                                    checkpoints, done if epoch == start_epoch else 0)
            val = evaluate(trainer, val_loader, val_samples, args)
            checkpoints.save(epoch + 1, 0)
            metrics.write({"epoch": epoch, "train": asdict(stats), "val": asdict(val)})
            print(f"epoch {epoch + 1}: train loss {stats.loss_sum / stats.samples:.4f}, "
                  f"{stats.samples / stats.seconds:.1f} samples/s | "
                  f"val loss {val.loss_sum / val.samples:.4f}, accuracy {val.correct / val.samples:.3f}")
            total.add(stats)
            if epoch + 1 < args.epochs:  # a SIGTERM in the last validation stops nothing left to do
                checkpoints.stop_if_terminated(epoch + 1, 0)
        if planner is not None and args.explain:
            print(planner.explain(model.stage_names))
    if total.samples:
        print(report(total, val))
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
