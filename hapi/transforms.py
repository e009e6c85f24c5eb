"""Preprocessing, identical on both tiers.

A sample's tensor depends only on its bytes, its key, the epoch and the spec, never on
which tier decoded it or what it was batched with: random augmentation draws from a
generator seeded per (seed, epoch, key). That is what lets the planner move work
between tiers without changing what the model sees.
"""

from __future__ import annotations

import hashlib
import io
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from struct import error as struct_error

import numpy as np
import torch
from PIL import Image
from torchvision.io import ImageReadMode, decode_image, decode_jpeg
from torchvision.transforms.v2 import functional as F

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
# RandomResizedCrop's defaults (torchvision, Inception-style augmentation).
CROP_SCALE = (0.08, 1.0)
CROP_RATIO = (3 / 4, 4 / 3)


# The formats torchvision's decode_image reads that this project accepts; PIL reads their
# headers. Anything else (TIFF, BMP, AVIF...) is refused before a decoder sees it.
ACCEPTED_FORMATS = ("JPEG", "PNG", "GIF", "WEBP")
# Peak bytes per pixel of decoding one image of each format, before resizing: torchvision's
# RGB output, plus for PNG the 16-bit decode and its 8-bit copy (3 + 6), and for an
# animated image PIL's palette frame, its RGBA-sized copy and the array taken of it (1 + 4 + 3).
_DECODE_BYTES_PER_PIXEL = {"JPEG": 3, "WEBP": 4, "PNG": 9, "GIF": 8}
_ANIMATED_BYTES_PER_PIXEL = 8


class CorruptImageError(ValueError):
    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"cannot decode image {key!r}: {reason}")
        self.key = key
        self.reason = reason

    def __reduce__(self) -> tuple:  # raised in a decode worker process, re-raised in the daemon
        return type(self), (self.key, self.reason)


class ImageTooLargeError(ValueError):
    """A header promises more pixels than the decoder may allocate: refused before decoding."""

    def __init__(self, key: str, reason: str, limit: int) -> None:
        super().__init__(f"image {key!r} {reason}; the limit is {limit} pixels")
        self.key = key
        self.reason = reason
        self.limit = limit

    def __reduce__(self) -> tuple:
        return type(self), (self.key, self.reason, self.limit)


@dataclass(frozen=True)
class ImageHeader:
    """What an encoded image's header says, read without decoding a pixel."""

    format: str
    width: int
    height: int
    animated: bool  # more than one frame: only the first is ever decoded

    @property
    def pixels(self) -> int:
        return self.width * self.height


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
        if not isinstance(body, dict):
            raise ValueError(f"transform must be a JSON object, got {type(body).__name__}")
        unknown = set(body) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown transform field(s) {sorted(unknown)[:10]}")
        for name in ("crop_size", "resize_size", "seed"):
            if name in body and (type(body[name]) is not int):
                raise ValueError(f"{name} must be an integer, got {str(body[name])[:80]}")
        if "augment" in body and type(body["augment"]) is not bool:
            raise ValueError(f"augment must be true or false, got {str(body['augment'])[:80]}")
        for name in ("mean", "std"):
            value = body.get(name, [1.0, 1.0, 1.0])
            if not (isinstance(value, list | tuple) and len(value) == 3
                    and all(type(v) in (int, float) and math.isfinite(v) for v in value)):
                raise ValueError(f"{name} must be a list of 3 finite numbers, got {str(value)[:80]}")
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


def read_header(data: bytes, key: str) -> ImageHeader:
    """Format, size and animation of ``data`` from its header alone (PIL opens lazily).

    PIL refuses to open what it considers a decompression bomb (over twice its own pixel
    limit); such an image is too large for any sensible limit, and says so.
    """
    if not data:
        raise CorruptImageError(key, "the object is empty")
    try:
        with Image.open(io.BytesIO(data), formats=ACCEPTED_FORMATS) as image:
            # is_animated looks for a second frame only; n_frames would walk every frame.
            return ImageHeader(image.format, *image.size, bool(getattr(image, "is_animated", False)))
    except Image.DecompressionBombError:
        raise ImageTooLargeError(key, f"claims more than {2 * Image.MAX_IMAGE_PIXELS} pixels",
                                 2 * Image.MAX_IMAGE_PIXELS) from None
    except (OSError, SyntaxError, ValueError, EOFError, struct_error) as exc:
        raise CorruptImageError(key, f"not a {', '.join(ACCEPTED_FORMATS)} image ({str(exc)[:120]})") from None


