"""The storage daemon's options, documented in one place (`python -m storage_side --help`).

Each field carries its own help text; ``__main__`` builds the command line from these
fields, so an option, its default and its documentation cannot drift apart.
"""

from __future__ import annotations

import ipaddress
import os
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from hapi.measure import cache_dir
from hapi.store import is_plain_key
from storage_side.memory import default_memory_budget

COMPUTE_DTYPES = ("float32", "bfloat16")
# From this many cores up, decoding runs in worker processes by default (see decode_workers):
# on 2 cores workers serve split 0 faster than threads, which share the daemon's GIL; on one
# core there is nothing to spread, and a worker only adds its IPC (experiments/results/node_scale/).
PROCESS_DECODE_FROM_CORES = 2


def _option(default: Any, help: str, **kwargs: Any) -> Any:  # noqa: A002  (argparse's name)
    return field(default=default, metadata={"help": help}, **kwargs)


@dataclass(frozen=True)
class DaemonConfig:
    store_url: str = field(metadata={"help": "s3://bucket/prefix or file:///path: the store this node serves"})
    endpoint_url: str | None = _option(None, "S3 endpoint of this node's store (Swift, MinIO, Ceph...); "
                                             "default $AWS_ENDPOINT_URL")
    dataset_prefixes: tuple[str, ...] = field(default_factory=tuple, metadata={
        "help": "a key prefix under --store that requests may read (e.g. imagenet/); repeatable. Keys "
                "outside every one are answered 404 like missing ones. Default: every key under --store, "
                "so give --store the data sets' own prefix (s3://bucket/datasets), not a whole bucket"})
    host: str = _option("127.0.0.1", "address to listen on; one other than loopback needs a token, or --insecure")
    port: int = _option(8470, "port to listen on")
    insecure: bool = _option(
        False, "serve a non-loopback --host without a token: anyone who reaches the port reads the data sets")
    server: str = _option(
        "auto", "waitress, gunicorn (one process, gthread), or auto: waitress. waitress reads each request "
                "whole on its event loop before a thread runs it, so slow or idle clients hold no thread; "
                "gunicorn's gthread hands a connection to a thread before reading it, and 32 idle "
                "connections stall every other client")
    server_threads: int = _option(
        32, "HTTP threads. Requests waiting for memory wait in the daemon's own fair queue, not in the "
            "server's accept queue, so keep this above the number of concurrent clients")
    max_connections: int = _option(
        1000, "open client connections (waitress); beyond it new ones wait in the kernel's accept queue")
    client_timeout_s: float = _option(
        30.0, "seconds a connection may stay idle or send nothing before it is closed (slow or stalled clients)")
    io_threads: int = _option(8, "concurrent object GETs, shared by all requests")
    cores: int = _option(
        0, "cores this daemon runs on: it pins itself and its decode workers to the first N of the cores it "
           "starts on (its CPU affinity: taskset, cpusets), leaving the rest to the object store on the same "
           "node; every count below that defaults to the cores follows it. 0: all of them")
    decode_workers: int | None = _option(
        None, "processes that decode and transform images (one core each, off the daemon's GIL; each holds "
              "~390 MB of its own, its interpreter and torch, counted in the memory budget); 0 decodes on one "
              "thread per core of the daemon's own process instead. Default: one process per core from 2 cores "
              "up; on one core, threads (a worker would only add its IPC and its memory)")
    torch_threads: int = _option(
        0, "intra-op threads of each forward pass; 0: the cores divided among the passes running at once, "
           "read at each sub-batch (all of them for a request alone, one each when every compute slot is busy); "
           "and no more passes of a prefix at once than its fastest layout has, timed on these cores the first "
           "time a model runs here (1, 2, 4, ... passes at once, and one per core) and kept in --state-dir")
    state_dir: Path | None = _option(
        None, "where the daemon keeps what it measured of this host (pass layouts) for later starts; default "
              "$HAPI_CACHE/node, or ~/.cache/hapi/node")
    compute_dtype: str = _option(
        "float32", "float32, or bfloat16: run the prefix under CPU autocast (faster on CPUs with bf16 "
                   "units; features deviate by ~1e-2 relative to float32, see the README). On --device cuda "
                   "the prefix always runs under bf16 autocast, as the compute tier's trainer does")
    device: str = _option(
        "cpu", "where the prefix runs: cpu, cuda, cuda:N, or auto (CUDA when this host has it, else the CPU). "
               "On CUDA it runs under bf16 autocast in channels_last, its weights and activations stay there, "
               "and --gpu-memory-budget bounds them; decoding stays on the CPUs")
    gpu_memory_budget: int | None = _option(
        None, "bytes of GPU memory (e.g. 40GiB) the prefix may use on --device cuda: loaded weights, "
              "sub-batches and their activations, measured per stage when a model loads; sub-batches "
              "shrink and requests queue to stay within it. Default: what is free on the device at start")
    memory_budget: int | None = _option(
        None, "bytes (e.g. 6GiB, 800M) this daemon's process may use in all, models and requests "
              "included; default: half of the machine's memory or of its cgroup's limit, whichever is lower")
    memory_headroom: float = _option(
        0.1, "fraction of the budget never reserved: allocator slack, HTTP buffers, decoder scratch")
    max_sub_batch: int = _option(
        16, "the largest sub-batch a request runs the prefix on; the daemon picks fewer when memory is short "
            "(features do not depend on it: frozen layers run in eval mode)")
    min_sub_batch: int = _option(
        4, "a request waits for memory rather than run sub-batches smaller than this (a sub-batch of 1 "
           "runs several times slower per sample), unless no more could ever fit; at most --max-sub-batch")
    adapt: bool = _option(
        True, "memory-aware admission and sub-batch adaptation; --no-adapt runs every request's whole batch "
              "at once, unqueued (the reference system's behaviour; for comparison only: it can run out of memory)")
    max_running: int = _option(
        0, "requests running at once (holding memory, fetching, decoding, computing); the rest wait their "
           "turn. 0: the compute slots (one per core, or per --torch-threads cores) and one more per decode "
           "worker (at least one), so requests fetch and decode while the others compute")
    max_queue: int = _option(64, "requests waiting for memory, over all jobs; beyond it: 503 + Retry-After")
    queue_timeout_s: float = _option(30.0, "seconds a request may wait for memory before 503 + Retry-After")
    max_keys_per_request: int = _option(1024, "keys per extract request; beyond it: 413")
    max_request_bytes: int = _option(1 << 20, "bytes of a request body; beyond it: 413")
    max_request_header_bytes: int = _option(
        64 << 10, "bytes of a request's line and headers together; beyond it: 431 (waitress)")
    max_image_pixels: int = _option(
        1 << 26, "pixels an image may decode or resize to (e.g. 8192 x 8192); read from its header and "
                 "refused (413) before any decode. Only the first frame of an animated image is ever decoded")
    max_object_bytes: int = _option(
        256 << 20, "bytes of one object (an image or a tar shard): refused (413) by its size before it is read, "
                   "or while reading where the store does not tell the size; the bytes of a request's objects "
                   "are also charged to its memory reservation before they are read")
    token: str | None = field(default=None, repr=False, metadata={
        "help": "shared bearer token; requests without it get 401. Read from $HAPI_STORAGE_TOKEN or "
                "--token-file, never from the command line (it would show in ps); an empty or blank one "
                "is an error, never 'no authentication'"})
    log_format: str = _option("text", "text, or json: one JSON object per log line")
    weights_files: tuple[Path, ...] = field(default_factory=tuple, metadata={
        "help": "a state_dict file requests may use (named by its sha256); repeatable"})

    def __post_init__(self) -> None:
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"compute_dtype {self.compute_dtype!r} not one of {COMPUTE_DTYPES}")
        if not 0 <= self.memory_headroom < 1:
            raise ValueError(f"memory_headroom {self.memory_headroom} must be in [0, 1)")
        for name in ("max_sub_batch", "min_sub_batch", "io_threads", "server_threads", "max_keys_per_request",
                     "max_connections", "max_image_pixels", "max_object_bytes", "max_request_header_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.client_timeout_s <= 0:
            raise ValueError(f"client_timeout_s must be > 0, got {self.client_timeout_s}")
        if self.token is not None and not self.token.strip():
            raise ValueError("the token is empty or blank: that would turn authentication off. Put a secret in "
                             "the token file (or $HAPI_STORAGE_TOKEN), or give neither on a loopback --host")
        if not self.token and not self.insecure and not is_loopback(self.host):
            raise ValueError(f"--host {self.host} is reachable from other machines and no token is set: set "
                             "$HAPI_STORAGE_TOKEN or --token-file, or pass --insecure to serve the data sets to "
                             "anyone who reaches the port")
        for prefix in self.dataset_prefixes:
            if not is_plain_key(prefix.rstrip("/")):
                raise ValueError(f"dataset prefix {prefix!r} must be a relative key prefix without '.', '..' or "
                                 "empty segments (e.g. imagenet/)")
        if self.max_queue < 0 or self.queue_timeout_s < 0 or self.max_running < 0:
            raise ValueError("max_queue, max_running and queue_timeout_s must be >= 0")
        if self.cores < 0 or self.torch_threads < 0 or (self.decode_workers or 0) < 0:
            raise ValueError("cores, torch_threads and decode_workers must be >= 0")

    def budget_bytes(self) -> int:
        """``memory_budget``, or by default half of the machine's memory or of its cgroup's limit."""
        return self.memory_budget or default_memory_budget()

    def headroom_bytes(self) -> int:
        """The part of the budget no request reserves: allocator slack, and freed memory kept for reuse."""
        return int(self.budget_bytes() * self.memory_headroom)

    def layouts_file(self) -> Path:
        """The file of this host's measured pass layouts (see ``storage_side.layout``)."""
        return (self.state_dir or cache_dir() / "node") / "layouts.json"

    def torch_device(self) -> torch.device:
        """The device of ``device``, resolved and checked (see ``resolve_device``)."""
        return resolve_device(self.device)

    def core_count(self) -> int:
        """The cores this daemon uses: ``cores``, within those it may run on."""
        return min(self.cores or usable_cpus(), usable_cpus())

    def compute_slots(self) -> int:
        """Forward passes run at once: one per group of ``torch_threads`` cores, or (auto) one per core."""
        return max(1, self.core_count() // (self.torch_threads or 1))

    def decode_processes(self) -> int:
        """Decode worker processes: ``decode_workers``, or (auto) one per core from 2 cores up; 0: threads."""
        if self.decode_workers is not None:
            return self.decode_workers
        return self.core_count() if self.core_count() >= PROCESS_DECODE_FROM_CORES else 0

    def running_limit(self) -> int:
        """``max_running``, or (0: auto) the compute slots and one more per decode worker (at
        least one more): a request decoding in a worker holds no slot, so each worker keeps
        one request's decode going while the slots run prefixes."""
        return self.max_running or self.compute_slots() + max(1, self.decode_processes())


def resolve_device(name: str) -> torch.device:
    """``auto``: the first CUDA device when this host has one, else the CPU; ``cpu``,
    ``cuda`` or ``cuda:N`` as given, with its index. A ValueError says what is wrong."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"--device {name!r}: expected auto, cpu, cuda or cuda:N") from None
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise ValueError(f"--device {name!r}: expected auto, cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        raise ValueError(f"--device {name}: this host has no CUDA device")
    index = torch.cuda.current_device() if device.index is None else device.index
    if index >= torch.cuda.device_count():
        raise ValueError(f"--device {name}: this host has {torch.cuda.device_count()} CUDA device(s)")
    return torch.device("cuda", index)


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or "localhost") is reachable only from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


def usable_cpus() -> int:
    """The cores this process may run on: its affinity (taskset, cpusets), not the machine's."""
    return len(os.sched_getaffinity(0))


def option_help(name: str) -> str:
    """The documentation of one DaemonConfig field."""
    return next(f.metadata["help"] for f in fields(DaemonConfig) if f.name == name)


_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
          "ki": 1 << 10, "mi": 1 << 20, "gi": 1 << 30, "ti": 1 << 40}


def parse_size(text: str) -> int:
    """Bytes from ``"2GiB"``, ``"512M"``, ``"1.5g"`` or ``"1000000"``."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]i?)?b?\s*", text.lower())
    if not match:
        raise ValueError(f"not a size: {text!r} (examples: 2GiB, 512M, 1000000)")
    return int(float(match.group(1)) * _UNITS[match.group(2) or ""])
