"""``POST /v1/profile``: the node times its own stages, for the compute tier's planner.

Timings are taken on this node as it is (its cores, its threads, its GPU, its load), on
random inputs of the requested size: a stage's time does not depend on the pixels. On a
GPU each stage is timed from a synchronised start to a synchronised end.
"""

from __future__ import annotations

import statistics
import time

import torch

from storage_side.memory import CPU, autocast_context
from storage_side.prefix_cache import LoadedPrefix


def profile_stages(prefix: LoadedPrefix, batch_sizes: tuple[int, ...], repeats: int,
                   compute_dtype: torch.dtype, device: torch.device = CPU) -> list[dict]:
    """Per frozen stage: its name, the split after it, output bytes per sample, median ms per batch size."""
    input_size = prefix.key[2]
    ms: dict[int, list[float]] = {}
    layout = {"memory_format": torch.channels_last} if device.type == "cuda" else {}
    for batch in batch_sizes:
        x = torch.randn(batch, 3, input_size, input_size).to(device, **layout)
        runs: list[list[float]] = []
        with torch.inference_mode(), autocast_context(compute_dtype, device):
            prefix.stages(x)  # warm-up: first calls pick kernels and fill caches
            for _ in range(repeats):
                h, times = x, []
                for stage in prefix.stages:
                    started = _clock(device)
                    h = stage(h)
                    times.append((_clock(device) - started) * 1e3)
                runs.append(times)
        ms[batch] = [statistics.median(stage_times) for stage_times in zip(*runs)]
    return [
        {"index": i, "split": i + 1, "name": name,
         "output_bytes_per_sample": prefix.memory.output_numel[i + 1] * torch.float32.itemsize,
         "ms": {str(batch): round(ms[batch][i], 3) for batch in batch_sizes}}
        for i, name in enumerate(prefix.stage_names[: len(prefix.stages)])
    ]


def _clock(device: torch.device) -> float:
    """Now, once the work queued on ``device`` is done (a GPU runs it asynchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