def working_pixels(header: ImageHeader, spec: TransformSpec) -> int:
    """The most pixels one step of ``preprocess`` holds: the decoded image, or its resized copy
    (a 1 x 30000 strip resized to a 256-pixel short side is 7.7 million pixels long)."""
    if spec.augment:
        resized = spec.crop_size * spec.crop_size
    else:
        short, long = sorted((max(header.width, 1), max(header.height, 1)))
        resized = spec.resize_size * math.ceil(spec.resize_size * long / short)
    return max(header.pixels, resized)


def check_pixels(header: ImageHeader, key: str, spec: TransformSpec, max_pixels: int) -> None:
    """Refuse, before decoding, an image whose decode or resize would hold over ``max_pixels``."""
    if header.pixels > max_pixels:
        raise ImageTooLargeError(key, f"is {header.width} x {header.height} pixels", max_pixels)
    resized = working_pixels(header, spec)
    if resized > max_pixels:
        raise ImageTooLargeError(key, f"is {header.width} x {header.height} pixels, which resize to {resized} "
                                 f"for a {spec.resize_size}-pixel short side", max_pixels)


def preprocess_peak_bytes(header: ImageHeader, spec: TransformSpec) -> int:
    """Peak bytes ``preprocess`` allocates for this image: its decode, then the resize (an
    8-bit copy and one separable pass of the same size), then the float crop and its normalised copy."""
    per_pixel = _ANIMATED_BYTES_PER_PIXEL if header.animated else _DECODE_BYTES_PER_PIXEL[header.format]
    decode = header.pixels * per_pixel
    resize = header.pixels * 3 + 2 * 3 * working_pixels(header, spec)
    return max(decode, resize) + 2 * 3 * spec.crop_size * spec.crop_size * 4


def _check_png(data: bytes, key: str) -> None:
    """PIL reads the PNG first: libpng inside torchvision crashes the whole process on some
    malformed ones (a header that claims more pixels than the data holds)."""
    try:
        with Image.open(io.BytesIO(data)) as image:
            image.load()
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        raise CorruptImageError(key, f"not a valid PNG ({exc})") from None


def _first_frame(data: bytes, key: str) -> torch.Tensor:
    """The first frame of an animated image as a (3, H, W) uint8 tensor.

    Only the first frame is decoded, never the rest: an animated image is a still one
    with frames the model never sees, and decoding them all (as torchvision's GIF decoder
    does) would let 700 one-pixel frames on a large canvas cost 700 canvases. Taking
    the first frame, rather than refusing, keeps data sets with a stray animation usable.
    """
    try:
        with Image.open(io.BytesIO(data), formats=ACCEPTED_FORMATS) as image:
            rgb = image.convert("RGB")
    except (OSError, SyntaxError, ValueError, EOFError) as exc:
        raise CorruptImageError(key, f"first frame not decodable ({str(exc)[:120]})") from None
    return torch.from_numpy(np.asarray(rgb).copy()).permute(2, 0, 1)


def decode_crop(data: bytes, key: str, spec: TransformSpec, epoch: int = 0,
                max_pixels: int | None = None) -> torch.Tensor:
    """Decode ``data`` and return its (3, crop, crop) uint8 crop, before normalisation.

    The header is read first: an unaccepted format is refused, and with ``max_pixels`` an
    image whose decode or resize would hold more pixels, before a byte of it is decoded.
    """
    header = read_header(data, key)
    if max_pixels is not None:
        check_pixels(header, key, spec, max_pixels)
    if header.animated:
        image = _first_frame(data, key)
    else:
        if header.format == "PNG":
            _check_png(data, key)
        try:
            image = decode_image(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB)
        except RuntimeError:
            # torchvision's own message is its C++ source location and a list of decoders.
            raise CorruptImageError(key, "not a decodable JPEG, PNG, WebP or GIF image") from None
    if image.ndim == 4:  # frames PIL did not count as an animation (giflib counts differently): the first
        image = image[0]
    # 16-bit PNGs decode to uint16; everything below works on 8-bit levels.
    return crop(F.to_dtype(image, torch.uint8, scale=True), key, spec, epoch)


