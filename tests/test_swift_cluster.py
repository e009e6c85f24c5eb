"""Self-check of the ``swift_s3`` fixture: a real S3 round trip."""

from __future__ import annotations

import os
import uuid

import pytest
from botocore.exceptions import ClientError

from experiments.swift_cluster import SwiftCluster


def test_put_get_list_round_trip(swift_s3: SwiftCluster) -> None:
    s3 = swift_s3.client()
    bucket = f"selfcheck-{uuid.uuid4().hex[:12]}"
    objects = {
        "empty": b"",
        "small.txt": b"hello swift",
        "nested/dir/big.bin": os.urandom(2 * 1024 * 1024 + 17),
    }
    s3.create_bucket(Bucket=bucket)

    for key, body in objects.items():
        s3.put_object(Bucket=bucket, Key=key, Body=body)
    for key, body in objects.items():
        assert s3.get_object(Bucket=bucket, Key=key)["Body"].read() == body

    listing = s3.list_objects_v2(Bucket=bucket)["Contents"]
    assert {o["Key"]: o["Size"] for o in listing} == {
        key: len(body) for key, body in objects.items()
    }
    nested = s3.list_objects_v2(Bucket=bucket, Prefix="nested/")["Contents"]
    assert [o["Key"] for o in nested] == ["nested/dir/big.bin"]


def test_missing_key_is_no_such_key(swift_s3: SwiftCluster) -> None:
    s3 = swift_s3.client()
    bucket = f"selfcheck-{uuid.uuid4().hex[:12]}"
    s3.create_bucket(Bucket=bucket)

    with pytest.raises(ClientError) as excinfo:
        s3.get_object(Bucket=bucket, Key="does-not-exist")
    error = excinfo.value.response
    assert error["Error"]["Code"] == "NoSuchKey"
    assert error["ResponseMetadata"]["HTTPStatusCode"] == 404


def test_env_points_at_cluster(swift_s3: SwiftCluster) -> None:
    assert swift_s3.env() == {
        "AWS_ACCESS_KEY_ID": "test:tester",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": swift_s3.endpoint_url,
    }
