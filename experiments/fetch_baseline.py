"""Is the all-in-compute baseline a fair one? Its object-fetch rate against a plain boto3 loop.

Starts a real Swift (s3api) on loopback, uploads synthetic JPEGs, then fetches the same
objects side by side, several rounds interleaved: a sequential ``get_object`` loop (what a
naive loader does) and HAPI's ``RawObjectSource`` (concurrent GETs on one shared client),
with and without decoding. Prints a table and writes CSV.

    python -m experiments.fetch_baseline [--images 400] [--rounds 3] [--quick]
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import tempfile
import time
from pathlib import Path

from compute_side.sources import RawObjectSource
from experiments.swift_cluster import SwiftCluster
from hapi.datasets import make_synthetic, read_samples
from hapi.store import S3Store
from hapi.transforms import TransformSpec

RESULTS = Path(__file__).parent / "results" / "fetch_baseline"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--images", type=int, default=400, help="images fetched per round (10 classes)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=16, help="concurrent GETs of the baseline loader")
    p.add_argument("--quick", action="store_true", help="100 images, 1 round")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    if args.quick:
        args.images, args.rounds = 100, 1

    with tempfile.TemporaryDirectory() as tmp, SwiftCluster.start(Path(tmp)) as swift:
        os.environ.update(swift.env())  # credentials for HAPI's store, by the standard chain
        s3 = swift.client()
        s3.create_bucket(Bucket="bench")
        store = S3Store("bench", "synthetic", endpoint_url=swift.endpoint_url)
        samples = make_synthetic(store, args.images // 10, 0).split("train")
        keys = [f"synthetic/{s.key}" for s in samples]
        megabytes = sum(s.size for s in samples) / 1e6
        transform = TransformSpec()
        source = RawObjectSource(store, transform, io_threads=args.threads)

        def sequential_loop() -> None:
            for key in keys:
                s3.get_object(Bucket="bench", Key=key)["Body"].read()

        def concurrent_get() -> None:
            # the fetch half of RawObjectSource, without decoding
            read_samples(store, [s.key for s in samples], source.pool)

        def concurrent_get_and_decode() -> None:
            for i in range(0, len(samples), 32):
                source.fetch(samples[i: i + 32], epoch=0)

        loaders = {"boto3 get_object loop (sequential)": sequential_loop,
                   f"HAPI baseline: {args.threads} concurrent GETs": concurrent_get,
                   f"HAPI baseline: {args.threads} concurrent GETs + decode 224px": concurrent_get_and_decode}
        times: dict[str, list[float]] = {name: [] for name in loaders}
        for _ in range(args.rounds):  # interleaved rounds: machine noise hits every loader alike
            for name, loader in loaders.items():
                started = time.perf_counter()
                loader()
                times[name].append(time.perf_counter() - started)

    base = statistics.median(times["boto3 get_object loop (sequential)"])
    rows = []
    for name, seconds in times.items():
        median = statistics.median(seconds)
        rows.append({"loader": name, "objects_per_s": round(len(keys) / median, 1),
                     "mb_per_s": round(megabytes / median, 1), "vs_sequential": round(base / median, 2)})
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "fetch_baseline.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"{len(keys)} objects, {megabytes:.1f} MB, median of {args.rounds} interleaved rounds, "
          "Swift s3api on loopback")
    print(f"{'loader':58s} {'objects/s':>10s} {'MB/s':>8s} {'x seq':>7s}")
    for r in rows:
        print(f"{r['loader']:58s} {r['objects_per_s']:10.1f} {r['mb_per_s']:8.1f} {r['vs_sequential']:7.2f}")


if __name__ == "__main__":
    main()
