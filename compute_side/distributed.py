"""One training job on many processes (``torchrun``): each rank's share, and one split for all.

Under ``torchrun`` every rank runs the same script. Each global batch (the user's batch
size, made from (seed, epoch) exactly as one process makes it) is cut into contiguous
slices, one per rank, so every sample is trained once per epoch and the gradients DDP
averages are the whole batch's.

Rank 0 plans. Its online planner picks the (split, dtype) of each batch as its loader
sends it and writes the pick into the job's key-value store (torch.distributed's TCP
store; plain strings, nothing unpickled) under the batch's place in the run. Another
rank's request for its slice of that batch waits for the key in its fetch thread, then
goes to the same (split, dtype): every rank trains each step from the same split, and a
switch takes effect at the same step on all of them. The storage nodes see one job: every
rank sends rank 0's job id.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
from torch import nn

from compute_side.sources import FeatureSource, Part, Planned, Sources
from hapi.datasets import Sample
from hapi.planner import OnlinePlanner

T = TypeVar("T")

# How long a rank waits for rank 0 to publish something: rank 0 may itself wait this long
# for a slow storage node; a dead rank 0 ends the job through torchrun before then.
WAIT = timedelta(minutes=30)
POLL_S = 0.005  # how often a waiting request looks for rank 0's decision


@dataclass(frozen=True)
class World:
    """This process's place in a job of ``size`` ranks, and the job's key-value store."""

    rank: int
    size: int
    store: dist.Store

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def shared(self, name: str, make: Callable[[], str]) -> str:
        """Rank 0's ``make()``, on every rank: rank 0 runs it first, the others then read its value."""
        if self.leader:
            value = make()
            self.store.set(name, value)
            return value
        self.store.wait([name])
        return self.store.get(name).decode()

    def sum(self, values: Sequence[float]) -> list[float]:
        """Each value summed over the ranks."""
        return _all_reduce(values, dist.ReduceOp.SUM)

    def max(self, value: float) -> float:
        """The largest of the ranks' values."""
        return _all_reduce([value], dist.ReduceOp.MAX)[0]

    def any(self, flag: bool) -> bool:
        """True on every rank when it is true on one (a SIGTERM, say): they stop at the same step."""
        return self.max(float(flag)) > 0


def _all_reduce(values: Sequence[float], op: dist.ReduceOp) -> list[float]:
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op)
    return tensor.tolist()


def join(device: str) -> World | None:
    """Joins the process group ``torchrun`` started this process in; None when alone.

    gloo on the CPU, NCCL on GPUs (each rank on its local GPU).
    """
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return None
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if cuda else "gloo")
    # A client of the rendezvous store the group was made with (torchrun's, or rank 0's);
    # keys are prefixed by the restart count, so a restarted job never reads a stale one.
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=WAIT)
    prefix = f"hapi/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
    return World(dist.get_rank(), dist.get_world_size(), dist.PrefixStore(prefix, store))


def leave(world: World | None, together: bool = True) -> None:
    """Leaves the group: ``together`` (a run that ended well) after every rank is done, so no
    rank stops a storage daemon another still reads from; else at once, so that torchrun sees
    this rank fail and stops the others rather than leaving them waiting in a collective."""
    if world is not None:
        if together:
            dist.barrier()
        dist.destroy_process_group()


def rank_slice(batch: Sequence[T], world: World | None) -> list[T]:
    """This rank's contiguous share of a global batch; the first ``len % size`` ranks get one more."""
    if world is None:
        return list(batch)
    base, extra = divmod(len(batch), world.size)
    start = world.rank * base + min(world.rank, extra)
    return list(batch[start: start + base + (world.rank < extra)])


class Decisions:
    """The (split, dtype) of each batch of each pass, in the job's store."""

    def __init__(self, store: dist.Store, name: str) -> None:
        self.store, self.name = store, name
        self.pass_id, self.index = "", 0
        self._lock = threading.Lock()

    def begin(self, pass_id: str) -> None:
        """A new pass over batches (an epoch's training, a validation), named alike on every rank."""
        self.pass_id, self.index = pass_id, 0

    def next_key(self) -> str:
        """The key of the next batch of this pass; batches are picked (or served from a cache) in order."""
        with self._lock:
            key = f"{self.name}/{self.pass_id}/{self.index}"
            self.index += 1
            return key


class Leader(Planned):
    """Rank 0's steering: the planner's, with every batch's pick published for the other ranks.

    A batch rank 0 serves from its feature cache still gets a decision (the plan's first
    candidate), as another rank may not hold that batch's slice.
    """

    def __init__(self, planner: OnlinePlanner, sources: Sources, world: World, name: str,
                 validation: bool = False) -> None:
        super().__init__(planner, sources, validation)
        self.decisions = Decisions(world.store, name)

    def begin(self, pass_id: str) -> None:
        self.decisions.begin(pass_id)

    def close(self) -> None:
        pass

    def pick(self, samples: int) -> FeatureSource:
        candidate = self.planner.pick(samples, training=not self.validation)
        self.decisions.store.set(self.decisions.next_key(), f"{candidate.split},{candidate.dtype}")
        return self.sources.build(candidate.split, candidate.dtype)[self.validation]

    def scout(self, samples: int) -> None:
        return None  # the other ranks send their slices of the first batch where rank 0 sends its own

    def cached(self, samples: int) -> None:
        candidate = self.planner.plan.parts[0]
        self.decisions.store.set(self.decisions.next_key(), f"{candidate.split},{candidate.dtype}")


