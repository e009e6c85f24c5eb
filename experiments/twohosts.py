"""Two emulated hosts on one machine: a storage host and a compute host joined by a link.

The storage host is a network namespace with its own veth end; the compute host is the
current namespace. The link is shaped with ``tc ... tbf`` on both ends (netem is not in
this kernel), and each host's processes are pinned to their own cores. Everything is torn
down on exit, also when a run fails. Needs root (``ip netns``).

    with TwoHosts() as hosts:
        hosts.shape(20)                      # Mbit/s, both directions
        storage = hosts.start_storage_host(tmp, "bucket", train_per_class=8)
        # storage.store: the synthetic set in Swift (s3api); storage.node: the daemon's URL
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import requests

from compute_side.daemon_process import stop_process_group
from hapi.datasets import Manifest, make_synthetic
from hapi.store import S3Store

log = logging.getLogger(__name__)

NAMESPACE = "hapi-storage"
STORAGE_IP, COMPUTE_IP = "10.77.0.2", "10.77.0.1"
STORAGE_DEV, COMPUTE_DEV = "hapi-s0", "hapi-c0"


def available() -> str | None:
    """None when namespaces can be made here, else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (ip, tc) is not installed"
    probe = subprocess.run(["ip", "netns", "add", "hapi-probe"], capture_output=True, text=True)
    if probe.returncode:
        return f"ip netns add failed: {probe.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", "hapi-probe"], capture_output=True)
    return None


