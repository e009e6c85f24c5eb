"""Deterministic synthetic image-classification data with ImageNet-like JPEGs.

Each class is a foreground shape with a class-typical hue and surface texture,
placed over a natural-looking noisy background with per-sample nuisance
variation.  Images are ~400x350 px and ~100 KB at JPEG quality 90, close to
ImageNet's averages, so that byte counts and decode costs measured on this data
are realistic stand-ins for the real thing.
"""

from __future__ import annotations

import colorsys
import io
import math

import numpy as np
from PIL import Image, ImageDraw

# (name, shape, hue in [0, 1), texture) per class; every (shape, hue, texture)
# combination is unique, and shapes/hues/textures each recur across classes so
# that no single cue alone separates all of them.
_CLASSES: tuple[tuple[str, str, float, str], ...] = (
    ("red-circle", "circle", 0.00, "smooth"),
    ("blue-square", "square", 0.62, "smooth"),
    ("green-triangle", "triangle", 0.33, "smooth"),
    ("yellow-star", "star", 0.15, "smooth"),
    ("purple-ring", "ring", 0.78, "smooth"),
    ("striped-cross", "cross", 0.07, "stripes"),
    ("checkered-square", "square", 0.50, "checker"),
    ("dotted-circle", "circle", 0.90, "dots"),
    ("striped-triangle", "triangle", 0.62, "stripes"),
    ("checkered-star", "star", 0.33, "checker"),
)

CLASS_NAMES: tuple[str, ...] = tuple(c[0] for c in _CLASSES)

# Std of the fine texture and half-width of the uniform per-pixel sensor grain
# (in 8-bit levels), and the fine texture's colour share.  They are the knobs for JPEG
# size: smooth content compresses to a few KB, and this high-frequency content
# is what brings the mean to ~100 KB at quality 90, as for ImageNet photos.
_DETAIL = 60.0
_DETAIL_CHROMA = 0.6
_GRAIN = 20

# The smooth background layers are built at 1/_SMOOTH of full resolution and
# upsampled once, which is several times cheaper than summing full-size layers.
_SMOOTH = 6


def _hsv(h: float, s: float, v: float) -> np.ndarray:
    """An RGB colour in [0, 255] from HSV components in [0, 1]."""
    return np.array(colorsys.hsv_to_rgb(h % 1.0, s, v), dtype=np.float32) * 255.0


def _coords(w: int, h: int) -> tuple[np.ndarray, np.ndarray]:
    """Pixel x (1xW) and y (Hx1) coordinates that broadcast to HxW."""
    xs = np.arange(w, dtype=np.float32)[None, :]
    ys = np.arange(h, dtype=np.float32)[:, None]
    return xs, ys


def _noise(rng: np.random.Generator, w: int, h: int, lum: float, chroma: float = 0.0) -> np.ndarray:
    """HxWx3 white noise: a `lum`-std part shared by RGB plus `chroma` per channel.

    HxWx1 (luminance only) if `chroma` is 0.
    """
    out = lum * rng.standard_normal((h, w, 1), dtype=np.float32)
    if chroma:
        out = out + chroma * rng.standard_normal((h, w, 3), dtype=np.float32)
    return out


def _upsample(a: np.ndarray, w: int, h: int, lo: float, hi: float) -> np.ndarray:
    """Bicubic resize of a float HxWxC array (C in 1, 3) to `w` x `h`.

    PIL resizes multi-channel images only at 8 bits, so [lo, hi] is mapped onto
    0..255 on the way; values outside are clipped.
    """
    scale = 255.0 / (hi - lo)
    q = np.clip((a - lo) * scale, 0, 255).astype(np.uint8)
    small = Image.fromarray(q if q.shape[2] == 3 else q[..., 0])
    out = np.asarray(small.resize((w, h), Image.Resampling.BICUBIC), np.float32)
    out = out.reshape(h, w, -1)
    out *= 1.0 / scale
    out += lo
    return out


