"""Node scale: what one storage daemon delivers against what its cores compute without it.

For one host (issue 22's table): a daemon on ``--cores`` cores, driven by 1, 4 and 16
concurrent clients (each its own job, one extract request of ``--batch`` samples in
flight at a time, as a trainer without overlap sends them), for the prefix to the
model's freeze index in float32 and in bf16 and for split 0 (fetch + decode + crop
only, shipped as uint8 like every split-0 request); and the bare capacities of the same
cores: the prefix alone in one process at batch 32 on all of them, and decodes per
second in one process per core (PIL's decode, resize and crop as the issue counted them,
and the daemon's own ``preprocess``). A cell's share of its bare capacity is printed
beside it.

``--scaling 1,2`` adds, in the same run, the daemon at ``--cores 1`` against ``--cores 2``
at 4 clients (split 0 and the freeze index, float32), and the ratio of their throughputs:
both daemons run at once, measured in alternate windows (the machine's speed drifts).

Throughput is counted between completions: (completed requests - 1) x batch over the time
from the first completion after the warm-up to the last, in a window of ``--seconds``.
Every daemon runs on the first cores of this process's affinity; the clients run in this
process, on any core (their work is reading sockets). Defaults are sized for a 2-core
machine (ResNet-18 at 112 px); the issue's sizes are ``--model resnet50 --image-size 224``.

    python -m experiments.node_scale                         # the table, every core of this host
    python -m experiments.node_scale --scaling 1,2 --skip-table   # --cores 1 vs 2 only
    python -m experiments.node_scale --model resnet50 --image-size 224 --seconds 30  # the issue's sizes
"""

from __future__ import annotations

import argparse
import io
import multiprocessing
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch
from PIL import Image

from compute_side.client import StorageClient
from compute_side.daemon_process import local_daemon
from hapi.datasets import make_synthetic
from hapi.models import build_model, get_spec
from hapi.store import FileStore
from hapi.transforms import TransformSpec, preprocess
from hapi.wire import ExtractRequest, wire_dtype

CLIENTS = (1, 4, 16)
BARE_BATCH = 32  # the batch for the prefix alone


@dataclass(frozen=True)
class Setup:
    model: str
    freeze: int
    spec: TransformSpec
    batch: int
    seconds: float
    keys: tuple[str, ...]
    store_url: str
    logs: Path
    daemon_args: tuple[str, ...]


def first_cores(count: int) -> list[int]:
    allowed = sorted(os.sched_getaffinity(0))
    return allowed[:count] if count else allowed


# --- the daemon under load --------------------------------------------------------------


@dataclass(frozen=True)
class Load:
    rate: float  # samples/s the daemon served
    client_cores: float  # the cores the clients (this process) kept busy meanwhile: theirs, not the daemon's


def drive(url: str, setup: Setup, clients: int, split: int) -> Load:
    """What the daemon at ``url`` serves to ``clients`` closed-loop clients, and what the
    clients cost this host's cores while it did (on a small host, they share them)."""
    done: list[float] = []
    lock = threading.Lock()
    ready = threading.Barrier(clients + 1)
    stop = threading.Event()
    errors: list[BaseException] = []

    def client(i: int) -> None:
        node = StorageClient(url, timeout_s=900, retries=20)
        step = 0
        try:
            while True:
                start = (i * 7919 + step * setup.batch) % len(setup.keys)
                keys = tuple((setup.keys * 2)[start: start + setup.batch])
                node.extract(ExtractRequest(keys=keys, model=setup.model, split=split, transform=setup.spec,
                                            dtype=wire_dtype(split, "float32"),
                                            job_id=f"client-{i}"))
                step += 1
                if step == 1:
                    ready.wait()  # every client warmed up (its first request) before the clock starts
                elif stop.is_set():
                    return
                else:
                    with lock:
                        done.append(time.perf_counter())
        except BaseException as exc:  # noqa: BLE001  (reported by the main thread)
            errors.append(exc)
            ready.abort()

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    try:
        ready.wait()
    except threading.BrokenBarrierError:
        raise errors[0] from None
    started, cpu_started = time.perf_counter(), time.process_time()
    deadline = started + setup.seconds
    while time.perf_counter() < deadline or len(done) < 3:  # at least two intervals between completions
        if errors:
            raise errors[0]
        time.sleep(0.05)
    stop.set()
    client_cores = (time.process_time() - cpu_started) / (time.perf_counter() - started)
    with lock:
        times = sorted(done)
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return Load((len(times) - 1) * setup.batch / (times[-1] - times[0]), client_cores)


