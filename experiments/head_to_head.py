"""Head-to-head: whole-command wall time of HAPI against AWS's s3torchconnector, on two hosts.

Two emulated hosts (``experiments.twohosts``): the storage host runs Swift with s3api and
HAPI's storage daemon on core 0, the compute host runs each job on core 1, and the veth
link between them is shaped with tc tbf. Every job is a whole command, timed from start to
exit as a user would see it (start-up, planning, training, validation after every epoch):

- HAPI (``python -m hapi.train``): ``--split auto``, ``freeze``, ``all-in-compute`` and a
  handful of fixed splits at the model's block boundaries (the fastest is "the best fixed
  split");
- the peer (``python -m experiments.peer_s3torch``): the same head on the same samples,
  read with s3torchconnector's ``S3MapDataset`` behind a DataLoader of 0, 2 or 4 workers
  (the fastest counts).

A case is (model, link, job length): one epoch of ``--samples`` samples, and a multi-epoch
job of ``--samples-multi`` samples per epoch (fewer, so that a 5-epoch job stays affordable
on a 1-core trainer). Within a case the jobs run side by side in an interleaved order
(HAPI and the peer alternating, rotated every repeat), so a drift of the machine's speed
falls on all of them; a fixed split whose job cannot beat ``--give-up`` times the case's
fastest so far is stopped (or, when the link alone would take that long, not started), as
it cannot be the best. Where auto trained at a split no other job measured, that split is
run too, so that its traffic can be compared.

Cache policy (``--cache``): ``fresh`` (the default) gives every HAPI job an empty cache
directory, as a new user's first job has: the planner knows only what the project ships
(saved profiles in the repository). ``warm`` shares one cache directory per model, filled
by an unrecorded ``--split auto`` job first: a user's second job. Every job writes to a fresh
``--output-dir``. The storage daemon is a long-running service, so each model's frozen
prefix is loaded into it before timing starts (an unrecorded job per model and data set).

Verdicts per case: "auto within 5% of the best of {peer, freeze, all-in-compute, best fixed
split}" and "auto's traffic <= the traffic of the mode it trained with" (both directions of
the veth, counted by the kernel, 2% slack for TCP acknowledgements and retransmissions).

    sudo .venv/bin/python -m experiments.head_to_head [--quick] [--models resnet50,resnet18]
        [--bandwidths 5,25,100] [--samples 320] [--samples-multi 128] [--epochs-list 1,5]

Writes ``runs.csv`` (every job), ``cases.csv`` and ``table.md`` under
``experiments/results/head_to_head/`` (``--quick``: its ``quick/`` folder).
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import math
import os
import re
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from experiments import twohosts
from hapi.datasets import make_synthetic
from hapi.models import build_model
from hapi.store import S3Store

log = logging.getLogger("head_to_head")

RESULTS = Path(__file__).parent / "results" / "head_to_head"
BUCKET = "head-to-head"
# auto passes when it is no slower than this many times the best alternative.
WITHIN = 1.05
# auto's traffic passes when it is at most this many times its own batches' bytes with the
# protocol overhead (TCP acknowledgements, headers, the manifest's GET) that the same
# transfers carry in the fixed modes: no bytes beyond what its training and validation needed.
TRAFFIC_SLACK = 1.02
ALL_IN_COMPUTE = -1  # hapi.train's split index of the all-in-compute mode (in its metrics.jsonl)
DAEMON_PORT = 8470
SECONDS_TO_STOP = 5.0


@dataclass(frozen=True)
class Settings:
    models: tuple[str, ...]
    bandwidths: tuple[float, ...]
    samples: int  # per epoch of a one-epoch job
    samples_multi: int  # per epoch of a longer job
    epochs_list: tuple[int, ...]
    repeats: int
    workers: tuple[int, ...]
    image_size: int
    batch_size: int
    val_per_class: int
    max_fixed: int  # fixed splits per model, at most
    give_up: float  # a fixed split slower than this many times the case's best so far is stopped
    cache: str  # "fresh" or "warm"
    out: Path
    keep_jobs: Path | None = None  # where each job's output and metrics.jsonl are kept
    uncached: bool = False  # multi-epoch cases also run auto without the feature cache

    def samples_for(self, epochs: int) -> int:
        return self.samples if epochs == 1 else self.samples_multi

    @property
    def command(self) -> str:
        """The command that measures the same cases, every setting spelled out."""
        def joined(values: tuple) -> str:
            return ",".join(f"{v:g}" if isinstance(v, float) else str(v) for v in values)
        return (f"sudo python -m experiments.head_to_head --models {joined(self.models)} "
                f"--bandwidths {joined(self.bandwidths)} --samples {self.samples} --samples-multi {self.samples_multi} "
                f"--epochs-list {joined(self.epochs_list)} --repeats {self.repeats} --workers {joined(self.workers)} "
                f"--image-size {self.image_size} --batch-size {self.batch_size} --val-per-class {self.val_per_class} "
                f"--max-fixed {self.max_fixed} --give-up {self.give_up:g} --cache {self.cache}"
                + (" --uncached" if self.uncached else ""))


@dataclass(frozen=True)
class Case:
    model: str
    bandwidth: float  # Mbit/s
    epochs: int
    samples: int  # per epoch

    @property
    def job(self) -> str:
        return f"{self.epochs}x{self.samples}"


@dataclass(frozen=True)
class Variant:
    """One way of running the job: a HAPI mode or the peer with a number of workers."""

    kind: str  # "hapi" or "peer"
    mode: str  # hapi: auto, freeze, all-in-compute or a split index; peer: its DataLoader workers
    split: int | None = None  # the split a HAPI mode trains at (None: auto, or the peer)
    uncached: bool = False  # a HAPI mode without the feature cache (--feature-cache 0)

    @property
    def label(self) -> str:
        if self.kind == "peer":
            return f"peer w{self.mode}"
        mode = f"split {self.mode}" if self.mode.isdigit() else self.mode
        return f"{mode}, no cache" if self.uncached else mode

    @property
    def fixed(self) -> bool:
        return self.kind == "hapi" and self.mode.isdigit()


@dataclass(frozen=True)
class Run:
    """One timed job."""

    model: str
    bandwidth_mbit: float
    epochs: int
    samples: int
    repeat: int
    variant: str  # Variant.label
    split: int | None  # where a HAPI mode trains (auto: None)
    wall_s: float  # start to exit; a lower bound when stopped
    stopped: bool  # given up (a fixed split that could not be the best)
    rx_bytes: int  # over the link, storage to compute
    tx_bytes: int  # compute to storage
    trained_split: int | None = None  # auto: the split most of its samples were trained at
    payload_bytes: int | None = None  # HAPI: its batches' bytes (training and validation), from its metrics
    replans: int = 0
    val_loss: float | None = None
    val_accuracy: float | None = None

    @property
    def link_bytes(self) -> int:
        return self.rx_bytes + self.tx_bytes


@dataclass(frozen=True)
class Verdict:
    """A case's times, ratios and verdicts, from its runs."""

    case: Case
    times: dict[str, float]  # median wall time per variant label (completed runs)
    link_mb: dict[str, float]  # median traffic per variant label, MB
    best_fixed: str | None
    fixed_floor_s: float | None  # every fixed split stopped: the least time one of them would have taken
    best_peer: str | None
    best_other: str  # the fastest of peer, freeze, all-in-compute and the best fixed split
    auto_vs_best: float
    vs_peer: dict[str, float]  # auto, freeze, all-in-compute, best fixed: time over the peer's
    auto_trained: str | None  # label of the mode auto trained with
    within: bool
    traffic_ok: bool | None  # None: auto's batches or the fixed modes' overhead were not measured
    auto_payload_mb: float | None = None  # the bytes auto's batches carried


