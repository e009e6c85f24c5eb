"""Features this tier received, kept for the epochs after the first.

Without augmentation a sample's features at a split are the same every epoch: frozen
stages run in eval mode and the transform draws nothing per epoch (invariant 1). So an
epoch after the first need not cross the network or ask the storage tier again. An entry
is keyed by everything its features depend on: the model, the weights id and the
transform (a ``CacheScope``), the split and the wire dtype, and the object's key and its
size from the manifest, so an object uploaded again with other bytes is read again,
never served stale.

The features live in memory for one run, or with a ``directory`` on local disk as one
safetensors file a sample, where the next run over the same data set finds them too (a
linear probe tried at several learning rates extracts its features once).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from compute_side.sources import Part
from hapi.datasets import Sample
from hapi.transforms import TransformSpec

log = logging.getLogger(__name__)

# 2 GiB holds a linear probe's features for 100k samples at the freeze index of every
# model in the zoo (ResNet-50 ships 2048 floats a sample, 8 KB; VGG 4096, 16 KB), and is
# small beside the memory of a host that trains: the cache grows only while it fits.
DEFAULT_MAX_BYTES = 2 * 1024 ** 3
UNITS = {"": 1, "K": 1024, "M": 1024 ** 2, "G": 1024 ** 3, "T": 1024 ** 4}


def parse_size(text: str) -> int:
    """Bytes from ``"0"``, ``"512M"``, ``"2G"``, ``"1.5G"`` (binary units, an optional trailing B)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?\s*", text.upper())
    if match is None:
        raise ValueError(f"size {text!r}: expected a number of bytes with an optional K, M, G or T, e.g. 2G")
    return int(float(match.group(1)) * UNITS[match.group(2)])


@dataclass(frozen=True)
class _Entry:
    size: int  # the object's size in the manifest when its features were kept
    split: int
    dtype: str
    nbytes: int  # what it holds of the budget
    features: torch.Tensor | None  # in memory; None: in ``path``
    path: Path | None = None

    def load(self) -> torch.Tensor:
        return self.features if self.features is not None else load_file(self.path)["features"]


