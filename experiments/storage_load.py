"""Load benchmark of one storage daemon: N concurrent training jobs under a fixed memory budget.

For each N it starts a fresh daemon (gunicorn, its own process) inside a real memory
limit equal to the budget (a cgroup where this machine has one and we may write it, else
RLIMIT_AS), drives it with N jobs that each send requests one after another, as a
trainer does, and reports the daemon's peak memory against the budget, requests
served, retries (503s the client retried), failures, and throughput per job and in
total. Then the same load with adaptation off (sub-batch = request size, no admission),
the reference system's behaviour, to show what goes wrong without it.

    python experiments/storage_load.py --quick        # ~5 minutes on 2 cores
    python experiments/storage_load.py                # the full run
    python experiments/storage_load.py --bf16         # bf16 compute: feature error, probe accuracy, speed

Loopback only; every daemon is stopped (and its cgroup removed) before the script ends.
"""

from __future__ import annotations

import argparse
import csv
import os
import resource
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import requests

from compute_side.client import StorageClient, StorageNodeError
from compute_side.daemon_process import free_port
from hapi.datasets import make_synthetic
from hapi.store import FileStore
from hapi.transforms import TransformSpec
from hapi.wire import ExtractRequest

CGROUP_V1 = Path("/sys/fs/cgroup/memory")
CGROUP_V2 = Path("/sys/fs/cgroup")
RESULTS = Path(__file__).parent / "results" / "storage_load"


@dataclass(frozen=True)
class Row:
    mode: str  # "adaptive" or "no-adapt"
    jobs: int
    budget_mb: float
    peak_rss_mb: float  # the daemon worker's peak resident memory (kernel's VmHWM); -1 if it died
    peak_cgroup_mb: float  # the whole daemon's peak as the cgroup counted it (-1 without a cgroup)
    requests_ok: int
    requests_sent: int  # fewer than planned when the run hit its deadline
    requests_planned: int
    retries: int  # 503 answers (the client waits Retry-After and retries)
    failures: int  # requests that never got features
    oom_kills: int
    samples_per_s_total: float
    samples_per_s_per_job: float
    sub_batch_mean: float
    wall_s: float


class MemoryLimit:
    """A real memory limit for one daemon process tree: a cgroup, or RLIMIT_AS as a fallback."""

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self.path: Path | None = None
        self.kind = "rlimit"
        name = f"hapi-storage-load-{os.getpid()}-{time.monotonic_ns()}"
        for root, limit_file in ((CGROUP_V2, "memory.max"), (CGROUP_V1, "memory.limit_in_bytes")):
            if not (root / limit_file).exists() and not (root / "cgroup.controllers").exists():
                continue
            path = root / name
            try:
                path.mkdir()
                (path / limit_file).write_text(str(limit_bytes))
            except OSError:
                if path.exists():
                    path.rmdir()
                continue
            self.path, self.kind = path, ("cgroup v2" if root == CGROUP_V2 else "cgroup v1")
            break

    def enter(self) -> None:
        """Runs in the daemon's child process before exec: the limit applies from its start."""
        if self.path is not None:
            (self.path / "cgroup.procs").write_text(str(os.getpid()))
        else:
            resource.setrlimit(resource.RLIMIT_AS, (self.limit_bytes, self.limit_bytes))

    def peak_bytes(self) -> int:
        for name in ("memory.max_usage_in_bytes", "memory.peak"):
            if self.path is not None and (self.path / name).exists():
                return int((self.path / name).read_text())
        return -1

    def oom_kills(self) -> int:
        for name in ("memory.oom_control", "memory.events"):
            if self.path is not None and (self.path / name).exists():
                for line in (self.path / name).read_text().splitlines():
                    if line.startswith("oom_kill "):
                        return int(line.split()[1])
        return 0

    def remove(self) -> None:
        if self.path is not None:
            for _ in range(50):  # the last processes may take a moment to leave
                try:
                    self.path.rmdir()
                    return
                except OSError:
                    time.sleep(0.1)