# ---------------------------------------------------------------- the variants of a case


def block_boundaries(stage_names: Sequence[str], freeze: int, most: int) -> list[int]:
    """Splits below the freeze index where a group of blocks (``layer2.0``, ``layer2.1``, ...)
    starts or ends: the cuts a user would try by hand. At most ``most``, spread evenly."""
    groups = [name.split(".")[0] for name in stage_names]
    blocky = {group for group, name in zip(groups, stage_names) if "." in name}
    cuts = [i for i in range(1, freeze)
            if groups[i] != groups[i - 1] and (groups[i] in blocky or groups[i - 1] in blocky)]
    if len(cuts) <= most:
        return cuts
    return sorted({cuts[round(k * (len(cuts) - 1) / max(most - 1, 1))] for k in range(most)})


@dataclass(frozen=True)
class ModelFacts:
    """What the harness needs to know of a model: its freeze index, fixed splits and the
    bytes per sample each split sends (float32 features; all-in-compute: a mean JPEG)."""

    freeze: int
    fixed: tuple[int, ...]
    bytes_per_sample: dict[int, int]


def model_facts(name: str, image_size: int, most: int, jpeg_bytes: float) -> ModelFacts:
    model = build_model(name, input_size=image_size)
    freeze = model.spec.freeze_index
    fixed = tuple(block_boundaries(model.stage_names, freeze, most))
    sizes = {ALL_IN_COMPUTE: int(jpeg_bytes)}
    with torch.no_grad():
        x = torch.zeros(1, 3, image_size, image_size)
        for i, stage in enumerate(model.stages[:freeze]):
            sizes[i] = x.numel() * 4
            x = stage.eval()(x)
        sizes[freeze] = x.numel() * 4
    return ModelFacts(freeze, fixed, sizes)