Cells = Sequence[tuple[int, int]]  # (split, clients)


def daemon_args(setup: Setup, cores: int, dtype: str) -> tuple[str, ...]:
    # Its own state directory: each daemon times its pass layout afresh, in its clients' warm-up.
    state = setup.logs / f"state-{cores}c-{dtype}"
    return ("--cores", str(cores), "--compute-dtype", dtype, "--max-sub-batch", str(setup.batch),
            "--queue-timeout", "900",  # queueing is expected here, not a fault
            "--state-dir", str(state), *(arg.format(cores=cores) for arg in setup.daemon_args))


def layouts(url: str) -> str:
    """The pass layouts the daemon at ``url`` measured: passes at once, and samples/s of each."""
    loaded = StorageClient(url).loaded()
    return "; ".join(f"{m['model']} at {m['input_size']} px: {m['pass_layout']['slots']} passes at once "
                     f"(samples/s by passes at once: {m['pass_layout']['samples_per_s']})"
                     for m in loaded if "pass_layout" in m) or "none measured"


def daemon_rates(setup: Setup, cores: int, dtype: str, cells: Cells) -> dict[tuple[int, int], float]:
    """Samples/s for each (split, clients) cell, from one daemon on ``cores`` cores in ``dtype``."""
    rates = {}
    log = setup.logs / f"daemon-{cores}c-{dtype}.log"
    with local_daemon(setup.store_url, log, extra_args=daemon_args(setup, cores, dtype), start_timeout_s=180) as url:
        for split, clients in cells:
            rates[split, clients] = drive(url, setup, clients, split).rate
            print(f"  cores {cores} {dtype:8s} split {split:2d} clients {clients:2d}: "
                  f"{rates[split, clients]:8.1f} samples/s", flush=True)
        print(f"  its pass layout: {layouts(url)}", flush=True)
    return rates


# --- bare capacities ----------------------------------------------------------------------


def _pinned(cores: list[int], work: Callable[..., float], *args: object) -> float:
    """Run ``work(*args)`` in a fresh process on ``cores`` (a daemon's cores, measured alone)."""
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1, initializer=os.sched_setaffinity, initargs=(0, cores)) as pool:
        return pool.apply(work, args)


def prefix_rate(model: str, size: int, dtype: str, threads: int, seconds: float) -> float:
    """Samples/s of the frozen prefix alone, one process, ``threads`` intra-op threads, batch 32."""
    torch.set_num_threads(threads)
    staged = build_model(model, None, size)
    stages = staged.prefix(staged.spec.freeze_index).eval()
    x = torch.randn(BARE_BATCH, 3, size, size)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bfloat16")
    with torch.inference_mode(), autocast:
        stages(x)  # warm-up: kernels chosen, memory mapped
        runs, started = 0, time.perf_counter()
        while runs < 2 or time.perf_counter() - started < seconds:
            stages(x)
            runs += 1
    return runs * BARE_BATCH / (time.perf_counter() - started)


def prefix_passes(cores: list[int], model: str, size: int, dtype: str, seconds: float) -> float:
    """Samples/s of one single-threaded prefix process per core, at once."""
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(len(cores), initializer=os.sched_setaffinity, initargs=(0, cores)) as pool:
        return sum(pool.starmap(prefix_rate, [(model, size, dtype, 1, seconds)] * len(cores)))


def _pil_decode(blob: bytes, spec: TransformSpec) -> None:
    with Image.open(io.BytesIO(blob)) as image:
        image = image.convert("RGB")
        w, h = image.size
        scale = spec.resize_size / min(w, h)
        image = image.resize((round(w * scale), round(h * scale)), Image.Resampling.BILINEAR)
        left, top = (image.width - spec.crop_size) // 2, (image.height - spec.crop_size) // 2
        image.crop((left, top, left + spec.crop_size, top + spec.crop_size)).tobytes()


def _decode_loop(blobs: list[bytes], spec: TransformSpec, how: str, seconds: float) -> int:
    torch.set_num_threads(1)
    done, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        blob = blobs[done % len(blobs)]
        if how == "pil":
            _pil_decode(blob, spec)
        else:
            preprocess(blob, "k", spec)
        done += 1
    return done


