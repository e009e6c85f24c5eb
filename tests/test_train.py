"""`python -m hapi.train` end to end on the embedded default (file:// store, local daemon)."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch

from hapi.datasets import make_synthetic
from hapi.models import build_model
from hapi.planner import Candidate, single
from hapi.store import FileStore
from hapi.train import MetricsLog, Moves, cli

SMALL = ["--model", "resnet18", "--image-size", "64", "--train-per-class", "4", "--val-per-class", "2",
         "--batch-size", "8"]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("hapi-cache")


def test_embedded_default_trains_and_reports(cache_dir, capsys) -> None:
    assert cli([*SMALL, "--cache-dir", str(cache_dir), "--split", "freeze"]) == 0
    out = capsys.readouterr().out
    assert "split 11/15" in out and "'layer4.0'" in out
    assert "trained 40 samples" in out
    assert "val loss" in out and "accuracy" in out
    ratio = float(re.search(r"([\d.]+)x less", out).group(1))
    # ResNet-18 after layer4.0 at 64 px ships 512x2x2 floats (8 KB) per ~100 KB JPEG.
    assert 8 < ratio < 20
    assert (cache_dir / "datasets" / "synthetic-4x2" / "manifest.json").is_file()


def test_split_zero_ships_decoded_images(cache_dir, capsys) -> None:
    assert cli([*SMALL, "--cache-dir", str(cache_dir), "--split", "0", "--dtype", "float16"]) == 0
    out = capsys.readouterr().out
    assert "split 0/15" in out
    ratio = float(re.search(r"([\d.]+)x less", out).group(1))
    # The pixels ship as uint8 whatever dtype was asked for: 3x64x64 = 12 KB per image
    # against the ~100 KB JPEG (fp16 would be 24 KB, about 4x less).
    assert ratio > 6


@pytest.mark.parametrize("args, message", [
    (["--model", "resnet51"], "error: unknown model 'resnet51'"),
    (["--model", "resnet18", "--split", "12"], "error: split 12 out of range for resnet18: 0..11"),
    (["--model", "resnet18", "--store", "file:///nonexistent/hapi"], "error: no data set at file:///nonexistent/hapi"),
    (["--model", "resnet18", "--store", "ftp://x"], "error: store URL 'ftp://x'"),
    (["--model", "resnet18", "--split", "4", "--dtype", "uint8"],
     "error: --dtype uint8 ships decoded images: only with --split 0"),
])
def test_bad_input_is_one_line(cache_dir, capsys, args, message) -> None:
    assert cli([*args, "--cache-dir", str(cache_dir)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1


def test_dead_storage_node_is_one_line(cache_dir, tmp_path, capsys) -> None:
    make_synthetic(FileStore(tmp_path), 1, 1)
    capsys.readouterr()
    store = tmp_path.as_uri()
    assert cli([*SMALL, "--store", store, "--storage-node", "http://127.0.0.1:9", "--cache-dir", str(cache_dir)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: storage node http://127.0.0.1:9: unreachable") and err.count("\n") == 1


def _daemons_for(cache_dir) -> list[str]:
    pattern = f"storage_side --store {cache_dir.as_uri()}"
    found = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True)
    return found.stdout.split()


def test_ctrl_c_stops_the_daemon(cache_dir) -> None:
    # Ctrl-C as a terminal sends it: with SIGINT's default action, even where this test runs
    # in the background (a shell starts background jobs with SIGINT ignored, and Python keeps that).
    process = subprocess.Popen([sys.executable, "-m", "hapi.train", *SMALL, "--cache-dir", str(cache_dir),
                                "--epochs", "50"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"},
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 60
    while not _daemons_for(cache_dir) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _daemons_for(cache_dir), "the daemon never started"
    time.sleep(1)
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=30)
    assert process.returncode == 130
    assert "Traceback" not in err and "interrupted" in err
    assert not _daemons_for(cache_dir)


def _trained(run_dir) -> dict:
    return torch.load(run_dir / "checkpoint.pt", weights_only=True)["trainer"]["trainable"]


def test_the_split_does_not_change_what_is_learned(cache_dir, tmp_path, capsys) -> None:
    """Decoupling end to end: same seed, same head, whether pushed down or not, and where."""
    runs = {}
    for split in ("all-in-compute", "4", "freeze", "auto"):
        runs[split] = tmp_path / split
        # auto with no saved profile: it measures this host first, on copies of the model
        assert cli([*SMALL, "--cache-dir", str(tmp_path / "fresh-cache" if split == "auto" else cache_dir),
                    "--split", split, "--output-dir", str(runs[split]), "--augment", "--request-size", "3",
                    "--refresh-profile"]) == 0
    capsys.readouterr()
    reference = _trained(runs["all-in-compute"])
    for split in ("4", "freeze", "auto"):
        trained = _trained(runs[split])
        assert trained.keys() == reference.keys()
        for name, value in reference.items():
            torch.testing.assert_close(trained[name], value, rtol=1e-5, atol=1e-6, msg=f"split {split}: {name}")
    untrained = build_model("resnet18", input_size=64).stages[11].state_dict()
    assert not torch.equal(reference["0.conv1.weight"], untrained["conv1.weight"])  # it did train


def test_resume_continues_where_the_checkpoint_left_off(cache_dir, tmp_path, capsys) -> None:
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    small = [*SMALL, "--split", "freeze"]
    assert cli([*small, "--cache-dir", str(cache_dir), "--epochs", "2", "--output-dir", str(straight)]) == 0
    assert cli([*small, "--cache-dir", str(cache_dir), "--epochs", "1", "--output-dir", str(resumed)]) == 0
    resume = ["--resume", str(resumed / "checkpoint.pt")]
    assert cli([*small, "--cache-dir", str(cache_dir), "--epochs", "2", *resume]) == 0
    out = capsys.readouterr().out
    assert out.count("epoch 2:") == 2
    for name, value in _trained(straight).items():
        torch.testing.assert_close(_trained(resumed)[name], value, msg=name)
    lines = (resumed / "metrics.jsonl").read_text().splitlines()
    steps = [json.loads(line) for line in lines if '"step"' in line]
    assert [s["epoch"] for s in steps] == [0] * 5 + [1] * 5
    assert all(s["wire_bytes"] > 0 and s["wait_s"] >= 0 and "forward_ms" in s["source_ms"] for s in steps)


def test_resume_refuses_a_checkpoint_of_another_setup(cache_dir, tmp_path, capsys) -> None:
    assert cli([*SMALL, "--cache-dir", str(cache_dir), "--split", "freeze", "--output-dir", str(tmp_path)]) == 0
    resume = ["--resume", str(tmp_path / "checkpoint.pt")]
    assert cli([*SMALL, "--cache-dir", str(cache_dir), "--split", "4", *resume, "--batch-size", "4"]) == 1
    assert "checkpoint has batch_size=8, this run 4" in capsys.readouterr().err


def test_auto_split_starts_at_once_explains_and_trains(cache_dir, capsys) -> None:
    assert cli([*SMALL, "--cache-dir", str(cache_dir), "--explain", "--dtypes", "float32,bfloat16"]) == 0
    out = capsys.readouterr().out
    # Where the first batch goes: with a scout ahead, or (where the node's two compute slots
    # leave no link on which another split is predicted much faster) whole to the safe start.
    assert any(line.startswith(("planner: a few of the first batch's samples (at split 0), or the first batch, go",
                                "planner: starting at split 11/15: storage runs up to 'layer4.0', the safest"))
               for line in out.splitlines())
    table = [line for line in out.splitlines() if line.startswith(("split ", "all-in-compute "))]
    assert len(table) == 1 + 1 + 2 * 11  # all-in-compute, split 0's uint8 images, splits 1..11 in two dtypes
    assert any(line.startswith("split 0 uint8 ") for line in table)
    # A plan is one candidate, or two sharing the batches: each of its parts is marked.
    plan_line = next(line for line in out.splitlines() if line.startswith("plan: "))
    assert sum("<- current" in line for line in table) == 1 + plan_line.count(" + ")
    assert "trained 40 samples" in out
    assert list((cache_dir / "profiles").glob("*/resnet18-64.json"))  # this host's stage times, saved


def test_each_planner_move_is_written_once_across_training_and_validation(tmp_path, capsys) -> None:
    def move(split: int) -> Candidate:
        return Candidate(split, "float32", 1.0, 1.0, 1.0, 1.0, 1.0)

    planner = SimpleNamespace(switches=[(0, single(move(3)), "first")])
    data = SimpleNamespace(planner=planner, model=build_model("resnet18", input_size=64))
    metrics = MetricsLog(tmp_path / "metrics.jsonl", 1, None)
    moves = Moves(data, metrics)
    moves.announce()  # a training step
    moves.announce()  # the next: nothing new
    planner.switches.append((96, single(move(5)), "while validating"))
    moves.announce()  # a validation batch
    metrics.close()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["switch"]["at_sample"], r["switch"]["why"]) for r in records if "switch" in r] == [
        (0, "first"), (96, "while validating")]
    assert capsys.readouterr().out.count("planner: from sample") == 2
