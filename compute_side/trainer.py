"""Trains stages [split, end) of a staged model on features from the storage tier.

Stages [split, freeze) are frozen: eval mode, no gradients, exactly as the storage tier
runs them, so a sample's features never depend on where the cut is. Stages [freeze,
end) train. Every optimiser step sees exactly one user batch.

On a CUDA device the stages run in bf16 autocast with CNN activations in channels_last
(the layout its convolution kernels are fastest in), and batches are copied to it without
blocking the host; on the CPU everything stays float32, as the storage tier computes.

In a job of many ranks (``torchrun``) the trained stages are wrapped in
DistributedDataParallel, each rank trains its slice of the global batch, and each rank's
loss is its slice's summed loss over the global batch's size, so the averaged gradient is
the whole batch's mean, as one process would compute it, whatever the slices' sizes
(empty ones too). BatchNorm in the trained stages (every new head standardises its input
with one) takes its statistics over the global batch (``WorldBatchNorm``).
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from compute_side.distributed import with_world_batch_norm
from hapi.models import StagedModel

OPTIMIZERS = ("sgd", "adam")


@dataclass(frozen=True)
class TrainConfig:
    optimizer: str = "sgd"
    lr: float = 0.01
    momentum: float = 0.9
    weight_decay: float = 1e-4
    device: str = "cpu"  # "cpu", "cuda" or "cuda:N"


class HeadTrainer:
    """Trains the stages after the freeze index; runs the frozen ones a batch still needs.

    Each batch says where it was cut (its ``split``), so the split may change from one
    batch to the next (re-planning) without touching what is trained.
    """

    def __init__(self, model: StagedModel, config: TrainConfig, distributed: bool = False) -> None:
        self.freeze = model.spec.freeze_index
        self.device = torch.device(config.device)
        cuda = self.device.type == "cuda"
        layout = {"memory_format": torch.channels_last} if cuda else {}
        self.frozen = nn.Sequential(*model.stages[: self.freeze]).to(self.device, **layout).eval().requires_grad_(False)
        self.trainable = nn.Sequential(*model.stages[self.freeze:]).to(self.device, **layout).train()
        self.world_size = dist.get_world_size() if distributed else 1
        self._ddp: DistributedDataParallel | None = None
        if distributed:  # rank 0's initial weights reach every rank here
            # A copy: the model's own stages stay as built, for whatever times them on one rank.
            self.trainable = with_world_batch_norm(copy.deepcopy(self.trainable))
            self._ddp = DistributedDataParallel(self.trainable, device_ids=[self.device.index] if cuda else None)
        self._autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if cuda else contextlib.nullcontext
        self._channels_last = cuda
        params = [p for p in self.trainable.parameters() if p.requires_grad]
        if config.optimizer == "sgd":
            self.optimizer = torch.optim.SGD(params, lr=config.lr, momentum=config.momentum,
                                             weight_decay=config.weight_decay)
        elif config.optimizer == "adam":
            self.optimizer = torch.optim.Adam(params, lr=config.lr, weight_decay=config.weight_decay)
        else:
            raise ValueError(f"unknown optimizer {config.optimizer!r}; choose one of {OPTIMIZERS}")
        self.loss_fn = nn.CrossEntropyLoss()

    def _on_device(self, features: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Features may arrive in a narrower wire dtype; the model computes in float32 (or
        # under autocast on a GPU).
        features = features.to(self.device, non_blocking=True).float()
        if self._channels_last and features.dim() == 4:
            features = features.contiguous(memory_format=torch.channels_last)
        return features, labels.to(self.device, non_blocking=True)

    def _frozen_forward(self, features: torch.Tensor, split: int) -> torch.Tensor:
        with torch.no_grad():
            return self.frozen[max(split, 0):](features)  # all-in-compute (-1) starts at 0

    def train_step(self, features: torch.Tensor, labels: torch.Tensor, split: int, batch_samples: int = 0) -> float:
        """One optimiser step on exactly this batch, cut at ``split``; returns its mean loss.

        ``batch_samples``: the global batch's size when this is one rank's slice of it (which
        may be empty: the rank still takes part in the step).
        """
        # BatchNorm cannot take batch statistics of one sample; such a (last, partial)
        # batch still trains, on the running statistics.
        self.trainable.train((batch_samples or len(labels)) > 1)
        features, labels = self._on_device(features, labels)
        with self._autocast():
            trained = self._ddp if self._ddp is not None else self.trainable
            logits = trained(self._frozen_forward(features, split)).float()
            if batch_samples:  # DDP averages the ranks' gradients: this makes it the batch's mean
                summed = nn.functional.cross_entropy(logits, labels, reduction="sum")
                loss = summed * (self.world_size / batch_samples)
            else:
                loss = self.loss_fn(logits, labels)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        return (summed.item() / max(len(labels), 1)) if batch_samples else loss.item()

    @torch.no_grad()
    def evaluate_batch(self, features: torch.Tensor, labels: torch.Tensor, split: int) -> tuple[float, int]:
        """(summed loss, number correct) on one batch, with the head in eval mode."""
        self.trainable.eval()
        features, labels = self._on_device(features, labels)
        with self._autocast():
            logits = self.trainable(self._frozen_forward(features, split)).float()
        loss = nn.functional.cross_entropy(logits, labels, reduction="sum").item()
        return loss, int((logits.argmax(1) == labels).sum())

    def state_dict(self) -> dict:
        """What a checkpoint needs: the trained stages and the optimiser's state."""
        return {"trainable": self.trainable.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.trainable.load_state_dict(state["trainable"])
        self.optimizer.load_state_dict(state["optimizer"])
