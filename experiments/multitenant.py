"""Multi-tenant: N concurrent training jobs on one storage node, HAPI against all-in-storage.

Two emulated hosts joined by a shaped link. Every job is a whole ``python -m hapi.train``
run (start-up, planning, one epoch, validation), all N started at once:

- ``hapi``: N trainers on the compute host, each planning its own split (``--split auto``)
  against the one shared storage daemon;
- ``hapi-freeze``: the same, every frozen stage pushed down (``--split freeze``);
- ``all-in-storage``: N whole jobs run on the storage host itself, reading Swift locally.

Reports each mode's mean job time (each job's wall time, start to exit), the mean of the
jobs' own training time, and the makespan (first start to last exit). The jobs share one
cache directory, so the stage times a first (unrecorded) ``hapi`` job profiled are
reused, as they would be by a user's later jobs; each job still probes the link itself.

    sudo python -m experiments.multitenant [--jobs 1,2,4,6,8,10] [--mbit 25] [--quick]
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
from collections import Counter
from pathlib import Path

from experiments import twohosts

RESULTS = Path(__file__).parent / "results" / "multitenant"
MODES = ("hapi", "hapi-freeze", "all-in-storage")


def job_command(args: argparse.Namespace, storage: twohosts.StorageHost, work: Path, i: int, mode: str) -> list[str]:
    command = [sys.executable, "-m", "hapi.train", "--model", args.model, "--image-size", str(args.image_size),
               "--batch-size", str(args.batch_size), "--store", storage.store.url,
               "--endpoint-url", storage.swift.endpoint_url,
               "--cache-dir", str(work / "cache"), "--output-dir", str(work / f"job{i}")]
    if mode == "all-in-storage":
        return [*command, "--split", "all-in-compute"]
    return [*command, "--split", "auto" if mode == "hapi" else "freeze", "--storage-node", storage.node]


def run_jobs(hosts: twohosts.TwoHosts, commands: list[list[str]], on_storage: bool, env: dict[str, str],
             work: Path) -> dict[str, object]:
    """Start every job at once and wait for all; their times and the splits they trained with."""
    started = time.perf_counter()
    running = []
    for i, command in enumerate(commands):
        log = work / f"job{i}.log"
        log.unlink(missing_ok=True)  # the storage host appends to its logs
        if on_storage:
            process = hosts.spawn_storage(command, log, env=env)
        else:
            with open(log, "wb") as f:
                process = subprocess.Popen(command, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **env})
        running.append((process, log))
    wall: dict[int, float] = {}
    while len(wall) < len(running):
        for i, (process, _) in enumerate(running):
            if i not in wall and process.poll() is not None:
                wall[i] = time.perf_counter() - started
        time.sleep(0.05)
    train_s, splits = [], Counter()
    for process, log in running:
        text = log.read_text(errors="replace")
        trained = re.search(r"trained \d+ samples in ([\d.]+) s", text)
        split = re.search(r"HAPI: \S+ (all-in-compute|split \d+)", text)
        if process.returncode or not trained or not split:
            raise RuntimeError(f"job failed ({log}):\n" + "\n".join(text.splitlines()[-5:]))
        train_s.append(float(trained.group(1)))
        splits[split.group(1)] += 1
    return {"mean_job_s": round(statistics.mean(wall.values()), 2), "mean_train_s": round(statistics.mean(train_s), 2),
            "makespan_s": round(max(wall.values()), 2),
            "splits": " ".join(f"{s} x{n}" for s, n in sorted(splits.items()))}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--jobs", default="1,2,4,6,8,10")
    p.add_argument("--model", default="resnet18")
    p.add_argument("--image-size", type=int, default=112)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--train-per-class", type=int, default=8, help="each job trains 10x this many samples")
    p.add_argument("--mbit", type=float, default=25, help="the shaped link between the hosts")
    p.add_argument("--quick", action="store_true", help="1 and 2 jobs, 64 px, 40 samples per job")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    if args.quick:
        args.jobs, args.image_size, args.train_per_class = "1,2", 64, 4
    reason = twohosts.available()
    if reason:
        print(f"cannot emulate two hosts here: {reason}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    with (open(args.out / "multitenant.csv", "w", newline="") as f, tempfile.TemporaryDirectory() as tmp,
          twohosts.TwoHosts() as hosts):
        writer = csv.DictWriter(f, fieldnames=["jobs", "mode", "mbit", "mean_job_s", "mean_train_s", "makespan_s",
                                               "splits"])
        writer.writeheader()
        work = Path(tmp)
        storage = hosts.start_storage_host(work, "tenants", args.train_per_class, 1)
        hosts.shape(args.mbit)
        env = {**storage.swift.env, "OMP_NUM_THREADS": "1"}  # one core per host: one thread per job
        run_jobs(hosts, [job_command(args, storage, work, 0, "hapi")], False, env, work)  # profiles the tiers
        for n in [int(j) for j in args.jobs.split(",")]:
            for mode in MODES:
                commands = [job_command(args, storage, work, i, mode) for i in range(n)]
                row = {"jobs": n, "mode": mode, "mbit": args.mbit,
                       **run_jobs(hosts, commands, mode == "all-in-storage", env, work)}
                writer.writerow(row)
                f.flush()
                print(f"{n:3d} jobs  {mode:15s} mean job {row['mean_job_s']:7.2f} s  (training "
                      f"{row['mean_train_s']:6.2f} s)  makespan {row['makespan_s']:7.2f} s  {row['splits']}",
                      flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
