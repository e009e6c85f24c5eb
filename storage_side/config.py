"""The storage daemon's options, documented in one place (`python -m storage_side --help`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class DaemonConfig:
    store_url: str  # s3://bucket/prefix or file:///path: the store this node serves
    endpoint_url: str | None = None  # S3 endpoint on this node (Swift, MinIO, Ceph...)
    host: str = "127.0.0.1"
    port: int = 8470
    server: str = "auto"  # gunicorn (gthread), waitress, or auto: gunicorn where it runs
    server_threads: int = 4  # concurrent requests served
    io_threads: int = 8  # concurrent object GETs and decodes per node
    torch_threads: int = 0  # intra-op threads for the prefix; 0 leaves torch's default
    sub_batch: int = 16  # samples per forward pass of the prefix
    max_keys_per_request: int = 1024
    max_request_bytes: int = 1 << 20
    model_cache_size: int = 4  # prefixes kept loaded, least recently used evicted
    # Operator-configured state_dict files; requests name them by their sha256 digest.
    weights_files: tuple[Path, ...] = field(default_factory=tuple)
