"""Data sets in an object store: manifests, shards, the synthetic set, packaged real images, uploads.

A data set is described by one manifest object, written last at upload, that lists every
sample as (key, label, size) per split, so training never LISTs a bucket. A sample is
either one object (``train/cat/000001.jpg``) or a member of a tar shard object
(``shards/train-00000.tar#train/cat/000001.jpg``), as the reference bundled 128 images per object.

CLI: ``python -m hapi.datasets {synthetic,packaged,upload,describe} ...``
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import json
import logging
import os
import sys
import tarfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from PIL import Image
from tqdm import tqdm

from hapi import synthetic
from hapi.store import MissingObjectError, ObjectStore, ObjectTooLargeError, S3Store, open_store
from hapi.transforms import CorruptImageError

log = logging.getLogger(__name__)

MANIFEST_KEY = "manifest.json"
SHARD_SEPARATOR = "#"
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png")


@dataclass(frozen=True)
class Sample:
    key: str  # object key, or "<shard key>#<member name>"
    label: int
    size: int  # bytes of the encoded image

    @property
    def object_key(self) -> str:
        return self.key.split(SHARD_SEPARATOR, 1)[0]


@dataclass(frozen=True)
class Manifest:
    name: str
    classes: tuple[str, ...]
    splits: dict[str, tuple[Sample, ...]]

    def to_json(self) -> bytes:
        body = {
            "name": self.name,
            "classes": list(self.classes),
            "splits": {split: [asdict(s) for s in samples] for split, samples in self.splits.items()},
        }
        return json.dumps(body).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Manifest:
        body = json.loads(data)
        splits = {split: tuple(Sample(**s) for s in samples) for split, samples in body["splits"].items()}
        return cls(body["name"], tuple(body["classes"]), splits)

    def split(self, name: str) -> tuple[Sample, ...]:
        if name not in self.splits:
            raise KeyError(f"data set {self.name!r} has no split {name!r}; it has {sorted(self.splits)}")
        return self.splits[name]


class DatasetNotFoundError(LookupError):
    pass


def load_manifest(store: ObjectStore) -> Manifest:
    try:
        return Manifest.from_json(store.get(MANIFEST_KEY))
    except MissingObjectError:
        raise DatasetNotFoundError(
            f"no data set at {store.url}: {MANIFEST_KEY} is missing "
            "(create one with `python -m hapi.datasets synthetic` or `upload`)"
        ) from None


def read_samples(store: ObjectStore, keys: Sequence[str], pool: ThreadPoolExecutor,
                 max_object_bytes: int | None = None,
                 on_size: Callable[[str, int | None], None] | None = None) -> list[bytes]:
    """The encoded bytes of each sample, in order. Each object is fetched once, concurrently.

    ``max_object_bytes`` caps each object (ObjectTooLargeError); ``on_size(object_key, size)``
    is told each object's size before its body is read, and may raise to refuse it.
    Raises MissingObjectError naming the first key that does not exist.
    """
    # The first requested key of each object, so a failure names a key the caller sent.
    first_key: dict[str, str] = {}
    wanted: dict[str, set[str]] = {}
    for key in keys:
        object_key, _, member = key.partition(SHARD_SEPARATOR)
        first_key.setdefault(object_key, key)
        if member:
            wanted.setdefault(object_key, set()).add(member)

    def fetch(object_key: str) -> bytes:
        check = (lambda size: on_size(object_key, size)) if on_size else None
        try:
            return store.get(object_key, max_bytes=max_object_bytes, on_size=check)
        except MissingObjectError:
            raise MissingObjectError(first_key[object_key]) from None
        except ObjectTooLargeError as exc:
            raise ObjectTooLargeError(first_key[object_key], None, exc.limit) from exc

    objects = dict(zip(first_key, pool.map(fetch, first_key)))
    members = {object_key: _untar(objects[object_key], first_key[object_key], names)
               for object_key, names in wanted.items()}
    out = []
    for key in keys:
        object_key, _, member = key.partition(SHARD_SEPARATOR)
        if not member:
            out.append(objects[object_key])
            continue
        try:
            out.append(members[object_key][member])
        except KeyError:
            raise MissingObjectError(key) from None
    return out


def _untar(data: bytes, key: str, names: set[str]) -> dict[str, bytes]:
    """The members ``names`` of the tar archive ``data`` (others are never extracted).

    Each member's size is checked against the archive before it is read: a sparse member
    expands to its declared size however few bytes the archive holds (a 10 KB tar can
    declare 2 GiB), and a plain member cannot hold more than the archive has after it.
    Image samples are never sparse, so a sparse member is refused outright.
    """
    found: dict[str, bytes] = {}
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
            for member in tar:
                if member.name not in names or not member.isfile():
                    continue
                if member.issparse():
                    raise CorruptImageError(key, f"shard member {member.name!r} is a sparse file "
                                            f"(declares {member.size} bytes); samples are never sparse")
                if member.offset_data + member.size > len(data):
                    raise CorruptImageError(key, f"shard member {member.name!r} declares {member.size} bytes, "
                                            f"past the end of its {len(data)}-byte archive")
                found[member.name] = tar.extractfile(member).read()
    except tarfile.TarError:
        raise CorruptImageError(key, "its shard object is not a readable tar archive") from None
    return found


def _tar(members: Iterable[tuple[str, bytes]]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def write_dataset(
    store: ObjectStore,
    name: str,
    classes: Sequence[str],
    items: dict[str, Sequence[tuple[str, int]]],
    read: Callable[[str, int], bytes],
    shard_size: int = 0,
    workers: int | None = None,
) -> Manifest:
    """Write samples and then the manifest (last, so a half-written set is never used).

    ``items`` maps a split to (key, label) pairs; ``read(key, label)`` returns the bytes.
    With ``shard_size`` > 0, samples are bundled that many per tar object.
    """
    splits: dict[str, tuple[Sample, ...]] = {}
    total = sum(len(v) for v in items.values())
    with ProcessPoolExecutor(workers or os.cpu_count()) as pool, tqdm(
        total=total, desc=f"writing {name}", unit="img", leave=False
    ) as bar:
        for split, pairs in items.items():
            samples: list[Sample] = []
            for chunk_start in range(0, len(pairs), shard_size or len(pairs) or 1):
                chunk = pairs[chunk_start: chunk_start + (shard_size or len(pairs))]
                blobs = list(pool.map(read, *zip(*chunk), chunksize=8)) if chunk else []
                bar.update(len(chunk))
                if shard_size:
                    shard_key = f"shards/{split}-{chunk_start // shard_size:05d}.tar"
                    # Members keep their whole key: file names alone repeat across classes.
                    store.put(shard_key, _tar((key, b) for (key, _), b in zip(chunk, blobs)))
                    samples += [Sample(f"{shard_key}{SHARD_SEPARATOR}{key}", label, len(b))
                                for (key, label), b in zip(chunk, blobs)]
                else:
                    for (key, label), blob in zip(chunk, blobs):
                        store.put(key, blob)
                        samples.append(Sample(key, label, len(blob)))
            splits[split] = tuple(samples)
    manifest = Manifest(name, tuple(classes), splits)
    store.put(MANIFEST_KEY, manifest.to_json())
    return manifest


def _render_synthetic(key: str, label: int) -> bytes:
    index = int(Path(key).stem)
    return synthetic.render_jpeg(label, index + (0 if key.startswith("train/") else 1_000_000))


def make_synthetic(store: ObjectStore, train_per_class: int, val_per_class: int,
                   shard_size: int = 0) -> Manifest:
    """Write the synthetic data set (classes from ``hapi.synthetic``) to ``store``."""
    items = {
        split: [(f"{split}/{cls}/{i:06d}.jpg", label)
                for i in range(per_class) for label, cls in enumerate(synthetic.CLASS_NAMES)]
        for split, per_class in (("train", train_per_class), ("val", val_per_class))
    }
    return write_dataset(store, "synthetic", synthetic.CLASS_NAMES, items, _render_synthetic, shard_size)


@dataclass(frozen=True)
class PackagedImages:
    """A real-image data set that ships inside an installed package, so it exists offline."""

    name: str
    classes: tuple[str, ...]
    module: str  # the import package that ships it
    distribution: str  # the name pip installs that package by
    # uint8 images, (N, H, W) grey or (N, H, W, 3) RGB, and their labels (indices into classes)
    load: Callable[[], tuple[np.ndarray, np.ndarray]]


def _lfw_subset() -> tuple[np.ndarray, np.ndarray]:
    """scikit-image's 200 25x25 grey crops of Labeled Faces in the Wild: 100 faces, then 100 not."""
    from skimage.data import lfw_subset

    images = (lfw_subset() * 255).round().astype(np.uint8)
    return images, np.repeat(np.arange(2), len(images) // 2)


PACKAGED: dict[str, PackagedImages] = {
    source.name: source
    for source in (
        PackagedImages("lfw", ("face", "not_face"), "skimage", "scikit-image", _lfw_subset),
    )
}
PACKAGED_VAL_EVERY = 5  # every fifth image of a class is a validation sample
PACKAGED_JPEG_QUALITY = 95


@dataclass(frozen=True)
class _Encoded:
    """Maps an object key to bytes encoded up front (picklable, for the process pool)."""

    blobs: dict[str, bytes]

    def __call__(self, key: str, _label: int) -> bytes:
        return self.blobs[key]


def _jpeg(image: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="JPEG", quality=PACKAGED_JPEG_QUALITY)
    return buffer.getvalue()


def make_packaged(store: ObjectStore, name: str, per_class: int | None = None, shard_size: int = 0) -> Manifest:
    """Upload the packaged real-image set ``name`` to ``store`` as JPEG objects.

    Every ``PACKAGED_VAL_EVERY``-th image of a class goes to val. ``per_class`` keeps only
    the first that many images of each class (a small set for tests).
    """
    if name not in PACKAGED:
        raise DatasetNotFoundError(f"no packaged data set {name!r}; choose one of {', '.join(PACKAGED)}")
    source = PACKAGED[name]
    if importlib.util.find_spec(source.module) is None:
        raise DatasetNotFoundError(f"data set {name!r} ships in {source.distribution}, not installed here: "
                                   f"pip install {source.distribution} (or 'hapi[pretrained]')")
    images, labels = source.load()
    items: dict[str, list[tuple[str, int]]] = {"train": [], "val": []}
    blobs: dict[str, bytes] = {}
    seen = [0] * len(source.classes)
    for image, label in zip(images, labels.tolist()):
        index, seen[label] = seen[label], seen[label] + 1
        if per_class is not None and index >= per_class:
            continue
        split = "val" if index % PACKAGED_VAL_EVERY == 0 else "train"
        key = f"{split}/{source.classes[label]}/{index:06d}.jpg"
        items[split].append((key, label))
        blobs[key] = _jpeg(image)
    return write_dataset(store, name, source.classes, items, _Encoded(blobs), shard_size)


@dataclass(frozen=True)
class _FileReader:
    """Maps an object key back to its local file (picklable, for the process pool)."""

    paths: dict[str, Path]

    def __call__(self, key: str, _label: int) -> bytes:
        return self.paths[key].read_bytes()


def upload_image_folder(store: ObjectStore, root: Path, val_fraction: float = 0.2,
                        shard_size: int = 0) -> Manifest:
    """Upload an ImageFolder tree: ``root/<class>/*.jpg``, or ``root/{train,val}/<class>/*``.

    Without train/ and val/ folders, every ``1/val_fraction``-th image of a class goes to val.
    """
    presplit = (root / "train").is_dir()
    class_root = root / "train" if presplit else root
    classes = sorted(d.name for d in class_root.iterdir() if d.is_dir())
    if not classes:
        raise ValueError(f"{root} holds no class folders (expected {root}/<class>/<image>.jpg)")
    val_every = round(1 / val_fraction) if val_fraction else 0
    items: dict[str, list[tuple[str, int]]] = {"train": [], "val": []}
    paths: dict[str, Path] = {}
    for split_name in ("train", "val") if presplit else ("",):
        for label, cls in enumerate(classes):
            folder = root / split_name / cls
            files = sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES) if folder.is_dir() else []
            for i, path in enumerate(files):
                split = split_name or ("val" if val_every and i % val_every == 0 else "train")
                key = f"{split}/{cls}/{path.name}"
                items[split].append((key, label))
                paths[key] = path
    return write_dataset(store, root.name, classes, items, _FileReader(paths), shard_size)


