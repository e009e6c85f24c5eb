"""Split sweep on two emulated hosts: the split a run settles on, against every candidate timed.

For each (model, bandwidth, batch size) case, on the two emulated hosts of
``experiments.twohosts`` (storage host: Swift + the storage daemon on core 0; this
process and the trainer on core 1; the veth link shaped with tc):

1. A short ``python -m hapi.train --split auto`` run, started as a user starts it (a
   subprocess on the compute host's core, one torch thread), with ``--explain``. The
   (split, dtype) of its last training step is the choice the run settled on after its
   exploration; its ``--explain`` table gives the calibrated cost model's pace for every
   candidate at the end of the run (the ``predicted_ms`` column).
2. The steady-state pace of every candidate (all-in-compute and every split up to the
   freeze index), trained here through the pipelined loader with ``hapi.train``'s depth of
   requests in flight. The clock starts once the pipeline is full and stops while it still
   is (``experiments.windows``). A mix's windows hold its shares of the batches
   (``timed_for``), and start after as many batches as they time.

The verdict judges the choice on that steady-state pace. The machine's speed drifts by tens
of percent within a minute, more than the 5% at stake, so absolute times taken a minute
apart cannot decide it:
- Screening: every candidate gets a short window, most promising first; one slower than
  ``GIVE_UP_FACTOR`` times the best so far is stopped (its time is a lower bound), never
  the choice.
- Selection: the candidates screened within ``RETIME_WITHIN`` of the best (``RIVALS`` at
  most) are the choice's rivals. Each is timed in long windows, every one bracketed by long
  windows of the choice; its time relative to the choice is the median of its ratios to the
  mean of its brackets. A rival gets another window while that median is within two
  standard errors of the 5% line, and at least two when it beats the choice by more than 5%.
- Confirmation: the lowest of several noisy medians is biased low (the winner's curse), so
  the rival that looks fastest, when selection makes the choice a miss, is timed in fresh
  bracketed windows, and their median ratio alone is the verdict.

One row per candidate in ``results/split_sweep/sweep.csv`` (every window and ratio is in
it); ``experiments.report`` makes the report and plots from it. The last line printed is
the verdict: the share of cases whose choice is the best or within 5% of it, and the
distribution of the choice's regret (how much slower it trains than the best).

Sizing: inputs of 112 px (VGGs at 64: their 40-odd candidates take a second a batch each
at 112), batch 4, runs of 320 training samples.

    sudo .venv/bin/python -m experiments.split_sweep [--quick] [--models resnet18,alexnet]
        [--bandwidths 5,25,100] [--batch-sizes 4,8]
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from compute_side.client import StorageClient
from compute_side.loader import Batch
from compute_side.sources import Sources
from compute_side.trainer import HeadTrainer, TrainConfig
from experiments import twohosts
from experiments.twohosts import StorageHost
from experiments.windows import window_ms
from hapi.models import build_model
from hapi.planner import ALL_IN_COMPUTE, deal
from hapi.train import DEFAULT_DEPTH
from hapi.transforms import TransformSpec
from hapi.wire import ExtractRequest, wire_dtype

RESULTS = Path(__file__).parent / "results" / "split_sweep"
PAPER_MODELS = ("alexnet", "resnet18", "resnet50", "vgg11", "vgg19", "densenet121", "vit_b_16")
FIELDS = ("bandwidth_mbit", "model", "image_size", "batch_size", "candidate", "split", "stage", "bytes_per_sample",
          "predicted_ms", "measured_ms", "timed_iterations", "long_windows_ms", "vs_choice", "ratios_to_choice",
          "confirm_ratios", "stopped_early", "chosen", "bottleneck", "run_measured", "run_s", "run_switches")
# A candidate slower than this many times the best so far is stopped, or not started when
# its bytes alone would take that long on the link; a lower bound is kept either way.
GIVE_UP_FACTOR = 1.4
# Candidates screened within this factor of the best, at most RIVALS of them (the fastest), are
# rivals of the choice, compared with it in long windows. Where a model has many splits of one
# pace (a convolution's split and its ReLU's), more rivals add no information, only more draws
# for the winner's curse and minutes of windows.
RETIME_WITHIN = 1.2
RIVALS = 4
# A window of a mix holds its shares of the batches within a point: its pace within about a
# percent of the mix's, well inside the 5% the verdict draws.
SHARE_TOLERANCE = 0.01
# The choice is "within 5% of the best" when no rival trained faster than 1 / WITHIN of its time.
WITHIN = 1.05
# A rival gets another bracketed window while its median ratio is within two standard errors
# of that line (at most --max-rounds); the spread of a bracketed ratio is taken as at least
# this (log units; 4 s windows read about 0.03), so one lucky window cannot end it.
WINDOW_NOISE = 0.04
# Input sizes: 112 px, and 64 for the VGGs, whose convolutions take about a second a batch
# on one core at 112 px, for each of their 40-odd candidates.
IMAGE_SIZE = 112
IMAGE_SIZES = {"vgg16": 64, "vgg19": 64}
# hapi.train's defaults: samples per request to the storage node.
REQUEST_SIZE = 32
VAL_PER_CLASS = 2  # the run validates, as a user's does; a few samples keep it short


# A plan: each of its candidates (split, wire dtype) with its share of the batches.
PlanKey = tuple[tuple[tuple[int, str], float], ...]


def single(split: int, dtype: str) -> PlanKey:
    return (((split, dtype), 1.0),)


def timed_for(key: PlanKey, at_least: int) -> int:
    """Timed iterations of a window of ``key``: ``at_least`` for one candidate; for a mix,
    the fewest from ``at_least`` (to twice that) whose batches, dealt by the mix's shares,
    hold those shares within ``SHARE_TOLERANCE`` (else the nearest). A window holds whole
    batches, so a mix's pace in one is the pace at the shares it holds: a ten-batch window
    of a 58/42 mix holds 6 and 4, and reads a mix bound by its larger part 3% slow."""
    shares = [share for _, share in key]
    if len(shares) == 1:
        return at_least

    def off(n: int) -> float:
        dealt = [0.0] * len(shares)
        for _ in range(n):
            deal(shares, dealt, 1)
        return max(abs(d / n - share) for d, share in zip(dealt, shares))
    return min(range(at_least, 2 * at_least + 1), key=lambda n: (max(off(n), SHARE_TOLERANCE), n))


class Mixed:
    """Deals the batches between sources by their shares, as the planner does, its tally
    restarted at the window's first timed batch (``restart_at``), so that the timed batches
    hold the shares as ``timed_for`` counted them, whatever the warm-up left over."""

    settled = True

    def __init__(self, sources: list, shares: list[float], restart_at: int) -> None:
        self.sources, self.shares, self.restart_at = sources, shares, restart_at
        self.dealt, self.picked = [0.0] * len(sources), 0

    def pick(self, samples: int):
        if self.picked == self.restart_at:
            self.dealt = [0.0] * len(self.sources)
        self.picked += 1
        return self.sources[deal(self.shares, self.dealt, samples)]

    def arrived(self, part, samples: int) -> None:
        pass

    def cached(self, samples: int) -> None:
        pass

    def scout(self, samples: int) -> None:
        return None


@dataclass(frozen=True)
class AutoRun:
    """What a ``hapi.train --split auto`` run settled on, and how its planner priced the candidates."""

    settled: PlanKey  # the plan it settled on: (split, dtype) and share of each of its candidates
    settled_label: str  # as the planner writes it (its --explain and switch lines)
    seconds: float  # the whole command's wall time
    switches: int  # switch records in its metrics.jsonl (explorations included)
    predicted: dict[str, dict]  # candidate label -> its --explain line, parsed


def run_auto(storage: StorageHost, name: str, image_size: int, batch_size: int, depth: int, work: Path,
             runs: Path) -> AutoRun:
    """One ``--split auto`` run of an epoch of the data set's training samples, as a user
    runs it, its output (metrics.jsonl) under ``runs``."""
    out = runs / f"{name}-{image_size}-b{batch_size}-{time.monotonic_ns()}"
    command = [sys.executable, "-m", "hapi.train", "--model", name, "--image-size", str(image_size),
               "--batch-size", str(batch_size), "--depth", str(depth), "--epochs", "1", "--split", "auto",
               "--explain", "--store", storage.store.url, "--endpoint-url", storage.swift.endpoint_url,
               "--storage-node", storage.node, "--output-dir", str(out), "--cache-dir", str(work / "cache")]
    started = time.perf_counter()
    # This process is pinned to the compute host's core; the run inherits it, with one torch thread.
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    seconds = time.perf_counter() - started
    if done.returncode:
        raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    logging.info("%s b%d: hapi.train --split auto, %.1f s:\n%s", name, batch_size, seconds, done.stdout)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    trained = next(r["train"]["samples"] for r in records if "train" in r)
    # The choice is what the run trained on: a move made while validation was read is not one.
    moves = [r["switch"] for r in records if "switch" in r and not r["switch"]["why"].startswith("exploring")
             and r["switch"]["at_sample"] < trained]
    if moves:
        settled = tuple(((c["split"], c["dtype"]), round(share, 2))
                        for c, share in zip(moves[-1]["parts"], moves[-1]["shares"]))
    else:
        first = next(r for r in records if "step" in r)
        settled = single(int(first["split"]), first["dtype"])
    label = moves[-1]["plan"] if moves else label_of(settled)
    return AutoRun(settled, label, seconds, sum("switch" in r for r in records), parse_explain(done.stdout))


def parse_explain(text: str) -> dict[str, dict]:
    """The planner's ``--explain`` table: per candidate label, its bytes, modelled pace (ms
    per sample), the run's own reading of it (None: not measured) and its bottleneck."""
    table = {}
    for line in text.splitlines():
        if line.startswith("plan: "):  # the plan the run ended with, which may share batches
            label, _, rest = line[len("plan: "):].partition(", model ")
            # A plan of one candidate keeps that candidate's line, which says more.
            table.setdefault(label, {"pace_ms": float(rest.split()[0]), "measured_ms": None, "bottleneck": ""})
            continue
        tokens = line.split()
        if tokens[:1] == ["all-in-compute"]:
            label, rest = tokens[0], tokens[1:]
        elif tokens[:1] == ["split"] and len(tokens) > 3 and tokens[1].isdigit():
            label, rest = " ".join(tokens[:3]), tokens[3:]
        else:
            continue
        try:
            _stage, kb, _storage, _network, _compute, pace, reading, bottleneck = rest[:8]
            table[label] = {"bytes_per_sample": float(kb) * 1e3, "pace_ms": float(pace),
                            "measured_ms": None if reading == "-" else float(reading), "bottleneck": bottleneck}
        except ValueError:
            continue  # not a line of the table
    return table