def _smooth_noise(rng: np.random.Generator, w: int, h: int, cell: int, lum: float, chroma: float = 0.0) -> np.ndarray:
    """Zero-mean noise (as `_noise`) that varies on a `cell`-px scale.

    Upsampling a coarse random grid bicubically is a cheap stand-in for the
    1/f-like spectra of natural images.
    """
    span = 3.0 * math.hypot(lum, chroma)
    grid = _noise(rng, w // cell + 2, h // cell + 2, lum, chroma)
    return _upsample(grid, w, h, -span, span)


def _background(rng: np.random.Generator, w: int, h: int) -> np.ndarray:
    """A float32 HxWx3 background: tinted gradient plus multi-scale noise."""
    sw, sh = w // _SMOOTH + 2, h // _SMOOTH + 2
    base = _hsv(rng.random(), rng.uniform(0.05, 0.45), rng.uniform(0.35, 0.8))
    ang = rng.uniform(0, 2 * math.pi)
    xs, ys = _coords(sw, sh)
    ramp = (xs * math.cos(ang) + ys * math.sin(ang)) / max(sw, sh)
    small = base + rng.uniform(20, 60) * ramp[..., None]
    # Mostly luminance variation with a little colour, as in real scenes; cells
    # are 96, 24 and 6 px at full resolution.
    small += _smooth_noise(rng, sw, sh, 16, 28.0, 14.0)
    small += _smooth_noise(rng, sw, sh, 4, 16.0, 6.0)
    small += _noise(rng, sw, sh, 10.0, 3.0)
    return _upsample(small, w, h, 0.0, 255.0)


def _detail(rng: np.random.Generator, w: int, h: int) -> np.ndarray:
    """A float32 HxWx3 fine texture whose strength varies in space.

    Busy regions lie next to calm ones, like foliage next to sky; this texture
    carries most of the JPEG bytes, as it does in photos.  It varies on a 2-px
    scale, so it is built at half resolution and upsampled.
    """
    gw, gh = w // 2 + 2, h // 2 + 2
    busy = np.clip(1.0 + _smooth_noise(rng, gw, gh, 64, 0.7), 0.15, 2.0)
    fine = busy * _noise(rng, gw, gh, _DETAIL, _DETAIL * _DETAIL_CHROMA)
    span = 4.0 * _DETAIL
    return _upsample(fine, w, h, -span, span)


def _outline(shape: str, cx: float, cy: float, r: float, rot: float) -> list[tuple[float, float]]:
    """Polygon vertices of a rotated polygonal shape of radius `r`."""
    if shape == "square":
        pts = [(r, math.pi / 4 + k * math.pi / 2) for k in range(4)]
    elif shape == "triangle":
        pts = [(r, -math.pi / 2 + k * 2 * math.pi / 3) for k in range(3)]
    elif shape == "star":
        pts = [(r if k % 2 == 0 else 0.42 * r, -math.pi / 2 + k * math.pi / 5) for k in range(10)]
    else:  # cross: a plus sign with arms of half-width r/3, one arm at a time
        t = r / 3
        arm = [(math.hypot(x, y), math.atan2(y, x)) for x, y in ((t, r), (t, t), (r, t))]
        pts = [(d, a - k * math.pi / 2) for k in range(4) for d, a in arm]
    return [(cx + d * math.cos(a + rot), cy + d * math.sin(a + rot)) for d, a in pts]


def _mask(shape: str, w: int, h: int, cx: float, cy: float, r: float, rot: float) -> np.ndarray:
    """A float32 HxW coverage mask in [0, 1] of the foreground shape."""
    m = Image.new("L", (w, h), 0)
    d = ImageDraw.Draw(m)
    if shape in ("circle", "ring"):
        d.ellipse((cx - r, cy - r, cx + r, cy + r), fill=255)
        if shape == "ring":
            ri = r * 0.55
            d.ellipse((cx - ri, cy - ri, cx + ri, cy + ri), fill=0)
    else:
        d.polygon(_outline(shape, cx, cy, r, rot), fill=255)
    return np.asarray(m, np.float32) / 255.0


def _pattern(rng: np.random.Generator, texture: str, w: int, h: int, rot: float) -> np.ndarray:
    """A float32 HxW brightness pattern in [0, 1] for the foreground surface."""
    if texture == "smooth":
        return np.ones((h, w), np.float32)
    period = rng.uniform(10, 20)
    xs, ys = _coords(w, h)
    u = (xs * math.cos(rot) + ys * math.sin(rot)) / period
    v = (-xs * math.sin(rot) + ys * math.cos(rot)) / period
    if texture == "stripes":
        on = np.floor(u) % 2 == 0
    elif texture == "checker":
        on = (np.floor(u) + np.floor(v)) % 2 == 0
    else:  # dots
        on = (u % 1 - 0.5) ** 2 + (v % 1 - 0.5) ** 2 < 0.09
    return np.where(on, 1.0, 0.3).astype(np.float32)


def _distractors(rng: np.random.Generator, img: np.ndarray) -> None:
    """Paint a few random-coloured soft ellipses onto `img` in place.

    They add clutter the classifier has to ignore, and their colours are drawn
    from the whole hue circle so colour alone is not a perfect cue.
    """
    h, w, _ = img.shape
    for _ in range(rng.integers(2, 6)):
        rx, ry = rng.uniform(10, 45, size=2)
        cx, cy = rng.uniform(0, w), rng.uniform(0, h)
        alpha = rng.uniform(0.4, 0.9) / 255.0
        col = _hsv(rng.random(), rng.uniform(0.2, 0.8), rng.uniform(0.3, 0.9))
        # Draw only within the ellipse's bounding box: full-frame masks would
        # dominate the render time.
        x0, y0 = max(0, int(cx - rx)), max(0, int(cy - ry))
        x1, y1 = min(w, int(cx + rx) + 2), min(h, int(cy + ry) + 2)
        m = Image.new("L", (x1 - x0, y1 - y0), 0)
        box = (cx - rx - x0, cy - ry - y0, cx + rx - x0, cy + ry - y0)
        ImageDraw.Draw(m).ellipse(box, fill=255)
        region = img[y0:y1, x0:x1]
        region += np.asarray(m, np.float32)[..., None] * alpha * (col - region)


def render_jpeg(label: int, index: int, seed: int = 0, quality: int = 90) -> bytes:
    """The JPEG bytes of sample `index` of class `label`.

    The same arguments always give the same bytes (for given numpy and Pillow
    versions, whose random streams and JPEG encoder the bytes depend on).
    """
    if not 0 <= label < len(_CLASSES):
        raise ValueError(f"label {label} not in [0, {len(_CLASSES)})")
    _, shape, hue, texture = _CLASSES[label]
    rng = np.random.default_rng([seed, label, index])
    w, h = int(rng.integers(360, 441)), int(rng.integers(320, 381))

    img = _background(rng, w, h)
    _distractors(rng, img)

    r = rng.uniform(0.18, 0.34) * min(w, h)
    cx, cy = rng.uniform(r, w - r), rng.uniform(r, h - r)
    rot = rng.uniform(0, 2 * math.pi)
    colour = _hsv(hue + rng.normal(0, 0.025), rng.uniform(0.6, 1.0), rng.uniform(0.65, 1.0))
    # The object is drawn in its bounding box only, which keeps rendering fast.
    x0, y0 = int(cx - r), int(cy - r)
    x1, y1 = min(w, int(cx + r) + 2), min(h, int(cy + r) + 2)
    bw, bh, lx, ly = x1 - x0, y1 - y0, cx - x0, cy - y0
    mask = _mask(shape, bw, bh, lx, ly, r, rot)[..., None]
    surface = _pattern(rng, texture, bw, bh, rot)[..., None] * colour
    # Directional shading so the object is not a flat colour patch.
    xs, ys = _coords(bw, bh)
    la = rng.uniform(0, 2 * math.pi)
    shade = 1.0 + 0.25 * ((xs - lx) * math.cos(la) + (ys - ly) * math.sin(la)) / r
    box = img[y0:y1, x0:x1]
    box += mask * (surface * shade[..., None] - box)

    # Objects get some surface texture too, but less than the background so
    # their pattern stays visible.
    detail = _detail(rng, w, h)
    detail[y0:y1, x0:x1] *= 1.0 - 0.6 * mask
    img += detail
    # Uniform integer grain: as good as Gaussian here and much cheaper to draw.
    img += rng.integers(-_GRAIN, _GRAIN + 1, size=img.shape, dtype=np.int8)
    out = Image.fromarray(np.clip(img, 0, 255).astype(np.uint8))
    buf = io.BytesIO()
    out.save(buf, format="JPEG", quality=quality)
    return buf.getvalue()
