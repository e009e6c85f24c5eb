"""HAPI in a user's own training loop: batches of features from the pushdown pipeline.

    from hapi.data import DataConfig, Pipeline

    pipeline = Pipeline(DataConfig(model="resnet50", store="s3://bucket/flowers",
                                   endpoint_url="http://swift:8080",
                                   storage_nodes=("http://storage1:8470",)))
    with pipeline.running(epochs=10):
        for epoch in range(10):
            for batch in pipeline.train(epoch):
                logits = pipeline.head(pipeline.frozen(batch.features, batch.split))
                ...

Under ``torchrun`` (after ``compute_side.distributed.join``), each rank's pipeline gives
it its slice of every global batch, and the splits rank 0's planner picks (see
``compute_side.distributed``); ``batch_samples(step)`` is the global batch's size. Every
rank gets the same number of training batches: where a last batch smaller than the world
leaves a rank nothing, its batch is empty, and the rank still steps (DDP needs every rank).

A ``Pipeline`` is what ``python -m hapi.train`` runs, without the training: the model
with a new head for the data set's classes, the storage nodes (given, or a daemon started
here next to the embedded default), the online planner steering a ``PipelinedLoader``
that keeps requests in flight while the caller trains, and the feature cache. Each batch
says where it was cut (``batch.split``, which the planner may move between batches), so
``frozen`` runs the frozen stages this tier still owes it, and ``head`` is what trains.

Like ``hapi/train.py``, this module is an entry point for users, not part of the core:
it composes the core (``hapi``) with the compute tier (``compute_side``), which is the
point of an API over the pipeline. No core module and no tier imports it, so the layout's
rule (the core imports neither tier) holds for every module they import.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field, fields, replace
from functools import cached_property
from pathlib import Path

import torch
from torch import nn

from compute_side import deployment
from compute_side.client import StorageClient, StorageNodeError
from compute_side.device_feed import to_device
from compute_side.distributed import Follower, Leader, World, rank_slice
from compute_side.feature_cache import DEFAULT_MAX_BYTES, CacheScope, FeatureCache
from compute_side.loader import Batch, PipelinedLoader, batches_of, epoch_order
from compute_side.sources import Planned, Sources
from hapi.datasets import Sample
from hapi.measure import cache_dir, host_name, host_profile, step_ratio
from hapi.models import StagedModel, build_model
from hapi.planner import ALL_IN_COMPUTE, OnlinePlanner
from hapi.store import open_store
from hapi.transforms import TransformSpec
from hapi.wire import ExtractRequest, layout_key, wire_dtype, wire_dtype_allowed

DEFAULT_DEPTH = 4  # requests in flight; see the overlap benchmark in experiments/overlap.py

# Why a run with --augment keeps no training features, in one place for the CLI and the API.
AUGMENT_NOTE = ("feature cache: training features are not kept: --augment crops and flips every sample anew "
                "each epoch, so no epoch's features serve another (validation's, never augmented, are kept)")


@dataclass(frozen=True)
class DataConfig:
    """The model, the data set and where it is served, and how batches are made.

    The defaults are ``python -m hapi.train``'s; each field is the flag of the same name.
    Without ``store`` the data set is the embedded default (``dataset``, made once under
    ``cache_dir``); without ``storage_nodes`` a storage daemon is started here next to it.
    """

    model: str = "resnet50"
    weights: str | None = None  # None: the model's own (see hapi.models.build_model)
    image_size: int | None = None  # None: the model's input size
    split: str = "auto"  # auto (planned), freeze, all-in-compute or an index
    dtype: str = "float32"  # features on the wire
    dtypes: tuple[str, ...] = ()  # the wire dtypes the planner may choose; (): dtype alone
    batch_size: int = 32
    seed: int = 0  # the new head's init, shuffling and augmentation
    augment: bool = False
    request_size: int = 32  # samples per request to a storage node
    depth: int = DEFAULT_DEPTH  # requests in flight while the caller trains (0: no overlap)
    feature_cache: int = DEFAULT_MAX_BYTES  # bytes of features kept for later epochs; 0: none
    feature_cache_dir: Path | None = None  # keep them there as safetensors, for later runs too; None: in memory
    device: str = "cpu"  # where the caller runs the model: the planner's profile of this tier is timed there
    refresh_profile: bool = False
    store: str | None = None  # s3://bucket/prefix or file:///path
    dataset: str = "synthetic"  # the embedded data set without a store
    endpoint_url: str | None = None
    storage_nodes: tuple[str, ...] = ()
    cache_dir: Path = field(default_factory=cache_dir)
    train_per_class: int = 96  # the embedded synthetic set's size
    val_per_class: int = 24

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> DataConfig:
        """The config of ``python -m hapi.train``'s parsed flags."""
        values = {f.name: getattr(args, f.name) for f in fields(cls) if f.name not in ("dtypes", "storage_nodes")}
        return cls(**values, dtypes=tuple(args.dtypes.split(",")) if args.dtypes else (),
                   storage_nodes=tuple(args.storage_node))


