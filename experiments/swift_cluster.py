"""Throw-away all-in-one OpenStack Swift cluster with the S3 API, for tests.

Usage::

    with SwiftCluster.start() as swift:
        s3 = swift.client()
        s3.create_bucket(Bucket="data")
        subprocess.run(cmd, env={**os.environ, **swift.env()})

One proxy, account, container and object server run as subprocesses of the
current interpreter, on free loopback ports, with a single device and
replica. Everything lives under one temporary directory that ``stop()``
deletes again.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import pwd
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import boto3
from botocore.client import BaseClient
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

log = logging.getLogger(__name__)

ACCESS_KEY = "test:tester"
SECRET_KEY = "testing"
REGION = "us-east-1"

_HOST = "127.0.0.1"
# Backend servers named as in their ring files and ``swift.<kind>.server``.
_BACKENDS = ("account", "container", "object")
_BACKEND_MODULES = {
    "account": "swift.account.server",
    "container": "swift.container.server",
    "object": "swift.obj.server",
}
_DEVICE = "d1"
_STOP_GRACE_S = 5.0
_LOG_TAIL_LINES = 25

# No memcache "cache" filter: s3api with tempauth works without it, and it
# would otherwise share a developer's real memcached (and its cached account
# and container info) between clusters. Only tempauth's native Swift tokens
# (/auth/v1.0) need it.
_PROXY_PIPELINE = (
    "catch_errors gatekeeper healthcheck proxy-logging listing_formats "
    "s3api tempauth copy slo dlo proxy-logging proxy-server"
)


class SwiftClusterError(RuntimeError):
    """The cluster could not be started or did not become healthy."""


def swift_available() -> bool:
    """Whether the ``swift`` package is installed (without importing it)."""
    return importlib.util.find_spec("swift") is not None


@dataclass
class SwiftCluster:
    """A running cluster; create it with :meth:`start`."""

    endpoint_url: str
    root: Path
    access_key: str = ACCESS_KEY
    secret_key: str = SECRET_KEY
    region: str = REGION
    _procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict, repr=False)

    @classmethod
    def start(cls, base_dir: Path | str | None = None, timeout: float = 30.0, proxy_host: str = _HOST) -> Self:
        """Start a cluster in a new directory under ``base_dir``.

        The backends listen on loopback; the S3 proxy on ``proxy_host`` (another
        interface, to serve a compute host across an emulated link).

        Returns once the proxy answers ``/healthcheck`` and an S3 round trip
        (create bucket, put, get, delete) succeeded; raises
        :class:`SwiftClusterError` with the server log tails otherwise.
        """
        started = time.monotonic()
        root = Path(tempfile.mkdtemp(prefix="swift-", dir=base_dir))
        proxy_port, *backend_ports = _free_ports(1 + len(_BACKENDS))
        cluster = cls(endpoint_url=f"http://{proxy_host}:{proxy_port}", root=root)
        try:
            ports = dict(zip(_BACKENDS, backend_ports, strict=True))
            _write_config(root, proxy_port, ports, proxy_host)
            for kind in _BACKENDS:
                cluster._spawn(kind, _BACKEND_MODULES[kind])
            cluster._spawn("proxy", "swift.proxy.server")
            cluster._wait_ready(started + timeout)
        except BaseException:
            cluster.stop()
            raise
        log.info(
            "Swift cluster ready at %s in %.1f s (%s)",
            cluster.endpoint_url,
            time.monotonic() - started,
            root,
        )
        return cluster

    def stop(self) -> None:
        """Kill every server process group and delete the cluster directory."""
        for proc in self._procs.values():
            _signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + _STOP_GRACE_S
        for name, proc in self._procs.items():
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("swift %s server ignored SIGTERM; killing", name)
                _signal_group(proc, signal.SIGKILL)
                proc.wait()
        self._procs.clear()
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def env(self) -> dict[str, str]:
        """AWS_* variables that point an AWS SDK or CLI subprocess here."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": self.region,
            "AWS_ENDPOINT_URL": self.endpoint_url,
        }

    def client(self, **config: Any) -> BaseClient:
        """A boto3 S3 client (SigV4, path-style); ``config`` extends Config."""
        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            region_name=self.region,
            config=Config(
                signature_version="s3v4", s3={"addressing_style": "path"}, **config
            ),
        )

    def _spawn(self, name: str, module: str) -> None:
        log_file = self.root / "log" / f"{name}.log"
        with log_file.open("wb") as out:
            self._procs[name] = subprocess.Popen(
                # -v adds a stderr log handler; without it Swift logs only to
                # syslog, which we route to the discard port (see _COMMON).
                [
                    sys.executable,
                    "-m",
                    module,
                    str(self.root / "etc" / f"{name}-server.conf"),
                    "-v",
                ],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=self.root,
                start_new_session=True,
            )

    def _wait_ready(self, deadline: float) -> None:
        # Short timeouts and no retries: the loop below is the retry.
        s3 = self.client(connect_timeout=2, read_timeout=5, retries={"max_attempts": 1})
        last_error = "not polled yet"
        while time.monotonic() < deadline:
            for name, proc in self._procs.items():
                if proc.poll() is not None:
                    raise SwiftClusterError(
                        self._report(
                            f"swift {name} server exited with {proc.returncode}"
                        )
                    )
            try:
                _healthcheck(self.endpoint_url)
                _s3_round_trip(s3)
                return
            except (OSError, BotoCoreError, ClientError, SwiftClusterError) as exc:
                last_error = f"{type(exc).__name__}: {exc}"
            time.sleep(0.2)
        raise SwiftClusterError(
            self._report(f"Swift cluster not healthy in time; last error: {last_error}")
        )

    def _report(self, headline: str) -> str:
        parts = [headline]
        for name in self._procs:
            lines = (
                (self.root / "log" / f"{name}.log")
                .read_text(errors="replace")
                .splitlines()[-_LOG_TAIL_LINES:]
            )
            parts.append(f"--- {name} server log (tail) ---")
            parts.extend(lines)
        return "\n".join(parts)


