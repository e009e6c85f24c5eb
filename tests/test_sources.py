"""Feature sources: failover and hedging across storage nodes, the local fallback, and the raw-object baseline."""

import logging
import socket
import time
from collections.abc import Iterator
from dataclasses import replace

import pytest
import torch

from compute_side.client import HEDGE_FLOOR_S, PROBE_TIMEOUT_S, StorageClient, StorageNodeError
from compute_side.daemon_process import free_port, local_daemon
from compute_side.sources import LocalPrefix, Part, Planned, PushdownSource, RawObjectSource, Sources
from hapi.data import node_capacities, node_passes
from hapi.datasets import Sample, make_synthetic
from hapi.models import build_model
from hapi.store import FileStore
from hapi.transforms import TransformSpec
from hapi.wire import ExtractRequest, layout_key

TRANSFORM = TransformSpec(crop_size=32, resize_size=36)
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this host")


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
    assert raw.link_bytes == raw.wire_bytes  # alone on the link: the meter counted its objects only
    assert pushed.wire_bytes > 3 * 32 * 32 * 4 * 6  # decoded float32 tensors are larger


def test_uint8_images_arrive_normalised_as_the_float_inputs_at_a_quarter_of_the_bytes(data, node) -> None:
    _, samples = data
    floats = PushdownSource([node], _template(split=0)).fetch(samples[:6], epoch=0)
    images = PushdownSource([node], replace(_template(split=0), dtype="uint8")).fetch(samples[:6], epoch=0)
    # What crossed the wire: uint8, a quarter of the float32 bytes (and a header each).
    assert images.dtype == "uint8" and images.split == 0
    assert images.wire_bytes < 0.3 * floats.wire_bytes
    # What the trainer receives: float inputs, the same decoded crop normalised (bit for bit on the CPU).
    assert images.features.dtype == torch.float32
    torch.testing.assert_close(images.features, floats.features, rtol=0, atol=1 / 255 / min(TRANSFORM.std))
    # So split 0 ships uint8 whatever dtype a run asks for: its inputs are all-in-compute's.
    assert torch.equal(images.features, RawObjectSource(data[0], TRANSFORM).fetch(samples[:6], epoch=0).features)


def test_uint8_images_after_split_0_are_refused_by_the_node(data, node) -> None:
    _, samples = data
    with pytest.raises(StorageNodeError, match="only split 0") as info:
        PushdownSource([node], replace(_template(split=4), dtype="uint8")).fetch(samples[:2], epoch=0)
    assert info.value.status == 400


def test_the_local_fallback_of_uint8_images_is_the_normalised_input(data, node) -> None:
    store, samples = data
    fallback = LocalPrefix(store, build_model("resnet18", input_size=TRANSFORM.crop_size))
    images = replace(_template(split=0), dtype="uint8")
    local = PushdownSource([_dead()], images, fallback).fetch(samples[:3], epoch=0)
    assert local.dtype == "uint8" and local.features.dtype == torch.float32
    assert torch.equal(local.features, PushdownSource([node], images).fetch(samples[:3], epoch=0).features)


def test_sources_decode_on_the_cpu_unless_told(data) -> None:
    store, _ = data
    train, val = Sources([], store, _template(), TRANSFORM).build(-1, "float32")
    assert train.decode_device == val.decode_device == torch.device("cpu")


@CUDA
def test_raw_objects_decoded_on_the_gpu_match_the_cpu_within_a_few_levels(data) -> None:
    store, samples = data
    for transform in (TransformSpec(crop_size=224, resize_size=256), replace(TRANSFORM, augment=True)):
        cpu = RawObjectSource(store, transform).fetch(samples[:8], epoch=1)
        gpu = RawObjectSource(store, transform, decode_device="cuda").fetch(samples[:8], epoch=1)
        assert gpu.features.is_cuda and gpu.features.dtype == torch.float32 and gpu.dtype == "float32"
        assert gpu.wire_bytes == cpu.wire_bytes
        # In uint8 levels: nvJPEG's IDCT and the GPU's resize round on their own.
        levels = ((gpu.features.cpu() - cpu.features) * torch.tensor(transform.std)[:, None, None] * 255).abs()
        assert levels.mean() < 2 and (levels > 16).float().mean() < 0.01, (levels.mean(), levels.max())


@CUDA
def test_uint8_images_are_normalised_on_the_gpu_when_decoding_is_there(data, node) -> None:
    _, samples = data
    images = replace(_template(split=0), dtype="uint8")
    gpu = PushdownSource([node], images, decode_device="cuda").fetch(samples[:4], epoch=0)
    cpu = PushdownSource([node], images).fetch(samples[:4], epoch=0)
    assert gpu.features.is_cuda
    torch.testing.assert_close(gpu.features.cpu(), cpu.features)


