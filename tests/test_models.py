"""Invariant 1: composing prefix and suffix gives the full model, for every model and split."""

import pytest
import torch

from hapi.models import MODELS, RANDOM_WEIGHTS, ModelUnavailableError, StagedModel, build_model, get_spec

# Deep models whose 40 splits each run the whole network: at 64 px they take 20 s apiece.
SMALLEST_INPUT = {"resnet101", "vgg16"}


def _input_size(name: str) -> int:
    # Small inputs keep the suite fast; ViT is built for its input size, 32 = 2x2 patches.
    return 32 if MODELS[name].input_size_fixed_at_build or name in SMALLEST_INPUT else 64


def _build(name: str, weights: str | None = None) -> StagedModel:
    """The model, or a skip where its package is not installed (the `pretrained` extra)."""
    try:
        return build_model(name, weights, input_size=_input_size(name))
    except ModelUnavailableError as exc:
        pytest.skip(str(exc))


@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_split_composes_to_the_torchvision_forward(name: str) -> None:
    spec = MODELS[name]
    size = _input_size(name)
    staged = _build(name, RANDOM_WEIGHTS)
    with torch.random.fork_rng():
        torch.manual_seed(0)  # the same seeded init build_model uses for "random" weights
        reference = spec.builder(weights=None, **spec.build_kwargs(size)).eval()
    x = torch.randn(3, 3, size, size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(x)
        assert torch.equal(staged(x), expected)
        for split in range(spec.freeze_index + 1):
            out = staged.suffix(split)(staged.prefix(split)(x.clone()))
            torch.testing.assert_close(out, expected, rtol=0, atol=0, msg=f"{name} split {split}")


@pytest.mark.parametrize("name", sorted(MODELS))
def test_freeze_index_leaves_a_trainable_head(name: str) -> None:
    staged = _build(name)
    trainable = list(staged.suffix(staged.spec.freeze_index).parameters())
    assert trainable, f"{name}: nothing to train after the freeze index"
    assert isinstance(staged.stages[-1], torch.nn.Linear)


def test_documented_freeze_points() -> None:
    resnet50 = build_model("resnet50", input_size=64)
    assert resnet50.stage_names[resnet50.spec.freeze_index:] == ("fc",)
    resnet18 = build_model("resnet18", input_size=64)
    assert resnet18.stage_names[resnet18.spec.freeze_index:] == ("layer4.1", "avgpool", "flatten", "fc")


def test_split_after_freeze_is_refused() -> None:
    model = build_model("resnet18", input_size=64)
    with pytest.raises(ValueError, match="freeze index"):
        model.prefix(model.spec.freeze_index + 1)
    with pytest.raises(ValueError, match="out of range"):
        model.suffix(-1)


def test_random_weights_are_identical_across_builds() -> None:
    a, b = build_model("resnet18", input_size=64), build_model("resnet18", input_size=64)
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa, pb), name


def test_weights_from_a_local_file_are_named_by_content(tmp_path) -> None:
    spec = get_spec("resnet18")
    source = spec.builder(weights=None)
    path = tmp_path / "resnet18.pt"
    torch.save(source.state_dict(), path)
    staged = build_model("resnet18", str(path), input_size=64)
    assert staged.weights_id.startswith("sha256:") and len(staged.weights_id) == 7 + 64
    assert torch.equal(staged.stages[0].weight, source.conv1.weight)


def test_unknown_model_and_weights_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="unknown model 'resnet51'; choose one of"):
        build_model("resnet51")
    with pytest.raises(ValueError, match="expected 'random', 'torchvision', 'package' or a state_dict file"):
        build_model("resnet18", "/no/such/file.pt")


def test_replace_head_sets_the_number_of_classes() -> None:
    model = build_model("vit_b_16", input_size=32)
    model.replace_head(7)
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 7)