def describe(manifest: Manifest) -> Iterator[str]:
    yield f"data set {manifest.name!r}: {len(manifest.classes)} classes"
    for split, samples in manifest.splits.items():
        total = sum(s.size for s in samples)
        mean_kb = total / max(len(samples), 1) / 1e3
        shards = len({s.object_key for s in samples})
        yield (f"  {split:5s} {len(samples):7d} samples in {shards} objects, "
               f"{total / 1e6:.1f} MB, mean {mean_kb:.1f} KB/sample")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hapi.datasets", description=__doc__.splitlines()[0])
    parser.add_argument("--store", required=True, help="s3://bucket/prefix or file:///path")
    parser.add_argument("--endpoint-url", help="S3 endpoint (Swift, MinIO, Ceph...); default $AWS_ENDPOINT_URL")
    sub = parser.add_subparsers(dest="command", required=True)
    synth = sub.add_parser("synthetic", help="generate the synthetic data set")
    synth.add_argument("--train-per-class", type=int, default=96)
    synth.add_argument("--val-per-class", type=int, default=24)
    synth.add_argument("--shard-size", type=int, default=0, help="images per tar object (0: one per object)")
    packaged = sub.add_parser("packaged", help="upload a real-image data set that ships in a package, as JPEGs")
    packaged.add_argument("name", choices=sorted(PACKAGED))
    packaged.add_argument("--per-class", type=int, help="keep only the first N images of each class")
    packaged.add_argument("--shard-size", type=int, default=0, help="images per tar object (0: one per object)")
    upload = sub.add_parser("upload", help="upload a local ImageFolder tree")
    upload.add_argument("root", type=Path)
    upload.add_argument("--val-fraction", type=float, default=0.2)
    upload.add_argument("--shard-size", type=int, default=0)
    sub.add_parser("describe", help="summarise a stored data set")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        store = open_store(args.store, args.endpoint_url)
        if isinstance(store, S3Store) and args.command != "describe":
            store.ensure_bucket()
        if args.command == "synthetic":
            manifest = make_synthetic(store, args.train_per_class, args.val_per_class, args.shard_size)
        elif args.command == "packaged":
            manifest = make_packaged(store, args.name, args.per_class, args.shard_size)
        elif args.command == "upload":
            manifest = upload_image_folder(store, args.root, args.val_fraction, args.shard_size)
        else:
            manifest = load_manifest(store)
    except (ValueError, LookupError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print("\n".join(describe(manifest)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
