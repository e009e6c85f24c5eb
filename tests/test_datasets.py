import importlib.util
import io
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from PIL import Image

from hapi import datasets
from hapi.datasets import (
    DatasetNotFoundError,
    Manifest,
    load_manifest,
    make_packaged,
    make_synthetic,
    read_samples,
    upload_image_folder,
)
from hapi.store import FileStore, MissingObjectError
from hapi.synthetic import CLASS_NAMES, render_jpeg


@pytest.fixture(scope="module")
def pool():
    with ThreadPoolExecutor(4) as p:
        yield p


@pytest.mark.parametrize("shard_size", [0, 7])
def test_synthetic_set_round_trips_through_its_manifest(tmp_path, pool, shard_size: int) -> None:
    store = FileStore(tmp_path)
    written = make_synthetic(store, train_per_class=2, val_per_class=1, shard_size=shard_size)
    manifest = load_manifest(store)
    assert manifest == written
    assert manifest.classes == CLASS_NAMES
    assert len(manifest.split("train")) == 20 and len(manifest.split("val")) == 10
    samples = manifest.split("train")
    blobs = read_samples(store, [s.key for s in samples], pool)
    assert [len(b) for b in blobs] == [s.size for s in samples]
    first = next(s for s in samples if s.label == 3)
    assert blobs[samples.index(first)] == render_jpeg(3, 0)
    objects = {s.object_key for s in samples}
    assert len(objects) == (3 if shard_size else 20)


needs_scikit_image = pytest.mark.skipif(importlib.util.find_spec("skimage") is None,
                                        reason="scikit-image is not installed (pip install 'hapi[pretrained]')")


@needs_scikit_image
def test_packaged_real_images_are_uploaded_as_labelled_jpeg_objects(tmp_path, pool) -> None:
    store = FileStore(tmp_path)
    written = make_packaged(store, "lfw", per_class=10)
    manifest = load_manifest(store)
    assert manifest == written and manifest.name == "lfw" and manifest.classes == ("face", "not_face")
    train, val = manifest.split("train"), manifest.split("val")
    # Every fifth image of each class is a validation sample.
    assert len(train) == 16 and len(val) == 4
    assert [s.key for s in val] == ["val/face/000000.jpg", "val/face/000005.jpg",
                                    "val/not_face/000000.jpg", "val/not_face/000005.jpg"]
    for sample in train + val:
        assert sample.label == manifest.classes.index(sample.key.split("/")[1])
    blobs = read_samples(store, [s.key for s in train], pool)
    assert [len(b) for b in blobs] == [s.size for s in train]
    for blob in blobs:
        with Image.open(io.BytesIO(blob)) as image:
            assert image.format == "JPEG" and image.size == (25, 25)
    from skimage.data import lfw_subset

    first_face = np.asarray(Image.open(io.BytesIO(blobs[0])), dtype=np.float64) / 255
    assert np.abs(first_face - lfw_subset()[1]).mean() < 0.02  # train/face/000001.jpg, through JPEG


@needs_scikit_image
def test_cli_uploads_a_packaged_data_set(tmp_path, capsys) -> None:
    assert datasets.main(["--store", tmp_path.as_uri(), "packaged", "lfw", "--per-class", "5"]) == 0
    out = capsys.readouterr().out
    assert "data set 'lfw': 2 classes" in out and "train       8 samples in 8 objects" in out


def test_unknown_packaged_data_set_names_the_choices(tmp_path) -> None:
    with pytest.raises(DatasetNotFoundError, match="no packaged data set 'cifar'; choose one of lfw"):
        make_packaged(FileStore(tmp_path), "cifar")


def test_read_samples_keeps_request_order_and_names_missing_members(tmp_path, pool) -> None:
    store = FileStore(tmp_path)
    samples = make_synthetic(store, 2, 0, shard_size=5).split("train")
    keys = [s.key for s in reversed(samples)]
    assert [len(b) for b in read_samples(store, keys, pool)] == [s.size for s in reversed(samples)]
    missing = samples[0].object_key + "#nope.jpg"
    with pytest.raises(MissingObjectError, match="nope.jpg"):
        read_samples(store, [samples[0].key, missing], pool)


def test_missing_manifest_says_how_to_create_one(tmp_path) -> None:
    with pytest.raises(DatasetNotFoundError, match="python -m hapi.datasets synthetic"):
        load_manifest(FileStore(tmp_path))


def test_upload_image_folder_splits_and_labels_by_folder(tmp_path) -> None:
    root = tmp_path / "pets"
    for cls in ("cat", "dog"):
        (root / cls).mkdir(parents=True)
        for i in range(5):
            Image.fromarray(np.full((8, 8, 3), i * 40, np.uint8)).save(root / cls / f"{i}.jpg")
    (root / "cat" / "notes.txt").write_text("not an image")
    manifest = upload_image_folder(FileStore(tmp_path / "store"), root, val_fraction=0.2)
    assert manifest.classes == ("cat", "dog")
    assert len(manifest.split("val")) == 2 and len(manifest.split("train")) == 8
    assert {s.label for s in manifest.split("train") if s.key.startswith("train/dog/")} == {1}
    assert Manifest.from_json(manifest.to_json()) == manifest


def test_cli_creates_and_describes_a_data_set(tmp_path, capsys) -> None:
    url = tmp_path.as_uri()
    assert datasets.main(["--store", url, "synthetic", "--train-per-class", "1", "--val-per-class", "1"]) == 0
    assert datasets.main(["--store", url, "describe"]) == 0
    out = capsys.readouterr().out
    assert "10 classes" in out and "train      10 samples" in out


def test_cli_reports_a_missing_data_set_in_one_line(tmp_path, capsys) -> None:
    assert datasets.main(["--store", tmp_path.as_uri(), "describe"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: no data set at") and err.count("\n") == 1
