"""Measurements the planner needs, taken on the machine at hand.

Per stage: the real output size per sample (the stage's output tensor, not its internals)
and the forward time per sample on a tier; for the trainable stages, forward + backward
+ optimiser step per sample; per sample decode time. Nothing here is hard-coded for one
kind of hardware: each tier times itself (the storage node through its profile endpoint).
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from hapi.models import StagedModel
from hapi.synthetic import render_jpeg
from hapi.transforms import TransformSpec, preprocess


@dataclass(frozen=True)
class TierTimes:
    """One tier's measured costs, in milliseconds per sample."""

    host: str
    batch_size: int
    threads: int
    decode_ms: float  # fetch excluded: JPEG decode + transform
    forward_ms: tuple[float, ...]  # per stage, eval mode, no gradients
    train_ms: float = 0.0  # forward + backward + step of the trainable stages (compute tier only)
    # Reading an object from the store: on the storage tier, the node's reads next to it; on
    # the compute tier, all-in-compute's reads across the link, as its loader makes them.
    fetch_ms: float = 0.0
    request_ms: float = 0.0  # fixed cost of one request to the storage tier, as the client sees it
    # This tier's own CPU for those reads (the client's work per object), which on the
    # compute tier competes with training.
    fetch_cpu_ms: float = 0.0


def host_name() -> str:
    """A hardware key for saved profiles: CPU model and thread count."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu} x{torch.get_num_threads()}"


def output_elements(model: StagedModel, input_size: int) -> tuple[int, ...]:
    """Elements per sample of each stage's output (index i: the output of stage i)."""
    sizes = []
    x = torch.zeros(1, 3, input_size, input_size)
    with torch.inference_mode():
        for stage in model.stages:
            x = stage(x)
            sizes.append(x[0].numel())
    return tuple(sizes)


def time_forward(stages: nn.Sequential, input_size: int, batch_size: int, repeats: int = 3) -> tuple[float, ...]:
    """Per-sample forward time of each stage (ms), eval mode, median over ``repeats``."""
    runs: list[list[float]] = []
    with torch.inference_mode():
        for _ in range(repeats + 1):  # the first run warms caches and allocators up
            x = torch.randn(batch_size, 3, input_size, input_size)
            times = []
            for stage in stages:
                started = time.perf_counter()
                x = stage(x)
                times.append((time.perf_counter() - started) * 1e3 / batch_size)
            runs.append(times)
    return tuple(statistics.median(column) for column in zip(*runs[1:]))


def time_decode(transform: TransformSpec, samples: int = 8) -> float:
    """Per-sample decode + transform time (ms) of ImageNet-sized JPEGs."""
    blobs = [render_jpeg(i % 10, i) for i in range(samples)]
    preprocess(blobs[0], "warm-up", transform)  # the first decode loads codecs and fills caches
    started = time.perf_counter()
    for i, blob in enumerate(blobs):
        preprocess(blob, str(i), transform)
    return (time.perf_counter() - started) * 1e3 / samples


