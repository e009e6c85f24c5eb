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
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from tqdm import tqdm

from compute_side.client import StorageClient, StorageNodeError
from compute_side.daemon_process import local_daemon
from compute_side.loader import PipelinedLoader, Source, batches_of, epoch_order
from compute_side.sources import PushdownSource, RawObjectSource
from compute_side.trainer import OPTIMIZERS, HeadTrainer, TrainConfig
from hapi.datasets import DatasetNotFoundError, Manifest, Sample, load_manifest, make_synthetic
from hapi.models import MODELS, StagedModel, build_model
from hapi.store import MissingObjectError, open_store
from hapi.transforms import CorruptImageError, TransformSpec
from hapi.wire import WIRE_DTYPES, ExtractRequest

log = logging.getLogger("hapi.train")

ALL_IN_COMPUTE = "all-in-compute"
DEFAULT_DEPTH = 4  # requests in flight; see the overlap benchmark in experiments/overlap.py


def default_cache_dir() -> Path:
    return Path(os.environ.get("HAPI_CACHE", Path.home() / ".cache" / "hapi"))


def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m hapi.train", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="resnet50", help=f"one of {', '.join(MODELS)}")
    p.add_argument("--weights", default="random",
                   help="random (seeded, the offline default), torchvision, or a state_dict file")
    p.add_argument("--split", default="freeze",
                   help="stages [0, split) run on the storage tier: an index, 'freeze' (every frozen stage), "
                        f"or '{ALL_IN_COMPUTE}' (no pushdown: raw objects, whole model here)")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=32, help="the optimiser's batch, whatever the storage side does")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="sgd")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0, help="shuffling and augmentation")
    p.add_argument("--augment", action="store_true", help="random resized crop + flip, seeded per sample")
    p.add_argument("--image-size", type=int, help="crop size fed to the model (default: the model's)")
    p.add_argument("--dtype", choices=sorted(WIRE_DTYPES), default="float32", help="features on the wire")
    p.add_argument("--request-size", type=int, default=32, help="samples per request to a storage node")
    p.add_argument("--depth", type=int, default=DEFAULT_DEPTH,
                   help="requests in flight while the trainer works (0: no overlap)")
    p.add_argument("--output-dir", type=Path, help="checkpoints and metrics.jsonl (default: CACHE/runs/...)")
    p.add_argument("--resume", type=Path, help="a checkpoint.pt to continue from")
    deployment = p.add_argument_group("deployment (default: the embedded synthetic data set)")
    deployment.add_argument("--store", help="s3://bucket/prefix or file:///path of a data set")
    deployment.add_argument("--endpoint-url", help="S3 endpoint of --store; default $AWS_ENDPOINT_URL")
    deployment.add_argument("--storage-node", action="append", default=[],
                            help="URL of a running storage daemon (repeatable); default: start one locally")
    deployment.add_argument("--cache-dir", type=Path, default=default_cache_dir())
    deployment.add_argument("--train-per-class", type=int, default=96, help="size of the embedded synthetic set")
    deployment.add_argument("--val-per-class", type=int, default=24)
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
    """One JSON line per iteration and per epoch, for plots and for the planner."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.file = open(path, "a", buffering=1)

    def write(self, record: dict) -> None:
        self.file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        self.file.close()


def train_one_epoch(trainer: HeadTrainer, loader: PipelinedLoader, samples: tuple[Sample, ...], epoch: int,
                    args: argparse.Namespace, metrics: MetricsLog) -> Totals:
    order = epoch_order(samples, epoch, args.seed)
    totals = Totals()
    started = time.perf_counter()
    with tqdm(total=len(order), desc=f"epoch {epoch + 1}/{args.epochs}", unit="img", leave=False) as bar:
        for step, batch in enumerate(loader.epoch(batches_of(order, args.batch_size), epoch)):
            step_started = time.perf_counter()
            loss = trainer.train_step(batch.features, batch.labels)
            compute_s = time.perf_counter() - step_started
            n = len(batch.keys)
            totals.add(Totals(n, loss * n, 0, batch.wire_bytes, batch.raw_bytes, batch.wait_s, compute_s))
            metrics.write({"epoch": epoch, "step": step, "samples": n, "loss": loss, "wait_s": batch.wait_s,
                           "compute_s": compute_s, "wire_bytes": batch.wire_bytes, "raw_bytes": batch.raw_bytes,
                           "requests": batch.requests, "source_ms": batch.timings})
            bar.update(n)
            bar.set_postfix(loss=f"{loss:.3f}")
    totals.seconds = time.perf_counter() - started
    return totals


def evaluate(trainer: HeadTrainer, loader: PipelinedLoader, samples: tuple[Sample, ...],
             args: argparse.Namespace) -> Totals:
    totals = Totals()
    started = time.perf_counter()
    with tqdm(total=len(samples), desc="validate", unit="img", leave=False) as bar:
        for batch in loader.epoch(batches_of(samples, args.batch_size), epoch=0):
            loss_sum, correct = trainer.evaluate_batch(batch.features, batch.labels)
            totals.add(Totals(len(batch.keys), loss_sum, correct, batch.wire_bytes, batch.raw_bytes, batch.wait_s))
            bar.update(len(batch.keys))
    totals.seconds = time.perf_counter() - started
    return totals


def resolve_split(model: StagedModel, value: str) -> int:
    """The split index; all-in-compute trains from stage 0 on raw objects."""
    if value == ALL_IN_COMPUTE:
        return 0
    split = model.spec.freeze_index if value == "freeze" else _int(value, "--split")
    model.check_split(split)
    return split


def _int(value: str, flag: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{flag} {value!r}: expected an integer, 'freeze' or '{ALL_IN_COMPUTE}'") from None


def open_dataset(args: argparse.Namespace) -> tuple[str, Manifest]:
    """The data set's store URL and manifest; creates the embedded default if needed."""
    if args.store:
        store = open_store(args.store, args.endpoint_url)
        return store.url, load_manifest(store)
    name = f"synthetic-{args.train_per_class}x{args.val_per_class}"
    store = open_store((args.cache_dir / "datasets" / name).resolve().as_uri())
    try:
        return store.url, load_manifest(store)
    except DatasetNotFoundError:
        log.info("creating the synthetic data set in %s (once)", store.url)
        return store.url, make_synthetic(store, args.train_per_class, args.val_per_class)