@contextmanager
def daemon(store_url: str, args: list[str], limit: MemoryLimit,
           log_path: Path) -> Iterator[tuple[str, subprocess.Popen]]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "storage_side", "--store", store_url, "--port", str(port), *args]
    with open(log_path, "ab") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, preexec_fn=limit.enter,
                                   start_new_session=True)
    try:
        probe = StorageClient(url, timeout_s=2, retries=0)
        deadline = time.monotonic() + 120
        while True:
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"daemon did not start; see {log_path}")
            try:
                probe.health()
                break
            except StorageNodeError:
                time.sleep(0.2)
        yield url, process
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


def metrics(url: str) -> dict[str, float]:
    try:
        text = requests.get(url + "/metrics", timeout=10).text
    except requests.RequestException:
        return {}
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def run_load(url: str, keys: list[str], jobs: int, requests_per_job: int, request_size: int,
             spec: TransformSpec, split: int, deadline_s: float) -> tuple[int, int, int, list[int], float]:
    """(sent, served, failed, sub-batches, wall seconds) for ``jobs`` jobs sending requests
    back to back; no job starts a request after ``deadline_s``."""
    failures = sent = 0
    sub_batches: list[int] = []
    lock = threading.Lock()
    deadline = time.monotonic() + deadline_s

    def job(j: int) -> int:
        nonlocal failures, sent
        client = StorageClient(url, timeout_s=deadline_s)  # retries 503 and lost connections as a trainer does
        served = 0
        for r in range(requests_per_job):
            if time.monotonic() > deadline:
                break
            with lock:
                sent += 1
            start = ((j * requests_per_job + r) * request_size) % max(len(keys) - request_size, 1)
            request = ExtractRequest(keys=tuple(keys[start: start + request_size]), model="resnet18", split=split,
                                     transform=spec, job_id=f"job-{j}")
            try:
                got = client.extract(request)
            except StorageNodeError:
                with lock:
                    failures += 1
                continue
            served += 1
            with lock:
                sub_batches.append(int(got.metadata["sub_batch"]))
        return served

    started = time.perf_counter()
    with ThreadPoolExecutor(jobs) as pool:
        served = sum(pool.map(job, range(jobs)))
    return sent, served, failures, sub_batches, time.perf_counter() - started


