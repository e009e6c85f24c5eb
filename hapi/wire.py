"""What crosses the network between the tiers: the extract request and the feature encoding.

Requests are JSON. Features travel as one safetensors blob: a self-describing header
(dtype, shape, and metadata that lists the sample keys in row order) and the raw tensor
bytes. Nothing received is ever unpickled.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, field

import torch
from safetensors.torch import save as safetensors_save

from hapi.models import RANDOM_WEIGHTS
from hapi.transforms import TransformSpec

FEATURES_CONTENT_TYPE = "application/vnd.safetensors"
# The shared bearer token between the tiers, when a deployment sets one.
TOKEN_ENV = "HAPI_STORAGE_TOKEN"
WIRE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
               "uint8": torch.uint8}
# Wire dtypes that carry the decoded, cropped image itself (0..255, not normalised; the
# receiving tier normalises it): only stage 0's input is an image, so only split 0 has them.
IMAGE_WIRE_DTYPES = ("uint8",)
_SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "U8": torch.uint8}


def wire_dtype_allowed(dtype: str, split: int) -> bool:
    """Whether features cut at ``split`` may cross the wire in ``dtype``."""
    return dtype in WIRE_DTYPES and (split == 0 or dtype not in IMAGE_WIRE_DTYPES)


def wire_dtype(split: int, dtype: str) -> str:
    """The dtype features cut at ``split`` cross the wire in, for a run that asked for
    ``dtype``: at split 0 the features are the decoded crop, 8-bit pixels that the
    receiving tier normalises, so uint8 carries them exactly in a quarter of float32's
    bytes (a 16-bit float would carry them in twice uint8's); every other split, ``dtype``."""
    return IMAGE_WIRE_DTYPES[0] if split == 0 else dtype


# The schema nests three deep (request -> transform -> mean); anything deeper is not a request.
def layout_key(model: str, input_size: int) -> str:
    """How a node names a model at an input size in its pass layouts (``GET /v1/models``)."""
    return f"{model} {input_size}px"


MAX_JSON_DEPTH = 8
# /v1/profile's own bounds: a handful of distinct batch sizes, a few timed runs each.
MAX_PROFILE_BATCH_SIZES = 8
MAX_PROFILE_REPEATS = 10
MAX_PROFILE_BATCH = 4096


class WireError(ValueError):
    """A request or response that does not follow the schema."""


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # "1e400" parses to inf
        raise WireError(f"number {text} is out of range")
    return value


def _no_constant(name: str) -> float:
    raise WireError(f"{name} is not a number JSON allows")


def parse_json(data: bytes) -> object:
    """A request body parsed as strict JSON: UTF-8, finite numbers, strings that are text
    (no lone surrogates), nested at most MAX_JSON_DEPTH deep. Anything else is a WireError."""
    try:
        text = data.decode("utf-8")
        body = json.loads(text, parse_float=_finite_float, parse_constant=_no_constant)
    except UnicodeDecodeError as exc:
        raise WireError(f"body is not UTF-8 ({exc.reason} at byte {exc.start})") from None
    except RecursionError:
        raise WireError(f"JSON nested deeper than {MAX_JSON_DEPTH} levels") from None
    except json.JSONDecodeError as exc:
        raise WireError(f"body is not JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None
    except ValueError as exc:  # an integer past Python's digit limit
        raise WireError(f"body is not usable JSON ({str(exc)[:120]})") from None
    _check_json_tree(body)
    return body


def _check_json_tree(body: object) -> None:
    """Iterative, so depth cannot exhaust the stack here either."""
    stack = [(body, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, str):
            _check_text(value)
        elif isinstance(value, dict | list):
            if depth > MAX_JSON_DEPTH:
                raise WireError(f"JSON nested deeper than {MAX_JSON_DEPTH} levels")
            if isinstance(value, dict):
                for key in value:
                    _check_text(key)
                value = value.values()
            stack.extend((item, depth + 1) for item in value)


def _check_text(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise WireError(f"string {text[:40]!r} holds a lone surrogate (U+{ord(text[exc.start]):04X}), "
                        "not text") from None


def shorten(value: object, limit: int = 80) -> str:
    """``repr(value)``, cut to ``limit`` characters: error messages echo what was sent, not all of it."""
    text = repr(value) if not isinstance(value, int) or abs(value) < 10**limit else f"<{value.bit_length()}-bit int>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _checked_fields(cls: type, body: object, required: tuple[str, ...], types: dict[str, type]) -> dict:
    """``body`` as a dict of ``cls``'s fields: no unknown, none required missing, scalars typed."""
    if not isinstance(body, dict):
        raise WireError(f"request body must be a JSON object, got {type(body).__name__}")
    unknown = set(body) - set(cls.__dataclass_fields__)
    if unknown:
        raise WireError(f"unknown field(s) {sorted(unknown)}")
    for name in required:
        if name not in body:
            raise WireError(f"missing field {name!r}")
    for name, kind in types.items():
        # bool is an int to Python, never to this schema.
        if name in body and (not isinstance(body[name], kind) or isinstance(body[name], bool)):
            raise WireError(f"{name!r} must be a {kind.__name__}, got {shorten(body[name])}")
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
    # The request's batch's place in its job's stream (every rank's batch i of an epoch has
    # the same): a node runs a job's requests in this order, the trainer's next one first.
    order: int = 0

    def to_json(self) -> dict:
        return {
            "keys": list(self.keys), "model": self.model, "split": self.split, "weights": self.weights,
            "transform": self.transform.to_dict(), "dtype": self.dtype, "epoch": self.epoch,
            "job_id": self.job_id, "order": self.order,
        }

    @classmethod
    def from_json(cls, body: object) -> ExtractRequest:
        body = _checked_fields(cls, body, required=("keys", "model", "split"),
                               types={"model": str, "split": int, "weights": str, "dtype": str, "epoch": int,
                                      "job_id": str, "order": int})
        keys = body["keys"]
        if not isinstance(keys, list) or not keys or not all(isinstance(k, str) and k for k in keys):
            raise WireError("'keys' must be a non-empty list of non-empty strings")
        if len(set(keys)) != len(keys):
            raise WireError("'keys' holds duplicates")
        if body.get("dtype", "float32") not in WIRE_DTYPES:
            raise WireError(f"dtype {shorten(body['dtype'])} not one of {sorted(WIRE_DTYPES)}")
        if not wire_dtype_allowed(body.get("dtype", "float32"), body["split"]):
            raise WireError(f"dtype {body['dtype']} carries images, which only split 0 ships; split "
                            f"{body['split']} needs one of {sorted(set(WIRE_DTYPES) - set(IMAGE_WIRE_DTYPES))}")
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
    since later stages may work in place; immutable bytes are copied once. Every field of
    the header is checked against the blob before any tensor is made of it.
    """
    if isinstance(blob, bytes):
        blob = bytearray(blob)
    if len(blob) < 8:
        raise WireError(f"malformed features response: {len(blob)} bytes, shorter than its length prefix")
    (header_len,) = struct.unpack_from("<Q", blob)
    _require(header_len <= len(blob) - 8, f"header length {header_len} past the end of {len(blob)} bytes")
    try:
        header = parse_json(bytes(blob[8: 8 + header_len]))
    except WireError as exc:
        raise WireError(f"malformed features response: {exc}") from None
    _require(isinstance(header, dict), "header is not a JSON object")
    meta, entry = header.get("__metadata__"), header.get("features")
    _require(isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values()),
             "'__metadata__' is not an object of strings")
    _require(isinstance(entry, dict), "no 'features' tensor")
    dtype = _SAFETENSORS_DTYPES.get(entry.get("dtype")) if isinstance(entry.get("dtype"), str) else None
    _require(dtype is not None, f"dtype {shorten(entry.get('dtype'))} not one of {sorted(_SAFETENSORS_DTYPES)}")
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    _require(isinstance(shape, list) and len(shape) >= 1 and all(type(d) is int and d >= 0 for d in shape),
             f"shape {shorten(shape)} is not a list of sizes")
    _require(isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
             and 0 <= offsets[0] <= offsets[1] <= len(blob) - 8 - header_len,
             f"data_offsets {shorten(offsets)} outside the {len(blob) - 8 - header_len} data bytes")
    start, end = offsets
    _require(end - start == math.prod(shape) * dtype.itemsize,
             f"{end - start} data bytes for shape {shape} of {dtype}")
    try:
        keys = json.loads(meta.pop("keys", "null"))
        extra = {name: json.loads(value) for name, value in meta.items()}
    except (ValueError, RecursionError) as exc:
        raise WireError(f"malformed features response: metadata is not JSON ({str(exc)[:80]})") from None
    _require(isinstance(keys, list) and all(isinstance(k, str) for k in keys), "metadata 'keys' is not a list of keys")
    if len(keys) != shape[0]:
        raise WireError(f"features hold {shape[0]} rows for {len(keys)} keys")
    data = torch.frombuffer(blob, dtype=dtype, count=(end - start) // dtype.itemsize,
                            offset=8 + header_len + start) if end > start else torch.empty(0, dtype=dtype)
    return data.view(shape), tuple(keys), extra


def _require(condition: bool, what: str) -> None:
    if not condition:
        raise WireError(f"malformed features response: {what}")


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
        if (not isinstance(sizes, list) or not 1 <= len(sizes) <= MAX_PROFILE_BATCH_SIZES
                or not all(type(b) is int and 1 <= b <= MAX_PROFILE_BATCH for b in sizes)
                or len(set(sizes)) != len(sizes)):
            raise WireError(f"'batch_sizes' must be 1 to {MAX_PROFILE_BATCH_SIZES} distinct integers in "
                            f"1..{MAX_PROFILE_BATCH}, got {str(sizes)[:200]}")
        if not 8 <= body.get("input_size", cls.input_size) <= 4096:
            raise WireError(f"input_size {shorten(body['input_size'])} not in 8..4096")
        if not 1 <= body.get("repeats", cls.repeats) <= MAX_PROFILE_REPEATS:
            raise WireError(f"repeats {shorten(body['repeats'])} not in 1..{MAX_PROFILE_REPEATS}")
        return cls(**{**body, "batch_sizes": tuple(sizes)})