def label_of(plan: PlanKey) -> str:
    """A plan's label, as the planner writes it."""
    def one(split: int, dtype: str) -> str:
        return "all-in-compute" if split == ALL_IN_COMPUTE else f"split {split} {dtype}"
    if len(plan) == 1:
        return one(*plan[0][0])
    return " + ".join(f"{share:.0%} {one(*key)}" for key, share in plan)


def sweep_case(name: str, batch_size: int, storage: StorageHost, samples: list, args: argparse.Namespace,
               bandwidth: float, work: Path) -> list[dict]:
    image_size = args.image_size or IMAGE_SIZES.get(name, IMAGE_SIZE)
    runs = args.keep_runs / f"{bandwidth:g}mbit" if args.keep_runs else work
    auto = run_auto(storage, name, image_size, batch_size, args.depth, work, runs)
    model = build_model(name, input_size=image_size)
    model.replace_head(10)
    trainer = HeadTrainer(model, TrainConfig())
    transform = TransformSpec(crop_size=image_size, resize_size=round(image_size * 256 / 224))
    template = ExtractRequest(keys=(), model=name, split=0, transform=transform, job_id="sweep")
    sources = Sources([StorageClient(storage.node)], storage.store, template, transform)
    keys = [single(ALL_IN_COMPUTE, "float32")] + [single(s, wire_dtype(s, "float32"))
                                                  for s in range(model.spec.freeze_index + 1)]
    if auto.settled not in keys:
        keys.append(auto.settled)
    chosen = auto.settled

    def step(batch: Batch) -> None:
        trainer.train_step(batch.features, batch.labels, batch.split)

    def measure(key: PlanKey, timed: int, give_up_ms: float = float("inf")) -> tuple[float, bool]:
        parts = [sources.build(*candidate)[0] for candidate, _ in key]
        if len(parts) == 1:
            source, warmup = parts[0], args.warmup
        else:
            # A mix's batches cost the node unevenly (a deep split's against an image's
            # decode), so its pipeline is full only once the node has got ahead of the
            # stream, which takes many batches where the node is nearly as busy as this tier:
            # its clock starts after as many batches as it times.
            warmup = max(args.warmup, timed)
            source = Mixed(parts, [share for _, share in key], warmup)
        return window_ms(source, step, samples, batch_size, REQUEST_SIZE, args.depth, warmup, timed, give_up_ms)

    def predicted(key: PlanKey) -> dict:
        return auto.predicted.get(auto.settled_label if key == chosen else label_of(key), {})

    rows: dict[PlanKey, dict] = {}
    best_ms = float("inf")  # per iteration
    # Screening: a short window for every candidate, most promising first, so that a slow
    # one can be given up on early; never the choice, whose verdict rests on long windows.
    for key in sorted(keys, key=lambda k: predicted(k).get("pace_ms", math.inf)):
        split = max(key, key=lambda part: part[1])[0][0]  # a mix's: its larger part's
        p = predicted(key)
        # The link alone takes bytes / bandwidth: a physical lower bound, not the cost model.
        link_bound_ms = p.get("bytes_per_sample", 0.0) * batch_size / (bandwidth * 1e6 / 8) * 1e3
        give_up_ms = float("inf") if key == chosen else GIVE_UP_FACTOR * best_ms
        timed = timed_for(key, args.iterations)
        if link_bound_ms > give_up_ms:
            measured, stopped = link_bound_ms, True
        else:
            measured, stopped = measure(key, timed, give_up_ms)
        if not stopped:
            best_ms = min(best_ms, measured)
        rows[key] = {"bandwidth_mbit": bandwidth, "model": name, "image_size": image_size, "batch_size": batch_size,
                     "candidate": label_of(key), "split": split,
                     "stage": "-" if split <= 0 else model.stage_names[split - 1],
                     "bytes_per_sample": round(p.get("bytes_per_sample", 0.0)),
                     "predicted_ms": round(p["pace_ms"] * batch_size, 1) if p else "",
                     "measured_ms": round(measured, 1), "timed_iterations": 0 if stopped else timed,
                     "long_windows_ms": "", "vs_choice": "", "ratios_to_choice": "", "confirm_ratios": "",
                     "stopped_early": stopped, "chosen": key == chosen, "bottleneck": p.get("bottleneck", ""),
                     "run_measured": p.get("measured_ms") is not None, "run_s": round(auto.seconds, 1),
                     "run_switches": auto.switches}
        logging.info("%s %g Mbit/s b%d %-20s predicted %7s measured %s%7.1f ms/iter", name, bandwidth, batch_size,
                     label_of(key), rows[key]["predicted_ms"], ">" if stopped else " ", measured)
    compare(rows, chosen, measure, args)
    return list(rows.values())