def variants_of(facts: ModelFacts, workers: Sequence[int], uncached: bool = False) -> tuple[list[Variant],
                                                                                          list[Variant]]:
    """(the modes every case reports, HAPI and the peer alternating; the fixed splits)."""
    hapi = [Variant("hapi", "auto"), Variant("hapi", "freeze", facts.freeze),
            Variant("hapi", "all-in-compute", ALL_IN_COMPUTE)] + [Variant("hapi", "auto", uncached=True)] * uncached
    peers = [Variant("peer", str(w)) for w in workers]
    headline = [v for pair in zip(hapi, peers) for v in pair] + hapi[len(peers):] + peers[len(hapi):]
    return headline, [Variant("hapi", str(s), s) for s in facts.fixed]


# ---------------------------------------------------------------- running one job


@dataclass
class Harness:
    """The two hosts, the data sets and daemons, and how each job is launched."""

    hosts: twohosts.TwoHosts
    settings: Settings
    endpoint_url: str
    env: dict[str, str]
    work: Path
    stores: dict[int, str] = field(default_factory=dict)  # samples per epoch -> s3:// URL
    nodes: dict[int, str] = field(default_factory=dict)  # samples per epoch -> its daemon's URL
    mean_jpeg_bytes: float = 0.0
    jobs: int = 0

    def command(self, case: Case, variant: Variant, output_dir: Path) -> list[str]:
        s = self.settings
        common = ["--model", case.model, "--image-size", str(s.image_size), "--batch-size", str(s.batch_size),
                  "--epochs", str(case.epochs), "--store", self.stores[case.samples],
                  "--endpoint-url", self.endpoint_url, "--output-dir", str(output_dir)]
        if variant.kind == "peer":
            return [sys.executable, "-m", "experiments.peer_s3torch", *common, "--workers", variant.mode]
        return [sys.executable, "-m", "hapi.train", *common, "--split", variant.mode,
                "--storage-node", self.nodes[case.samples], "--cache-dir", str(self.cache_dir(case.model)),
                *(["--feature-cache", "0"] if variant.uncached else [])]

    def cache_dir(self, model: str) -> Path:
        if self.settings.cache == "warm":
            return self.work / "cache" / model
        return self.work / "cache" / f"job{self.jobs}"  # a new user's: empty (one per job)

    def time_job(self, case: Case, variant: Variant, repeat: int, give_up_s: float = math.inf) -> Run:
        """Run one job to its end (or until ``give_up_s``) and measure it."""
        self.jobs += 1
        output_dir = self.work / "runs" / f"job{self.jobs}"
        log_path = self.work / "logs" / f"job{self.jobs}-{case.model}-{case.job}-{variant.label.replace(' ', '')}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        before = link_counters()
        started = time.perf_counter()
        with open(log_path, "wb") as out:
            process = subprocess.Popen(self.command(case, variant, output_dir), stdout=out, stderr=subprocess.STDOUT,
                                       env={**os.environ, **self.env}, start_new_session=True)
            stopped = wait_or_stop(process, give_up_s)
        wall_s = time.perf_counter() - started
        after = link_counters()
        text = log_path.read_text(errors="replace")
        if self.settings.keep_jobs is not None:
            kept = self.settings.keep_jobs / log_path.stem
            kept.mkdir(parents=True, exist_ok=True)
            shutil.copy(log_path, kept / "output.txt")
            if (output_dir / "metrics.jsonl").is_file():
                shutil.copy(output_dir / "metrics.jsonl", kept / "metrics.jsonl")
        if process.returncode and not stopped:
            tail = "\n".join(text.splitlines()[-12:])
            raise RuntimeError(f"{variant.label} failed ({log_path}):\n{tail}")
        val = re.search(r"final validation: loss ([\d.]+), accuracy ([\d.]+)", text)
        return Run(case.model, case.bandwidth, case.epochs, case.samples, repeat, variant.label, variant.split,
                   round(wall_s, 2), stopped, after[0] - before[0], after[1] - before[1],
                   trained_split=trained_split(output_dir, text) if variant.mode == "auto" else variant.split,
                   payload_bytes=payload_bytes(output_dir),
                   replans=text.count("planner: from sample"),
                   val_loss=float(val.group(1)) if val else None, val_accuracy=float(val.group(2)) if val else None)