class FrozenStages(nn.Module):
    """The frozen stages a batch cut at ``split`` still needs on this tier: [split, freeze).

    They stay in eval mode and take no gradients whatever the caller's loop sets (a
    Lightning module's ``train()`` reaches them too): a sample's features never depend on
    which tier ran them (invariant 1).
    """

    def __init__(self, model: StagedModel) -> None:
        super().__init__()
        self.stages = nn.Sequential(*model.stages[: model.spec.freeze_index]).eval().requires_grad_(False)

    def train(self, mode: bool = True) -> FrozenStages:
        return super().train(False)

    def forward(self, features: torch.Tensor, split: int) -> torch.Tensor:
        with torch.no_grad():
            # Features may arrive in a narrower wire dtype; the model computes in float32.
            return self.stages[max(split, 0):](features.float())  # all-in-compute (-1) starts at 0


class Pipeline:
    """The model with a new head, the data set, and (inside ``running``) the batches.

    Building it reads the data set's manifest (making the embedded one if needed) and
    seeds torch's RNG with ``config.seed`` before the new head is drawn, so one seed
    trains one head. Nothing is started until ``running``.
    """

    def __init__(self, config: DataConfig, world: World | None = None) -> None:
        self.config, self.world = config, world
        self.model = build_model(config.model, config.weights, config.image_size)
        self.fixed_split = None if config.split == "auto" else resolve_split(self.model, config.split)
        if world is not None and config.batch_size < world.size:
            raise ValueError(f"--batch-size {config.batch_size} is smaller than the {world.size} ranks: "
                             "each rank trains a slice of every batch")
        if self.fixed_split not in (None, ALL_IN_COMPUTE) and not wire_dtype_allowed(config.dtype, self.fixed_split):
            raise ValueError(f"--dtype {config.dtype} ships decoded images: only with --split 0")
        # Rank 0 makes the embedded data set, if needed, before the others read it.
        opened = deployment.open_dataset(self._deployment_args()) if world is None or world.leader else None
        if world is not None:
            world.shared("dataset", lambda: "ready")
        self.store_url, self.manifest = opened or deployment.open_dataset(self._deployment_args())
        self.train_samples: tuple[Sample, ...] = self.manifest.split("train")
        self.val_samples: tuple[Sample, ...] = self.manifest.split("val")
        torch.manual_seed(config.seed)  # the new head's init and any dropout: same seed, same run
        self.model.replace_head(len(self.manifest.classes))
        self.frozen = FrozenStages(self.model)
        self.head = nn.Sequential(*self.model.stages[self.model.spec.freeze_index:])
        crop = config.image_size or self.model.spec.input_size
        self.eval_transform = TransformSpec(crop_size=crop, resize_size=round(crop * 256 / 224), seed=config.seed)
        self.train_transform = replace(self.eval_transform, augment=config.augment)
        # Why training features are not cached, when the cache is on and they are not.
        self.cache_note = AUGMENT_NOTE if config.augment and config.feature_cache else None
        self.planner: OnlinePlanner | None = None  # rank 0's only, in a job of many ranks
        self.split: int | None = None  # the first batch's split, once running (where known)
        self._loaders: tuple[PipelinedLoader, PipelinedLoader] | None = None
        self._passes = 0  # passes over batches so far, counted alike on every rank
        self._batches = 0  # batches of those passes (every rank's slices of one batch count once)

    def _deployment_args(self) -> argparse.Namespace:
        c = self.config
        return argparse.Namespace(store=c.store, dataset=c.dataset, endpoint_url=c.endpoint_url,
                                  storage_node=list(c.storage_nodes), cache_dir=c.cache_dir,
                                  train_per_class=c.train_per_class, val_per_class=c.val_per_class)

    @contextmanager
    def running(self, epochs: int = 1) -> Iterator[Pipeline]:
        """Storage nodes reached (or a local daemon started), the planner and the loaders
        ready; all stopped on leaving. ``epochs``: how many the caller will run, over which
        the planner weighs what a move of the split costs against what it saves."""
        c = self.config
        with ExitStack() as stack:
            clients = [] if self.fixed_split == ALL_IN_COMPUTE else self._storage_nodes(stack)
            job = f"train-{os.getpid()}"  # one job to the storage nodes, however many ranks
            template = ExtractRequest(keys=(), model=c.model, split=0, weights=self.model.weights_id,
                                      transform=self.train_transform, dtype=c.dtype,
                                      job_id=self.world.shared("job", lambda: job) if self.world else job)
            sources = Sources(clients, open_store(self.store_url, c.endpoint_url), template, self.eval_transform,
                              self.model, decode_device=c.device)
            if self.fixed_split is None and self.world is not None and not self.world.leader:
                train_source, val_source = (Follower(sources, self.world, "train"),
                                            Follower(sources, self.world, "val", True))
            elif self.fixed_split is None:
                self.planner = self._make_planner(epochs, clients)
                if self.world is None:
                    train_source, val_source = Planned(self.planner, sources), Planned(self.planner, sources, True)
                else:
                    train_source, val_source = (Leader(self.planner, sources, self.world, "train"),
                                                Leader(self.planner, sources, self.world, "val", True))
                self.split = self.planner.plan.parts[0].split
            else:
                train_source, val_source = sources.build(self.fixed_split, wire_dtype(self.fixed_split, c.dtype))
                self.split = self.fixed_split
            cache, weights = FeatureCache(c.feature_cache, c.feature_cache_dir), self.model.weights_id
            # Augmented features differ every epoch: none would ever be read again.
            train_cache = (CacheScope(cache, c.model, weights, self.train_transform, self._advance)
                           if c.feature_cache and not c.augment else None)
            val_cache = (CacheScope(cache, c.model, weights, self.eval_transform, self._advance)
                         if c.feature_cache else None)
            self._loaders = (PipelinedLoader(train_source, c.request_size, c.depth, train_cache, self._advance),
                             PipelinedLoader(val_source, c.request_size, c.depth, val_cache))
            try:
                yield self
            finally:
                self._loaders = None

    def _storage_nodes(self, stack: ExitStack) -> list[StorageClient]:
        """Clients of the storage nodes; in a job of many ranks, rank 0's (which may have
        started the local daemon) reached by every rank."""
        args = self._deployment_args()
        if self.world is not None and not self.world.leader:
            args.storage_node = self.world.shared("storage_nodes", str).split()
        clients = stack.enter_context(deployment.storage_nodes(args, self.store_url))
        if self.world is not None and self.world.leader:
            self.world.shared("storage_nodes", lambda: " ".join(client.url for client in clients))
        return clients

    def _make_planner(self, epochs: int, clients: list[StorageClient]) -> OnlinePlanner:
        """The online planner for ``epochs`` epochs, from a profile of the model (this host's
        or another's of its kind, shipped or saved, else measured now on copies of the stages,
        touching nothing the run trains)."""
        c = self.config
        crop = c.image_size or self.model.spec.input_size
        device = torch.device(c.device)
        profile = host_profile(self.model, crop, c.cache_dir / "profiles", refresh=c.refresh_profile, device=device)
        # Another host's profile: this tier's speed against it is timed while the first batch is in flight.
        ratio = step_ratio(self.model, profile, device) if profile.host != host_name(device) else None
        # Rank 0 plans its own slices: the planner sees one rank's batches and samples.
        ranks = self.world.size if self.world else 1
        in_flight = max(c.depth, 1) * ranks
        capacities, prefix = node_capacities(clients), layout_key(c.model, crop)
        batch = -(-c.batch_size // ranks)
        requests_per_batch = -(-batch // c.request_size)
        # After the first epoch the feature cache serves validation, and training too
        # unless augmentation draws new crops every epoch.
        later_train = (epochs - 1) * (0 if c.augment else len(self.train_samples))
        cached_train = later_train if c.feature_cache else 0
        cached = later_train + (epochs - 1) * len(self.val_samples) if c.feature_cache else 0
        passes = 2 * epochs - ((epochs - 1) * (1 if c.augment else 2) if c.feature_cache else 0)
        sent = epochs * (len(self.train_samples) + len(self.val_samples)) - cached
        train_sent = epochs * len(self.train_samples) - cached_train
        return OnlinePlanner(profile, self.model.spec.freeze_index, batch, -(-sent // ranks),
                             node_passes=max(1, node_passes(capacities, in_flight) // ranks),
                             prefix_passes=max(1, node_passes(capacities, in_flight, prefix) // ranks),
                             raw_bytes=sum(s.size for s in self.train_samples) / len(self.train_samples),
                             dtypes=tuple(dict.fromkeys((*(c.dtypes or (c.dtype,)), wire_dtype(0, c.dtype)))),
                             batches_in_flight=max(1, -(-c.depth // requests_per_batch)),
                             cached_samples=-(-cached // ranks), step_ratio=ratio, passes=passes,
                             train_samples=-(-train_sent // ranks))

    def train(self, epoch: int, done: int = 0) -> Iterator[Batch]:
        """The training batches of ``epoch``, shuffled from (seed, epoch), after the first
        ``done`` (trained already, by a run this one resumes).

        The time from handing out a batch to being asked for the next is that batch's
        step, which the planner reads as the pace of the plan the batch came from; a
        batch from the feature cache teaches it nothing.
        """
        train_loader, _ = self._running()
        batches = batches_of(epoch_order(self.train_samples, epoch, self.config.seed), self.config.batch_size)
        if self.planner is not None:
            self.planner.restarted()
        first, slices = self._slices(train_loader, batches[done:])
        try:
            for batch in to_device(train_loader.epoch([piece for piece in slices if piece], epoch, first),
                                   self.config.device):
                handed = time.perf_counter()
                yield batch
                if self.planner is not None and not batch.cached:
                    self.planner.trained(len(batch.keys), batch.wait_s, time.perf_counter() - handed)
        finally:  # a pass left early (a SIGTERM) leaves no request waiting for rank 0
            if isinstance(train_loader.steering, Leader | Follower):
                train_loader.steering.close()
        if slices and not slices[-1]:
            yield self._empty_batch()

    def validation(self) -> Iterator[Batch]:
        """The validation batches, in the manifest's order, never augmented."""
        _, val_loader = self._running()
        if self.planner is not None:
            self.planner.restarted()
        first, slices = self._slices(val_loader, batches_of(self.val_samples, self.config.batch_size))
        return to_device(val_loader.epoch([piece for piece in slices if piece], 0, first), self.config.device)

    def batch_samples(self, step: int) -> int:
        """The size of training step ``step``'s global batch (of which this rank has a slice)."""
        return min(self.config.batch_size, len(self.train_samples) - step * self.config.batch_size)

    def _slices(self, loader: PipelinedLoader, batches: list[list[Sample]]) -> tuple[int, list[list[Sample]]]:
        """This rank's slice of each batch, for a new pass named alike on every rank, and the
        place of the pass's first batch in the run's stream of batches (alike on every rank:
        a node serves a job's requests in it). Only a last batch smaller than the world
        leaves some ranks an empty slice."""
        self._passes += 1
        first, self._batches = self._batches, self._batches + len(batches)
        if isinstance(loader.steering, Leader | Follower):
            loader.steering.begin(str(self._passes))
        return first, [rank_slice(batch, self.world) for batch in batches]

    def _advance(self, features: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """Inputs of stage ``start`` run through the frozen stages [start, stop), on the device
        the stages are on (a trainer may have moved them), returned to the CPU."""
        with torch.no_grad():
            return self.frozen.stages[start:stop](features.to(self._stages_device())).cpu()

    @cached_property
    def _freeze_shape(self) -> torch.Size:
        """One sample's shape at the freeze index, from a blank image through the frozen stages (once)."""
        crop = self.config.image_size or self.model.spec.input_size
        with torch.no_grad():
            return self.frozen(torch.zeros(1, 3, crop, crop, device=self._stages_device()), 0).shape[1:]

    def _stages_device(self) -> torch.device:
        """Where the frozen stages are: a trainer may have moved them."""
        return next(self.frozen.parameters(), torch.empty(0)).device

    def _empty_batch(self) -> Batch:
        """A training step with no samples, at the freeze index: a rank whose slice of the
        last batch is empty still takes part in the step's collectives (DDP's, BatchNorm's)."""
        return Batch(torch.zeros(0, *self._freeze_shape), torch.zeros(0, dtype=torch.long), (),
                     self.model.spec.freeze_index,
                     "float32", 0, 0, 0, 0.0, 0.0)

    def _running(self) -> tuple[PipelinedLoader, PipelinedLoader]:
        if self._loaders is None:
            raise RuntimeError("the pipeline's batches come only inside `with pipeline.running():`")
        return self._loaders


def node_capacities(clients: list[StorageClient]) -> list[dict]:
    """What each node says it runs at once (``StorageClient.capacity``); {} where it cannot say."""
    capacities = []
    for client in clients:
        try:
            capacities.append(client.capacity())
        except StorageNodeError:
            capacities.append({})
    return capacities


def node_passes(capacities: list[dict], in_flight: int, prefix: str | None = None) -> int:
    """How many of ``in_flight`` requests, spread round-robin, nodes of ``capacities`` run at
    once: each node as many as it has compute slots (one where it does not say); for
    ``prefix`` (a ``layout_key``), no more than its fastest layout of that prefix has,
    where the node timed one."""
    per_node = -(-in_flight // max(len(capacities), 1))
    passes = 0
    for capacity in capacities:
        slots = int(capacity.get("compute_slots", 1))
        if prefix is not None:
            slots = min(slots, int(capacity.get("pass_layouts", {}).get(prefix, slots)))
        passes += min(slots, per_node)
    return max(1, min(passes, in_flight))


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