def compare(rows: dict[PlanKey, dict], chosen: PlanKey, measure, args: argparse.Namespace) -> None:
    """Selection and confirmation (see the module's docstring): the choice against its
    rivals in long windows, each bracketed by long windows of the choice. Fills in the rows'
    long windows and ratios."""
    mine = rows[chosen]
    best_ms = min(row["measured_ms"] for row in rows.values() if row["timed_iterations"])
    rivals = sorted((key for key, row in rows.items() if row["timed_iterations"] and key != chosen
                     and row["measured_ms"] <= RETIME_WITHIN * best_ms),
                    key=lambda k: rows[k]["measured_ms"])[:RIVALS]
    # A long window lasts at least args.window_s.
    iterations = {key: timed_for(key, max(args.long_iterations,
                                          math.ceil(args.window_s * 1e3 / rows[key]["measured_ms"])))
                  for key in (*rivals, chosen)}

    def long_window(key: PlanKey) -> float:
        """One more long window; the candidate's time is the median of its long windows."""
        row = rows[key]
        ms = measure(key, iterations[key])[0]
        times = [float(w) for w in row["long_windows_ms"].split()] + [ms]
        row.update(measured_ms=round(statistics.median(times), 1), timed_iterations=iterations[key],
                   long_windows_ms=" ".join(f"{t:.1f}" for t in times))
        return ms

    def bracketed(key: PlanKey, before: float) -> tuple[float, float]:
        """(a rival's long window over the mean of the choice's before and after it; after)."""
        theirs = long_window(key)
        after = long_window(chosen)
        logging.info("%s %s ms/iter between the choice's %.1f and %.1f", rows[key]["candidate"], f"{theirs:.1f}",
                     before, after)
        return theirs / ((before + after) / 2), after

    before = long_window(chosen)
    while live := [key for key in rivals if in_play(ratios_of(rows[key]), args.max_rounds)]:
        for key in live:
            ratio, before = bracketed(key, before)
            ratios = [*ratios_of(rows[key]), ratio]
            rows[key].update(vs_choice=round(statistics.median(ratios), 3),
                             ratios_to_choice=" ".join(f"{r:.3f}" for r in ratios))
    leader = min(rivals, key=lambda k: rows[k]["vs_choice"], default=None)
    if leader is not None and rows[leader]["vs_choice"] < 1 / WITHIN:
        confirm = []
        for _ in range(args.confirm):
            ratio, before = bracketed(leader, before)
            confirm.append(ratio)
        rows[leader]["confirm_ratios"] = " ".join(f"{r:.3f}" for r in confirm)
        logging.info("%s confirmed at %s of the choice (%s)", rows[leader]["candidate"],
                     rows[leader]["confirm_ratios"], mine["candidate"])


