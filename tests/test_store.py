"""The store interface, on a directory and on a real Swift (s3api)."""

import pytest

from hapi.store import FileStore, MissingObjectError, S3Store, open_store


@pytest.fixture(params=["file", "swift"])
def store(request, tmp_path):
    if request.param == "file":
        return open_store(tmp_path.as_uri())
    swift = request.getfixturevalue("swift_s3")
    s3 = S3Store("store-test", "some/prefix", endpoint_url=swift.endpoint_url)
    s3.ensure_bucket()
    return s3


def test_put_then_get_round_trips_bytes(store) -> None:
    data = bytes(range(256)) * 1000
    store.put("a/b/c.bin", data)
    assert store.get("a/b/c.bin") == data


def test_missing_key_names_the_key(store) -> None:
    with pytest.raises(MissingObjectError, match="'no/such.jpg'") as info:
        store.get("no/such.jpg")
    assert info.value.key == "no/such.jpg"


def test_s3_keys_live_under_the_prefix(swift_s3) -> None:
    store = S3Store("prefix-test", "datasets/one", endpoint_url=swift_s3.endpoint_url)
    store.ensure_bucket()
    store.put("x.txt", b"hello")
    assert swift_s3.client().get_object(Bucket="prefix-test", Key="datasets/one/x.txt")["Body"].read() == b"hello"
    assert store.url == "s3://prefix-test/datasets/one"


def test_file_store_refuses_keys_that_climb_out(tmp_path) -> None:
    (tmp_path / "secret").write_bytes(b"x")
    store = FileStore(tmp_path / "store")
    for key in ("../secret", "a/../../secret", "/" + str(tmp_path / "secret")):
        with pytest.raises(MissingObjectError):
            store.get(key)


def test_file_store_follows_the_operators_symlinks(tmp_path) -> None:
    # A data set linked into the store from another disk is the operator's to place there.
    (tmp_path / "disk2").mkdir()
    (tmp_path / "disk2" / "x.jpg").write_bytes(b"x")
    (tmp_path / "store").mkdir()
    (tmp_path / "store" / "set").symlink_to(tmp_path / "disk2")
    assert FileStore(tmp_path / "store").get("set/x.jpg") == b"x"


@pytest.mark.parametrize("url", ["http://x/y", "s3://", "bucket/prefix"])
def test_bad_store_urls_say_what_is_expected(url: str) -> None:
    with pytest.raises(ValueError, match="s3://bucket"):
        open_store(url)