@contextmanager
def feature_sources(args: argparse.Namespace, template: ExtractRequest, eval_transform: TransformSpec,
                    store_url: str) -> Iterator[tuple[Source, Source]]:
    """(train, validation) sources: raw objects, given daemons, or a daemon started here."""
    if args.split == ALL_IN_COMPUTE:
        store = open_store(store_url, args.endpoint_url)
        yield RawObjectSource(store, template.transform), RawObjectSource(store, eval_transform)
        return
    with _storage_nodes(args, store_url) as urls:
        clients = [StorageClient(url) for url in urls]
        for client in clients:
            client.health()  # a dead node fails here, before any training
        # Validation never augments: the same centre crop on every run.
        yield PushdownSource(clients, template), PushdownSource(clients, replace(template, transform=eval_transform))


@contextmanager
def _storage_nodes(args: argparse.Namespace, store_url: str) -> Iterator[list[str]]:
    if args.storage_node:
        yield args.storage_node
        return
    extra = ("--endpoint-url", args.endpoint_url) if args.endpoint_url else ()
    with local_daemon(store_url, args.cache_dir / "storage-daemon.log", extra) as url:
        yield [url]


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
    model = build_model(args.model, args.weights, args.image_size)
    split = resolve_split(model, args.split)
    store_url, manifest = open_dataset(args)
    torch.manual_seed(args.seed)  # the new head's init and any dropout: same seed, same run
    model.replace_head(len(manifest.classes))
    trainer = HeadTrainer(model, split, TrainConfig(optimizer=args.optimizer, lr=args.lr))
    setup = {"model": args.model, "weights": model.weights_id, "split": split, "classes": len(manifest.classes),
             "batch_size": args.batch_size, "seed": args.seed}
    start_epoch = 0
    if args.resume:
        checkpoint = load_checkpoint(args.resume, setup)
        trainer.load_state_dict(checkpoint["trainer"])
        start_epoch = checkpoint["epoch"]
    run_dir = args.output_dir or (args.resume.parent if args.resume else
                                  args.cache_dir / "runs" / f"{args.model}-{time.strftime('%Y%m%d-%H%M%S')}")
    run_dir.mkdir(parents=True, exist_ok=True)

    crop = args.image_size or model.spec.input_size
    eval_transform = TransformSpec(crop_size=crop, resize_size=round(crop * 256 / 224), seed=args.seed)
    template = ExtractRequest(keys=(), model=args.model, split=split, weights=model.weights_id,
                              transform=replace(eval_transform, augment=args.augment),
                              dtype=args.dtype, job_id=f"train-{os.getpid()}")
    where = ("all-in-compute: raw objects, every stage here" if args.split == ALL_IN_COMPUTE else
             f"split {split}/{len(model)}: storage runs up to {model.stage_names[split - 1] if split else 'input'!r}")
    print(f"HAPI: {args.model}, {where} (freeze index {model.spec.freeze_index}); "
          f"data set {manifest.name!r} at {store_url}; run in {run_dir}")

    metrics = MetricsLog(run_dir / "metrics.jsonl")
    total = Totals()
    val = Totals()
    try:
        with feature_sources(args, template, eval_transform, store_url) as (train_source, val_source):
            train_loader = PipelinedLoader(train_source, args.request_size, args.depth)
            val_loader = PipelinedLoader(val_source, args.request_size, args.depth)
            for epoch in range(start_epoch, args.epochs):
                stats = train_one_epoch(trainer, train_loader, manifest.split("train"), epoch, args, metrics)
                val = evaluate(trainer, val_loader, manifest.split("val"), args)
                torch.save({"epoch": epoch + 1, "setup": setup, "trainer": trainer.state_dict()},
                           run_dir / "checkpoint.pt")
                summary = {"epoch": epoch, "train": asdict(stats), "val": asdict(val)}
                metrics.write(summary)
                print(f"epoch {epoch + 1}: train loss {stats.loss_sum / stats.samples:.4f}, "
                      f"{stats.samples / stats.seconds:.1f} samples/s | "
                      f"val loss {val.loss_sum / val.samples:.4f}, accuracy {val.correct / val.samples:.3f}")
                total.add(stats)
    finally:
        metrics.close()
    if total.samples:
        print(report(total, val))
    return 0


def report(total: Totals, val: Totals) -> str:
    ratio = total.raw_bytes / total.wire_bytes if total.wire_bytes else float("nan")
    busy = total.wait_s + total.compute_s
    return "\n".join([
        f"trained {total.samples} samples in {total.seconds:.1f} s: {total.samples / total.seconds:.1f} samples/s; "
        f"waiting for data {total.wait_s / busy:.0%}, computing {total.compute_s / busy:.0%}",
        f"over the network: {total.wire_bytes / 1e6:.1f} MB vs {total.raw_bytes / 1e6:.1f} MB of raw objects "
        f"for the same samples: {ratio:.1f}x less",
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
    except (StorageNodeError, MissingObjectError, CorruptImageError, DatasetNotFoundError, ValueError,
            RuntimeError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(cli())
