"""Where the data set and the storage daemons are: given, or the embedded default."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from compute_side.client import StorageClient
from compute_side.daemon_process import local_daemon
from hapi.datasets import PACKAGED, DatasetNotFoundError, Manifest, load_manifest, make_packaged, make_synthetic
from hapi.store import open_store

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser, default_cache_dir: Path) -> None:
    group = parser.add_argument_group("deployment (default: an embedded data set, made once in --cache-dir)")
    group.add_argument("--store", help="s3://bucket/prefix or file:///path of a data set")
    group.add_argument("--dataset", choices=("synthetic", *PACKAGED), default="synthetic",
                       help="the embedded data set without --store: synthetic, or real images a package ships")
    group.add_argument("--endpoint-url", help="S3 endpoint of --store; default $AWS_ENDPOINT_URL")
    group.add_argument("--storage-node", action="append", default=[],
                       help="URL of a running storage daemon (repeatable); default: start one locally")
    group.add_argument("--cache-dir", type=Path, default=default_cache_dir)
    group.add_argument("--train-per-class", type=int, default=96, help="size of the embedded synthetic set")
    group.add_argument("--val-per-class", type=int, default=24)


def open_dataset(args: argparse.Namespace) -> tuple[str, Manifest]:
    """The data set's store URL and manifest; creates the embedded one (``--dataset``) if needed."""
    if args.store:
        store = open_store(args.store, args.endpoint_url)
        return store.url, load_manifest(store)
    synthetic = args.dataset == "synthetic"
    name = f"synthetic-{args.train_per_class}x{args.val_per_class}" if synthetic else args.dataset
    store = open_store((args.cache_dir / "datasets" / name).resolve().as_uri())
    try:
        return store.url, load_manifest(store)
    except DatasetNotFoundError:
        log.info("creating the %s data set in %s (once)", args.dataset, store.url)
        if synthetic:
            return store.url, make_synthetic(store, args.train_per_class, args.val_per_class)
        return store.url, make_packaged(store, args.dataset)


@contextmanager
def storage_nodes(args: argparse.Namespace, store_url: str) -> Iterator[list[StorageClient]]:
    """Clients of the given daemons, or of one started here next to ``store_url``; all healthy."""
    if args.storage_node:
        clients = [StorageClient(url) for url in args.storage_node]
        for client in clients:
            client.health()  # a dead node fails here, before any work
        yield clients
        return
    extra = ("--state-dir", str(args.cache_dir / "node"),
             *(("--endpoint-url", args.endpoint_url) if args.endpoint_url else ()))
    with local_daemon(store_url, args.cache_dir / "storage-daemon.log", extra) as url:
        yield [StorageClient(url)]