def bf16_effect(out: Path, crop: int) -> None:
    """The daemon with --compute-dtype bfloat16 against float32, in process: how far its
    features move, what a linear probe trained on them scores, and how fast it runs."""
    import torch

    from hapi.wire import decode_features
    from storage_side.app import create_app
    from storage_side.config import DaemonConfig

    spec = TransformSpec(crop_size=crop, resize_size=crop + crop // 7)
    with tempfile.TemporaryDirectory(prefix="hapi-bf16-") as tmp:
        store = FileStore(Path(tmp))
        manifest = make_synthetic(store, 80, 20)
        features: dict[tuple[str, str], torch.Tensor] = {}
        whole: dict[str, torch.Tensor] = {}  # the val features as sent, to measure the error on
        forward_ms: dict[str, float] = {}
        for dtype in ("float32", "bfloat16"):
            client = create_app(DaemonConfig(store_url=store.url, compute_dtype=dtype, torch_threads=2,
                                             max_sub_batch=32)).test_client()
            forward_ms[dtype] = 0.0
            for split in ("train", "val"):
                keys = [s.key for s in manifest.split(split)]
                parts = []
                for i in range(0, len(keys), 64):
                    body = {"keys": keys[i: i + 64], "model": "resnet18", "split": 11, "transform": spec.to_dict()}
                    blob, _, meta = decode_features(client.post("/v1/extract", json=body, buffered=True).data)
                    parts.append(blob.float())
                    forward_ms[dtype] += meta["timings"]["forward_ms"]
                features[dtype, split] = torch.cat(parts).mean(dim=(2, 3))
                if split == "val":
                    whole[dtype] = torch.cat(parts).flatten(1)
    labels = {split: torch.tensor([s.label for s in manifest.split(split)]) for split in ("train", "val")}
    reference, reduced = whole["float32"], whole["bfloat16"]
    relative = ((reduced - reference).norm(dim=1) / reference.norm(dim=1)).mean().item()
    cosine = torch.nn.functional.cosine_similarity(reduced, reference, dim=1).min().item()
    # The probe reads channel means (512 numbers, not 8k) to learn from a few hundred samples.
    reference, reduced = features["float32", "val"], features["bfloat16", "val"]

    def probe(train: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        torch.manual_seed(0)
        mean, std = train.mean(0), train.std(0) + 1e-6
        head = torch.nn.Linear(train.shape[1], len(manifest.classes))
        optimiser = torch.optim.Adam(head.parameters(), lr=1e-2)
        for _ in range(300):
            optimiser.zero_grad()
            torch.nn.functional.cross_entropy(head((train - mean) / std), labels["train"]).backward()
            optimiser.step()
        return lambda x: head((x - mean) / std)

    def accuracy(model: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> float:
        with torch.no_grad():
            return (model(x).argmax(1) == labels["val"]).float().mean().item()

    fp32_probe, bf16_probe = probe(features["float32", "train"]), probe(features["bfloat16", "train"])
    n = sum(len(manifest.split(s)) for s in ("train", "val"))
    lines = [
        f"# bf16 compute on the storage daemon: resnet18 split 11, {crop} px, random weights, "
        f"synthetic set ({len(labels['train'])} train / {len(labels['val'])} val, 10 classes), 2 threads",
        "",
        "| measure | value |", "|---|---|",
        f"| mean relative L2 error of a sample's features | {relative:.4f} |",
        f"| lowest cosine similarity to float32 | {cosine:.5f} |",
        f"| linear probe trained and tested on float32 features | {accuracy(fp32_probe, reference):.3f} |",
        f"| same probe, tested on bf16 features | {accuracy(fp32_probe, reduced):.3f} |",
        f"| probe trained and tested on bf16 features | {accuracy(bf16_probe, reduced):.3f} |",
        f"| prefix throughput, float32 (samples/s) | {n / forward_ms['float32'] * 1e3:.1f} |",
        f"| prefix throughput, bf16 autocast (samples/s) | {n / forward_ms['bfloat16'] * 1e3:.1f} |",
    ]
    (out / "bf16.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smaller images and fewer requests: ~5 minutes")
    p.add_argument("--jobs", default="1,2,4,8,16", help="numbers of concurrent jobs")
    p.add_argument("--budget", type=float, default=1.6, help="memory budget and real limit of the daemon, GB")
    p.add_argument("--request-size", type=int, default=32, help="samples per request (the client's choice)")
    p.add_argument("--requests-per-job", type=int, help="default 2 (--quick) or 4")
    p.add_argument("--crop", type=int, help="input size in pixels; default 160 (--quick) or 224")
    p.add_argument("--split", type=int, default=11, help="resnet18 split; 11 is its freeze index")
    p.add_argument("--modes", default="adaptive,no-adapt")
    p.add_argument("--run-timeout", type=float, help="seconds per N after which no new request starts, and the "
                   "daemon is stopped 60 s later; default 90 (--quick) or 180")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--bf16", action="store_true", help="measure bf16 compute instead of load")
    a = p.parse_args(argv)
    crop = a.crop or (160 if a.quick else 224)
    if a.bf16:
        a.out.mkdir(parents=True, exist_ok=True)
        bf16_effect(a.out, crop)
        return 0
    per_job = a.requests_per_job or (2 if a.quick else 4)
    run_timeout = a.run_timeout or (90 if a.quick else 180)
    spec = TransformSpec(crop_size=crop, resize_size=crop + crop // 7)
    budget = int(a.budget * 1e9)
    a.out.mkdir(parents=True, exist_ok=True)

    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="hapi-load-") as tmp:
        store = FileStore(Path(tmp) / "store")
        keys = [s.key for s in make_synthetic(store, 12, 0).split("train")]
        for mode in a.modes.split(","):
            for jobs in (int(n) for n in a.jobs.split(",")):
                limit = MemoryLimit(budget)
                # Decoding on threads: two decode workers' ~0.8 GB would leave a 1.6 GB budget nothing.
                args = ["--memory-budget", str(budget), "--max-sub-batch", "16", "--torch-threads", "2",
                        "--decode-workers", "0", "--io-threads", "4", "--server-threads", "48",
                        "--queue-timeout", "120"]
                if mode == "no-adapt":
                    args.append("--no-adapt")
                try:
                    log_path = Path(tmp) / f"daemon-{mode}-{jobs}.log"  # gone with the run: the table says it all
                    with daemon(store.url, args, limit, log_path) as (url, process):
                        # Load and calibrate the prefix first: a one-off cost, not throughput under load.
                        try:
                            StorageClient(url, timeout_s=run_timeout).extract(ExtractRequest(
                                keys=tuple(keys[:2]), model="resnet18", split=a.split, transform=spec,
                                job_id="warm-up"))
                        except StorageNodeError as exc:
                            print(f"{mode} jobs={jobs}: warm-up failed, skipped: {exc}", flush=True)
                            continue
                        # Requests in flight past the deadline end when their daemon does.
                        watchdog = threading.Timer(run_timeout + 60, os.killpg, (process.pid, signal.SIGKILL))
                        watchdog.start()
                        sent, served, failed, sub_batches, wall = run_load(url, keys, jobs, per_job, a.request_size,
                                                                           spec, a.split, run_timeout)
                        watchdog.cancel()
                        m = metrics(url)
                        oom = limit.oom_kills()
                        peak_cgroup = limit.peak_bytes()
                finally:
                    limit.remove()
                samples = served * a.request_size
                # After an OOM kill gunicorn starts a new worker: its peak is not the one that died.
                peak_rss = m.get("hapi_storage_process_peak_resident_bytes", -1e6) if not oom else -1e6
                row = Row(mode, jobs, budget / 1e6, round(peak_rss / 1e6, 1), round(peak_cgroup / 1e6, 1),
                          served, sent, jobs * per_job, int(m.get('hapi_storage_requests_total{endpoint="/v1/extract",'
                                                              'status="503"}', 0)),
                          failed, oom, round(samples / wall, 1), round(samples / wall / jobs, 1),
                          round(sum(sub_batches) / max(len(sub_batches), 1), 1), round(wall, 1))
                rows.append(row)
                print(f"{mode:9s} jobs={jobs:2d} served {served}/{sent} of {jobs * per_job} failures={failed} "
                      f"oom_kills={oom} peak_rss={row.peak_rss_mb} MB ({limit.kind} limit {budget / 1e6:.0f} MB) "
                      f"{row.samples_per_s_total} samples/s", flush=True)

    if not rows:
        print("no run completed", file=sys.stderr)
        return 1
    header = list(asdict(rows[0]))
    with open(a.out / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, header)
        writer.writeheader()
        writer.writerows(asdict(r) for r in rows)
    title = (f"resnet18 split {a.split}, {crop} px, {a.request_size} samples/request, {per_job} requests/job, "
             f"budget = real limit ({limit.kind}) {budget / 1e9:.2f} GB, {os.cpu_count()} cores")
    table = [f"# storage_side load: {title}", "", "| " + " | ".join(header) + " |",
             "|" + "---|" * len(header)]
    table += ["| " + " | ".join(str(v) for v in asdict(r).values()) + " |" for r in rows]
    (a.out / "results.md").write_text("\n".join(table) + "\n")
    print("\n".join(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
