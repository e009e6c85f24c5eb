"""Upload -> storage daemon -> training, against a real OpenStack Swift (s3api)."""

import re

import pytest

from compute_side.daemon_process import local_daemon
from hapi import datasets
from hapi.train import cli


@pytest.mark.parametrize("shard_size", [0, 8])
def test_train_through_a_daemon_over_swift(swift_s3, tmp_path, capsys, shard_size: int) -> None:
    store = f"s3://hapi-it/synthetic-{shard_size}"
    endpoint = ["--endpoint-url", swift_s3.endpoint_url]
    assert datasets.main(["--store", store, *endpoint, "synthetic", "--train-per-class", "3",
                          "--val-per-class", "1", "--shard-size", str(shard_size)]) == 0
    assert "train      30 samples" in capsys.readouterr().out

    with local_daemon(store, tmp_path / "daemon.log", tuple(endpoint)) as node:
        assert cli(["--model", "resnet18", "--image-size", "64", "--batch-size", "8", "--store", store, *endpoint,
                    "--storage-node", node, "--cache-dir", str(tmp_path), "--split", "freeze"]) == 0
    out = capsys.readouterr().out
    assert "trained 30 samples" in out and "accuracy" in out
    ratio = float(re.search(r"([\d.]+)x less", out).group(1))
    assert ratio > 8
    log = (tmp_path / "daemon.log").read_text()
    assert "storage_side.app INFO extract job=" in log and "split=11" in log  # the daemon ran the prefix


def test_daemon_reports_a_missing_swift_object_by_key(swift_s3, tmp_path, capsys) -> None:
    store = "s3://hapi-it/missing"
    endpoint = ["--endpoint-url", swift_s3.endpoint_url]
    assert datasets.main(["--store", store, *endpoint, "synthetic", "--train-per-class", "1",
                          "--val-per-class", "1"]) == 0
    swift_s3.client().delete_object(Bucket="hapi-it", Key="missing/train/red-circle/000000.jpg")
    capsys.readouterr()
    with local_daemon(store, tmp_path / "daemon.log", tuple(endpoint)) as node:
        assert cli(["--model", "resnet18", "--image-size", "64", "--store", store, *endpoint,
                    "--storage-node", node, "--cache-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err.rsplit("\r", 1)[-1]
    assert "answered 404" in err and "'train/red-circle/000000.jpg'" in err
