"""Feature sources: failover across storage nodes, and the raw-object baseline."""

import pytest
import torch

from compute_side.client import StorageClient, StorageNodeError
from compute_side.daemon_process import free_port, local_daemon
from compute_side.sources import PushdownSource, RawObjectSource
from hapi.datasets import Sample, make_synthetic
from hapi.store import FileStore
from hapi.transforms import TransformSpec
from hapi.wire import ExtractRequest

TRANSFORM = TransformSpec(crop_size=32, resize_size=36)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    return FileStore(root), make_synthetic(FileStore(root), 2, 0).split("train")


@pytest.fixture(scope="module")
def node(data, tmp_path_factory):
    store, _ = data
    with local_daemon(store.url, tmp_path_factory.mktemp("log") / "daemon.log") as url:
        yield StorageClient(url)


def _dead() -> StorageClient:
    return StorageClient(f"http://127.0.0.1:{free_port()}", retries=0)


def _template(split: int = 4) -> ExtractRequest:
    return ExtractRequest(keys=(), model="resnet18", split=split, transform=TRANSFORM)


def test_a_dead_node_loses_nothing(data, node) -> None:
    _, samples = data
    source = PushdownSource([_dead(), node, _dead()], _template())
    parts = [source.fetch(samples[i: i + 5], epoch=0) for i in range(0, len(samples), 5)]
    assert sum(len(p.features) for p in parts) == len(samples)
    alone = PushdownSource([node], _template())
    assert torch.equal(parts[1].features, alone.fetch(samples[5:10], epoch=0).features)


def test_all_nodes_dead_is_an_error_naming_a_node() -> None:
    source = PushdownSource([_dead(), _dead()], _template())
    with pytest.raises(StorageNodeError, match="unreachable"):
        source.fetch([Sample("train/x.jpg", 0, 1)], epoch=0)


def test_a_missing_sample_is_not_retried_elsewhere(data, node) -> None:
    _, samples = data
    missing = Sample("train/nope.jpg", 0, 1)
    with pytest.raises(StorageNodeError) as info:
        PushdownSource([node, node], _template()).fetch([samples[0], missing], epoch=0)
    assert info.value.status == 404 and info.value.key == "train/nope.jpg"


def test_raw_objects_give_the_inputs_the_daemon_would_compute(data, node) -> None:
    store, samples = data
    raw = RawObjectSource(store, TRANSFORM).fetch(samples[:6], epoch=0)
    pushed = PushdownSource([node], _template(split=0)).fetch(samples[:6], epoch=0)
    assert torch.equal(raw.features, pushed.features)
    assert raw.wire_bytes == sum(s.size for s in samples[:6])  # raw objects cross the network
    assert pushed.wire_bytes > 3 * 32 * 32 * 4 * 6  # decoded float32 tensors are larger
