"""``python -m hapi.train --model resnet50``: train a head on features extracted next to the store.

With no store given, it trains on the embedded default: a synthetic data set in a
``file://`` store under the cache directory, served by a storage daemon it starts on a
loopback port and stops at the end. With ``--store s3://bucket/prefix --endpoint-url URL
--storage-node URL`` it trains against a real deployment.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

from tqdm import tqdm

from compute_side.client import StorageClient, StorageNodeError
from compute_side.daemon_process import local_daemon
from compute_side.loader import FeatureLoader, batches_of, epoch_order
from compute_side.trainer import OPTIMIZERS, HeadTrainer, TrainConfig
from hapi.datasets import DatasetNotFoundError, Manifest, load_manifest, make_synthetic
from hapi.models import MODELS, StagedModel, build_model
from hapi.store import MissingObjectError, open_store
from hapi.transforms import TransformSpec
from hapi.wire import WIRE_DTYPES, ExtractRequest

log = logging.getLogger("hapi.train")


def default_cache_dir() -> Path:
    return Path(os.environ.get("HAPI_CACHE", Path.home() / ".cache" / "hapi"))


def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m hapi.train", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="resnet50", help=f"one of {', '.join(MODELS)}")
    p.add_argument("--weights", default="random",
                   help="random (seeded, the offline default), torchvision, or a state_dict file")
    p.add_argument("--split", default="freeze",
                   help="stages [0, split) run on the storage tier: an index, or 'freeze' (all frozen stages)")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=32, help="the optimiser's batch, whatever the storage side does")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="sgd")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0, help="shuffling and augmentation")
    p.add_argument("--augment", action="store_true", help="random resized crop + flip, seeded per sample")
    p.add_argument("--image-size", type=int, help="crop size fed to the model (default: the model's)")
    p.add_argument("--dtype", choices=sorted(WIRE_DTYPES), default="float32", help="features on the wire")
    p.add_argument("--request-size", type=int, default=32, help="samples per request to a storage node")
    p.add_argument("--prefetch", type=int, default=1, help="batches fetched ahead while one trains")
    store = p.add_argument_group("deployment (default: the embedded synthetic data set)")
    store.add_argument("--store", help="s3://bucket/prefix or file:///path of a data set")
    store.add_argument("--endpoint-url", help="S3 endpoint of --store; default $AWS_ENDPOINT_URL")
    store.add_argument("--storage-node", action="append", default=[],
                       help="URL of a running storage daemon (repeatable); default: start one locally")
    store.add_argument("--cache-dir", type=Path, default=default_cache_dir())
    store.add_argument("--train-per-class", type=int, default=96, help="size of the embedded synthetic set")
    store.add_argument("--val-per-class", type=int, default=24)
    p.add_argument("-v", "--verbose", action="store_true")
    return p


@dataclass
class EpochStats:
    samples: int = 0
    loss_sum: float = 0.0
    correct: int = 0
    wire_bytes: int = 0
    raw_bytes: int = 0
    wait_s: float = 0.0
    seconds: float = 0.0

    def add(self, other: EpochStats) -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))


def train_one_epoch(trainer: HeadTrainer, loader: FeatureLoader, manifest: Manifest, epoch: int,
                    args: argparse.Namespace) -> EpochStats:
    order = epoch_order(manifest.split("train"), epoch, args.seed, shuffle=True)
    stats = EpochStats()
    started = time.perf_counter()
    with tqdm(total=len(order), desc=f"epoch {epoch + 1}/{args.epochs}", unit="img", leave=False) as bar:
        for batch in loader.epoch(batches_of(order, args.batch_size), epoch):
            loss = trainer.train_step(batch.features, batch.labels)
            n = len(batch.keys)
            stats.add(EpochStats(n, loss * n, 0, batch.wire_bytes, batch.raw_bytes, batch.wait_s))
            bar.update(n)
            bar.set_postfix(loss=f"{loss:.3f}")
    stats.seconds = time.perf_counter() - started
    return stats


def evaluate(trainer: HeadTrainer, loader: FeatureLoader, manifest: Manifest, args: argparse.Namespace) -> EpochStats:
    stats = EpochStats()
    started = time.perf_counter()
    samples = manifest.split("val")
    with tqdm(total=len(samples), desc="validate", unit="img", leave=False) as bar:
        for batch in loader.epoch(batches_of(samples, args.batch_size), epoch=0):
            loss_sum, correct = trainer.evaluate_batch(batch.features, batch.labels)
            stats.add(EpochStats(len(batch.keys), loss_sum, correct, batch.wire_bytes, batch.raw_bytes, batch.wait_s))
            bar.update(len(batch.keys))
    stats.seconds = time.perf_counter() - started
    return stats


def resolve_split(model: StagedModel, value: str) -> int:
    split = model.spec.freeze_index if value == "freeze" else int(value)
    model.check_split(split)
    return split


@contextmanager
def storage_nodes(args: argparse.Namespace, store_url: str) -> Iterator[list[str]]:
    """The daemons to use: those given, or one started here next to ``store_url``."""
    if args.storage_node:
        yield args.storage_node
        return
    extra = ("--endpoint-url", args.endpoint_url) if args.endpoint_url else ()
    with local_daemon(store_url, args.cache_dir / "storage-daemon.log", extra) as url:
        yield [url]


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


def main(args: argparse.Namespace) -> int:
    model = build_model(args.model, args.weights, args.image_size)
    split = resolve_split(model, args.split)
    store_url, manifest = open_dataset(args)
    model.replace_head(len(manifest.classes))
    trainer = HeadTrainer(model, split, TrainConfig(optimizer=args.optimizer, lr=args.lr))
    crop = args.image_size or model.spec.input_size
    # Validation never augments: the same centre crop on every run.
    eval_transform = TransformSpec(crop_size=crop, resize_size=round(crop * 256 / 224), seed=args.seed)
    template = ExtractRequest(keys=(), model=args.model, split=split, weights=model.weights_id,
                              transform=replace(eval_transform, augment=args.augment),
                              dtype=args.dtype, job_id=f"train-{os.getpid()}")
    stage = model.stage_names[split - 1] if split else "input"
    print(f"HAPI: {args.model}, split {split}/{len(model)} (storage runs stages up to {stage!r}; "
          f"freeze index {model.spec.freeze_index}), data set {manifest.name!r} at {store_url}")

    with storage_nodes(args, store_url) as urls:
        clients = [StorageClient(url) for url in urls]
        for client in clients:
            client.health()  # a dead node fails here, before any training
        train_loader = FeatureLoader(clients, template, args.request_size, args.prefetch)
        val_loader = FeatureLoader(clients, replace(template, transform=eval_transform),
                                   args.request_size, args.prefetch)
        total = EpochStats()
        for epoch in range(args.epochs):
            stats = train_one_epoch(trainer, train_loader, manifest, epoch, args)
            val = evaluate(trainer, val_loader, manifest, args)
            total.add(stats)
            print(f"epoch {epoch + 1}: train loss {stats.loss_sum / stats.samples:.4f}, "
                  f"{stats.samples / stats.seconds:.1f} samples/s, waited for data {stats.wait_s:.1f} s | "
                  f"val loss {val.loss_sum / val.samples:.4f}, accuracy {val.correct / val.samples:.3f}")
            total.add(EpochStats(wire_bytes=val.wire_bytes, raw_bytes=val.raw_bytes))
    print(report(total, split, stage))
    return 0


def report(total: EpochStats, split: int, stage: str) -> str:
    ratio = total.raw_bytes / total.wire_bytes if total.wire_bytes else float("nan")
    return "\n".join([
        f"trained {total.samples} samples in {total.seconds:.1f} s: {total.samples / total.seconds:.1f} samples/s",
        f"over the network: {total.wire_bytes / 1e6:.1f} MB of features (split {split}, after {stage!r}) "
        f"vs {total.raw_bytes / 1e6:.1f} MB of raw objects: {ratio:.1f}x less",
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
    except (StorageNodeError, MissingObjectError, DatasetNotFoundError, ValueError, RuntimeError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(cli())
