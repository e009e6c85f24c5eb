import io
import struct
import zlib

import numpy as np
import pytest
import torch
from PIL import Image

from hapi.synthetic import render_jpeg
from hapi.transforms import CorruptImageError, TransformSpec, preprocess


@pytest.fixture(scope="module")
def jpeg() -> bytes:
    return render_jpeg(0, 0)


def test_eval_transform_is_a_normalised_centre_crop(jpeg: bytes) -> None:
    x = preprocess(jpeg, "k", TransformSpec(crop_size=64, resize_size=72))
    assert x.shape == (3, 64, 64) and x.dtype == torch.float32
    assert -3 < x.mean() < 3  # normalised, not 0..255


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