def crop(image: torch.Tensor, key: str, spec: TransformSpec, epoch: int = 0) -> torch.Tensor:
    """The (3, crop, crop) uint8 crop of a decoded (3, H, W) uint8 image, on the image's device:
    a centre crop of the resized image, or (``spec.augment``) a random resized crop and flip
    drawn from the sample's own generator, whichever device decoded it."""
    if spec.augment:
        g = sample_generator(spec.seed, epoch, key)
        top, left, h, w = _random_crop_box(image.shape[1], image.shape[2], g)
        image = F.resized_crop(image, top, left, h, w, [spec.crop_size] * 2, antialias=True)
        if torch.rand(1, generator=g).item() < 0.5:
            image = F.horizontal_flip(image)
    else:
        image = F.resize(image, [spec.resize_size], antialias=True)
        image = F.center_crop(image, [spec.crop_size])
    return image


def decode_crops(blobs: Sequence[bytes], keys: Sequence[str], spec: TransformSpec, epoch: int,
                 device: torch.device) -> torch.Tensor:
    """The (N, 3, crop, crop) uint8 crops of ``blobs`` on CUDA ``device``.

    The JPEGs are decoded there all together by nvJPEG, then resized and cropped there by
    ``crop``, with the same boxes and flips as on the CPU; other formats, and any batch
    nvJPEG refuses (where ``decode_crop`` then names the corrupt image by its key), are
    decoded on the CPU and copied. nvJPEG's IDCT and chroma upsampling are not
    libjpeg-turbo's, and a GPU resize rounds on its own: a pixel may be a few levels off
    the CPU's crop of the same bytes, the mean difference well under one level.
    """
    headers = [read_header(blob, key) for blob, key in zip(blobs, keys, strict=True)]
    out = torch.empty((len(blobs), 3, spec.crop_size, spec.crop_size), dtype=torch.uint8, device=device)
    jpegs = [i for i, header in enumerate(headers) if header.format == "JPEG" and not header.animated]
    decoded: list[torch.Tensor] = []
    if jpegs:
        try:
            decoded = decode_jpeg([torch.frombuffer(bytearray(blobs[i]), dtype=torch.uint8) for i in jpegs],
                                  mode=ImageReadMode.RGB, device=device)
        except RuntimeError:
            jpegs = []
    for i, image in zip(jpegs, decoded, strict=True):
        out[i] = crop(image, keys[i], spec, epoch)
    on_device = set(jpegs)
    for i, (blob, key) in enumerate(zip(blobs, keys, strict=True)):
        if i not in on_device:
            out[i] = decode_crop(blob, key, spec, epoch).to(device)
    return out


def normalize(images: torch.Tensor, spec: TransformSpec, device: torch.device | str | None = None) -> torch.Tensor:
    """uint8 crops, (3, H, W) or (N, 3, H, W), as the model's float32 input on ``device``
    (None: where they are). They move as uint8, a quarter of the float32 bytes, and are
    converted there; on the CPU the result is bit for bit what ``preprocess`` returns."""
    if images.dtype != torch.uint8:
        raise ValueError(f"normalize takes uint8 images, got {images.dtype}")
    if device is not None:
        images = images.to(device, non_blocking=True)
    return F.normalize(F.to_dtype(images, torch.float32, scale=True), list(spec.mean), list(spec.std))


def preprocess(data: bytes, key: str, spec: TransformSpec, epoch: int = 0,
               max_pixels: int | None = None) -> torch.Tensor:
    """Decode ``data`` and return a normalised float32 (3, crop, crop) tensor (see ``decode_crop``)."""
    return normalize(decode_crop(data, key, spec, epoch, max_pixels), spec)