def link_counters() -> tuple[int, int]:
    """(received, sent) bytes of the compute host's end of the link, as the kernel counts them."""
    stats = Path("/sys/class/net") / twohosts.COMPUTE_DEV / "statistics"
    return int((stats / "rx_bytes").read_text()), int((stats / "tx_bytes").read_text())


def wait_or_stop(process: subprocess.Popen, give_up_s: float) -> bool:
    """Wait for ``process``; past ``give_up_s`` stop its whole session. True if stopped."""
    try:
        process.wait(timeout=None if math.isinf(give_up_s) else give_up_s)
        return False
    except subprocess.TimeoutExpired:
        pass
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, sig)
            process.wait(timeout=SECONDS_TO_STOP)
            break
        except subprocess.TimeoutExpired:
            continue
        except ProcessLookupError:
            break
    return True


def payload_bytes(output_dir: Path) -> int | None:
    """The bytes a HAPI job's batches carried, training and validation (its metrics.jsonl)."""
    metrics = output_dir / "metrics.jsonl"
    if not metrics.is_file():
        return None
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    return sum(r[part]["wire_bytes"] for r in records if "train" in r for part in ("train", "val")) or None


def trained_split(output_dir: Path, text: str) -> int | None:
    """The split most of a HAPI job's training samples came at (its metrics.jsonl), else
    the last one its output announced."""
    counts: Counter[int] = Counter()
    metrics = output_dir / "metrics.jsonl"
    if metrics.is_file():
        for line in metrics.read_text().splitlines():
            record = json.loads(line)
            if "step" in record and "split" in record:
                counts[int(record["split"])] += int(record.get("samples", 1))
    if counts:
        return counts.most_common(1)[0][0]
    announced = re.findall(r"(?:HAPI: \S+|re-planned: now) (all-in-compute|split (\d+))", text)
    if not announced:
        return None
    return ALL_IN_COMPUTE if announced[-1][0] == "all-in-compute" else int(announced[-1][1])


# ---------------------------------------------------------------- a case


