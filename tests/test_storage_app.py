"""The storage daemon's Flask app, driven in process through Flask's test client.

The features it serves must be exactly what the compute tier would compute from the same
bytes (invariant 1), and every bad request must come back as a JSON error with the right
status, naming the key where one sample is at fault (invariant 4), without taking the app
down.
"""

from __future__ import annotations

import io
import tarfile
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from flask.testing import FlaskClient
from PIL import Image

from hapi.datasets import Manifest, make_synthetic
from hapi.models import MODELS, build_model
from hapi.store import FileStore
from hapi.transforms import TransformSpec, normalize, preprocess
from hapi.wire import decode_features
from storage_side.app import create_app
from storage_side.config import DaemonConfig

SPEC = TransformSpec(crop_size=32, resize_size=40)
FREEZE = MODELS["resnet18"].freeze_index  # 11
MAX_KEYS = 4
MAX_BYTES = 4096
SHARDED = "sharded/"  # the sharded copy of the data set lives under this prefix of the same store
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this host")


@dataclass(frozen=True)
class Data:
    store: FileStore
    plain: Manifest
    sharded: Manifest

    def val_keys(self, n: int) -> list[str]:
        return [s.key for s in self.plain.split("val")[:n]]


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Data:
    root = tmp_path_factory.mktemp("store")
    store = FileStore(root)
    plain = make_synthetic(store, 2, 1)
    sharded = make_synthetic(FileStore(root / SHARDED), 2, 1, shard_size=4)
    good = store.get(plain.split("val")[0].key)
    store.put("bad/garbage.jpg", b"this is not an image at all")
    store.put("bad/truncated.jpg", good[:2000])
    store.put("bad/empty.jpg", b"")
    # A shard with distinct member names: a.jpg and b.jpg are the 2nd and 3rd val images of the plain set.
    members = [(name, store.get(s.key)) for name, s in zip(("a.jpg", "b.jpg"), plain.split("val")[1:3], strict=True)]
    store.put("extra/pair.tar", _tar(members))
    return Data(store, plain, sharded)


@pytest.fixture(scope="module")
def client(data: Data) -> FlaskClient:
    config = DaemonConfig(store_url=data.store.url, max_keys_per_request=MAX_KEYS, max_request_bytes=MAX_BYTES,
                          io_threads=2, max_sub_batch=2)
    return create_app(config).test_client()


@pytest.fixture(scope="module")
def resnet18() -> torch.nn.Module:
    return build_model("resnet18", input_size=SPEC.crop_size)


