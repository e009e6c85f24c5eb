"""``POST /v1/profile``: the node times its own stages, for the compute tier's planner.

Timings are taken on this node as it is (its cores, its threads, its load), on random
inputs of the requested size: a stage's time does not depend on the pixels.
"""

from __future__ import annotations

import statistics
import time

import torch

from storage_side.memory import autocast_context
from storage_side.prefix_cache import LoadedPrefix


def profile_stages(prefix: LoadedPrefix, batch_sizes: tuple[int, ...], repeats: int,
                   compute_dtype: torch.dtype) -> list[dict]:
    """Per frozen stage: its name, the split after it, output bytes per sample, median ms per batch size."""
    input_size = prefix.key[2]
    ms: dict[int, list[float]] = {}
    for batch in batch_sizes:
        x = torch.randn(batch, 3, input_size, input_size)
        runs: list[list[float]] = []
        with torch.inference_mode(), autocast_context(compute_dtype):
            prefix.stages(x)  # warm-up: first calls pick kernels and fill caches
            for _ in range(repeats):
                h, times = x, []
                for stage in prefix.stages:
                    started = time.perf_counter()
                    h = stage(h)
                    times.append((time.perf_counter() - started) * 1e3)
                runs.append(times)
        ms[batch] = [statistics.median(stage_times) for stage_times in zip(*runs)]
    return [
        {"index": i, "split": i + 1, "name": name,
         "output_bytes_per_sample": prefix.memory.output_numel[i + 1] * torch.float32.itemsize,
         "ms": {str(batch): round(ms[batch][i], 3) for batch in batch_sizes}}
        for i, name in enumerate(prefix.stage_names[: len(prefix.stages)])
    ]