def run_case(harness: Harness, case: Case, facts: ModelFacts, bar: tqdm) -> list[Run]:
    """Every variant of ``case``, ``repeats`` times, interleaved; then auto's split if unmeasured."""
    settings = harness.settings
    headline, fixed = variants_of(facts, settings.workers, settings.uncached and case.epochs > 1)
    # The link alone takes bytes / bandwidth: a bound no job at that split can beat.
    bound_s = {v.label: facts.bytes_per_sample[v.split] * case.samples * case.epochs * 8 / (case.bandwidth * 1e6)
               for v in fixed}
    fixed.sort(key=lambda v: bound_s[v.label])
    runs: list[Run] = []

    def best_s() -> float:
        return min((r.wall_s for r in runs if not r.stopped), default=math.inf)

    def record(run: Run) -> None:
        runs.append(run)
        bar.update(1)
        bar.set_postfix_str(f"{case.model} {case.bandwidth:g} Mbit/s {case.job}: {run.variant} "
                            f"{'>' if run.stopped else ''}{run.wall_s:.1f} s")
        log.info("%s %g Mbit/s %s  %-15s %s%7.1f s  %6.1f MB%s", case.model, case.bandwidth, case.job, run.variant,
                 ">" if run.stopped else " ", run.wall_s, run.link_bytes / 1e6,
                 f"  trained at {run.trained_split}" if run.variant == "auto" else "")

    for repeat in range(settings.repeats):
        # Rotated every repeat, so no mode always runs first (after a reshaped link) or last.
        shift = repeat % len(headline)
        for variant in headline[shift:] + headline[:shift]:
            record(harness.time_job(case, variant, repeat))
        for variant in fixed:
            give_up_s = settings.give_up * best_s()
            if bound_s[variant.label] > give_up_s:  # cannot be the best: not started
                record(Run(case.model, case.bandwidth, case.epochs, case.samples, repeat, variant.label,
                           variant.split, round(bound_s[variant.label], 2), True, 0, 0, variant.split))
            else:
                record(harness.time_job(case, variant, repeat, give_up_s))
    measured = {r.split for r in runs if r.split is not None and not r.stopped}
    for split in sorted({r.trained_split for r in runs if r.variant == "auto"} - measured - {None}):
        log.info("auto trained at split %s, which no other job measured: running it", split)
        record(harness.time_job(case, Variant("hapi", str(split), split), 0))
    return runs


def judge(case: Case, runs: Sequence[Run], freeze: int) -> Verdict:
    """The case's verdicts from its runs (as measured, or as read back from runs.csv)."""
    done = [r for r in runs if not r.stopped]
    labels = sorted({r.variant for r in done})
    times = {v: statistics.median(r.wall_s for r in done if r.variant == v) for v in labels}
    link_mb = {v: statistics.median(r.link_bytes for r in done if r.variant == v) / 1e6 for v in labels}
    fixed = [v for v in labels if v.startswith("split ")]
    peers = [v for v in labels if v.startswith("peer ")]
    best_fixed = min(fixed, key=times.get, default=None)
    fixed_floor_s = min((r.wall_s for r in runs if r.stopped), default=None) if best_fixed is None else None
    best_peer = min(peers, key=times.get, default=None)
    others = [v for v in (best_peer, "freeze", "all-in-compute", best_fixed) if v in times]
    best_other = min(others, key=times.get)
    auto = times["auto"]
    vs_peer = ({name: times[v] / times[best_peer] for name, v in
                (("auto", "auto"), ("freeze", "freeze"), ("all-in-compute", "all-in-compute"),
                 ("best fixed", best_fixed)) if v in times} if best_peer else {})
    splits = Counter(r.trained_split for r in done if r.variant == "auto" and r.trained_split is not None)
    auto_trained = label_of(splits.most_common(1)[0][0], freeze) if splits else None
    payload = {v: statistics.median(r.payload_bytes for r in done if r.variant == v) / 1e6
               for v in labels if all(r.payload_bytes for r in done if r.variant == v)}
    overheads = [link_mb[v] / payload[v] for v in ("freeze", "all-in-compute") if v in payload]
    traffic_ok = (link_mb["auto"] <= TRAFFIC_SLACK * max(overheads) * payload["auto"]
                  if overheads and "auto" in payload else None)
    return Verdict(case, times, link_mb, best_fixed, fixed_floor_s, best_peer, best_other, auto / times[best_other],
                   vs_peer, auto_trained, auto <= WITHIN * times[best_other], traffic_ok, payload.get("auto"))


