"""Shared pytest fixtures."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from experiments.swift_cluster import SwiftCluster, swift_available


@pytest.fixture(scope="session", autouse=True)
def hapi_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """What the code under test measures and keeps of this host (host profiles, the node's
    pass layouts) goes to a directory of the session's, never the user's ~/.cache/hapi."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("HAPI_CACHE", str(tmp_path_factory.mktemp("hapi-cache")))
        yield


# --- OpenStack Swift + s3api ------------------------------------------------


@pytest.fixture(scope="session")
def swift_s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SwiftCluster]:
    """A real all-in-one Swift cluster with the S3 API, shared per session.

    Its credentials and endpoint are exported (AWS_*) for the session, so S3 clients in
    the tests and in the daemons they start find them by the standard chain.
    """
    if not swift_available():
        pytest.skip("OpenStack Swift is not installed (pip install swift)")
    with SwiftCluster.start(tmp_path_factory.mktemp("swift")) as cluster, pytest.MonkeyPatch.context() as env:
        for name, value in cluster.env().items():
            env.setenv(name, value)
        yield cluster
