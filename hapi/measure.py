"""What a model's stages cost on this host, measured once per hardware and saved.

A ``HostProfile`` holds, per sample: each frozen stage's forward time, the trainable
stages' training step, and JPEG decode + transform; and each stage's output size. The
planner takes the stages' proportions from it for both tiers (a stage's share of the
prefix is the model's; the speed of the hardware that runs it is learned from the run).
Profiles of the machines the project is tested on ship in the top-level ``profiles/``;
one measured here is saved under the cache directory and found there next time.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
import platform
import re
import statistics
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from hapi.models import StagedModel
from hapi.synthetic import render_jpeg
from hapi.transforms import TransformSpec, preprocess

log = logging.getLogger(__name__)

SHIPPED_PROFILES = Path(__file__).resolve().parent.parent / "profiles"
PROFILE_BATCH = 16  # the batch the stages are timed at: per-sample times change little above it
CPU = torch.device("cpu")


@dataclass(frozen=True)
class HostProfile:
    """One host's measured costs for one model and input size, in ms per sample."""

    host: str
    model: str
    input_size: int
    output_elements: tuple[int, ...]  # per sample, the output of stage i
    forward_ms: tuple[float, ...]  # per frozen stage, eval mode, no gradients
    train_ms: float  # forward + backward + optimiser step of the trainable stages
    decode_ms: float  # JPEG decode + transform

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> HostProfile:
        body = json.loads(text)
        return cls(**{**body, "output_elements": tuple(body["output_elements"]),
                      "forward_ms": tuple(body["forward_ms"])})


def cache_dir() -> Path:
    """Where this host keeps what HAPI measured and made of it: $HAPI_CACHE, or ~/.cache/hapi."""
    return Path(os.environ.get("HAPI_CACHE", Path.home() / ".cache" / "hapi"))


def host_name(device: torch.device = CPU) -> str:
    """A hardware key for saved profiles: the GPU's name, or the CPU model and the threads
    torch uses."""
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} cuda bf16"
    return f"{cpu_name()} x{torch.get_num_threads()}"


