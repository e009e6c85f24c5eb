"""Property-based fuzzing of what the daemon parses from the network (hypothesis).

Whatever bytes arrive, the request parser and the features decoder either return a value
that satisfies the schema or raise WireError: never another exception, never a hang. The
app built on them answers every fuzzed request with JSON and a 4xx (or 200), never a 5xx.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from experiments.attacks import encode_json, json_values, near_requests, request_payloads
from hapi.transforms import TransformSpec
from hapi.wire import ExtractRequest, ProfileRequest, WireError, decode_features, encode_features, parse_json
from storage_side.app import create_app
from storage_side.config import DaemonConfig

FAST = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

@FAST
@given(st.binary(max_size=200) | near_requests().map(encode_json) | json_values.map(encode_json))
def test_parse_and_validate_raise_only_wire_errors(payload: bytes) -> None:
    try:
        request = ExtractRequest.from_json(parse_json(payload))
    except WireError:
        return
    assert request.keys and all(isinstance(k, str) and k for k in request.keys)
    assert all(math.isfinite(v) for v in (*request.transform.mean, *request.transform.std))
    assert isinstance(request.transform, TransformSpec) and min(request.transform.std) > 0
    json.dumps(request.to_json()).encode("utf-8")  # every string in it is text


@FAST
@given(near_requests())
def test_a_valid_request_round_trips(body: dict) -> None:
    try:
        request = ExtractRequest.from_json(parse_json(encode_json(body)))
    except WireError:
        return
    assert ExtractRequest.from_json(parse_json(json.dumps(request.to_json()).encode())) == request


@FAST
@given(st.dictionaries(st.sampled_from(("model", "weights", "input_size", "batch_sizes", "repeats", "job_id")),
                       json_values, max_size=4))
def test_profile_requests_are_bounded_or_refused(fields: dict) -> None:
    try:
        request = ProfileRequest.from_json(parse_json(encode_json({"model": "resnet18", **fields})))
    except WireError:
        return
    assert 1 <= len(request.batch_sizes) <= 8 and 1 <= request.repeats <= 10


@st.composite
def mangled_features(draw) -> bytearray:
    rows = draw(st.integers(0, 3))
    blob = bytearray(encode_features(torch.zeros(rows, 2), tuple(f"k{i}" for i in range(rows)), {"split": 1}))
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(blob) - 1))
        blob[at] = draw(st.integers(0, 255))
    cut = draw(st.integers(0, len(blob)))
    return blob[:cut] if draw(st.booleans()) else blob


@st.composite
def forged_headers(draw) -> bytearray:
    header = {"features": {"dtype": draw(st.sampled_from(["F32", "F16", "I64"]) | json_values),
                           "shape": draw(st.lists(st.integers(-2, 1 << 40), max_size=3) | json_values),
                           "data_offsets": draw(st.lists(st.integers(-8, 1 << 40), max_size=3) | json_values)},
              "__metadata__": {"keys": draw(st.sampled_from(['["a"]', "[]", "nope", "[1]"]))}}
    text = json.dumps(header).encode()
    return bytearray(len(text).to_bytes(8, "little") + text + bytes(draw(st.integers(0, 64))))


@FAST
@given(mangled_features() | forged_headers() | st.binary(max_size=64).map(bytearray))
def test_the_features_decoder_raises_only_wire_errors(blob: bytearray) -> None:
    try:
        features, keys, _ = decode_features(blob)
    except WireError:
        return
    assert features.shape[0] == len(keys)


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("store")
    return create_app(DaemonConfig(store_url=root.as_uri(), io_threads=1, max_request_bytes=8192)).test_client()


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(request_payloads)
def test_the_app_answers_fuzzed_requests_with_json_4xx(client, payload: bytes) -> None:
    for path in ("/v1/extract", "/v1/profile"):
        response = client.post(path, data=payload, content_type="application/json")
        assert 400 <= response.status_code < 500 or response.status_code == 200, response.data[:300]
        assert response.mimetype == "application/json"
        assert set(response.get_json()) >= {"error", "message"} or response.status_code == 200
