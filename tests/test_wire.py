import json

import pytest
import torch

from hapi.transforms import TransformSpec
from hapi.wire import ExtractRequest, WireError, decode_features, encode_features, parse_json


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.uint8])
def test_features_round_trip_without_pickle(dtype: torch.dtype) -> None:
    features = (torch.rand(3, 8, 2, 2) * 255).to(dtype)
    blob = encode_features(features, ("a", "b", "c"), {"split": 5, "timings": {"forward_ms": 1.5}})
    assert b"pickle" not in blob and blob[8:9] == b"{"  # a JSON header, then raw bytes
    decoded, keys, meta = decode_features(bytearray(blob))
    assert torch.equal(decoded, features) and decoded.dtype == dtype
    assert keys == ("a", "b", "c")
    assert meta == {"split": 5, "timings": {"forward_ms": 1.5}}


def test_decoded_features_are_a_view_of_the_buffer() -> None:
    buffer = bytearray(encode_features(torch.zeros(2, 4), ("a", "b"), {}))
    decoded, _, _ = decode_features(buffer)
    decoded[0, 0] = 7.0
    assert decode_features(buffer)[0][0, 0] == 7.0


def test_malformed_responses_are_wire_errors() -> None:
    with pytest.raises(WireError):
        decode_features(bytearray(b"\x01\x00"))
    blob = encode_features(torch.zeros(2, 4), ("a", "b"), {})
    with pytest.raises(WireError):
        decode_features(bytearray(blob[:-8]))


def test_uint8_images_are_a_request_at_split_0() -> None:
    request = ExtractRequest.from_json({"keys": ["a"], "model": "resnet18", "split": 0, "dtype": "uint8"})
    assert request.dtype == "uint8" and request.split == 0


def test_request_round_trips_through_json() -> None:
    request = ExtractRequest(keys=("x", "y"), model="resnet18", split=4,
                             transform=TransformSpec(crop_size=64, resize_size=72, augment=True),
                             dtype="bfloat16", epoch=3, job_id="j1", order=7)
    assert ExtractRequest.from_json(json.loads(json.dumps(request.to_json()))) == request


@pytest.mark.parametrize("body, message", [
    ([], "JSON object"),
    ({"model": "resnet18", "split": 1}, "missing field 'keys'"),
    ({"keys": [], "model": "resnet18", "split": 1}, "non-empty list"),
    ({"keys": ["a", "a"], "model": "resnet18", "split": 1}, "duplicates"),
    ({"keys": ["a"], "model": "resnet18", "split": "1"}, "'split' must be a int"),
    ({"keys": ["a"], "model": "resnet18", "split": True}, "'split' must be a int"),
    ({"keys": ["a"], "model": "resnet18", "split": 1, "dtype": "int8"}, "dtype 'int8'"),
    ({"keys": ["a"], "model": "resnet18", "split": 1, "dtype": "uint8"}, "only split 0 ships"),
    ({"keys": ["a"], "model": "resnet18", "split": 1, "colour": 1}, "unknown field"),
    ({"keys": ["a"], "model": "resnet18", "split": 1, "order": 1.5}, "'order' must be a int"),
    ({"keys": ["a"], "model": "resnet18", "split": 1, "transform": {"crop_size": 4}}, "bad 'transform'"),
])
def test_bad_requests_name_what_is_wrong(body: object, message: str) -> None:
    with pytest.raises(WireError, match=message):
        ExtractRequest.from_json(body)


@pytest.mark.parametrize("payload, words", [
    (b"[" * 5000 + b"]" * 5000, "nested deeper"),
    (b'{"a": [[[[[[[[1]]]]]]]]}', "nested deeper"),
    (b'{"a": NaN}', "NaN is not a number"),
    (b'{"a": -Infinity}', "-Infinity is not a number"),
    (b'{"a": 1e999}', "out of range"),
    (b'{"a": ' + b"1" * 5000 + b"}", "not usable JSON"),
    (b'{"\\ud800": 1}', "lone surrogate"),
    (b'["x\\udc00y"]', "lone surrogate"),
    (b"\xff{}", "not UTF-8"),
    (b"{", "not JSON"),
])
def test_parse_json_refuses_what_is_not_strict_json(payload: bytes, words: str) -> None:
    with pytest.raises(WireError, match=words):
        parse_json(payload)


def test_parse_json_takes_a_real_request() -> None:
    body = ExtractRequest(keys=("é/ü.jpg",), model="resnet18", split=4).to_json()
    assert ExtractRequest.from_json(parse_json(json.dumps(body).encode())).keys == ("é/ü.jpg",)