class Follower:
    """Another rank's steering: each batch goes where rank 0 sent the same batch.

    It sends as soon as its loader has room; each request waits in its fetch thread for
    rank 0's decision. It plans nothing, so its replies teach no planner.

    The fetch threads poll for their keys rather than block in the store: a blocking wait
    holds the store client's lock, so a thread waiting for a batch rank 0 has not reached
    would keep the others from reading decisions already there, and rank 0 waits for
    those batches in DDP's all-reduce. ``close`` ends the waits of a pass left early.
    """

    settled = True

    def __init__(self, sources: Sources, world: World, name: str, validation: bool = False) -> None:
        self.sources, self.validation = sources, validation
        self.decisions = Decisions(world.store, name)
        self._closed = threading.Event()

    def begin(self, pass_id: str) -> None:
        self._closed.clear()
        self.decisions.begin(pass_id)

    def close(self) -> None:
        """The pass ends: requests still waiting for a decision give up."""
        self._closed.set()

    def pick(self, samples: int) -> Awaited:
        return Awaited(self, self.decisions.next_key())

    def cached(self, samples: int) -> None:
        self.decisions.next_key()

    def scout(self, samples: int) -> None:
        return None

    def arrived(self, part: Part, samples: int) -> None:
        pass

    def source(self, key: str) -> FeatureSource:
        store, deadline = self.decisions.store, time.monotonic() + WAIT.total_seconds()
        while not store.check([key]):
            if self._closed.wait(POLL_S):
                raise RuntimeError(f"the pass ended before rank 0 decided {key}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"rank 0 decided nothing for {key} in {WAIT}")
        split, dtype = store.get(key).decode().split(",")
        return self.sources.build(int(split), dtype)[self.validation]


class Awaited:
    """The source rank 0 decided for one batch, looked up when the batch's first request leaves."""

    def __init__(self, follower: Follower, key: str) -> None:
        self.follower, self.key = follower, key
        self._source: FeatureSource | None = None
        self._lock = threading.Lock()

    @property
    def split(self) -> int:
        return self._resolved().split

    def fetch(self, samples: Sequence[Sample], epoch: int, order: int = 0) -> Part:
        return self._resolved().fetch(samples, epoch, order)

    def _resolved(self) -> FeatureSource:
        with self._lock:
            if self._source is None:
                self._source = self.follower.source(self.key)
            return self._source


class WorldBatchNorm(nn.modules.batchnorm._BatchNorm):
    """BatchNorm whose training statistics are the whole global batch's, over every rank.

    Each rank's per-channel sum, sum of squares and count are summed across the ranks (in
    float64, so the variance keeps its precision where features' means dwarf their spread)
    by a differentiable all-reduce: forward and backward are the single-process
    BatchNorm's on the global batch, on gloo as on NCCL. A rank with an empty slice adds
    nothing but still takes part, so every rank runs the same collectives.
    """

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return super().forward(x)
        dims = [0, *range(2, x.dim())]
        wide = x.double()
        count = torch.full((1,), x.numel() / max(x.shape[1], 1), dtype=torch.float64, device=x.device)
        stats = dist_nn.all_reduce(torch.cat([wide.sum(dims), (wide * wide).sum(dims), count]))
        channels = x.shape[1]
        total = stats[-1]
        mean = stats[:channels] / total
        var = stats[channels: 2 * channels] / total - mean * mean
        if self.track_running_stats:
            with torch.no_grad():  # as BatchNorm keeps them: the unbiased variance
                momentum = self.momentum if self.momentum is not None else 1 / float(self.num_batches_tracked + 1)
                unbiased = var * total / torch.clamp(total - 1, min=1)
                self.running_mean.mul_(1 - momentum).add_(mean.to(self.running_mean.dtype), alpha=momentum)
                self.running_var.mul_(1 - momentum).add_(unbiased.to(self.running_var.dtype), alpha=momentum)
                self.num_batches_tracked.add_(1)
        shape = [1, channels] + [1] * (x.dim() - 2)
        y = ((wide - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)).to(x.dtype)
        if self.affine:
            y = y * self.weight.view(shape) + self.bias.view(shape)
        return y


def with_world_batch_norm(module: nn.Module) -> nn.Module:
    """``module`` with each BatchNorm replaced by a WorldBatchNorm holding the same state."""
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        world = WorldBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                               module.track_running_stats)
        world.load_state_dict(module.state_dict())
        return world.to(next(module.buffers(), torch.empty(0)).device)
    for name, child in module.named_children():
        module.add_module(name, with_world_batch_norm(child))
    return module