def decode_rate(cores: list[int], blobs: list[bytes], spec: TransformSpec, how: str, seconds: float) -> float:
    """Images/s decoded, resized and cropped by one process per core."""
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(len(cores), initializer=os.sched_setaffinity, initargs=(0, cores)) as pool:
        pool.apply(_decode_loop, (blobs[:1], spec, how, 0.0))  # every worker imported and started
        counts = pool.starmap(_decode_loop, [(blobs, spec, how, seconds)] * len(cores))
    return sum(counts) / seconds


# --- the report ---------------------------------------------------------------------------


def _cell(rate: float | None, bare: float) -> str:
    return "—" if rate is None else f"{rate:.1f} ({rate / bare:.2f})"


def table(setup: Setup, cores: int, clients: Sequence[int], dtypes: Sequence[str], blobs: list[bytes]) -> None:
    pinned = first_cores(cores)
    print(f"\n# bare capacities on {len(pinned)} cores ({pinned})", flush=True)
    bare = {dtype: _pinned(pinned, prefix_rate, setup.model, setup.spec.crop_size, dtype, len(pinned),
                           setup.seconds) for dtype in dtypes}
    for dtype, rate in bare.items():
        print(f"  {setup.model} prefix to {setup.freeze}, {dtype}, batch {BARE_BATCH}, one process: "
              f"{rate:.1f} samples/s", flush=True)
    # What the daemon runs when every compute slot is busy: one pass per core, one thread each.
    narrow = prefix_passes(pinned, setup.model, setup.spec.crop_size, dtypes[0], setup.seconds)
    print(f"  the same in {dtypes[0]}, {len(pinned)} processes of one thread: {narrow:.1f} samples/s", flush=True)
    pil = decode_rate(pinned, blobs, setup.spec, "pil", setup.seconds)
    ours = decode_rate(pinned, blobs, setup.spec, "preprocess", setup.seconds)
    print(f"  decode + resize + crop, {len(pinned)} processes: PIL {pil:.1f}/s, hapi preprocess {ours:.1f}/s",
          flush=True)
    rows = []
    for dtype in dtypes:
        cells = [(setup.freeze, c) for c in clients] + ([(0, c) for c in clients] if dtype == dtypes[0] else [])
        rates = daemon_rates(setup, cores, dtype, cells)
        rows.append((f"{setup.model} to its freeze index ({setup.freeze}), {dtype}",
                     [rates[setup.freeze, c] for c in clients], bare[dtype],
                     f"{bare[dtype]:.1f} (the prefix alone, one process, all cores, batch {BARE_BATCH})"))
        if dtype == dtypes[0]:
            split0 = [rates[0, c] for c in clients]
    rows.append(("split 0 (fetch + decode + crop only, uint8 wire)", split0, ours,
                 f"{ours:.1f} preprocess/s ({pil:.1f} PIL decodes/s) in {len(pinned)} processes"))
    print(f"\n{setup.model} at {setup.spec.crop_size} px, {setup.batch}-sample requests, daemon on "
          f"{len(pinned)} cores; a cell is samples/s (its share of the bare capacity)\n")
    print("| work | " + " | ".join(f"{c} client{'s' * (c > 1)}" for c in clients)
          + " | the same work without the daemon |")
    print("|---|" + "---|" * len(clients) + "---|")
    for name, rates_, bare_rate, bare_text in rows:
        print(f"| {name} | " + " | ".join(_cell(r, bare_rate) for r in rates_) + f" | {bare_text} |")