def time_training(model: StagedModel, input_size: int, batch_size: int, repeats: int = 3) -> float:
    """Per-sample forward + backward + SGD step (ms) of the trainable stages, on their real input."""
    freeze = model.spec.freeze_index
    with torch.inference_mode():
        x = torch.randn(batch_size, 3, input_size, input_size)
        for stage in model.stages[:freeze]:
            x = stage(x)
    x = x.clone()  # out of inference mode, so autograd may use it
    trainable = nn.Sequential(*model.stages[freeze:]).train()
    optimizer = torch.optim.SGD(trainable.parameters(), lr=0.0)  # lr 0: time it, change nothing
    labels = torch.zeros(batch_size, dtype=torch.long)  # class 0 exists whatever the head's width
    times = []
    for _ in range(repeats + 1):
        started = time.perf_counter()
        loss = nn.functional.cross_entropy(trainable(x), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        times.append((time.perf_counter() - started) * 1e3 / batch_size)
    trainable.eval()
    return statistics.median(times[1:])


def profile_tier(model: StagedModel, input_size: int, batch_size: int, stages_upto: int,
                 with_training: bool) -> TierTimes:
    """Time this host: decode, forward of stages [0, stages_upto), and training if asked."""
    transform = TransformSpec(crop_size=input_size, resize_size=round(input_size * 256 / 224))
    return TierTimes(
        host=host_name(), batch_size=batch_size, threads=torch.get_num_threads(),
        decode_ms=time_decode(transform),
        forward_ms=time_forward(nn.Sequential(*model.stages[:stages_upto]), input_size, batch_size),
        train_ms=time_training(model, input_size, batch_size) if with_training else 0.0,
    )


@dataclass(frozen=True)
class Profile:
    """Everything the planner weighs for one model, input size and pair of hosts."""

    model: str
    input_size: int
    stage_names: tuple[str, ...]
    freeze_index: int
    output_elements: tuple[int, ...]
    storage: TierTimes
    compute: TierTimes
    raw_bytes: float  # mean encoded object size per sample
    bandwidth: float  # bytes/s between the tiers
    # (split, ms per sample): the node's pace with requests overlapping as in training (its
    # fetches, decodes and forwards share its cores), at a split whose replies the link does
    # not pace; None where it could not be measured. The planner anchors its model of the
    # node here.
    node_anchor: tuple[int, float] | None = None
    # (split, wire dtype, ms per sample) readings of a short training run at a candidate
    # (split -1: all-in-compute), its pipeline full, as the run would train: taken for the
    # planner's contenders, where the model's ranking is close. Measured anew for each run.
    trial_paces: tuple[tuple[int, str, float], ...] = ()

    def trial_pace(self, split: int, dtype: str) -> float | None:
        """The pace a trial run measured at this candidate (median of the readings), if any."""
        readings = [ms for s, d, ms in self.trial_paces if (s, d) == (split, dtype)]
        return statistics.median(readings) if readings else None

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> Profile:
        body = json.loads(text)
        for tier in ("storage", "compute"):
            body[tier] = TierTimes(**{**body[tier], "forward_ms": tuple(body[tier]["forward_ms"])})
        anchor = body["node_anchor"]
        return cls(**{**body, "stage_names": tuple(body["stage_names"]),
                      "output_elements": tuple(body["output_elements"]),
                      "node_anchor": tuple(anchor) if anchor else None,
                      "trial_paces": tuple(tuple(pace) for pace in body["trial_paces"])})


def main(argv: list[str] | None = None) -> int:
    """``python -m hapi.profile --model M [--storage-node URL]``: measure and save a profile."""
    import argparse
    import logging
    import sys

    from compute_side import deployment
    from compute_side.client import StorageNodeError
    from compute_side.profiling import measure_profile
    from hapi.models import build_model
    from hapi.store import open_store
    from hapi.train import DEFAULT_DEPTH, default_cache_dir
    from hapi.wire import ExtractRequest

    parser = argparse.ArgumentParser(prog="python -m hapi.profile", description=main.__doc__)
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--weights", default="random")
    parser.add_argument("--image-size", type=int)
    parser.add_argument("--batch-size", type=int, default=16, help="batch size the stages are timed at")
    parser.add_argument("--profiles-dir", type=Path, help="default: CACHE/profiles")
    parser.add_argument("--depth", type=int, default=DEFAULT_DEPTH,
                        help="requests in flight while the node's pace is measured, as in hapi.train")
    deployment.add_arguments(parser, default_cache_dir())
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    try:
        model = build_model(args.model, args.weights, args.image_size)
        size = args.image_size or model.spec.input_size
        store_url, manifest = deployment.open_dataset(args)
        template = ExtractRequest(keys=(), model=args.model, split=0, weights=model.weights_id,
                                  transform=TransformSpec(crop_size=size, resize_size=round(size * 256 / 224)),
                                  job_id="profile")
        with deployment.storage_nodes(args, store_url) as clients:
            profile = measure_profile(model, clients[0], open_store(store_url, args.endpoint_url), template,
                                      manifest.split("train"), args.batch_size,
                                      args.profiles_dir or args.cache_dir / "profiles", args.depth, refresh=True)
    except (StorageNodeError, ValueError, LookupError, RuntimeError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"{profile.model} at {size} px; storage: {profile.storage.host}; compute: {profile.compute.host}")
    print(f"link {profile.bandwidth * 8 / 1e6:.1f} Mbit/s; raw objects {profile.raw_bytes / 1e3:.1f} KB/sample; "
          f"decode storage {profile.storage.decode_ms:.2f} / compute {profile.compute.decode_ms:.2f} ms/sample; "
          f"object fetch {profile.storage.fetch_ms:.2f} ms/sample on the node, {profile.compute.fetch_ms:.2f} across "
          f"the link ({profile.compute.fetch_cpu_ms:.2f} of client CPU); request {profile.storage.request_ms:.1f} ms; "
          f"training step {profile.compute.train_ms:.2f} ms/sample; with requests overlapping the node works "
          + (f"{profile.node_anchor[1]:.2f} ms/sample at split {profile.node_anchor[0]}" if profile.node_anchor
             else "at a pace not measured (the link would set it)"))
    print(f"{'stage':4s} {'name':20s} {'output KB':>10s} {'storage ms':>11s} {'compute ms':>11s}   (per sample)")
    for i in range(profile.freeze_index):
        print(f"{i:4d} {profile.stage_names[i]:20s} {profile.output_elements[i] * 4 / 1e3:10.1f} "
              f"{profile.storage.forward_ms[i]:11.3f} {profile.compute.forward_ms[i]:11.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
