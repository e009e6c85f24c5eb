"""The peer of the head-to-head: the same job as ``hapi.train``, fed by AWS's s3torchconnector.

It trains the same head on the same samples as ``python -m hapi.train --split
all-in-compute``, with the loader AWS recommends for PyTorch on S3 instead of HAPI's:
``S3MapDataset.from_objects`` (one GET per JPEG through the AWS CRT client) behind a
``torch.utils.data.DataLoader`` with ``--workers`` processes. Everything else is HAPI's, so
the two jobs differ only in how the bytes arrive:

- the manifest of ``hapi.datasets`` (the same samples, labels and validation split);
- ``hapi.transforms.preprocess`` (the same decode, resize, centre crop and normalisation);
- ``hapi.models.build_model`` + ``compute_side.trainer.HeadTrainer`` (the frozen stages in
  eval mode under no_grad, the same head, optimiser, learning rate and seed);
- the same shuffle per epoch, validation after every epoch, a checkpoint per epoch, and
  the same closing lines as ``hapi.train`` prints.

    python -m experiments.peer_s3torch --model resnet50 --store s3://bucket/prefix \\
        --endpoint-url http://10.77.0.2:8080 --workers 2 --epochs 1

Credentials come from the standard AWS environment variables (the CRT client reads them).
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from s3torchconnector import S3ClientConfig, S3MapDataset, S3Reader
from torch.utils.data import DataLoader

from compute_side.trainer import OPTIMIZERS, HeadTrainer, TrainConfig
from hapi.datasets import Sample, load_manifest
from hapi.models import build_model
from hapi.store import open_store
from hapi.transforms import TransformSpec, preprocess

log = logging.getLogger("peer_s3torch")

# The frozen stages take the decoded image: a batch's features are stage 0's input.
RAW_INPUT_SPLIT = 0


@dataclass(frozen=True)
class PeerConfig:
    model: str
    store: str  # s3://bucket/prefix of a hapi.datasets data set
    endpoint_url: str
    region: str
    workers: int
    epochs: int
    batch_size: int
    optimizer: str
    lr: float
    seed: int
    image_size: int | None
    output_dir: Path


class DecodeSample:
    """S3MapDataset's transform: an object's bytes to (the model's input tensor, label).

    A class, not a closure, so that DataLoader workers can be started by any method."""

    def __init__(self, labels: dict[str, int], prefix: str, spec: TransformSpec) -> None:
        self.labels, self.prefix, self.spec = labels, prefix, spec

    def __call__(self, reader: S3Reader) -> tuple[torch.Tensor, int]:
        key = reader.key.removeprefix(self.prefix)
        # No augmentation in these jobs, so the epoch does not change the tensor.
        return preprocess(reader.read(), key, self.spec), self.labels[key]


def epoch_order(samples: Sequence[Sample], epoch: int, seed: int) -> list[int]:
    """Indices of ``samples`` in the order hapi.train visits them in ``epoch``.

    For single-object samples, hapi's two-level shuffle (objects, then members) reduces to
    one shuffle of the samples sorted by key, seeded by (seed, epoch)."""
    order = sorted(range(len(samples)), key=lambda i: samples[i].key)
    random.Random(f"{seed}/{epoch}").shuffle(order)
    return order


def dataset_of(config: PeerConfig, samples: Sequence[Sample], spec: TransformSpec) -> S3MapDataset:
    bucket, _, prefix = config.store.removeprefix("s3://").partition("/")
    prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
    if any("#" in s.key for s in samples):
        raise ValueError("the peer reads one object per sample; this data set is sharded")
    return S3MapDataset.from_objects(
        [f"s3://{bucket}/{prefix}{s.key}" for s in samples], region=config.region, endpoint=config.endpoint_url,
        transform=DecodeSample({s.key: s.label for s in samples}, prefix, spec),
        # Swift's s3api (like MinIO and Ceph) answers path-style requests only.
        s3client_config=S3ClientConfig(force_path_style=True))


def loader_of(dataset: S3MapDataset, order: list[int] | None, config: PeerConfig) -> DataLoader:
    return DataLoader(dataset, batch_size=config.batch_size, sampler=order, num_workers=config.workers,
                      persistent_workers=False)


def run(config: PeerConfig) -> dict:
    manifest = load_manifest(open_store(config.store, config.endpoint_url))
    train, val = manifest.split("train"), manifest.split("val")
    model = build_model(config.model, input_size=config.image_size)
    torch.manual_seed(config.seed)  # the new head's init, as hapi.train seeds it
    model.replace_head(len(manifest.classes))
    trainer = HeadTrainer(model, TrainConfig(optimizer=config.optimizer, lr=config.lr))
    crop = config.image_size or model.spec.input_size
    spec = TransformSpec(crop_size=crop, resize_size=round(crop * 256 / 224), seed=config.seed)
    train_set, val_set = dataset_of(config, train, spec), dataset_of(config, val, spec)
    config.output_dir.mkdir(parents=True, exist_ok=True)
    summary: dict = {}
    trained, train_seconds = 0, 0.0
    for epoch in range(config.epochs):
        started = time.perf_counter()
        loss_sum = 0.0
        for images, labels in loader_of(train_set, epoch_order(train, epoch, config.seed), config):
            loss = trainer.train_step(images, labels, RAW_INPUT_SPLIT)
            loss_sum += loss * len(labels)
        seconds = time.perf_counter() - started
        trained += len(train)
        train_seconds += seconds
        val_loss, correct = 0.0, 0
        for images, labels in loader_of(val_set, None, config):  # manifest order, as hapi.train validates
            batch_loss, batch_correct = trainer.evaluate_batch(images, labels, RAW_INPUT_SPLIT)
            val_loss, correct = val_loss + batch_loss, correct + batch_correct
        torch.save({"epoch": epoch + 1, "trainer": trainer.state_dict()}, config.output_dir / "checkpoint.pt")
        summary = {"epoch": epoch, "train_loss": loss_sum / len(train), "train_seconds": seconds,
                   "val_loss": val_loss / len(val), "val_accuracy": correct / len(val),
                   "raw_bytes": sum(s.size for s in train) + sum(s.size for s in val)}
        with open(config.output_dir / "metrics.jsonl", "a") as metrics:
            metrics.write(json.dumps(summary) + "\n")
        print(f"epoch {epoch + 1}: train loss {summary['train_loss']:.4f}, {len(train) / seconds:.1f} samples/s | "
              f"val loss {summary['val_loss']:.4f}, accuracy {summary['val_accuracy']:.3f}")
    # The same closing lines as hapi.train's report, so one parser reads both.
    print(f"trained {trained} samples in {train_seconds:.1f} s: {trained / train_seconds:.1f} samples/s "
          f"(s3torchconnector, {config.workers} DataLoader workers)")
    print(f"final validation: loss {summary['val_loss']:.4f}, accuracy {summary['val_accuracy']:.3f}")
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.peer_s3torch", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="resnet50")
    p.add_argument("--store", required=True, help="s3://bucket/prefix of a hapi.datasets data set")
    p.add_argument("--endpoint-url", required=True, help="S3 endpoint (here: Swift's s3api)")
    p.add_argument("--region", default="us-east-1")
    p.add_argument("--workers", type=int, default=0, help="DataLoader worker processes")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="sgd")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--image-size", type=int)
    p.add_argument("--output-dir", type=Path, required=True)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    config = PeerConfig(**{name.replace("-", "_"): value for name, value in vars(args).items()})
    log.info("%s", asdict(config))
    run(config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