@pytest.fixture
def hung() -> Iterator[StorageClient]:
    """A node that accepts connections and never answers, as a SIGSTOPped daemon does."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)  # the kernel completes connects; nobody ever reads
        yield StorageClient(f"http://127.0.0.1:{listener.getsockname()[1]}")


def test_a_hung_node_is_hedged_by_its_pace(data, node, hung) -> None:
    _, samples = data
    hung.pace.record((4, "float32"), 0.1)  # measured before it hung: deadline at the floor
    source = PushdownSource([hung, node], _template())
    started = time.monotonic()
    part = source.fetch(samples[:4], epoch=0)
    assert time.monotonic() - started < HEDGE_FLOOR_S + 3
    assert len(part.features) == 4
    deadline = time.monotonic() + PROBE_TIMEOUT_S + 2
    while not hung.breaker.out and time.monotonic() < deadline:
        time.sleep(0.05)
    assert hung.breaker.out  # its /healthz went unanswered: out of rotation
    started = time.monotonic()
    source.fetch(samples[4:8], epoch=0)
    assert time.monotonic() - started < HEDGE_FLOOR_S  # the next request goes straight to the live node


def test_no_node_answers_computes_the_same_features_here(data, node, caplog) -> None:
    store, samples = data
    model = build_model("resnet18", input_size=TRANSFORM.crop_size)
    fallback = LocalPrefix(store, model)
    dead = PushdownSource([_dead(), _dead()], _template(), fallback)
    with caplog.at_level(logging.WARNING, logger="compute_side.sources"):
        parts = [dead.fetch(samples[i: i + 3], epoch=0) for i in (0, 3)]
    assert [r.message for r in caplog.records].count(
        "no storage node answers: reading raw objects and running stages [0, 4) here until one does") == 1
    pushed = PushdownSource([node], _template()).fetch(samples[:6], epoch=0)
    local = torch.cat([p.features for p in parts])
    assert [(p.split, p.dtype) for p in parts] == [(4, "float32")] * 2
    torch.testing.assert_close(local, pushed.features)
    assert parts[0].wire_bytes == sum(s.size for s in samples[:3])  # raw objects crossed the network
    half = PushdownSource([_dead()], replace(_template(), dtype="bfloat16"), fallback).fetch(samples[:3], epoch=0)
    assert half.features.dtype == torch.bfloat16 and half.dtype == "bfloat16"


def test_the_nodes_run_as_many_requests_at_once_as_their_compute_slots_allow_within_those_in_flight(node) -> None:
    slots = node.capacity()["compute_slots"]
    assert slots >= 1
    assert node_passes(node_capacities([node]), 4) == min(slots, 4)
    assert node_passes(node_capacities([node]), 1) == 1
    # Requests go round-robin: two of four to each node; a node that cannot say runs one.
    assert node_passes(node_capacities([node, _dead()]), 4) == min(slots, 2) + 1


def test_a_prefix_runs_as_many_passes_at_once_as_the_node_measured_fastest(data, node) -> None:
    """A node says, per model it has timed, how many of its passes run fastest at once; a
    model it has not timed runs as many as its slots."""
    _, samples = data
    slots = node.capacity()["compute_slots"]
    node.extract(replace(_template(), keys=(samples[0].key,)))
    measured = node.capacity()["pass_layouts"]
    if slots == 1:
        assert measured == {}  # one core: one layout, nothing to time
        return
    resnet18 = layout_key("resnet18", TRANSFORM.crop_size)
    assert 1 <= measured[resnet18] <= slots  # (with any other model the session's daemons timed before)
    assert node_passes(node_capacities([node]), 4, resnet18) == min(measured[resnet18], 4)
    assert node_passes(node_capacities([node]), 4, layout_key("resnet50", 224)) == min(slots, 4)


class Listening:
    """A planner's stand-in: keeps the replies it hears of."""

    def __init__(self) -> None:
        self.replies: list = []

    def arrived(self, reply) -> None:
        self.replies.append(reply)


def test_the_planner_hears_of_a_request_s_time_on_the_link_and_its_second_half() -> None:
    planner = Listening()
    Planned(planner, sources=None).arrived(Part(torch.zeros(1), 4, "float32", 1_000_000, elapsed_ms=700.0,
                                                link_interval=(0.1, 0.6), timings={"forward_ms": 50.0},
                                                tail_started=0.3), 1)
    (reply,) = planner.replies
    # All the request's time but the node's own work: from 650 ms before the body's end.
    assert reply.link_interval == pytest.approx((-0.05, 0.6)) and reply.tail_started == 0.3
    # A reply that shared the link is read over its body, while the meter counted the link's bytes.
    Planned(planner, sources=None).arrived(Part(torch.zeros(1), 4, "float32", 1_000_000, elapsed_ms=700.0,
                                                link_interval=(0.1, 0.6), timings={"forward_ms": 50.0},
                                                tail_started=0.3, link_bytes=1_500_000), 1)
    assert planner.replies[-1].link_interval == (0.1, 0.6) and planner.replies[-1].link_bytes == 1_500_000
