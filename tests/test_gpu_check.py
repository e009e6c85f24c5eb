"""experiments/gpu_check.py, the part that runs without a GPU: it says in one line that it needs one."""

import pytest
import torch

from experiments.gpu_check import NO_GPU, gpu_budget_note, main, parse_train


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has a CUDA device")
def test_without_a_gpu_it_says_so_in_one_line_and_exits_2(capsys, tmp_path) -> None:
    assert main(["--out", str(tmp_path)]) == 2
    captured = capsys.readouterr()
    assert captured.err.strip() == NO_GPU == "no CUDA device on this host: gpu_check needs a GPU"
    assert captured.out == "" and not any(tmp_path.iterdir())


def test_it_reads_hapi_trains_closing_report() -> None:
    text = ("HAPI: resnet50, split 22/24: storage runs up to 'layer4.0' (freeze index 22); data set ...\n"
            "trained 120 samples in 2.5 s: 48.0 samples/s; waiting for data 75%, computing 25%\n"
            "over the network: 0.5 MB vs 11.9 MB of raw objects for the same samples: 23.8x less\n"
            "gpu_check: trainer peak GPU bytes 123456789\n")
    assert parse_train(text) == {"samples": 120, "samples_per_s": 48.0, "wait_share": 0.75, "compute_share": 0.25,
                                 "network_mb": 0.5, "raw_mb": 11.9, "trainer_peak_gpu_mb": 123.5,
                                 "split": "split 22/24: storage runs up to 'layer4.0'"}


def test_a_missing_memory_reading_is_not_a_pass() -> None:
    assert gpu_budget_note({"daemon_gpu_memory_reserved_peak_mb": 10.0, "daemon_gpu_memory_capacity_mb": 20.0}) \
        == "reservations within the GPU budget"
    assert gpu_budget_note({"daemon_gpu_memory_reserved_peak_mb": 30.0, "daemon_gpu_memory_capacity_mb": 20.0}) \
        == "RESERVED OVER THE GPU BUDGET"
    for metrics in ({}, {"daemon_gpu_memory_capacity_mb": 20.0}, {"daemon_gpu_memory_reserved_peak_mb": 0.0}):
        assert gpu_budget_note(metrics) == "GPU reservations not measured"
