"""Tests for the synthetic ImageNet-like data set generator."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from hapi.synthetic import CLASS_NAMES, render_jpeg

TRAIN_PER_CLASS = 16
TEST_PER_CLASS = 8


@pytest.fixture(scope="module")
def samples() -> list[tuple[int, bytes]]:
    """(label, JPEG) pairs, TRAIN_PER_CLASS + TEST_PER_CLASS per class.

    Rendered once and shared, since rendering dominates the tests' run time.
    """
    per_class = TRAIN_PER_CLASS + TEST_PER_CLASS
    return [(label, render_jpeg(label, index)) for label in range(len(CLASS_NAMES)) for index in range(per_class)]


def test_class_names_are_distinct() -> None:
    assert len(CLASS_NAMES) == 10
    assert len(set(CLASS_NAMES)) == len(CLASS_NAMES)


def test_deterministic() -> None:
    assert render_jpeg(3, 7) == render_jpeg(3, 7)
    assert render_jpeg(3, 7, seed=5, quality=75) == render_jpeg(3, 7, 5, 75)
    assert render_jpeg(3, 7) != render_jpeg(3, 8)
    assert render_jpeg(3, 7) != render_jpeg(4, 7)
    assert render_jpeg(3, 7) != render_jpeg(3, 7, seed=1)


def test_rejects_unknown_label() -> None:
    with pytest.raises(ValueError):
        render_jpeg(len(CLASS_NAMES), 0)


def test_decodes_at_imagenet_like_size(samples: list[tuple[int, bytes]]) -> None:
    for _, data in samples[:: TRAIN_PER_CLASS + TEST_PER_CLASS]:
        with Image.open(io.BytesIO(data)) as img:
            assert img.format == "JPEG"
            img.load()
            assert img.mode == "RGB"
            w, h = img.size
            assert 360 <= w <= 440
            assert 320 <= h <= 380


def test_mean_jpeg_size_like_imagenet(samples: list[tuple[int, bytes]]) -> None:
    sizes = np.array([len(data) for _, data in samples]) / 1e3
    assert 60 <= sizes.mean() <= 160, sizes.mean()
    assert sizes.min() > 30


def _colour_histogram(data: bytes, bins: int = 6) -> np.ndarray:
    """A normalised bins**3 RGB histogram of a 32x32 thumbnail.

    A histogram ignores where the object is, so a linear model on it can pick
    up class hue and texture contrast despite random placement and rotation.
    """
    with Image.open(io.BytesIO(data)) as img:
        # DCT-domain downscaling at decode time keeps this test fast.
        img.draft("RGB", (64, 64))
        thumb = img.convert("RGB").resize((32, 32), Image.Resampling.BILINEAR)
    q = np.minimum(np.asarray(thumb, np.int64) * bins // 256, bins - 1)
    code = (q[..., 0] * bins + q[..., 1]) * bins + q[..., 2]
    return np.bincount(code.ravel(), minlength=bins**3) / code.size


def _fit_softmax(x: np.ndarray, y: np.ndarray, k: int) -> np.ndarray:
    """Weights (with a bias row) of an L2-regularised softmax regression."""
    x = np.hstack([x, np.ones((len(x), 1))])
    w = np.zeros((x.shape[1], k))
    onehot = np.eye(k)[y]
    for _ in range(300):
        logits = x @ w
        p = np.exp(logits - logits.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        w -= 0.1 * (x.T @ (p - onehot) / len(x) + 1e-2 * w)
    return w


def test_classes_are_learnable(samples: list[tuple[int, bytes]]) -> None:
    x = np.stack([_colour_histogram(data) for _, data in samples])
    y = np.array([label for label, _ in samples])
    train = np.arange(len(y)) % (TRAIN_PER_CLASS + TEST_PER_CLASS) < TRAIN_PER_CLASS
    mu, sd = x[train].mean(0), x[train].std(0) + 1e-3
    z = (x - mu) / sd
    w = _fit_softmax(z[train], y[train], len(CLASS_NAMES))
    pred = (np.hstack([z, np.ones((len(z), 1))]) @ w).argmax(1)
    accuracy = (pred[~train] == y[~train]).mean()
    # Chance is 10%; about 80% is measured.  Well below 100% on purpose: the
    # nuisance variation should leave the real network something to learn.
    assert accuracy >= 0.5, accuracy