def label_of(split: int, freeze: int) -> str:
    """The variant label of the HAPI mode that trains at ``split``."""
    if split == ALL_IN_COMPUTE:
        return "all-in-compute"
    return "freeze" if split == freeze else f"split {split}"


# ---------------------------------------------------------------- tables


TABLE_HEADERS = ("model", "Mbit/s", "job", "auto s", "freeze s", "all-in-compute s", "best fixed s",
                 "peer s", "auto/best", "auto/peer", "freeze/peer", "aic/peer", "fixed/peer",
                 "auto MB", "auto trained", "its batches MB", "auto within 5%", "traffic <= its batches'",
                 "auto, no cache s", "auto, no cache MB")


def table_rows(verdicts: Sequence[Verdict]) -> list[list[str]]:
    def seconds(label: str | None) -> str:
        return f"{v.times[label]:.1f}" if label in v.times else "-"

    def ratio(name: str) -> str:
        return f"{v.vs_peer[name]:.2f}" if name in v.vs_peer else "-"

    def fixed(v: Verdict) -> str:
        if v.best_fixed:
            return f"{seconds(v.best_fixed)} ({v.best_fixed.removeprefix('split ')})"
        return f">{v.fixed_floor_s:.1f} (stopped)" if v.fixed_floor_s is not None else "-"

    rows = []
    for v in verdicts:
        c = v.case
        rows.append([
            c.model, f"{c.bandwidth:g}", c.job, seconds("auto"), seconds("freeze"), seconds("all-in-compute"),
            fixed(v),
            f"{seconds(v.best_peer)} ({v.best_peer.removeprefix('peer ')})" if v.best_peer else "-",
            f"{v.auto_vs_best:.2f} ({v.best_other})", ratio("auto"), ratio("freeze"), ratio("all-in-compute"),
            ratio("best fixed"), f"{v.link_mb['auto']:.1f}", v.auto_trained or "?",
            f"{v.auto_payload_mb:.1f}" if v.auto_payload_mb is not None else "-",
            "yes" if v.within else "NO",
            {True: "yes", False: "NO", None: "n/a"}[v.traffic_ok],
            seconds("auto, no cache"),
            f"{v.link_mb['auto, no cache']:.1f}" if "auto, no cache" in v.link_mb else "-",
        ])
    return rows


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]], markdown: bool = False) -> str:
    if markdown:
        lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
        return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])
    widths = [max(len(str(x)) for x in column) for column in zip(headers, *rows)]
    return "\n".join("  ".join(str(x).rjust(w) for x, w in zip(row, widths)) for row in (headers, *rows))


def closing_line(verdicts: Sequence[Verdict]) -> str:
    within = sum(v.within for v in verdicts)
    traffic = [v.traffic_ok for v in verdicts if v.traffic_ok is not None]
    worst = max(verdicts, key=lambda v: v.auto_vs_best)
    return (f"auto within 5% of the best of {{peer, freeze, all-in-compute, best fixed split}}: {within}/"
            f"{len(verdicts)} cases (worst {worst.auto_vs_best:.2f}x, {worst.case.model} {worst.case.bandwidth:g} "
            f"Mbit/s {worst.case.job}); auto's traffic <= its own batches' (with the fixed modes' protocol "
            f"overhead): {sum(traffic)}/{len(traffic)} measured")


