"""What crosses the network between the tiers: the extract request and the feature encoding.

Requests are JSON. Features travel as one safetensors blob: a self-describing header
(dtype, shape, and metadata that lists the sample keys in row order) and the raw tensor
bytes. Nothing received is ever unpickled.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field

import torch
from safetensors.torch import save as safetensors_save

from hapi.models import RANDOM_WEIGHTS
from hapi.transforms import TransformSpec

FEATURES_CONTENT_TYPE = "application/vnd.safetensors"
# The shared bearer token between the tiers, when a deployment sets one.
TOKEN_ENV = "HAPI_STORAGE_TOKEN"
WIRE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


class WireError(ValueError):
    """A request or response that does not follow the schema."""


def _checked_fields(cls: type, body: object, required: tuple[str, ...], types: dict[str, type]) -> dict:
    """``body`` as a dict of ``cls``'s fields: no unknown, none required missing, scalars typed."""
    if not isinstance(body, dict):
        raise WireError("request body must be a JSON object")
    unknown = set(body) - set(cls.__dataclass_fields__)
    if unknown:
        raise WireError(f"unknown field(s) {sorted(unknown)}")
    for name in required:
        if name not in body:
            raise WireError(f"missing field {name!r}")
    for name, kind in types.items():
        # bool is an int to Python, never to this schema.
        if name in body and (not isinstance(body[name], kind) or isinstance(body[name], bool)):
            raise WireError(f"{name!r} must be a {kind.__name__}, got {body[name]!r}")
    return body


@dataclass(frozen=True)
class ExtractRequest:
    """Run stages [0, split) of ``model`` on the samples ``keys``; reply with features."""

    keys: tuple[str, ...]
    model: str
    split: int
    weights: str = RANDOM_WEIGHTS  # "random", "torchvision:<enum>" or "sha256:<digest>"
    transform: TransformSpec = field(default_factory=TransformSpec)
    dtype: str = "float32"
    epoch: int = 0  # seeds per-sample augmentation
    job_id: str = "default"

    def to_json(self) -> dict:
        return {
            "keys": list(self.keys), "model": self.model, "split": self.split, "weights": self.weights,
            "transform": self.transform.to_dict(), "dtype": self.dtype, "epoch": self.epoch,
            "job_id": self.job_id,
        }

    @classmethod
    def from_json(cls, body: object) -> ExtractRequest:
        body = _checked_fields(cls, body, required=("keys", "model", "split"),
                               types={"model": str, "split": int, "weights": str, "dtype": str, "epoch": int,
                                      "job_id": str})
        keys = body["keys"]
        if not isinstance(keys, list) or not keys or not all(isinstance(k, str) and k for k in keys):
            raise WireError("'keys' must be a non-empty list of non-empty strings")
        if len(set(keys)) != len(keys):
            raise WireError("'keys' holds duplicates")
        if body.get("dtype", "float32") not in WIRE_DTYPES:
            raise WireError(f"dtype {body['dtype']!r} not one of {sorted(WIRE_DTYPES)}")
        try:
            transform = TransformSpec.from_dict(body.get("transform", {}))
        except (TypeError, ValueError) as exc:
            raise WireError(f"bad 'transform': {exc}") from None
        fields = {k: v for k, v in body.items() if k not in ("keys", "transform")}
        return cls(keys=tuple(keys), transform=transform, **fields)


def encode_features(features: torch.Tensor, keys: tuple[str, ...], metadata: dict[str, object]) -> bytes:
    """One safetensors blob: ``features`` (rows in ``keys`` order) plus JSON metadata."""
    meta = {name: json.dumps(value) for name, value in metadata.items()}
    meta["keys"] = json.dumps(list(keys))
    return safetensors_save({"features": features.contiguous()}, metadata=meta)


def decode_features(blob: bytearray) -> tuple[torch.Tensor, tuple[str, ...], dict[str, object]]:
    """Inverse of ``encode_features``; the tensor is a view of ``blob``, not a copy.

    Parsed by hand (the format is an 8-byte length, a JSON header, then raw data) because
    ``safetensors.torch.load`` copies every tensor. ``blob`` must be writable (a bytearray)
    since later stages may work in place; immutable bytes are copied once.
    """
    if isinstance(blob, bytes):
        blob = bytearray(blob)
    try:
        (header_len,) = struct.unpack_from("<Q", blob)
        header = json.loads(blob[8: 8 + header_len])
        meta = header.pop("__metadata__")
        entry = header["features"]
        start, end = entry["data_offsets"]
        dtype = _SAFETENSORS_DTYPES[entry["dtype"]]
        offset = 8 + header_len + start
        shape = entry["shape"]
        count = end - start
        data = torch.frombuffer(blob, dtype=dtype, count=count // dtype.itemsize, offset=offset)
        keys = tuple(json.loads(meta.pop("keys")))
    except (struct.error, ValueError, KeyError, TypeError) as exc:
        raise WireError(f"malformed features response: {exc}") from None
    if len(keys) != (shape[0] if shape else 0):
        raise WireError(f"features hold {shape[0] if shape else 0} rows for {len(keys)} keys")
    return data.view(shape), keys, {name: json.loads(value) for name, value in meta.items()}


@dataclass(frozen=True)
class ProfileRequest:
    """Time each frozen stage of ``model`` on a storage node, at each of ``batch_sizes``.

    The node answers with milliseconds per stage and batch size, output bytes per sample,
    and its measured memory model: what a planner needs to cost a split on that node.
    """

    model: str
    weights: str = RANDOM_WEIGHTS
    input_size: int = 224
    batch_sizes: tuple[int, ...] = (1, 8, 32)
    repeats: int = 3  # timings are the median of this many runs
    job_id: str = "profile"

    def to_json(self) -> dict:
        return {"model": self.model, "weights": self.weights, "input_size": self.input_size,
                "batch_sizes": list(self.batch_sizes), "repeats": self.repeats, "job_id": self.job_id}

    @classmethod
    def from_json(cls, body: object) -> ProfileRequest:
        body = _checked_fields(cls, body, required=("model",),
                               types={"model": str, "weights": str, "input_size": int, "repeats": int,
                                      "job_id": str})
        sizes = body.get("batch_sizes", list(cls.batch_sizes))
        if (not isinstance(sizes, list) or not sizes
                or not all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in sizes)):
            raise WireError(f"'batch_sizes' must be a non-empty list of positive integers, got {sizes!r}")
        if not 8 <= body.get("input_size", cls.input_size) <= 4096:
            raise WireError(f"input_size {body['input_size']} not in 8..4096")
        if not 1 <= body.get("repeats", cls.repeats) <= 20:
            raise WireError(f"repeats {body['repeats']} not in 1..20")
        return cls(**{**body, "batch_sizes": tuple(sizes)})
