"""Object-store access: S3 (boto3) and a ``file://`` directory behind one small interface.

A store is addressed by URL: ``s3://bucket/prefix`` (any S3 endpoint: AWS, Swift+s3api,
MinIO, Ceph RGW; credentials from the standard boto3 chain) or ``file:///path`` (the
embedded default, like SQLite for databases). Keys are relative to the URL's prefix.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import BinaryIO, Protocol
from urllib.parse import urlparse


class MissingObjectError(KeyError):
    """The store has no object under ``key``."""

    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key

    def __str__(self) -> str:
        return f"no object with key {self.key!r}"


class ObjectTooLargeError(ValueError):
    """An object over the size a reader accepts, refused before (or while) its body is read."""

    def __init__(self, key: str, size: int | None, limit: int) -> None:
        told = f"is {size} bytes" if size is not None else "holds more"
        super().__init__(f"object {key!r} {told}; at most {limit} bytes are read of one object")
        self.key = key
        self.limit = limit


# Told an object's size once the store knows it (file size, Content-Length), before its
# body is read; it may raise to refuse the object. Called with None where the store cannot tell.
SizeCheck = Callable[[int | None], None]


def is_plain_key(key: str) -> bool:
    """A relative key whose segments are all names: no '', '.', '..', no leading '/' or backslash.

    Such a key means the same object to every store (a file system, or an S3 server that
    normalises paths), so a prefix check on it cannot be walked around.
    """
    return bool(key) and "\\" not in key and all(part not in ("", ".", "..") for part in key.split("/"))


class ObjectStore(Protocol):
    url: str

    def get(self, key: str, max_bytes: int | None = None, on_size: SizeCheck | None = None) -> bytes: ...

    def put(self, key: str, data: bytes) -> None: ...


@dataclass(frozen=True)
class FileStore:
    """Objects as files under a root directory."""

    root: Path

    @property
    def url(self) -> str:
        return self.resolved_root.as_uri()

    @cached_property
    def resolved_root(self) -> Path:
        return self.root.resolve()  # once: resolving walks every component of the path

    def _path(self, key: str) -> Path:
        # A key must not climb out of the store ("../../etc/passwd"). A plain key cannot; any
        # other is resolved (a system call per component) and checked.
        if is_plain_key(key):
            return self.resolved_root / key
        path = (self.resolved_root / key).resolve()
        if not path.is_relative_to(self.resolved_root):
            raise MissingObjectError(key)
        return path

    def get(self, key: str, max_bytes: int | None = None, on_size: SizeCheck | None = None) -> bytes:
        """The object's bytes; over ``max_bytes`` (by its size, or as read) is ObjectTooLargeError."""
        try:
            f = self._path(key).open("rb")
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise MissingObjectError(key) from None
        except (ValueError, OSError) as exc:
            # A key no file could have (NUL byte, name too long) names no object.
            if isinstance(exc, ValueError) or exc.errno == errno.ENAMETOOLONG:
                raise MissingObjectError(key) from None
            raise
        with f:
            return _bounded_read(f, key, os.fstat(f.fileno()).st_size, max_bytes, on_size)

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

    def get(self, key: str, max_bytes: int | None = None, on_size: SizeCheck | None = None) -> bytes:
        """The object's bytes; over ``max_bytes`` (by Content-Length, or as read) is ObjectTooLargeError."""
        try:
            response = self.client.get_object(Bucket=self.bucket, Key=self._key(key))
        except self.client.exceptions.NoSuchKey:
            raise MissingObjectError(key) from None
        body = response["Body"]
        try:
            return _bounded_read(body, key, response.get("ContentLength"), max_bytes, on_size)
        finally:
            body.close()  # unread, the connection cannot be reused

    def put(self, key: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data)

    def ensure_bucket(self) -> None:
        """Create the bucket if it does not exist (for uploads to a fresh store)."""
        try:
            self.client.head_bucket(Bucket=self.bucket)
        except self.client.exceptions.ClientError:
            self.client.create_bucket(Bucket=self.bucket)


def _bounded_read(stream: BinaryIO, key: str, size: int | None, max_bytes: int | None,
                  on_size: SizeCheck | None) -> bytes:
    """Read ``stream`` whole, refusing it before reading when its ``size`` is over ``max_bytes``,
    and while reading when the stream holds more than it said."""
    if max_bytes is not None and size is not None and size > max_bytes:
        raise ObjectTooLargeError(key, size, max_bytes)
    if on_size is not None:
        on_size(size)
    if max_bytes is None:
        return stream.read()
    # One byte past what may be read tells an object that grew, or never said its size, apart;
    # asking for no more than the stated size keeps the reader from sizing a buffer to the limit.
    data = stream.read(min(size, max_bytes) + 1 if size is not None else max_bytes + 1)
    if len(data) > max_bytes:
        raise ObjectTooLargeError(key, None, max_bytes)
    return data


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