def ratios_of(row: dict, column: str = "ratios_to_choice") -> list[float]:
    """A rival's times relative to the choice's, one per bracketed long window (of the
    selection, or with ``column="confirm_ratios"`` of the confirmation)."""
    return [float(r) for r in str(row[column]).split()]


def in_play(ratios: list[float], max_rounds: int) -> bool:
    """Whether a rival needs another bracketed window: its median ratio is within two
    standard errors of the line where it would make the choice a miss, or it would make it
    one on a single window (a rival that wins once may have been lucky once)."""
    n = len(ratios)
    if n == 0:
        return True
    if n >= max_rounds:
        return False
    logs = [math.log(r) for r in ratios]
    spread = max(statistics.stdev(logs) if n > 1 else 0.0, WINDOW_NOISE)
    distance = statistics.median(logs) + math.log(WITHIN)  # below zero: the rival makes the choice a miss
    return abs(distance) < 2 * 1.25 * spread / math.sqrt(n) or (distance < 0 and n < 2)


@dataclass(frozen=True)
class Verdict:
    """The choice against the best candidate of its case."""

    chosen: dict
    best: dict
    regret: float  # how much slower the choice trained than the best (0: it is the best), confirmed
    selection_regret: float  # the same by the selection windows alone: biased up by the winner's curse

    @property
    def within(self) -> bool:
        return self.regret <= WITHIN - 1

    @property
    def within_by_selection(self) -> bool:
        return self.selection_regret <= WITHIN - 1


