"""Preprocessing, identical on both tiers.

A sample's tensor depends only on its bytes, its key, the epoch and the spec, never on
which tier decoded it or what it was batched with: random augmentation draws from a
generator seeded per (seed, epoch, key). That is what lets the planner move work
between tiers without changing what the model sees.
"""

from __future__ import annotations

import hashlib
import io
from dataclasses import asdict, dataclass

import torch
from PIL import Image
from torchvision.io import ImageReadMode, decode_image
from torchvision.transforms.v2 import functional as F

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
# RandomResizedCrop's defaults (torchvision, Inception-style augmentation).
CROP_SCALE = (0.08, 1.0)
CROP_RATIO = (3 / 4, 4 / 3)
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


class CorruptImageError(ValueError):
    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"cannot decode image {key!r}: {reason}")
        self.key = key


@dataclass(frozen=True)
class TransformSpec:
    """How an encoded image becomes the model's input tensor."""

    crop_size: int = 224
    resize_size: int = 256
    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD
    augment: bool = False  # random resized crop + horizontal flip, seeded per sample
    seed: int = 0

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, body: dict) -> TransformSpec:
        unknown = set(body) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown transform field(s) {sorted(unknown)}")
        for name in ("crop_size", "resize_size", "seed"):
            if name in body and (type(body[name]) is not int):
                raise ValueError(f"{name} must be an integer, got {body[name]!r}")
        if "augment" in body and type(body["augment"]) is not bool:
            raise ValueError(f"augment must be true or false, got {body['augment']!r}")
        for name in ("mean", "std"):
            value = body.get(name, [1.0, 1.0, 1.0])
            if not (isinstance(value, list | tuple) and len(value) == 3
                    and all(type(v) in (int, float) for v in value)):
                raise ValueError(f"{name} must be a list of 3 numbers, got {value!r}")
        spec = cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in body.items()})
        if min(spec.std) <= 0:
            raise ValueError(f"std must be positive, got {list(spec.std)}")
        if not (8 <= spec.crop_size <= spec.resize_size <= 4096):
            raise ValueError(f"need 8 <= crop_size <= resize_size <= 4096, got {spec.crop_size}, {spec.resize_size}")
        return spec


def sample_generator(seed: int, epoch: int, key: str) -> torch.Generator:
    digest = hashlib.blake2b(f"{seed}/{epoch}/{key}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)


def _random_crop_box(height: int, width: int, g: torch.Generator) -> tuple[int, int, int, int]:
    """A RandomResizedCrop box (top, left, h, w), drawn from ``g`` only."""
    area = height * width
    log_ratio = torch.log(torch.tensor(CROP_RATIO))
    for _ in range(10):
        target_area = area * torch.empty(1).uniform_(*CROP_SCALE, generator=g).item()
        ratio = torch.exp(torch.empty(1).uniform_(*log_ratio.tolist(), generator=g)).item()
        w = round((target_area * ratio) ** 0.5)
        h = round((target_area / ratio) ** 0.5)
        if 0 < w <= width and 0 < h <= height:
            top = int(torch.randint(0, height - h + 1, (1,), generator=g))
            left = int(torch.randint(0, width - w + 1, (1,), generator=g))
            return top, left, h, w
    side = min(height, width)  # fall back to a centre crop, as torchvision does
    return (height - side) // 2, (width - side) // 2, side, side


def _check_png(data: bytes, key: str) -> None:
    """PIL reads the PNG first: libpng inside torchvision crashes the whole process on some
    malformed ones (a header that claims more pixels than the data holds)."""
    try:
        with Image.open(io.BytesIO(data)) as image:
            image.load()
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        raise CorruptImageError(key, f"not a valid PNG ({exc})") from None


def preprocess(data: bytes, key: str, spec: TransformSpec, epoch: int = 0) -> torch.Tensor:
    """Decode ``data`` and return a normalised float32 (3, crop, crop) tensor."""
    if not data:
        raise CorruptImageError(key, "the object is empty")
    if data.startswith(PNG_SIGNATURE):
        _check_png(data, key)
    try:
        image = decode_image(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB)
    except RuntimeError:
        # torchvision's own message is its C++ source location and a list of decoders.
        raise CorruptImageError(key, "not a decodable JPEG, PNG, WebP or GIF image") from None
    if image.ndim == 4:  # an animated GIF: its first frame
        image = image[0]
    # 16-bit PNGs decode to uint16; everything below works on 8-bit levels.
    image = F.to_dtype(image, torch.uint8, scale=True)
    if spec.augment:
        g = sample_generator(spec.seed, epoch, key)
        top, left, h, w = _random_crop_box(image.shape[1], image.shape[2], g)
        image = F.resized_crop(image, top, left, h, w, [spec.crop_size] * 2, antialias=True)
        if torch.rand(1, generator=g).item() < 0.5:
            image = F.horizontal_flip(image)
    else:
        image = F.resize(image, [spec.resize_size], antialias=True)
        image = F.center_crop(image, [spec.crop_size])
    return F.normalize(F.to_dtype(image, torch.float32, scale=True), list(spec.mean), list(spec.std))