def _tar(members: list[tuple[str, bytes]]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:") as tar:
        for name, blob in members:
            info = tarfile.TarInfo(name)
            info.size = len(blob)
            tar.addfile(info, io.BytesIO(blob))
    return buffer.getvalue()


def _body(keys: list[str], split: int = 4, **fields: object) -> dict:
    return {"keys": keys, "model": "resnet18", "split": split, "transform": SPEC.to_dict(), **fields}


def _extract(client: FlaskClient, keys: list[str], split: int = 4, **fields: object):
    return client.post("/v1/extract", json=_body(keys, split, **fields))


def _local_features(model, blobs: list[tuple[str, bytes]], split: int, spec: TransformSpec = SPEC,
                    epoch: int = 0) -> torch.Tensor:
    """What the compute tier computes for these samples: the same preprocess and prefix, locally."""
    inputs = torch.stack([preprocess(blob, key, spec, epoch) for key, blob in blobs])
    with torch.inference_mode():
        return model.prefix(split)(inputs)


def _assert_json_error(response, status: int, code: str, key: str | None = None) -> dict:
    assert response.status_code == status, response.data[:300]
    assert response.mimetype == "application/json"
    assert b"<html" not in response.data.lower() and b"Traceback" not in response.data
    body = response.get_json()
    assert body["error"] == code, body
    assert isinstance(body["message"], str) and body["message"]
    if key is not None:
        assert body["key"] == key
    return body


def _assert_still_serving(client: FlaskClient, data: Data) -> None:
    response = _extract(client, data.val_keys(1))
    assert response.status_code == 200
    assert decode_features(response.data)[0].shape == (1, 64, 8, 8)


# --- good requests ----------------------------------------------------------------


@pytest.mark.parametrize("split, stage, shape", [
    (0, "input", (3, 3, 32, 32)),  # nothing pushed down: the preprocessed images themselves
    (4, "maxpool", (3, 64, 8, 8)),
    (FREEZE, "layer4.0", (3, 512, 1, 1)),  # the deepest split allowed
])
def test_extract_equals_the_prefix_run_locally(client, data, resnet18, split, stage, shape) -> None:
    keys = data.val_keys(3)[::-1]  # not manifest order: rows must follow the request
    response = _extract(client, keys, split)
    assert response.status_code == 200
    assert response.headers["Content-Type"] == "application/vnd.safetensors"
    features, got_keys, metadata = decode_features(response.data)
    assert got_keys == tuple(keys)
    assert features.shape == shape and features.dtype == torch.float32
    assert metadata["split"] == split and metadata["stage"] == stage
    blobs = [(k, data.store.get(k)) for k in keys]
    assert metadata["raw_bytes"] == sum(len(b) for _, b in blobs)
    torch.testing.assert_close(features, _local_features(resnet18, blobs, split))


def test_augmented_extract_is_seeded_per_sample_and_epoch(client, data, resnet18) -> None:
    spec = TransformSpec(crop_size=32, resize_size=40, augment=True, seed=7)
    keys = data.val_keys(2)
    blobs = [(k, data.store.get(k)) for k in keys]
    by_epoch = {}
    for epoch in (3, 4):
        response = _extract(client, keys, 6, transform=spec.to_dict(), epoch=epoch)
        assert response.status_code == 200
        by_epoch[epoch] = decode_features(response.data)[0].clone()
        torch.testing.assert_close(by_epoch[epoch], _local_features(resnet18, blobs, 6, spec, epoch))
    assert not torch.allclose(by_epoch[3], by_epoch[4])  # a new epoch draws new crops


def test_shard_members_mixed_with_plain_objects(client, data, resnet18) -> None:
    plain_key = data.val_keys(1)[0]
    keys = ["extra/pair.tar#b.jpg", plain_key, "extra/pair.tar#a.jpg"]
    response = _extract(client, keys, FREEZE)
    assert response.status_code == 200
    features, got_keys, _ = decode_features(response.data)
    assert got_keys == tuple(keys)
    val = data.plain.split("val")
    originals = [(keys[0], data.store.get(val[2].key)), (plain_key, data.store.get(plain_key)),
                 (keys[2], data.store.get(val[1].key))]
    torch.testing.assert_close(features, _local_features(resnet18, originals, FREEZE))


def test_synthetic_shard_members_are_the_plain_images(client, data, resnet18) -> None:
    sharded = data.sharded.split("train")
    assert len({s.key for s in sharded}) == len(sharded) == len(data.plain.split("train"))  # no sample lost
    chosen = sharded[2:6]  # spans the first two shards of 4
    assert len({s.object_key for s in chosen}) == 2
    keys = [SHARDED + s.key for s in chosen]
    response = _extract(client, keys, 6)
    assert response.status_code == 200
    features, got_keys, metadata = decode_features(response.data)
    assert got_keys == tuple(keys)
    assert metadata["raw_bytes"] == sum(s.size for s in chosen)
    # The same sample, stored as its own object in the plain set, gives the same features.
    plain = {s.key: s for s in data.plain.split("train")}
    members = [plain[s.key.split("#", 1)[1]] for s in chosen]
    assert [m.label for m in members] == [s.label for s in chosen]
    originals = [(key, data.store.get(m.key)) for key, m in zip(keys, members, strict=True)]
    torch.testing.assert_close(features, _local_features(resnet18, originals, 6))


def test_features_do_not_depend_on_the_sub_batch(data, client) -> None:
    keys = data.val_keys(4)
    one_by_one = create_app(DaemonConfig(store_url=data.store.url, max_sub_batch=1)).test_client()
    a = decode_features(_extract(client, keys, FREEZE).data)[0]
    b = decode_features(_extract(one_by_one, keys, FREEZE).data)[0]
    torch.testing.assert_close(a, b)


@pytest.mark.parametrize("dtype, torch_dtype, rtol", [
    ("float16", torch.float16, 2e-3),
    ("bfloat16", torch.bfloat16, 1.6e-2),
])
def test_half_precision_wire_dtypes(client, data, dtype, torch_dtype, rtol) -> None:
    keys = data.val_keys(2)
    full = _extract(client, keys, FREEZE)
    half = _extract(client, keys, FREEZE, dtype=dtype)
    assert half.status_code == 200
    reference, _, _ = decode_features(full.data)
    features, got_keys, _ = decode_features(half.data)
    assert features.dtype == torch_dtype and got_keys == tuple(keys)
    assert features.shape == reference.shape
    assert len(half.data) < 0.75 * len(full.data)  # half the bytes of features on the wire
    torch.testing.assert_close(features.float(), reference, rtol=rtol, atol=1e-3)


def test_uint8_images_at_split_0_are_a_quarter_of_the_bytes_and_normalise_to_the_float_input(client, data) -> None:
    keys = data.val_keys(3)
    floats = _extract(client, keys, 0)
    images = _extract(client, keys, 0, dtype="uint8")
    assert images.status_code == 200
    reference, _, _ = decode_features(floats.data)
    crops, got_keys, meta = decode_features(images.data)
    assert crops.dtype == torch.uint8 and got_keys == tuple(keys) and meta["split"] == 0
    assert len(images.data) < 0.3 * len(floats.data)
    # Both are the same decoded crop; on the CPU, normalising it is bit for bit the float input.
    assert torch.equal(normalize(crops, SPEC), reference)


def test_uint8_images_after_split_0_are_400_json(client, data) -> None:
    error = _assert_json_error(_extract(client, data.val_keys(1), 4, dtype="uint8"), 400, "bad_request")
    assert "only split 0" in error["message"]
    _assert_still_serving(client, data)


@CUDA
def test_on_the_gpu_features_match_the_cpu_within_bf16_and_the_node_says_where(client, data) -> None:
    gpu = create_app(DaemonConfig(store_url=data.store.url, device="cuda", gpu_memory_budget=4 << 30,
                                  max_sub_batch=2, decode_workers=0)).test_client()
    keys = data.val_keys(3)
    for split in (4, FREEZE):
        reference, _, _ = decode_features(_extract(client, keys, split).data)
        response = _extract(gpu, keys, split)
        assert response.status_code == 200, response.data[:300]
        features, got_keys, meta = decode_features(response.data)
        assert features.dtype == torch.float32 and got_keys == tuple(keys) and meta["sub_batch"] == 2
        torch.testing.assert_close(features, reference, rtol=5e-2, atol=5e-2)
    # uint8 images at split 0 are decoded on the CPUs either way: the same bytes.
    images = [decode_features(_extract(app, keys, 0, dtype="uint8").data)[0] for app in (gpu, client)]
    assert torch.equal(*images)
    node = gpu.get("/v1/models").get_json()["node"]
    assert node["device"].startswith("cuda:") and node["device_name"] == torch.cuda.get_device_name()
    assert 0 < node["gpu_memory_reserved_peak"] <= node["gpu_memory_capacity"] < node["gpu_memory_budget"]
    assert node["gpu_memory_peak_allocated"] > 0
    assert "hapi_storage_gpu_memory_peak_allocated_bytes" in gpu.get("/metrics").get_data(as_text=True)


@CUDA
def test_little_free_gpu_memory_shrinks_the_sub_batch_not_the_features(data) -> None:
    app = create_app(DaemonConfig(store_url=data.store.url, device="cuda", max_sub_batch=4, min_sub_batch=1,
                                  decode_workers=0))
    client, keys = app.test_client(), data.val_keys(4)
    roomy, _, meta = decode_features(_extract(client, keys, FREEZE).data)  # loads the model, too
    assert meta["sub_batch"] == 4
    memory = app.extensions["hapi"]["cache"].loaded()[0].memory
    admission = app.extensions["hapi"]["extractor"].device_admission
    # Another job holds all the GPU memory but room for one sample's pass and half of a second's.
    room = memory.forward_bytes(FREEZE, 1) + (memory.forward_bytes(FREEZE, 2) - memory.forward_bytes(FREEZE, 1)) // 2
    with admission.admit("other-job", admission.free - room, admission.free - room):
        response = _extract(client, keys, FREEZE)
    assert response.status_code == 200, response.data[:300]
    features, _, meta = decode_features(response.data)
    assert meta["sub_batch"] == 1
    torch.testing.assert_close(features, roomy, rtol=5e-2, atol=5e-2)
    assert admission.peak_reserved <= admission.capacity


def test_healthz(client, data) -> None:
    response = client.get("/healthz")
    assert response.status_code == 200
    assert response.get_json() == {"status": "ok"}  # nothing private: not the store's URL


def test_models_lists_the_registry(client) -> None:
    response = client.get("/v1/models")
    assert response.status_code == 200
    models = {m["name"]: m for m in response.get_json()["models"]}
    assert set(models) == set(MODELS)
    assert models["resnet18"] == {"name": "resnet18", "freeze_index": 11, "input_size": 224}
    assert models["resnet50"]["freeze_index"] == 22
    node = response.get_json()["node"]
    assert node["device"] == "cpu" and "gpu_memory_budget" not in node  # the default: the prefix on the CPU


# --- bad requests: JSON errors, and the app keeps serving ---------------------------


@pytest.mark.parametrize("body, code, words", [
    (_body(["k"], model="resnet1000"), "unknown_model", "resnet1000"),
    (_body(["k"], split=FREEZE + 1), "bad_split", "0..11"),
    (_body(["k"], split=-1), "bad_split", "out of range"),
    ({**_body(["k"]), "colour": "red"}, "bad_request", "colour"),
    (_body(["k"], split="4"), "bad_request", "'split'"),
    (_body(["k"], split=True), "bad_request", "'split'"),
    (_body(["k"], model=18), "bad_request", "'model'"),
    (_body("k"), "bad_request", "'keys'"),
    (_body([]), "bad_request", "non-empty"),
    (_body(["k", ""]), "bad_request", "non-empty"),
    (_body([3]), "bad_request", "'keys'"),
    (_body(["k", "k"]), "bad_request", "duplicates"),
    (_body(["k"], dtype="int8"), "bad_request", "int8"),
    (_body(["k"], transform={"crop_size": 32, "hue": 1}), "bad_request", "hue"),
    (_body(["k"], transform={"crop_size": 300, "resize_size": 256}), "bad_request", "crop_size"),
    ({"model": "resnet18", "split": 4}, "bad_request", "'keys'"),
    ([_body(["k"])], "bad_request", "JSON object"),
], ids=["unknown-model", "split-after-freeze", "negative-split", "unknown-field", "split-str", "split-bool",
        "model-int", "keys-str", "keys-empty", "key-empty", "key-int", "keys-duplicate", "bad-dtype",
        "transform-field", "crop-gt-resize", "missing-keys", "body-list"])
def test_bad_request_is_400_json(client, data, body, code, words) -> None:
    error = _assert_json_error(client.post("/v1/extract", json=body), 400, code)
    assert words in error["message"]
    _assert_still_serving(client, data)


@pytest.mark.parametrize("payload, content_type", [
    (b"keys=a&model=resnet18", "application/x-www-form-urlencoded"),
    (b'{"keys": ["a"], "model": ', "application/json"),  # truncated JSON
    (b'{"keys": ["a"], "model": "resnet18", "split": 4}', "text/plain"),  # JSON, but not declared so
    (b"", "application/json"),
])
def test_non_json_body_is_400(client, data, payload, content_type) -> None:
    response = client.post("/v1/extract", data=payload, content_type=content_type)
    _assert_json_error(response, 400, "bad_request")
    _assert_still_serving(client, data)


@pytest.mark.parametrize("key", [
    "val/red-circle/999999.jpg",
    "no/such/dir/x.jpg",
    "val",  # a directory, not an object
    "../../../../etc/passwd",  # must not climb out of the store
    "/etc/passwd",
])
def test_missing_object_is_404_naming_the_key(client, data, key) -> None:
    keys = [*data.val_keys(2), key]
    _assert_json_error(_extract(client, keys), 404, "missing_object", key=key)
    _assert_still_serving(client, data)


@pytest.mark.parametrize("key", ["extra/pair.tar#c.jpg", SHARDED + "shards/val-00000.tar#999999.jpg"])
def test_missing_shard_member_is_404_naming_the_sample(client, data, key) -> None:
    _assert_json_error(_extract(client, [data.val_keys(1)[0], key]), 404, "missing_object", key=key)
    _assert_still_serving(client, data)


@pytest.mark.parametrize("key", ["bad/garbage.jpg", "bad/truncated.jpg", "bad/empty.jpg"])
def test_corrupt_image_is_422_naming_the_key(client, data, key) -> None:
    error = _assert_json_error(_extract(client, [data.val_keys(1)[0], key]), 422, "corrupt_image", key=key)
    assert key in error["message"]
    _assert_still_serving(client, data)


def test_too_many_keys_is_413(client, data) -> None:
    keys = data.val_keys(MAX_KEYS + 1)
    error = _assert_json_error(_extract(client, keys), 413, "too_many_keys")
    assert error["limit"] == MAX_KEYS and str(MAX_KEYS + 1) in error["message"]
    assert _extract(client, keys[:MAX_KEYS]).status_code == 200  # the limit itself is allowed


def test_body_over_max_request_bytes_is_413(client, data) -> None:
    body = _body([*data.val_keys(1), "x" * MAX_BYTES])  # valid JSON, just too big
    _assert_json_error(client.post("/v1/extract", json=body), 413, "request_too_large")
    _assert_still_serving(client, data)


def test_unknown_weights_is_409(client, data) -> None:
    weights = "sha256:" + "0" * 64
    error = _assert_json_error(_extract(client, data.val_keys(1), weights=weights), 409, "weights_unavailable")
    assert weights in error["message"] and "--weights-file" in error["message"]
    _assert_still_serving(client, data)


@pytest.mark.parametrize("method, path, status, code", [
    ("GET", "/v1/nope", 404, "not_found"),
    ("POST", "/", 404, "not_found"),
    ("GET", "/v1/extract", 405, "method_not_allowed"),
    ("DELETE", "/v1/extract", 405, "method_not_allowed"),
    ("POST", "/healthz", 405, "method_not_allowed"),
])
def test_routing_errors_are_json(client, data, method, path, status, code) -> None:
    _assert_json_error(client.open(path, method=method), status, code)
    _assert_still_serving(client, data)


def test_405_names_the_allowed_methods(client) -> None:
    response = client.get("/v1/extract")
    assert response.status_code == 405
    assert "POST" in response.headers.get("Allow", "")


# --- known bugs: strict xfail, so each turns into a failure once fixed (drop the marker then) ----


def _bug(reason: str):
    return pytest.mark.xfail(strict=True, reason="BUG: " + reason)


def _png16(grey16: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(grey16).save(buffer, format="PNG")  # a 2-D uint16 array: a 16-bit greyscale PNG
    return buffer.getvalue()


@pytest.fixture(scope="module")
def odd_objects(data: Data) -> None:
    grey16 = (np.random.default_rng(0).random((40, 40)) * 65535).astype(np.uint16)
    data.store.put("odd/grey16.png", _png16(grey16))
    buffer = io.BytesIO()
    Image.fromarray((grey16 >> 8).astype(np.uint8)).save(buffer, format="PNG")
    data.store.put("odd/grey8.png", buffer.getvalue())
    frames = [Image.new("RGB", (40, 40), (80 * i, 20, 200)) for i in range(3)]
    buffer = io.BytesIO()
    frames[0].save(buffer, format="GIF", save_all=True, append_images=frames[1:])
    data.store.put("odd/animated.gif", buffer.getvalue())
    data.store.put("odd/not-a-tar.tar", b"junk" * 100)


@pytest.mark.parametrize("keys, fields, statuses, key", [
    pytest.param(["odd/not-a-tar.tar#a.jpg"], {}, {404, 422}, "odd/not-a-tar.tar#a.jpg"),
    pytest.param(["odd/animated.gif"], {}, {200, 422}, None),
    pytest.param(["a\x00b.jpg"], {}, {400, 404}, "a\x00b.jpg"),
    pytest.param(["x" * 300], {}, {400, 404}, "x" * 300),
    pytest.param(None, {"transform": {"crop_size": 32.5, "resize_size": 40}}, {400}, None),
    pytest.param(None, {"transform": {"crop_size": 32, "resize_size": 40, "mean": [0.5, 0.5]}}, {400}, None),
    pytest.param(None, {"transform": {"crop_size": 32, "resize_size": 40, "std": [0, 0, 0]}}, {400}, None),
], ids=["shard-not-a-tar", "animated-gif", "nul-in-key", "key-too-long", "crop-float",
        "mean-length", "std-zero"])
def test_bad_input_is_a_client_error_not_500(client, data, odd_objects, keys, fields, statuses, key) -> None:
    response = _extract(client, keys or data.val_keys(1), **fields)
    assert response.status_code in statuses, response.get_json()
    if response.status_code != 200:
        body = response.get_json()
        assert body["error"] != "internal_error"
        if key is not None:
            assert body["key"] == key


def test_16_bit_png_is_scaled_like_8_bit(client, odd_objects) -> None:
    sixteen = decode_features(_extract(client, ["odd/grey16.png"], 0).data)[0]
    eight = decode_features(_extract(client, ["odd/grey8.png"], 0).data)[0]
    torch.testing.assert_close(sixteen, eight, rtol=0, atol=0.05)


def test_missing_shard_object_names_a_requested_key(client, data) -> None:
    response = _extract(client, ["extra/nope.tar#b.jpg", "extra/nope.tar#a.jpg"])
    _assert_json_error(response, 404, "missing_object", key="extra/nope.tar#b.jpg")



# --- malformed requests are 4xx, never 500 (issue 21) ---------------------------------


@pytest.mark.parametrize("payload", [
    b"[" * 1500 + b"]" * 1500,  # deeper than the parser's recursion limit
    b'{"keys": [[[[[[[[[["a"]]]]]]]]]], "model": "resnet18", "split": 4}',
    b'{"keys": ["a"], "model": "resnet18", "split": 4, "transform": []}',
    b'{"keys": ["a"], "model": "resnet18", "split": 4, "transform": "big"}',
    b'{"keys": ["a"], "model": "resnet18", "split": 4, "\\ud800": 1}',  # a lone surrogate as a key
    b'{"keys": ["\\udfff.jpg"], "model": "resnet18", "split": 4}',
    b'{"keys": ["a"], "model": "resnet18", "split": 4, "transform": {"mean": [NaN, 0, 0]}}',
    b'{"keys": ["a"], "model": "resnet18", "split": 4, "transform": {"std": [Infinity, 1, 1]}}',
    b'{"keys": ["a"], "model": "resnet18", "split": 4, "transform": {"std": [1e400, 1, 1]}}',
    b'\xff\xfe{"keys": ["a"]}',
], ids=["deep", "deep-keys", "transform-list", "transform-str", "surrogate-field", "surrogate-key", "nan-mean",
        "inf-std", "overflow-std", "not-utf8"])
def test_malformed_json_is_400(client, data, payload) -> None:
    response = client.post("/v1/extract", data=payload, content_type="application/json")
    _assert_json_error(response, 400, "bad_request")
    _assert_still_serving(client, data)


def test_torchvision_weights_a_node_lacks_are_409_without_a_download(client, data, monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path))  # an empty cache
    monkeypatch.setattr(torch.hub, "load_state_dict_from_url", lambda *a, **k: pytest.fail("downloaded"))
    weights = f"torchvision:{MODELS['resnet18'].torchvision_weights}"
    error = _assert_json_error(_extract(client, data.val_keys(1), weights=weights), 409, "weights_unavailable")
    assert weights in error["message"] and "--weights-file" in error["message"]


def test_only_keys_under_the_configured_dataset_prefixes_are_served(data) -> None:
    config = DaemonConfig(store_url=data.store.url, io_threads=2, dataset_prefixes=("val",))
    client = create_app(config).test_client()
    assert _extract(client, data.val_keys(1)).status_code == 200
    train_key = data.plain.split("train")[0].key
    _assert_json_error(_extract(client, [train_key]), 404, "missing_object", key=train_key)
    for key in ("val/../train/x.jpg", "val//x.jpg", "val/./x.jpg", "bad/garbage.jpg"):
        _assert_json_error(_extract(client, [key]), 404, "missing_object", key=key)