def start_cli() -> bool:
    """An experiment's start: timestamped logging, urllib3's retries quiet, and whether two
    hosts can be emulated here (if not, says why on stderr)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("urllib3").setLevel(logging.ERROR)
    reason = available()
    if reason:
        print(f"cannot emulate two hosts here: {reason}", file=sys.stderr)
    return reason is None


def _run(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, text=True)


@dataclass(frozen=True)
class RemoteSwift:
    endpoint_url: str
    env: dict[str, str]


@dataclass(frozen=True)
class StorageHost:
    """What runs on the storage host: Swift holding the synthetic set, and the daemon."""

    swift: RemoteSwift
    store: S3Store
    manifest: Manifest
    node: str  # the storage daemon's URL


@dataclass
class TwoHosts:
    storage_cpus: frozenset[int] = frozenset({0})
    compute_cpus: frozenset[int] = frozenset({1})
    _processes: list[subprocess.Popen] = field(default_factory=list)

    def __enter__(self) -> TwoHosts:
        # A SIGTERM (a timeout, pkill) unwinds like Ctrl-C, so the hosts are still torn down.
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        self._teardown_network()  # leftovers of a run that was killed
        try:
            _run("ip", "netns", "add", NAMESPACE)
            _run("ip", "link", "add", COMPUTE_DEV, "type", "veth", "peer", "name", STORAGE_DEV)
            _run("ip", "link", "set", STORAGE_DEV, "netns", NAMESPACE)
            _run("ip", "addr", "add", f"{COMPUTE_IP}/24", "dev", COMPUTE_DEV)
            _run("ip", "link", "set", COMPUTE_DEV, "up")
            self._in_storage("ip", "addr", "add", f"{STORAGE_IP}/24", "dev", STORAGE_DEV)
            self._in_storage("ip", "link", "set", STORAGE_DEV, "up")
            self._in_storage("ip", "link", "set", "lo", "up")
        except BaseException:
            self._teardown_network()
            raise
        os.sched_setaffinity(0, self.compute_cpus)
        return self

    def __exit__(self, *exc: object) -> None:
        for process in reversed(self._processes):
            stop_process_group(process)
        self._processes.clear()
        self._teardown_network()
        os.sched_setaffinity(0, set(range(os.cpu_count() or 1)))

    def _in_storage(self, *args: str) -> None:
        _run("ip", "netns", "exec", NAMESPACE, *args)

    def shape(self, rate_mbit: float | None) -> None:
        """Limit the link to ``rate_mbit`` in both directions (None: unshaped)."""
        for prefix, dev in ((("ip", "netns", "exec", NAMESPACE), STORAGE_DEV), ((), COMPUTE_DEV)):
            subprocess.run([*prefix, "tc", "qdisc", "del", "dev", dev, "root"], capture_output=True)
            if rate_mbit is not None:
                # A burst of ~10 ms of traffic (at least 32 KB) keeps tbf accurate at low rates.
                burst = max(32_000, int(rate_mbit * 1e6 / 8 / 100))
                _run(*prefix, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{rate_mbit}mbit",
                     "burst", str(burst), "latency", "400ms")

    def spawn_storage(self, command: list[str], log_path: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
        """Run ``command`` on the storage host, pinned to its cores."""
        cpus = ",".join(map(str, sorted(self.storage_cpus)))
        with open(log_path, "ab") as log_file:
            process = subprocess.Popen(["ip", "netns", "exec", NAMESPACE, "taskset", "-c", cpus, *command],
                                       stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True,
                                       env={**os.environ, **(env or {})})
        self._processes.append(process)
        return process

    def start_swift(self, work_dir: Path) -> RemoteSwift:
        """OpenStack Swift with s3api on the storage host, reachable from the compute host."""
        info = work_dir / "swift.json"
        info.unlink(missing_ok=True)
        process = self.spawn_storage([sys.executable, "-m", "experiments.swift_cluster", "--proxy-host", STORAGE_IP,
                                      "--info", str(info), "--base-dir", str(work_dir)], work_dir / "swift.log")
        _wait_for(lambda: info.is_file() and info.stat().st_size > 0, process, work_dir / "swift.log", 60)
        body = json.loads(info.read_text())
        return RemoteSwift(body.pop("endpoint_url"), body)

    def start_daemon(self, store_url: str, swift: RemoteSwift, log_path: Path, port: int = 8470,
                     extra_args: tuple[str, ...] = ()) -> str:
        """A storage daemon on the storage host, next to its Swift; returns its URL.

        It listens beyond loopback, so it requires a bearer token: ``$HAPI_STORAGE_TOKEN``,
        set here when unset, which this process's clients and its children read too."""
        os.environ.setdefault("HAPI_STORAGE_TOKEN", secrets.token_hex(16))
        # The daemon reads the store through the storage host's own loopback side of Swift.
        self.spawn_storage([sys.executable, "-m", "storage_side", "--store", store_url, "--endpoint-url",
                            swift.endpoint_url, "--host", STORAGE_IP, "--port", str(port), *extra_args],
                           log_path, env=swift.env)
        url = f"http://{STORAGE_IP}:{port}"
        _wait_for(lambda: _healthy(url), self._processes[-1], log_path, 60)
        return url

    def start_storage_host(self, work_dir: Path, bucket: str, train_per_class: int, val_per_class: int = 0,
                           daemon_args: tuple[str, ...] = ("--torch-threads", "1")) -> StorageHost:
        """Swift on the storage host with the synthetic set in ``bucket``, and a daemon serving it."""
        swift = self.start_swift(work_dir)
        os.environ.update(swift.env)  # this process (the compute host) reads the same store
        store = S3Store(bucket, "synthetic", endpoint_url=swift.endpoint_url)
        store.ensure_bucket()
        manifest = make_synthetic(store, train_per_class, val_per_class)
        node = self.start_daemon(store.url, swift, work_dir / "daemon.log", extra_args=daemon_args)
        return StorageHost(swift, store, manifest, node)

    def _teardown_network(self) -> None:
        subprocess.run(["ip", "netns", "del", NAMESPACE], capture_output=True)
        subprocess.run(["ip", "link", "del", COMPUTE_DEV], capture_output=True)


def _healthy(url: str) -> bool:
    try:
        return requests.get(url + "/healthz", timeout=1).ok
    except requests.RequestException:
        return False


def _wait_for(ready: callable, process: subprocess.Popen, log_path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        if process.poll() is not None or time.monotonic() > deadline:
            tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-15:]) if log_path.exists() else ""
            raise RuntimeError(f"storage host process did not come up; last log lines:\n{tail}")
        time.sleep(0.2)