def cpu_name() -> str:
    """This host's CPU model, as the kernel names it."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def profile_path(directory: Path, host: str, model: str, input_size: int) -> Path:
    slug = re.sub(r"[^A-Za-z0-9]+", "-", host).strip("-").lower()
    return directory / slug / f"{model}-{input_size}.json"


def host_profile(model: StagedModel, input_size: int, cache_dir: Path, refresh: bool = False,
                 device: torch.device = CPU) -> HostProfile:
    """The profile of ``model`` the planner starts from: this host's on ``device``, shipped
    or saved in ``cache_dir``; else another host's of the same kind of device, model and
    input size; else measured now (seconds before the first batch, nothing over the
    network) and saved there. ``refresh`` measures this host whatever is saved.

    Another host's profile serves because the planner takes only the stages' proportions
    from it and learns each tier's speed from the run; measuring first would make every
    new host's first job wait for it.
    """
    host = host_name(device)
    if not refresh:
        saved = [profile_path(directory, host, model.spec.name, input_size)
                 for directory in (SHIPPED_PROFILES, cache_dir)]
        kin = sorted((path for directory in (SHIPPED_PROFILES, cache_dir)
                      for path in directory.glob(f"*/{model.spec.name}-{input_size}.json")
                      if path not in saved and _same_kind(path.parent.name, host)),
                     key=lambda path: (not _same_threads(path.parent.name, host), str(path)))
        for path in saved + kin:
            profile = _load(path)
            if profile is not None:
                if path in kin:
                    log.info("no profile of %s: the planner starts from %s's (%s); "
                             "python -m hapi.measure measures this host", host, profile.host, path)
                return profile
    profile = measure_host(model, input_size, device=device)
    path = profile_path(cache_dir, host, model.spec.name, input_size)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(profile.to_json())
    log.info("profile of this host saved to %s", path)
    return profile


def _same_kind(slug: str, host: str) -> bool:
    """Whether a profile directory is of a host like ``host``: a GPU's for a GPU, a CPU's
    for a CPU (their stages' proportions differ)."""
    return slug.endswith("-cuda-bf16") == host.endswith(" cuda bf16")


def _same_threads(slug: str, host: str) -> bool:
    """Whether a CPU profile's directory was measured on as many torch threads as ``host``."""
    return slug.endswith("-" + host.rsplit(" ", 1)[-1].lower())


def _load(path: Path) -> HostProfile | None:
    if not path.is_file():
        return None
    try:
        return HostProfile.from_json(path.read_text())
    except (TypeError, KeyError, ValueError) as exc:
        log.warning("not using %s: it does not load (%s)", path, exc)
        return None


def measure_host(model: StagedModel, input_size: int, batch_size: int = PROFILE_BATCH,
                 device: torch.device = CPU) -> HostProfile:
    """Time this host: decode (on its CPU), every frozen stage's forward, and the training
    step, on ``device`` as the trainer runs them there (bf16 autocast on a GPU).

    It runs on copies of the model's stages with the RNG state restored afterwards, so
    measuring never changes what a run learns (BatchNorm statistics, dropout draws).
    """
    freeze = model.spec.freeze_index
    stages = nn.Sequential(*copy.deepcopy(list(model.stages)))
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        transform = TransformSpec(crop_size=input_size, resize_size=round(input_size * 256 / 224))
        timed = stages.to(device)
        return HostProfile(
            host=host_name(device), model=model.spec.name, input_size=input_size,
            output_elements=output_elements(stages, input_size),
            forward_ms=time_forward(timed[:freeze], input_size, batch_size, device=device),
            train_ms=time_training(timed, freeze, input_size, batch_size, device=device),
            decode_ms=time_decode(transform),
        )


def step_ratio(model: StagedModel, profile: HostProfile, device: torch.device = CPU) -> Future[float]:
    """This host's frozen prefix and training step of ``model`` against ``profile``'s, a
    ratio of times: where the profile is another host's, what this tier's work in it is
    scaled by here until the run's own steps measure it. Both, because a head may be a
    single small layer whose time says little of a convolution's. The stages are copied
    now; one pass after a warm-up is timed on a thread of its own (on this thread's torch
    threads), the step on that pass's features, touching nothing a job computes or draws,
    so that it runs while the job's first batch is in flight."""
    stages = nn.Sequential(*copy.deepcopy(list(model.stages))).to(device)
    freeze, threads = model.spec.freeze_index, torch.get_num_threads()

    def timed() -> float:
        torch.set_num_threads(threads)  # a new thread starts with torch's default
        started = time.perf_counter()
        runs, features = _timed_passes(stages[:freeze], profile.input_size, PROFILE_BATCH, 1, device,
                                       torch.Generator(device=device))
        step_ms = time_training(stages, freeze, profile.input_size, PROFILE_BATCH, repeats=1, device=device,
                                beside_a_job=True, features=features)
        ratio = (sum(runs[0]) + step_ms) / (sum(profile.forward_ms) + profile.train_ms)
        log.info("this tier runs %s's prefix and step at %.2fx the time of %s's profile (timed in %.1f s)",
                 model.spec.name, ratio, profile.host, time.perf_counter() - started)
        return ratio

    pool = ThreadPoolExecutor(1, thread_name_prefix="step-ratio")
    future = pool.submit(timed)
    pool.shutdown(wait=False)  # the thread ends with the step; nothing waits for it here
    return future


def _clock(device: torch.device) -> float:
    """perf_counter once the device has finished what it was given (kernels run async)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _autocast(device: torch.device) -> contextlib.AbstractContextManager:
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()


def output_elements(stages: nn.Sequential, input_size: int) -> tuple[int, ...]:
    """Elements per sample of each stage's output (index i: the output of stage i)."""
    sizes = []
    x = torch.zeros(1, 3, input_size, input_size, device=next(stages.parameters()).device)
    with torch.inference_mode():
        for stage in stages.eval():
            x = stage(x)
            sizes.append(x[0].numel())
    return tuple(sizes)


def time_forward(stages: nn.Sequential, input_size: int, batch_size: int, repeats: int = 3,
                 device: torch.device = CPU, beside_a_job: bool = False) -> tuple[float, ...]:
    """Per-sample forward time of each stage (ms), eval mode, median over ``repeats``;
    ``beside_a_job``: the inputs drawn from a private generator."""
    generator = torch.Generator(device=device) if beside_a_job else None
    runs, _ = _timed_passes(stages, input_size, batch_size, repeats, device, generator)
    return tuple(statistics.median(column) for column in zip(*runs))


def _timed_passes(stages: nn.Sequential, input_size: int, batch_size: int, repeats: int, device: torch.device,
                  generator: torch.Generator | None) -> tuple[list[list[float]], torch.Tensor]:
    """Per-sample time of each stage (ms) in each of ``repeats`` passes over random images,
    eval mode, after one that warms caches and allocators up; and the last pass's output."""
    runs = []
    with torch.inference_mode(), _autocast(device):
        for _ in range(repeats + 1):
            x = torch.randn(batch_size, 3, input_size, input_size, device=device, generator=generator)
            times = []
            for stage in stages.eval():
                started = _clock(device)
                x = stage(x)
                times.append((_clock(device) - started) * 1e3 / batch_size)
            runs.append(times)
    return runs[1:], x


def time_decode(transform: TransformSpec, samples: int = 8) -> float:
    """Per-sample decode + transform time (ms) of ImageNet-sized JPEGs."""
    blobs = [render_jpeg(i % 10, i) for i in range(samples)]
    preprocess(blobs[0], "warm-up", transform)  # the first decode loads codecs and fills caches
    started = time.perf_counter()
    for i, blob in enumerate(blobs):
        preprocess(blob, str(i), transform)
    return (time.perf_counter() - started) * 1e3 / samples


def time_training(stages: nn.Sequential, freeze: int, input_size: int, batch_size: int, repeats: int = 3,
                  device: torch.device = CPU, beside_a_job: bool = False,
                  features: torch.Tensor | None = None) -> float:
    """Per-sample forward + backward + SGD step (ms) of stages [freeze, end), on their real
    input: ``features`` (the frozen stages' output of a batch), else computed here from
    ``batch_size`` images. ``stages`` is changed: pass a copy. ``beside_a_job``: draw
    nothing from torch's global generator (inputs from a private one, the trainable stages
    in eval mode, so no dropout draws), so that it may run while a job trains."""
    if features is None:
        generator = torch.Generator(device=device) if beside_a_job else None
        with torch.inference_mode(), _autocast(device):
            inputs = torch.randn(batch_size, 3, input_size, input_size, device=device, generator=generator)
            features = stages[:freeze].eval()(inputs)
    x = features.float().clone()  # out of inference mode, so autograd may use it
    trainable = stages[freeze:].train(not beside_a_job)
    optimizer = torch.optim.SGD(trainable.parameters(), lr=0.0)
    labels = torch.zeros(len(x), dtype=torch.long, device=device)  # class 0 exists whatever the head's width
    times = []
    for _ in range(repeats + 1):
        started = _clock(device)
        with _autocast(device):
            loss = nn.functional.cross_entropy(trainable(x).float(), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        times.append((_clock(device) - started) * 1e3 / len(x))
    return statistics.median(times[1:])


def main(argv: list[str] | None = None) -> int:
    """``python -m hapi.measure --model M --image-size N [--save-to DIR]``: measure this host."""
    import argparse

    from hapi.models import MODELS, build_model

    parser = argparse.ArgumentParser(prog="python -m hapi.measure", description=main.__doc__)
    parser.add_argument("--model", default="resnet50", help=f"one of {', '.join(MODELS)}")
    parser.add_argument("--image-size", type=int, help="default: the model's")
    parser.add_argument("--save-to", type=Path, default=SHIPPED_PROFILES,
                        help="profiles directory (default: the project's profiles/)")
    args = parser.parse_args(argv)
    model = build_model(args.model, input_size=args.image_size)
    size = args.image_size or model.spec.input_size
    profile = measure_host(model, size)
    path = profile_path(args.save_to, profile.host, profile.model, size)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(profile.to_json())
    print(f"{profile.host}: {profile.model} at {size} px, frozen forward {sum(profile.forward_ms):.2f} ms, "
          f"training step {profile.train_ms:.2f} ms, decode {profile.decode_ms:.2f} ms per sample -> {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