def verdict(case: list[dict]) -> Verdict:
    """The verdict on a case's rows (as written or as read back from the CSV): the confirmed
    rival's median ratio to the choice when one was confirmed, else the selection's."""
    chosen = next(r for r in case if str(r["chosen"]) == "True")
    timed = [r for r in case if ratios_of(r)]
    leader = min(timed, key=lambda r: float(r["vs_choice"]), default=chosen)
    selection = float(leader["vs_choice"]) if timed else 1.0
    confirmed = ratios_of(leader, "confirm_ratios")
    ratio = statistics.median(confirmed) if confirmed else selection
    return Verdict(chosen, leader if ratio < 1 else chosen, max(0.0, 1 / ratio - 1), max(0.0, 1 / selection - 1))


def error_spread(errors: list[float]) -> str:
    """The cost model's errors per candidate, in words."""
    if not errors:
        return "unknown (no candidate was both predicted and timed to the end)"
    errors = sorted(errors)
    return f"median {errors[len(errors) // 2]:.0%}, 90th percentile {errors[int(len(errors) * 0.9)]:.0%}"


def regret_spread(regret: list[float]) -> str:
    """The choice's regret over the cases, in words: mean, median, worst."""
    return (f"regret mean {statistics.mean(regret):.1%}, median {statistics.median(regret):.1%}, "
            f"worst {max(regret):.1%}")