class FeatureCache:
    """Per-sample features within a byte budget, shared by a run's loaders.

    A batch is served only whole and at one split, because a batch carries one split to
    the trainer. Where its samples were kept at different splits (the planner moved or
    explored while they first arrived), the scope's ``advance`` runs the rows kept at
    shallower splits through the frozen stages to the deepest of them: work the trainer
    would do on those rows anyway, from their own split on, so the batch costs nothing
    more than if every row had been kept at that depth. Nothing is evicted to admit more: every epoch reshuffles, so
    each sample is as likely as any to be needed next, and an eviction would only trade
    one miss for another at the cost of the copy. A sample whose features arrive at
    another split or dtype (the planner moved) replaces its entry: one entry per object.
    """

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES, directory: Path | None = None) -> None:
        self.max_bytes = max_bytes
        self.directory = directory
        self.bytes = 0
        if directory is not None:
            directory.mkdir(parents=True, exist_ok=True)
            self.bytes = sum(p.stat().st_size for p in directory.rglob("*.safetensors"))
        self._entries: dict[tuple[CacheScope, str], _Entry] = {}
        self._lock = threading.Lock()
        self._warned = False

    def get(self, scope: CacheScope, samples: Sequence[Sample]) -> Part | None:
        """The features of all ``samples``, in order, at one split and dtype; None unless all are kept."""
        started = time.perf_counter()
        with self._lock:
            entries = [self._entry(scope, s.key) for s in samples]
        if not entries or any(e is None or e.size != s.size for e, s in zip(entries, samples)):
            return None
        first = entries[0]
        if all((e.split, e.dtype) == (first.split, first.dtype) for e in entries):
            features, split, dtype = torch.stack([e.load() for e in entries]), first.split, first.dtype
        elif scope.advance is not None:
            split, dtype = max(max(e.split, 0) for e in entries), "float32"
            features = _advanced(entries, split, scope.advance)
        else:
            return None
        now = time.perf_counter()
        elapsed_ms = (now - started) * 1e3
        return Part(features, split, dtype, wire_bytes=0, elapsed_ms=elapsed_ms, link_interval=(now, now),
                    timings={"cache_ms": elapsed_ms})

    def put(self, scope: CacheScope, samples: Sequence[Sample], part: Part) -> None:
        """Keep each sample's row of ``part`` while the budget allows."""
        features = part.features.cpu()  # one copy from a GPU for the whole request, not one a row
        with self._lock:
            for sample, row in zip(samples, features):
                old = self._entry(scope, sample.key)
                if old is not None:
                    self.bytes -= old.nbytes
                    del self._entries[(scope, sample.key)]
                    if old.path is not None:
                        old.path.unlink(missing_ok=True)
                if self.bytes + row.nbytes > self.max_bytes:
                    self._warn_full_once()
                    continue
                # A copy, in host memory (what the budget bounds): a view would keep the whole
                # request's tensor alive for one row.
                entry = _Entry(sample.size, part.split, part.dtype, row.nbytes, row.clone())
                if self.directory is not None:
                    entry = self._write(scope, sample.key, entry)
                self._entries[(scope, sample.key)] = entry
                self.bytes += entry.nbytes

    def _path(self, scope: CacheScope, key: str) -> Path:
        return self.directory / scope.digest / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.safetensors"

    def _entry(self, scope: CacheScope, key: str) -> _Entry | None:
        """The kept entry of ``key``: known to this run, or found on disk from an earlier one."""
        entry = self._entries.get((scope, key))
        if entry is None and self.directory is not None:
            path = self._path(scope, key)
            if path.is_file():
                with safe_open(str(path), "pt") as f:
                    meta = f.metadata()
                if meta.get("key") == key:  # a digest collision would name another object
                    entry = _Entry(int(meta["size"]), int(meta["split"]), meta["dtype"], path.stat().st_size, None,
                                   path)
                    self._entries[(scope, key)] = entry
        return entry

    def _write(self, scope: CacheScope, key: str, entry: _Entry) -> _Entry:
        path = self._path(scope, key)
        if not path.parent.is_dir():
            path.parent.mkdir()
            (path.parent / "scope.json").write_text(json.dumps(scope.describe()))  # for a person looking in
        # Written aside and renamed: a run killed mid-write leaves no torn file for the next.
        partial = path.with_suffix(".partial")
        save_file({"features": entry.features}, str(partial), metadata={
            "key": key, "size": str(entry.size), "split": str(entry.split), "dtype": entry.dtype})
        os.replace(partial, path)
        return _Entry(entry.size, entry.split, entry.dtype, path.stat().st_size, None, path)

    def _warn_full_once(self) -> None:
        if not self._warned:
            self._warned = True
            log.warning("feature cache full at %.1f MB: the samples it cannot keep cross the network every epoch; "
                        "a larger --feature-cache keeps them", self.bytes / 1e6)


# Runs inputs of stage ``start`` through the frozen stages [start, stop), returning them on the CPU.
Advance = Callable[[torch.Tensor, int, int], torch.Tensor]


def _advanced(entries: Sequence[_Entry], split: int, advance: Advance) -> torch.Tensor:
    """The entries' features as the input of stage ``split``, in order: rows kept at a
    shallower split run through the stages between, a group per split they were kept at."""
    rows: list[torch.Tensor | None] = [None] * len(entries)
    for start in {max(e.split, 0) for e in entries}:  # all-in-compute rows are stage 0's input
        at = [i for i, e in enumerate(entries) if max(e.split, 0) == start]
        group = torch.stack([entries[i].load().float() for i in at])
        for i, row in zip(at, advance(group, start, split) if start < split else group):
            rows[i] = row
    return torch.stack(rows)


@dataclass(frozen=True)
class CacheScope:
    """One model, weights and transform in a cache: what one loader reads and fills.

    ``advance`` (the model's frozen stages) lets a batch whose samples were kept at
    different splits be served at the deepest of them; without it such a batch is a miss.
    """

    cache: FeatureCache = field(compare=False, repr=False)
    model: str
    weights: str
    transform: TransformSpec
    advance: Advance | None = field(default=None, compare=False, repr=False)

    @cached_property
    def digest(self) -> str:
        """A name for the scope that is the same in every process (a directory on disk)."""
        return hashlib.sha256(json.dumps(self.describe(), sort_keys=True).encode()).hexdigest()[:32]

    def describe(self) -> dict:
        return {"model": self.model, "weights": self.weights, "transform": self.transform.to_dict()}

    def get(self, samples: Sequence[Sample]) -> Part | None:
        return self.cache.get(self, samples)

    def put(self, samples: Sequence[Sample], part: Part) -> None:
        self.cache.put(self, samples, part)
