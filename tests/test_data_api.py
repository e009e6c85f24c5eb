"""`hapi.data`: the README's own loops run as written, and train what `hapi.train` trains."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch import nn

from hapi.data import DataConfig, Pipeline
from hapi.train import cli

README = Path(__file__).resolve().parent.parent / "README.md"


def readme_blocks(importing: str) -> list[str]:
    """The README's python code blocks that import ``importing``."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    return [b for b in blocks if re.search(rf"^import {importing}\b|^from {importing}\b", b, re.M)]


def test_the_readme_loop_runs_as_written(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("HAPI_CACHE", str(tmp_path))  # the example's embedded default, made here
    [block] = [b for b in readme_blocks("hapi") if "lightning" not in b]
    exec(compile(block, str(README), "exec"), {"__name__": "readme"})
    accuracies = [float(a) for a in re.findall(r"epoch \d: validation accuracy ([\d.]+)", capsys.readouterr().out)]
    assert len(accuracies) == 3 and all(0 <= a <= 1 for a in accuracies)
    assert (tmp_path / "datasets" / "synthetic-8x2" / "manifest.json").is_file()


def test_the_readme_lightning_module_trains(tmp_path, monkeypatch) -> None:
    pytest.importorskip("lightning", reason="PyTorch Lightning is not installed (pip install -e .[lightning])")
    monkeypatch.setenv("HAPI_CACHE", str(tmp_path))
    [block] = readme_blocks("lightning")
    namespace: dict = {"__name__": "readme"}
    exec(compile(block, str(README), "exec"), namespace)
    data = namespace["data"]
    assert data.trainer.current_epoch == 3 and data.trainer.global_step == 3 * 5  # 80 samples in batches of 16
    with pytest.raises(RuntimeError):  # torn down: the daemon is stopped
        next(data.pipeline.train(0))


def test_a_users_loop_trains_the_head_hapi_train_trains(tmp_path, capsys) -> None:
    small = {"model": "resnet18", "image_size": 64, "batch_size": 8, "train_per_class": 4, "val_per_class": 2,
             "split": "freeze", "cache_dir": tmp_path}
    run = tmp_path / "run"
    assert cli(["--model", "resnet18", "--image-size", "64", "--batch-size", "8", "--train-per-class", "4",
                "--val-per-class", "2", "--split", "freeze", "--cache-dir", str(tmp_path), "--epochs", "2",
                "--output-dir", str(run)]) == 0
    capsys.readouterr()
    pipeline = Pipeline(DataConfig(**small))
    frozen, head = pipeline.frozen, pipeline.head
    optimizer = torch.optim.SGD(head.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)  # hapi.train's
    with pipeline.running(epochs=2):
        for epoch in range(2):
            head.train()
            for batch in pipeline.train(epoch):
                loss = nn.functional.cross_entropy(head(frozen(batch.features, batch.split)), batch.labels)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
    reference = torch.load(run / "checkpoint.pt", weights_only=True)["trainer"]["trainable"]
    for name, value in head.state_dict().items():
        torch.testing.assert_close(value, reference[name], rtol=1e-5, atol=1e-6, msg=name)


def test_frozen_stages_stay_in_eval_mode_and_take_no_gradients(tmp_path) -> None:
    pipeline = Pipeline(DataConfig(model="resnet18", image_size=64, train_per_class=1, val_per_class=1,
                                   cache_dir=tmp_path))
    probe = nn.ModuleDict({"frozen": pipeline.frozen, "head": pipeline.head}).train()  # as a framework would
    assert not any(m.training for m in probe["frozen"].modules())
    assert all(m.training for m in probe["head"].modules())
    assert not any(p.requires_grad for p in probe["frozen"].parameters())
    x = torch.randn(2, 3, 64, 64)
    model = pipeline.model.eval()
    torch.testing.assert_close(pipeline.frozen(model.prefix(4)(x), 4), model.prefix(model.spec.freeze_index)(x))


def test_batches_come_only_while_running(tmp_path) -> None:
    pipeline = Pipeline(DataConfig(model="resnet18", image_size=64, train_per_class=1, val_per_class=1,
                                   cache_dir=tmp_path))
    with pytest.raises(RuntimeError, match="inside `with pipeline.running"):
        next(pipeline.train(0))