def summarise(rows: list[dict]) -> str:
    cases: dict[tuple, list[dict]] = {}
    for r in rows:
        cases.setdefault((float(r["bandwidth_mbit"]), r["model"], int(r["batch_size"])), []).append(r)
    verdicts, lines = [], []
    errors = [abs(float(r["predicted_ms"]) - float(r["measured_ms"])) / float(r["measured_ms"]) for r in rows
              if str(r["stopped_early"]) != "True" and r["predicted_ms"] != ""]
    for (bw, model, batch), case in sorted(cases.items()):
        v = verdict(case)
        verdicts.append(v)
        baseline = next(r for r in case if int(r["split"]) == ALL_IN_COMPUTE)
        lines.append(f"{model:18s} {bw:6g} Mbit/s b{batch:<3d} chosen {v.chosen['candidate']:16s} "
                     f"{float(v.chosen['measured_ms']):8.1f} ms  "
                     f"best {v.best['candidate']:16s} (choice +{v.regret:.1%})  {'ok' if v.within else 'MISS':4s}  "
                     f"speed-up vs all-in-compute "
                     f"{float(baseline['measured_ms']) / float(v.chosen['measured_ms']):.2f}x")
    good = sum(v.within for v in verdicts)
    selection_good = sum(v.within_by_selection for v in verdicts)
    lines.append(f"choice best or within 5% of best: {good}/{len(cases)} = {good / len(cases):.1%} "
                 f"({selection_good}/{len(cases)} by the selection windows alone); "
                 f"{regret_spread([v.regret for v in verdicts])}; "
                 f"the calibrated cost model's prediction error {error_spread(errors)}")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(PAPER_MODELS))
    p.add_argument("--bandwidths", default="5,25,100", help="Mbit/s of the shaped link")
    p.add_argument("--batch-sizes", default="4", help="the optimiser's batch, of the run and of every window")
    p.add_argument("--image-size", type=int, help=f"px, of every model (default: {IMAGE_SIZE}, {IMAGE_SIZES})")
    p.add_argument("--run-samples", type=int, default=320, help="training samples of the --split auto run")
    p.add_argument("--iterations", type=int, default=4, help="timed steady-state iterations per candidate")
    p.add_argument("--long-iterations", type=int, default=6,
                   help="timed iterations at least of a long window (the choice's and its rivals')")
    p.add_argument("--window-s", type=float, default=3.5, help="seconds at least of a long window")
    p.add_argument("--max-rounds", type=int, default=2, help="bracketed long windows at most per rival (selection)")
    p.add_argument("--confirm", type=int, default=4,
                   help="fresh bracketed long windows of the rival that looks fastest, which decide the verdict")
    p.add_argument("--depth", type=int, default=DEFAULT_DEPTH, help="requests in flight, as in hapi.train")
    p.add_argument("--warmup", type=int, help="iterations before the clock starts (default: the depth)")
    p.add_argument("--quick", action="store_true",
                   help="resnet18 and alexnet at 10 and 50 Mbit/s, 64 px, runs of 120 samples, short windows")
    p.add_argument("--daemon-args", default="", help="extra options of the storage daemon, e.g. '--max-running 1'")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--keep-runs", type=Path, help="keep each --split auto run's output (metrics.jsonl) here")
    args = p.parse_args()
    if args.quick:  # explicit options still win
        defaults = p.parse_args([])
        args.models = args.models if args.models != defaults.models else "resnet18,alexnet"
        args.bandwidths = args.bandwidths if args.bandwidths != defaults.bandwidths else "10,50"
        args.iterations = args.iterations if args.iterations != defaults.iterations else 3
        args.long_iterations = args.long_iterations if args.long_iterations != defaults.long_iterations else 4
        args.run_samples = args.run_samples if args.run_samples != defaults.run_samples else 120
        args.window_s, args.max_rounds, args.confirm = 1.0, 2, 2
        args.image_size = args.image_size or 64
    args.warmup = args.depth if args.warmup is None else args.warmup
    if not twohosts.start_cli():
        return 2
    torch.set_num_threads(1)  # one core per host
    rows: list[dict] = []
    args.out.mkdir(parents=True, exist_ok=True)
    # Written case by case, so a run cut short keeps what it measured.
    with open(args.out / "sweep.csv", "w", newline="") as f, tempfile.TemporaryDirectory() as tmp, \
            twohosts.TwoHosts() as hosts:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        storage = hosts.start_storage_host(Path(tmp), "sweep", train_per_class=-(-args.run_samples // 10),
                                           val_per_class=VAL_PER_CLASS,
                                           daemon_args=("--torch-threads", "1", *args.daemon_args.split()))
        samples = list(storage.manifest.split("train"))
        for bandwidth in [float(b) for b in args.bandwidths.split(",")]:
            hosts.shape(bandwidth)
            for name in args.models.split(","):
                for batch_size in [int(b) for b in args.batch_sizes.split(",")]:
                    case = sweep_case(name, batch_size, storage, samples, args, bandwidth, Path(tmp))
                    writer.writerows(case)
                    f.flush()
                    rows += case
    print(summarise(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
