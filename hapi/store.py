"""Object-store access: S3 (boto3) and a ``file://`` directory behind one small interface.

A store is addressed by URL: ``s3://bucket/prefix`` (any S3 endpoint: AWS, Swift+s3api,
MinIO, Ceph RGW; credentials from the standard boto3 chain) or ``file:///path`` (the
embedded default, like SQLite for databases). Keys are relative to the URL's prefix.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol
from urllib.parse import urlparse


class MissingObjectError(KeyError):
    """The store has no object under ``key``."""

    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key

    def __str__(self) -> str:
        return f"no object with key {self.key!r}"


class ObjectStore(Protocol):
    url: str

    def get(self, key: str) -> bytes: ...

    def put(self, key: str, data: bytes) -> None: ...


@dataclass(frozen=True)
class FileStore:
    """Objects as files under a root directory."""

    root: Path

    @property
    def url(self) -> str:
        return self.root.resolve().as_uri()

    def _path(self, key: str) -> Path:
        path = (self.root / key).resolve()
        # A key must not climb out of the store ("../../etc/passwd").
        if not path.is_relative_to(self.root.resolve()):
            raise MissingObjectError(key)
        return path

    def get(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise MissingObjectError(key) from None
        except (ValueError, OSError) as exc:
            # A key no file could have (NUL byte, name too long) names no object.
            if isinstance(exc, ValueError) or exc.errno == errno.ENAMETOOLONG:
                raise MissingObjectError(key) from None
            raise

    def put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".part")
        tmp.write_bytes(data)
        tmp.replace(path)  # readers never see half an object


class S3Store:
    """Objects in an S3 bucket under a key prefix."""

    def __init__(self, bucket: str, prefix: str = "", endpoint_url: str | None = None,
                 max_connections: int = 32) -> None:
        import boto3
        from botocore.config import Config

        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.endpoint_url = endpoint_url
        config = Config(
            s3={"addressing_style": "path"},  # Swift, MinIO and Ceph expect path style
            max_pool_connections=max_connections,
            retries={"max_attempts": 5, "mode": "standard"},
        )
        # boto3 clients are thread-safe; one is shared by every request of a process.
        self.client = boto3.client("s3", endpoint_url=endpoint_url, config=config)

    @property
    def url(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def get(self, key: str) -> bytes:
        try:
            return self.client.get_object(Bucket=self.bucket, Key=self._key(key))["Body"].read()
        except self.client.exceptions.NoSuchKey:
            raise MissingObjectError(key) from None

    def put(self, key: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data)

    def ensure_bucket(self) -> None:
        """Create the bucket if it does not exist (for uploads to a fresh store)."""
        try:
            self.client.head_bucket(Bucket=self.bucket)
        except self.client.exceptions.ClientError:
            self.client.create_bucket(Bucket=self.bucket)


def open_store(url: str, endpoint_url: str | None = None) -> ObjectStore:
    """Open the store at ``url`` (``s3://bucket/prefix`` or ``file:///path``).

    ``endpoint_url`` defaults to ``$AWS_ENDPOINT_URL`` and is needed for any S3 store
    other than AWS.
    """
    parsed = urlparse(url)
    if parsed.scheme == "file":
        return FileStore(Path(parsed.path))
    if parsed.scheme == "s3":
        if not parsed.netloc:
            raise ValueError(f"store URL {url!r} names no bucket; expected s3://bucket/prefix")
        return S3Store(parsed.netloc, parsed.path, endpoint_url or os.environ.get("AWS_ENDPOINT_URL"))
    raise ValueError(f"store URL {url!r}: expected s3://bucket/prefix or file:///path")