def _free_ports(count: int) -> list[int]:
    # Keep all sockets open until every port is picked so they are distinct.
    # Another process may still grab one before the server binds it; that
    # shows up as a start-up error.
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind((_HOST, 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _signal_group(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):  # group already gone
        os.killpg(proc.pid, sig)


def _healthcheck(endpoint_url: str) -> None:
    with urllib.request.urlopen(f"{endpoint_url}/healthcheck", timeout=2):
        pass  # urlopen raises on any non-2xx status


def _s3_round_trip(s3: BaseClient) -> None:
    bucket, key, body = "swift-cluster-selfcheck", "probe", b"ok"
    s3.create_bucket(Bucket=bucket)
    try:
        s3.put_object(Bucket=bucket, Key=key, Body=body)
        got = s3.get_object(Bucket=bucket, Key=key)["Body"].read()
        if got != body:
            raise SwiftClusterError(f"S3 round trip returned {got!r}")
        s3.delete_object(Bucket=bucket, Key=key)
    finally:
        s3.delete_bucket(Bucket=bucket)


def _write_config(
    root: Path, proxy_port: int, backend_ports: Mapping[str, int], proxy_host: str
) -> None:
    etc, devices = root / "etc", root / "srv"
    for path in (etc, devices / _DEVICE, root / "log"):
        path.mkdir(parents=True)
    _check_xattrs(devices / _DEVICE)
    _build_rings(etc, backend_ports)
    (etc / "swift.conf").write_text(
        _SWIFT_CONF.format(suffix=secrets.token_hex(8), prefix=secrets.token_hex(8))
    )
    common = {
        "host": _HOST,
        "swift_dir": etc,
        "devices": devices,
        "user": pwd.getpwuid(os.getuid()).pw_name,
    }
    for kind, port in backend_ports.items():
        (etc / f"{kind}-server.conf").write_text(
            _COMMON.format(port=port, **common) + _BACKEND_CONF.format(kind=kind)
        )
    (etc / "proxy-server.conf").write_text(
        _COMMON.format(port=proxy_port, **{**common, "host": proxy_host})
        + _PROXY_CONF.format(
            pipeline=_PROXY_PIPELINE,
            user=ACCESS_KEY.replace(":", "_"),
            key=SECRET_KEY,
            region=REGION,
        )
    )


def _check_xattrs(device: Path) -> None:
    # The object server stores metadata in user xattrs; fail early and
    # clearly instead of with 507s from every PUT.
    probe = "user.swift-cluster-probe"
    try:
        os.setxattr(device, probe, b"1")
    except OSError as exc:
        raise SwiftClusterError(
            f"{device} does not support user xattrs, which Swift needs "
            f"({exc}); use a base_dir on ext4, xfs or tmpfs"
        ) from exc
    os.removexattr(device, probe)


def _build_rings(swift_dir: Path, ports: Mapping[str, int]) -> None:
    from swift.common.ring import RingBuilder  # optional dependency

    for kind, port in ports.items():
        # 2**8 partitions, 1 replica, min_part_hours=1: as the SAIO docs,
        # scaled down to one device.
        builder = RingBuilder(8, 1, 1)
        builder.add_dev(
            {
                "id": 0,
                "region": 1,
                "zone": 1,
                "ip": _HOST,
                "port": port,
                "device": _DEVICE,
                "weight": 100,
            }
        )
        builder.rebalance()
        builder.get_ring().save(str(swift_dir / f"{kind}.ring.gz"))


_SWIFT_CONF = """\
[swift-hash]
swift_hash_path_suffix = {suffix}
swift_hash_path_prefix = {prefix}

[storage-policy:0]
name = default
default = yes
"""

# workers = 0 serves from the launched process itself: one process (and
# process group) per server, with no forked workers to outlive it. Syslog
# goes to the UDP discard port: without /dev/log Swift would otherwise fall
# back to UDP port 514 and, on hosts that have /dev/log, spam the real syslog.
_COMMON = """\
[DEFAULT]
bind_ip = {host}
bind_port = {port}
workers = 0
user = {user}
swift_dir = {swift_dir}
devices = {devices}
mount_check = false
disable_fallocate = true
log_level = INFO
log_udp_host = {host}
log_udp_port = 9

"""

_BACKEND_CONF = """\
[pipeline:main]
pipeline = {kind}-server

[app:{kind}-server]
use = egg:swift#{kind}
"""

_PROXY_CONF = """\
[pipeline:main]
pipeline = {pipeline}

[app:proxy-server]
use = egg:swift#proxy
account_autocreate = true

[filter:catch_errors]
use = egg:swift#catch_errors

[filter:gatekeeper]
use = egg:swift#gatekeeper

[filter:healthcheck]
use = egg:swift#healthcheck

[filter:proxy-logging]
use = egg:swift#proxy_logging

[filter:listing_formats]
use = egg:swift#listing_formats

[filter:s3api]
use = egg:swift#s3api
location = {region}

[filter:tempauth]
use = egg:swift#tempauth
user_{user} = {key} .admin

[filter:copy]
use = egg:swift#copy

[filter:slo]
use = egg:swift#slo

[filter:dlo]
use = egg:swift#dlo
"""


def main() -> None:
    """Run a cluster until SIGTERM; write its endpoint to ``--info`` once it is ready."""
    import argparse
    import json

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--proxy-host", default=_HOST)
    parser.add_argument("--info", type=Path, required=True)
    parser.add_argument("--base-dir", type=Path)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    with SwiftCluster.start(args.base_dir, proxy_host=args.proxy_host) as cluster:
        args.info.write_text(json.dumps({"endpoint_url": cluster.endpoint_url, **cluster.env()}))
        while not stop:
            time.sleep(0.2)


if __name__ == "__main__":
    main()
