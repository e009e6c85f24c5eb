import io
import struct
import zlib

import numpy as np
import pytest
import torch
from PIL import Image

from hapi.synthetic import render_jpeg
from hapi.transforms import (
    CorruptImageError,
    ImageTooLargeError,
    TransformSpec,
    decode_crop,
    normalize,
    preprocess,
    preprocess_peak_bytes,
    read_header,
)


@pytest.fixture(scope="module")
def jpeg() -> bytes:
    return render_jpeg(0, 0)


def test_eval_transform_is_a_normalised_centre_crop(jpeg: bytes) -> None:
    x = preprocess(jpeg, "k", TransformSpec(crop_size=64, resize_size=72))
    assert x.shape == (3, 64, 64) and x.dtype == torch.float32
    assert -3 < x.mean() < 3  # normalised, not 0..255


@pytest.mark.parametrize("augment", [False, True])
def test_normalising_the_uint8_crop_is_preprocess_bit_for_bit(jpeg: bytes, augment: bool) -> None:
    spec = TransformSpec(crop_size=64, resize_size=72, augment=augment)
    crops = torch.stack([decode_crop(jpeg, k, spec, 2) for k in ("a", "b")])
    assert crops.dtype == torch.uint8 and crops.shape == (2, 3, 64, 64)
    assert torch.equal(normalize(crops, spec), torch.stack([preprocess(jpeg, k, spec, 2) for k in ("a", "b")]))


def test_normalize_takes_only_uint8() -> None:
    with pytest.raises(ValueError, match="uint8"):
        normalize(torch.zeros(1, 3, 8, 8), TransformSpec(crop_size=8, resize_size=8))


def test_png_and_greyscale_decode_to_three_channels() -> None:
    buffer = io.BytesIO()
    Image.fromarray(np.full((40, 50), 128, np.uint8), mode="L").save(buffer, "PNG")
    assert preprocess(buffer.getvalue(), "g.png", TransformSpec(crop_size=32, resize_size=32)).shape == (3, 32, 32)


def test_augmentation_depends_only_on_seed_epoch_and_key(jpeg: bytes) -> None:
    spec = TransformSpec(crop_size=64, resize_size=72, augment=True, seed=3)
    a = preprocess(jpeg, "k", spec, epoch=1)
    assert torch.equal(a, preprocess(jpeg, "k", spec, epoch=1))
    assert not torch.equal(a, preprocess(jpeg, "k", spec, epoch=2))
    assert not torch.equal(a, preprocess(jpeg, "other", spec, epoch=1))
    assert not torch.equal(a, preprocess(jpeg, "k", TransformSpec(crop_size=64, resize_size=72, augment=True), 1))


def test_augmentation_ignores_the_global_rng(jpeg: bytes) -> None:
    spec = TransformSpec(crop_size=64, resize_size=72, augment=True)
    torch.manual_seed(1)
    a = preprocess(jpeg, "k", spec)
    torch.manual_seed(2)
    assert torch.equal(a, preprocess(jpeg, "k", spec))


@pytest.mark.parametrize("data", [b"", b"not an image", render_jpeg(0, 0)[:200]])
def test_corrupt_images_name_their_key(data: bytes) -> None:
    with pytest.raises(CorruptImageError, match="'bad/key.jpg'") as info:
        preprocess(data, "bad/key.jpg", TransformSpec(crop_size=32, resize_size=32))
    assert info.value.key == "bad/key.jpg"


def _png_claiming(width: int, height: int) -> bytes:
    """A 10x10 PNG whose header says ``width`` x ``height`` (with a valid header checksum)."""
    out = io.BytesIO()
    Image.new("RGB", (10, 10), (200, 10, 10)).save(out, "PNG")
    png = bytearray(out.getvalue())
    png[16:24] = struct.pack(">II", width, height)
    png[29:33] = struct.pack(">I", zlib.crc32(bytes(png[12:29])))
    return bytes(png)


def test_a_png_whose_header_lies_is_corrupt_not_a_crash() -> None:
    # Handed to torchvision's libpng as is, this one kills the process (segmentation fault).
    with pytest.raises(CorruptImageError, match="'lying.png'.*not a valid PNG"):
        preprocess(_png_claiming(20, 20), "lying.png", TransformSpec(crop_size=8, resize_size=8))


def _image(fmt: str, width: int, height: int, **save: object) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (height, width, 3), np.uint8)).save(
        buffer, fmt, **save)
    return buffer.getvalue()


@pytest.mark.parametrize("fmt, width, height", [("JPEG", 640, 480), ("PNG", 300, 200), ("WEBP", 200, 200),
                                                ("JPEG", 20, 2000)])
def test_the_peak_estimate_covers_what_preprocess_allocates(fmt: str, width: int, height: int) -> None:
    from storage_side.memory import peak_live_bytes

    data = _image(fmt, width, height)
    spec = TransformSpec(crop_size=64, resize_size=72)
    header = read_header(data, "k")
    assert (header.format, header.width, header.height, header.animated) == (fmt, width, height, False)
    assert peak_live_bytes(lambda: preprocess(data, "k", spec)) <= preprocess_peak_bytes(header, spec)


def test_pixel_limits_are_checked_from_the_header_and_after_resizing() -> None:
    spec = TransformSpec(crop_size=32, resize_size=40)
    with pytest.raises(ImageTooLargeError, match="'big.png' is 12000 x 12000 pixels"):
        preprocess(_png_claiming(12_000, 12_000), "big.png", spec, max_pixels=10**6)
    thread = _image("PNG", 1, 5000)  # 5000 pixels, resized to 40 x 200000
    with pytest.raises(ImageTooLargeError, match="resize to 8000000"):
        preprocess(thread, "thread.png", spec, max_pixels=10**6)
    assert preprocess(thread, "thread.png", spec, max_pixels=10**7).shape == (3, 32, 32)


def test_unaccepted_formats_are_refused_before_decoding() -> None:
    with pytest.raises(CorruptImageError, match="'x.bmp'.*not a JPEG, PNG, GIF, WEBP image"):
        preprocess(_image("BMP", 8, 8), "x.bmp", TransformSpec(crop_size=8, resize_size=8))


@pytest.mark.parametrize("transform, words", [
    ([], "JSON object"), ("big", "JSON object"), ({"mean": [float("nan"), 0, 0]}, "finite"),
    ({"std": [float("inf"), 1, 1]}, "finite"),
])
def test_a_transform_that_is_not_a_spec_is_a_value_error(transform: object, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        TransformSpec.from_dict(transform)