def scaling(setup: Setup, cores: Sequence[int], clients: int, rounds: int, blobs: list[bytes]) -> None:
    """The daemon at each of ``cores``, all started at once and measured in turn, ``rounds`` times,
    each round also timing the bare work on the same cores (one process per core): the machine's
    speed drifts within minutes, so each ratio pairs windows taken side by side."""
    rates: dict[tuple[str, int, int], list[float]] = {}
    client_cores: dict[tuple[int, int], list[float]] = {}

    def bare(c: int, split: int) -> float:
        pinned = first_cores(c)
        if split == 0:
            return decode_rate(pinned, blobs, setup.spec, "preprocess", setup.seconds)
        return prefix_passes(pinned, setup.model, setup.spec.crop_size, "float32", setup.seconds)

    with ExitStack() as stack:
        urls = {c: stack.enter_context(local_daemon(setup.store_url, setup.logs / f"scaling-{c}c.log",
                                                    extra_args=daemon_args(setup, c, "float32"),
                                                    start_timeout_s=180)) for c in cores}
        for split in (0, setup.freeze):
            for _ in range(rounds):
                for c in cores:
                    load = drive(urls[c], setup, clients, split)
                    client_cores.setdefault((c, split), []).append(load.client_cores)
                    rates.setdefault(("daemon", c, split), []).append(load.rate)
                    rates.setdefault(("bare", c, split), []).append(bare(c, split))
                    print(f"  daemon --cores {c} split {split:2d}: {load.rate:8.1f} samples/s "
                          f"(its clients kept {load.client_cores:.2f} cores busy); "
                          f"bare: {rates['bare', c, split][-1]:8.1f}", flush=True)
        for c in cores:
            print(f"  daemon --cores {c}'s pass layout: {layouts(urls[c])}", flush=True)
    low, high = cores[0], cores[-1]
    print(f"\n{setup.model} at {setup.spec.crop_size} px, {setup.batch}-sample requests, {clients} clients, "
          f"float32; samples/s, the median of {rounds} windows of {setup.seconds:g} s each; bare: the same work "
          "in one process per core, no daemon; clients' cores: what the clients kept busy of this host's cores, "
          "which on a host without spare cores the daemon did not have\n")
    print("| work | " + " | ".join(f"--cores {c}" for c in cores) + f" | --cores {high} / --cores {low} | "
          + " | ".join(f"bare, {c} cores" for c in cores) + f" | bare {high} / {low} | "
          + " | ".join(f"clients' cores, --cores {c}" for c in cores) + " |")
    print("|---|" + "---|" * (3 * len(cores) + 2))
    for split, name in ((0, "split 0 (fetch + decode + crop, uint8 wire)"),
                        (setup.freeze, f"freeze index ({setup.freeze})")):
        med = {(w, c): statistics.median(rates[w, c, split]) for w in ("daemon", "bare") for c in cores}
        print(f"| {name} | " + " | ".join(f"{med['daemon', c]:.1f}" for c in cores)
              + f" | {med['daemon', high] / med['daemon', low]:.2f}x | "
              + " | ".join(f"{med['bare', c]:.1f}" for c in cores)
              + f" | {med['bare', high] / med['bare', low]:.2f}x | "
              + " | ".join(f"{statistics.median(client_cores[c, split]):.2f}" for c in cores) + " |")


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="resnet18")
    p.add_argument("--image-size", type=int, default=112, help="crop size in px (resized to 256/224 of it first)")
    p.add_argument("--batch", type=int, default=32, help="samples per extract request")
    p.add_argument("--clients", type=_ints, default=list(CLIENTS), help="concurrent clients, comma-separated")
    p.add_argument("--dtypes", default="float32,bfloat16", help="--compute-dtype values for the freeze rows")
    p.add_argument("--cores", type=int, default=0, help="the daemon's --cores for the table; 0: all of ours")
    p.add_argument("--seconds", type=float, default=10.0, help="measurement window of each cell")
    p.add_argument("--images", type=int, default=10, help="synthetic images per class (10 classes)")
    p.add_argument("--scaling", type=_ints, default=[], help="also compare the daemon at these --cores, e.g. 1,2")
    p.add_argument("--scaling-clients", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2, help="windows per daemon and work in the --scaling comparison")
    p.add_argument("--skip-table", action="store_true", help="only the --scaling comparison")
    p.add_argument("--daemon-arg", action="append", default=[], help="one more daemon argument; repeatable; "
                   "{cores} is the daemon's --cores (e.g. --daemon-arg=--decode-workers={cores})")
    a = p.parse_args(argv)
    size = a.image_size
    spec = TransformSpec(crop_size=size, resize_size=round(size * 256 / 224))
    with tempfile.TemporaryDirectory(prefix="node-scale-") as tmp:
        store = FileStore(Path(tmp) / "store")
        manifest = make_synthetic(store, a.images, 0)
        keys = tuple(s.key for s in manifest.split("train"))
        setup = Setup(a.model, get_spec(a.model).freeze_index, spec, a.batch, a.seconds, keys, store.url,
                      Path(tmp) / "logs", tuple(a.daemon_arg))
        print(f"{len(keys)} synthetic JPEGs of {statistics.mean(len(store.get(k)) for k in keys) / 1e3:.0f} KB "
              f"on average; this process may use cores {sorted(os.sched_getaffinity(0))}", flush=True)
        blobs = [store.get(k) for k in keys]
        if a.scaling:
            scaling(setup, a.scaling, a.scaling_clients, a.rounds, blobs)
        if not a.skip_table:
            table(setup, a.cores, a.clients, a.dtypes.split(","), blobs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
