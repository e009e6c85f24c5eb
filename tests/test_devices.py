"""The compute tier on a device: the CPU path as it always was, CUDA where a GPU exists."""

import copy

import pytest
import torch

from compute_side.trainer import HeadTrainer, TrainConfig
from hapi.measure import measure_host
from hapi.models import build_model
from hapi.train import cli

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this host")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has a CUDA device")
def test_asking_for_a_gpu_on_a_host_without_one_is_one_line(capsys) -> None:
    assert cli(["--model", "resnet18", "--device", "cuda", "--split", "all-in-compute"]) == 1
    assert capsys.readouterr().err.strip() == "error: --device cuda: this host has no CUDA device"


def _step(trainer: HeadTrainer, features: torch.Tensor, labels: torch.Tensor) -> float:
    return trainer.train_step(features, labels, split=0)


@CUDA
def test_a_step_on_the_gpu_matches_the_cpu_within_bf16() -> None:
    torch.manual_seed(0)
    model = build_model("resnet18", input_size=64)
    model.replace_head(4)
    cpu, gpu = HeadTrainer(copy.deepcopy(model), TrainConfig()), HeadTrainer(model, TrainConfig(device="cuda"))
    features, labels = torch.randn(8, 3, 64, 64), torch.arange(8) % 4
    assert _step(gpu, features, labels) == pytest.approx(_step(cpu, features, labels), rel=2e-2)
    loss_sum, _ = gpu.evaluate_batch(features, labels, split=0)
    assert loss_sum == pytest.approx(cpu.evaluate_batch(features, labels, split=0)[0], rel=2e-2)


@CUDA
def test_stage_times_on_the_gpu_are_taken_there() -> None:
    profile = measure_host(build_model("resnet18", input_size=64), 64, device=torch.device("cuda"))
    assert "cuda" in profile.host and len(profile.forward_ms) == 11 and profile.train_ms > 0