def write_results(out: Path, runs: Sequence[Run], verdicts: Sequence[Verdict], settings: Settings) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "runs.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[*asdict(runs[0]), "link_mb"])
        writer.writeheader()
        writer.writerows({**asdict(r), "link_mb": round(r.link_bytes / 1e6, 3)} for r in runs)
    rows = table_rows(verdicts)
    with open(out / "cases.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(TABLE_HEADERS)
        writer.writerows(rows)
    text = (f"# HAPI vs s3torchconnector: whole-command wall time\n\n"
            f"Command: `{settings.command}`\n\n"
            f"{len(settings.models)} model(s) at {settings.image_size} px, batch {settings.batch_size}, "
            f"{settings.val_per_class * 10} validation samples after every epoch; job = epochs x training samples "
            f"per epoch; median of {settings.repeats} "
            f"run(s); cache policy: {settings.cache}. Ratios below 1: faster than the peer (s3torchconnector, "
            f"best of {', '.join(map(str, settings.workers))} DataLoader workers). MB: both directions of the "
            f"link, as the kernel counts them.\n\n{format_table(TABLE_HEADERS, rows, markdown=True)}\n\n"
            f"{closing_line(verdicts)}\n")
    (out / "table.md").write_text(text)


# ---------------------------------------------------------------- the benchmark


def setup_harness(hosts: twohosts.TwoHosts, settings: Settings, work: Path) -> Harness:
    """Swift on the storage host with one data set per epoch size, each served by a daemon."""
    swift = hosts.start_swift(work)
    os.environ.update(swift.env)  # this process writes the data sets
    # The daemons listen beyond loopback, so they require a bearer token; the daemons and
    # the HAPI jobs (children of this process) read it from the environment.
    os.environ.setdefault("HAPI_STORAGE_TOKEN", secrets.token_hex(16))
    # One trainer thread on the one core of the compute host, as the storage daemon runs one.
    harness = Harness(hosts, settings, swift.endpoint_url, {**swift.env, "OMP_NUM_THREADS": "1"}, work)
    for i, samples in enumerate(sorted({settings.samples_for(e) for e in settings.epochs_list})):
        store = S3Store(BUCKET, f"n{samples}", endpoint_url=swift.endpoint_url)
        store.ensure_bucket()
        manifest = make_synthetic(store, -(-samples // 10), settings.val_per_class)
        harness.stores[samples] = store.url
        harness.mean_jpeg_bytes = statistics.mean(s.size for s in manifest.split("train"))
        # A daemon serves one data set (its store URL): one per epoch size.
        harness.nodes[samples] = hosts.start_daemon(store.url, swift, work / f"daemon-{samples}.log",
                                                    port=DAEMON_PORT + i, extra_args=("--torch-threads", "1"))
    return harness


def warm_up(harness: Harness, models: Sequence[str]) -> None:
    """Load every model's frozen prefix into every daemon (a service loads it once for all
    jobs), and with ``--cache warm`` leave each model's profile in its cache directory."""
    mode = "auto" if harness.settings.cache == "warm" else "freeze"
    for model in models:
        for samples in harness.stores:
            case = Case(model, 0, 1, samples)
            run = harness.time_job(case, Variant("hapi", mode), -1)
            log.info("warm-up: %s on the %d-sample set, --split %s, %.1f s", model, samples, mode, run.wall_s)


def benchmark(settings: Settings) -> tuple[list[Run], list[Verdict]]:
    cases = [Case(m, b, e, settings.samples_for(e)) for b in settings.bandwidths for m in settings.models
             for e in settings.epochs_list]
    runs: list[Run] = []
    verdicts: list[Verdict] = []
    with (tempfile.TemporaryDirectory(prefix="head-to-head-") as tmp, twohosts.TwoHosts() as hosts,
          logging_redirect_tqdm()):
        work = Path(tmp)
        harness = setup_harness(hosts, settings, work)
        facts = {m: model_facts(m, settings.image_size, settings.max_fixed, harness.mean_jpeg_bytes)
                 for m in settings.models}
        warm_up(harness, settings.models)
        planned = sum(settings.repeats * (3 + len(settings.workers) + len(facts[c.model].fixed)) for c in cases)
        with tqdm(total=planned, desc="jobs", unit="job") as bar:
            shaped = None
            for case in cases:
                if case.bandwidth != shaped:
                    hosts.shape(case.bandwidth)
                    shaped = case.bandwidth
                case_runs = run_case(harness, case, facts[case.model], bar)
                runs += case_runs
                verdicts.append(judge(case, case_runs, facts[case.model].freeze))
                # Written case by case, so a run cut short keeps what it measured.
                write_results(settings.out, runs, verdicts, settings)
    return runs, verdicts


def parse_args(argv: list[str] | None = None) -> Settings:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="resnet50,resnet18")
    p.add_argument("--bandwidths", default="5,25,100", help="Mbit/s of the shaped link")
    p.add_argument("--samples", type=int, default=320, help="training samples of a one-epoch job")
    p.add_argument("--samples-multi", type=int, default=128,
                   help="training samples per epoch of a longer job (fewer, to keep 5 epochs affordable)")
    p.add_argument("--epochs-list", default="1,5")
    p.add_argument("--repeats", type=int, default=1, help="runs of every variant per case (the median counts)")
    p.add_argument("--workers", default="0,2,4", help="DataLoader workers of the peer (the fastest counts)")
    p.add_argument("--image-size", type=int, default=112)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--val-per-class", type=int, default=4, help="validation samples per class (10 classes)")
    p.add_argument("--max-fixed", type=int, default=5, help="fixed splits per model (block boundaries)")
    p.add_argument("--give-up", type=float, default=1.5,
                   help="a fixed split's job is stopped at this many times the case's fastest job so far")
    p.add_argument("--cache", choices=("fresh", "warm"), default="fresh",
                   help="fresh: every HAPI job an empty cache dir (a first job); warm: one per model, "
                        "filled by an unrecorded auto job (a second job)")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: resnet18 at 25 Mbit/s, 64 samples (2 epochs of 32), workers 0,2, 2 fixed splits")
    p.add_argument("--out", type=Path)
    p.add_argument("--keep-jobs", type=Path, help="keep each job's output and metrics.jsonl under this folder")
    p.add_argument("--uncached", action="store_true",
                   help="multi-epoch cases also run auto without its feature cache (--feature-cache 0)")
    args = p.parse_args(argv)
    if args.quick:  # explicit flags still win over the quick sizes
        defaults = vars(p.parse_args([]))
        quick = {"models": "resnet18", "bandwidths": "25", "samples": 64, "samples_multi": 32, "epochs_list": "1,2",
                 "workers": "0,2", "max_fixed": 2, "val_per_class": 2}
        for name, value in quick.items():
            if getattr(args, name) == defaults[name]:
                setattr(args, name, value)
    return Settings(
        models=tuple(args.models.split(",")), bandwidths=tuple(float(b) for b in args.bandwidths.split(",")),
        samples=args.samples, samples_multi=args.samples_multi,
        epochs_list=tuple(int(e) for e in args.epochs_list.split(",")), repeats=args.repeats,
        workers=tuple(int(w) for w in args.workers.split(",")), image_size=args.image_size,
        batch_size=args.batch_size, val_per_class=args.val_per_class, max_fixed=args.max_fixed,
        give_up=args.give_up, cache=args.cache, out=args.out or (RESULTS / "quick" if args.quick else RESULTS),
        keep_jobs=args.keep_jobs, uncached=args.uncached)


def main(argv: list[str] | None = None) -> int:
    settings = parse_args(argv)
    if not twohosts.start_cli():
        return 2
    started = time.perf_counter()
    runs, verdicts = benchmark(settings)
    table = format_table(TABLE_HEADERS, table_rows(verdicts))
    print(f"\n{table}\n\n{closing_line(verdicts)}\n{len(runs)} jobs in {(time.perf_counter() - started) / 60:.1f} min; "
          f"results in {settings.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
