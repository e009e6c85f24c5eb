"""Multi-tenant: N concurrent training jobs on one storage node, HAPI against all-in-storage.

Two emulated hosts. HAPI: N trainers on the compute host, all pushing their frozen
stages down to the one storage daemon (``--split freeze``). All-in-storage: N trainers
run whole jobs on the storage host itself, reading Swift locally (``--split
all-in-compute`` started inside the storage namespace). Reports the average job time (as
each job measured its own training) and the makespan (first start to last exit).

    sudo python -m experiments.multitenant [--jobs 1,2,4,8] [--quick]
"""

from __future__ import annotations

import argparse
import csv
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from experiments import twohosts
from hapi.datasets import make_synthetic
from hapi.store import S3Store

RESULTS = Path(__file__).parent / "results" / "multitenant"


def job_command(args: argparse.Namespace, store_url: str, endpoint: str, work: Path, i: int, mode: str,
                node: str | None) -> list[str]:
    command = [sys.executable, "-m", "hapi.train", "--model", args.model, "--image-size", str(args.image_size),
               "--batch-size", str(args.batch_size), "--store", store_url, "--endpoint-url", endpoint,
               "--cache-dir", str(work / f"job{i}"), "--output-dir", str(work / f"job{i}" / "run")]
    if mode == "hapi":
        return [*command, "--split", "freeze", "--storage-node", node]
    return [*command, "--split", "all-in-compute"]


def run_jobs(hosts: twohosts.TwoHosts, commands: list[list[str]], on_storage: bool, env: dict[str, str],
             work: Path) -> tuple[list[float], float]:
    """Start every job at once; (each job's own training seconds, makespan seconds)."""
    started = time.perf_counter()
    processes = []
    for i, command in enumerate(commands):
        log = work / f"job{i}.log"
        if on_storage:
            processes.append((hosts.spawn_storage(command, log, env=env), log))
        else:
            with open(log, "wb") as f:
                processes.append((subprocess.Popen(command, stdout=f, stderr=subprocess.STDOUT,
                                                   env={**os.environ, **env}), log))
    for process, _ in processes:
        process.wait()
    makespan = time.perf_counter() - started
    seconds = []
    for process, log in processes:
        text = log.read_text(errors="replace")
        found = re.search(r"trained \d+ samples in ([\d.]+) s", text)
        if process.returncode or not found:
            raise RuntimeError(f"job failed ({log}):\n" + "\n".join(text.splitlines()[-5:]))
        seconds.append(float(found.group(1)))
    return seconds, makespan


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--jobs", default="1,2,4,8")
    p.add_argument("--model", default="resnet18")
    p.add_argument("--image-size", type=int, default=112)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--train-per-class", type=int, default=8, help="each job trains 10x this many samples")
    p.add_argument("--quick", action="store_true", help="1 and 2 jobs, 64 px, 32 samples per job")
    args = p.parse_args()
    if args.quick:
        args.jobs, args.image_size, args.train_per_class = "1,2", 64, 4
    reason = twohosts.available()
    if reason:
        print(f"cannot emulate two hosts here: {reason}", file=sys.stderr)
        return 2
    rows = []
    with tempfile.TemporaryDirectory() as tmp, twohosts.TwoHosts() as hosts:
        work = Path(tmp)
        swift = hosts.start_swift(work)
        os.environ.update(swift.env)
        store = S3Store("tenants", "synthetic", endpoint_url=swift.endpoint_url)
        store.ensure_bucket()
        make_synthetic(store, args.train_per_class, 1)
        node = hosts.start_daemon(store.url, swift, work / "daemon.log", extra_args=("--torch-threads", "1"))
        env = {**swift.env, "OMP_NUM_THREADS": "1"}  # one core per host: one thread per job
        for n in [int(j) for j in args.jobs.split(",")]:
            for mode in ("hapi", "all-in-storage"):
                commands = [job_command(args, store.url, swift.endpoint_url, work, i, mode, node) for i in range(n)]
                seconds, makespan = run_jobs(hosts, commands, mode == "all-in-storage", env, work)
                rows.append({"jobs": n, "mode": mode, "mean_job_s": round(statistics.mean(seconds), 2),
                             "makespan_s": round(makespan, 2)})
                print(f"{n:3d} jobs  {mode:15s} mean job {rows[-1]['mean_job_s']:7.2f} s  "
                      f"makespan {rows[-1]['makespan_s']:7.2f} s", flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    with open(RESULTS / "multitenant.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
