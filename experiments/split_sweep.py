"""Exhaustive split sweep on two emulated hosts: every candidate timed, against the planner.

For each shaped bandwidth and model: profile both tiers, let the planner choose (it tries
its close contenders in short training runs first, as for a long ``hapi.train`` run), then
train a few steady-state iterations at every candidate (all-in-compute and every split up
to the freeze index) and record the measured time per iteration. Reports the share of
cases where the planner's choice is the best or within 5% of it, its prediction error per
candidate (the cost model's, over the candidates it did not try), and the speed-up of the
choice over all-in-compute. One row per candidate in
``results/split_sweep/sweep.csv``; the report and plots are made from it.

Each candidate is trained as ``hapi.train`` trains: the pipelined loader with its default
depth of requests in flight. The clock starts once the pipeline is full (a warm-up of as
many iterations as the depth) and stops while it still is; a window that drains the
pipeline would be flattered by work fetched before the clock started.

Sizing (a CPU is ~60x slower than the paper's GPUs): inputs of 112 px (ViT's patches stay
16 px), VGG-19 at 64 (at 112 px its 40-odd candidates took 15 min a case), batch 4, 4 warm-up
+ 4 timed iterations per candidate (+ 4 in flight when the clock stops), bandwidths 5-100
Mbit/s. The planner's trials (3 s each) and the long windows (3.5 s) are timed by the clock;
a smaller batch shortens everything counted in iterations: the screening windows and every
pipeline's fill and drain (at batch 8, nine cases timed put the sweep at 90-110 min).
Smaller inputs for every model do not shorten it: at 64 px more candidates tie, so more are
tried and compared (the first four cases took 21 min at 64 px, 20 min the first five at 96).
A candidate 1.4x slower than the best so far is stopped there (never the choice: its
verdict rests on long windows, not on a short screening one). So sized, the 21 cases
took 42 min here (sweep X).

The verdict. The machine's speed drifts by tens of percent within a minute, more than the 5%
at stake, so absolute times taken a minute apart cannot decide it. The candidates screened
within 20% of the best (the 4 fastest at most) are the choice's rivals: each is timed in long
windows (6 iterations and 3.5 s at least), every one bracketed by long windows of the choice,
and its time relative to the choice is the median of its ratios to the mean of its brackets. Selection: a rival
gets another window while that median is within two standard errors of the 5% line, and at
least two when it beats the choice by more than 5% (a winner may have been lucky once), up
to 2. Confirmation: the lowest of several noisy medians is biased low (the winner's curse),
so the rival that looks fastest, when selection makes the choice a miss, is timed in 4 fresh
bracketed windows, and their median ratio alone is the verdict (a choice selection finds
within 5% stands: the bias runs against it). Every window and ratio is in the CSV.

    sudo python -m experiments.split_sweep [--quick] [--models ...] [--bandwidths 5,25,100]
"""

from __future__ import annotations

import argparse
import csv
import logging
import math
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from compute_side.client import StorageClient
from compute_side.loader import Batch, Source
from compute_side.profiling import measure_profile, time_contenders, trial_paces_ms, window_ms
from compute_side.trainer import HeadTrainer, TrainConfig
from experiments import twohosts
from hapi.models import build_model
from hapi.planner import ALL_IN_COMPUTE, TRIAL_SECONDS, Candidate, candidates, choose, explain
from hapi.profile import Profile
from hapi.store import S3Store
from hapi.train import DEFAULT_DEPTH, Sources
from hapi.transforms import TransformSpec
from hapi.wire import ExtractRequest

RESULTS = Path(__file__).parent / "results" / "split_sweep"
PAPER_MODELS = ("alexnet", "resnet18", "resnet50", "vgg11", "vgg19", "densenet121", "vit_b_16")
FIELDS = ("bandwidth_mbit", "model", "image_size", "batch_size", "candidate", "split", "stage", "bytes_per_sample",
          "predicted_ms", "measured_ms", "timed_iterations", "long_windows_ms", "vs_choice", "ratios_to_choice",
          "confirm_ratios", "stopped_early", "chosen", "bottleneck", "tried")
# A candidate slower than this many times the best so far is stopped, or not started when
# its bytes alone would take that long on the link; a lower bound is kept either way.
GIVE_UP_FACTOR = 1.4
# Candidates screened within this factor of the best, at most RIVALS of them (the fastest), are
# rivals of the choice, compared with it in long windows. Where a model has many splits of one
# pace (vgg19's convolutions and their ReLUs), more rivals add no information, only more draws
# for the winner's curse and minutes of windows.
RETIME_WITHIN = 1.2
RIVALS = 4
# The choice is "within 5% of the best" when no rival trained faster than 1 / WITHIN of its time.
WITHIN = 1.05
# A rival gets another bracketed window while its median ratio is within two standard errors
# of that line (at most --max-rounds); the spread of a bracketed ratio is taken as at least
# this (log units; measured on alexnet's 4 s windows: 0.03), so one lucky window cannot end it.
WINDOW_NOISE = 0.04
# Input sizes: 112 px, and 64 for VGG-19, whose 40-odd candidates at 112 px took 15 min a case
# (a batch's convolutions take about a second on one core, and each of its candidates is timed).
IMAGE_SIZE = 112
IMAGE_SIZES = {"vgg19": 64}
# The planner is asked about a long epoch, where fill and drain vanish: the sweep times the
# steady state.
STEADY_STATE_SAMPLES = 100_000


def sweep_model(name: str, client: StorageClient, store: S3Store, samples: list, args: argparse.Namespace,
                bandwidth: float, profiles_dir: Path) -> list[dict]:
    image_size = args.image_size or IMAGE_SIZES.get(name, IMAGE_SIZE)
    model = build_model(name, input_size=image_size)
    model.replace_head(10)
    trainer = HeadTrainer(model, TrainConfig())
    transform = TransformSpec(crop_size=image_size, resize_size=round(image_size * 256 / 224))
    template = ExtractRequest(keys=(), model=name, split=0, transform=transform, job_id="sweep")
    profile = measure_profile(model, client, store, template, samples, args.batch_size, profiles_dir, args.depth)

    def options_for(p: Profile) -> list[Candidate]:
        return candidates(p, args.batch_size, STEADY_STATE_SAMPLES)

    def source_for(c: Candidate) -> Source:
        return Sources([client], store, template, transform).build(c.split, c.dtype)[0]

    def step(batch: Batch) -> None:
        trainer.train_step(batch.features, batch.labels, batch.split)

    def try_candidate(c: Candidate, readings: int) -> list[float]:
        return trial_paces_ms(source_for(c), step, samples, args.batch_size, args.batch_size, args.depth, c.steady_ms,
                              args.trial_s, readings)

    profile = time_contenders(profile, options_for, try_candidate)
    options = options_for(profile)
    chosen = choose(options)
    logging.info("%s %s Mbit/s: node anchor %s, compute-tier reads %.2f ms/sample (%.2f of client CPU)\n%s", name,
                 bandwidth, profile.node_anchor, profile.compute.fetch_ms, profile.compute.fetch_cpu_ms,
                 explain(profile, options, chosen))

    def measure(c: Candidate, timed: int, give_up_ms: float = float("inf")) -> tuple[float, bool]:
        return window_ms(source_for(c), step, samples, args.batch_size, args.batch_size, args.depth, args.warmup,
                         timed, give_up_ms)

    rows = []
    best_ms = float("inf")  # per iteration
    # Screening: a short window for every candidate, most promising first, so that a slow
    # one can be given up on early; never the choice, whose verdict rests on long windows.
    order = sorted(options, key=lambda c: c.epoch_s)
    for c in order:
        # The link alone takes bytes / bandwidth: a physical lower bound, not the cost model.
        link_bound_ms = c.bytes_per_sample * args.batch_size / profile.bandwidth * 1e3
        give_up_ms = float("inf") if c == chosen else GIVE_UP_FACTOR * best_ms
        if link_bound_ms > give_up_ms:
            measured, stopped = link_bound_ms, True
        else:
            measured, stopped = measure(c, args.iterations, give_up_ms)
        if not stopped:
            best_ms = min(best_ms, measured)
        stage = "-" if c.split <= 0 else model.stage_names[c.split - 1]
        rows.append({"bandwidth_mbit": bandwidth, "model": name, "image_size": image_size,
                     "batch_size": args.batch_size, "candidate": c.label, "split": c.split, "stage": stage,
                     "bytes_per_sample": round(c.bytes_per_sample),
                     "predicted_ms": round(c.epoch_s * 1e3 / STEADY_STATE_SAMPLES * args.batch_size, 1),
                     "measured_ms": round(measured, 1), "timed_iterations": 0 if stopped else args.iterations,
                     "long_windows_ms": "", "vs_choice": "", "ratios_to_choice": "", "confirm_ratios": "",
                     "stopped_early": stopped,
                     "chosen": c == chosen, "bottleneck": c.bottleneck, "tried": c.trial_ms is not None})
        logging.info("%s %s Mbit/s %-20s predicted %7.1f measured %s%7.1f ms/iter", name, bandwidth, c.label,
                     rows[-1]["predicted_ms"], ">" if stopped else " ", measured)

    # The comparison: the machine's speed drifts by tens of percent within a minute, far more
    # than the 5% at stake, so the choice is compared with each rival in long windows
    # bracketed by windows of the choice, and a rival's time is the median ratio to the mean
    # of its two brackets (a drift of the machine falls on both sides of a ratio).
    by_label = {c.label: (row, c) for row, c in zip(rows, order)}
    mine = by_label[chosen.label]
    best_ms = min(row["measured_ms"] for row in rows if row["timed_iterations"])
    rivals = sorted(((row, c) for row, c in zip(rows, order) if row["timed_iterations"] and c != chosen
                     and row["measured_ms"] <= RETIME_WITHIN * best_ms), key=lambda rc: rc[0]["measured_ms"])[:RIVALS]
    iterations = {row["candidate"]: max(args.long_iterations, math.ceil(args.window_s * 1e3 / row["measured_ms"]))
                  for row, _ in (*rivals, mine)}  # a long window lasts at least args.window_s

    def long_window(row: dict, c: Candidate) -> float:
        """One more long window; the candidate's time is the median of its long windows."""
        ms = measure(c, iterations[row["candidate"]])[0]
        times = [float(w) for w in row["long_windows_ms"].split()] + [ms]
        row.update(measured_ms=round(statistics.median(times), 1), timed_iterations=iterations[row["candidate"]],
                   long_windows_ms=" ".join(f"{t:.1f}" for t in times))
        return ms

    def bracketed(row: dict, c: Candidate, before: float) -> tuple[float, float]:
        """(a rival's long window over the mean of the choice's before and after it; after)."""
        theirs = long_window(row, c)
        after = long_window(*mine)
        logging.info("%s %s Mbit/s %-20s %.1f ms/iter between the choice's %.1f and %.1f", name, bandwidth,
                     row["candidate"], theirs, before, after)
        return theirs / ((before + after) / 2), after

    before = long_window(*mine)
    # Selection: rivals clearly slower (or faster) than the 5% line drop out early.
    while live := [(row, c) for row, c in rivals if in_play(ratios_of(row), args.max_rounds)]:
        for row, c in live:
            ratio, before = bracketed(row, c, before)
            ratios = [*ratios_of(row), ratio]
            row.update(vs_choice=round(statistics.median(ratios), 3),
                       ratios_to_choice=" ".join(f"{r:.3f}" for r in ratios))
    # Confirmation: the lowest of several noisy medians is biased low (the winner's curse), so
    # the rival that makes the choice look a miss is timed again in fresh windows, and only
    # these decide the verdict. A choice that selection finds within 5% needs none: the bias
    # runs against it.
    leader = min(rivals, key=lambda rc: rc[0]["vs_choice"], default=None)
    if leader and leader[0]["vs_choice"] < 1 / WITHIN:
        confirm = []
        for _ in range(args.confirm):
            ratio, before = bracketed(*leader, before)
            confirm.append(ratio)
        leader[0]["confirm_ratios"] = " ".join(f"{r:.3f}" for r in confirm)
        logging.info("%s %s Mbit/s %s confirmed at %s of the choice", name, bandwidth, leader[0]["candidate"],
                     leader[0]["confirm_ratios"])
    return rows


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
    """The cost model's errors (untried candidates) in words."""
    if not errors:
        return "unknown (every candidate timed to the end was tried)"
    errors = sorted(errors)
    return f"median {errors[len(errors) // 2]:.0%}, 90th percentile {errors[int(len(errors) * 0.9)]:.0%}"


def summarise(rows: list[dict]) -> str:
    cases = {}
    for r in rows:
        cases.setdefault((r["bandwidth_mbit"], r["model"]), []).append(r)
    verdicts, lines = [], []
    errors = [abs(r["predicted_ms"] - r["measured_ms"]) / r["measured_ms"] for r in rows
              if not r["stopped_early"] and not r["tried"]]  # a tried candidate's prediction is its trial
    for (bw, model), case in sorted(cases.items()):
        v = verdict(case)
        verdicts.append(v)
        baseline = next(r for r in case if r["split"] == ALL_IN_COMPUTE)
        lines.append(f"{model:12s} {bw:6g} Mbit/s  chosen {v.chosen['candidate']:16s} "
                     f"{v.chosen['measured_ms']:8.1f} ms  "
                     f"best {v.best['candidate']:16s} (choice +{v.regret:.1%})  {'ok' if v.within else 'MISS':4s}  "
                     f"speed-up vs all-in-compute {baseline['measured_ms'] / v.chosen['measured_ms']:.2f}x")
    good = sum(v.within for v in verdicts)
    selection_good = sum(v.within_by_selection for v in verdicts)
    regret = [v.regret for v in verdicts]
    lines.append(f"choice best or within 5% of best: {good}/{len(cases)} = {good / len(cases):.1%} "
                 f"({selection_good}/{len(cases)} by the selection windows alone); "
                 f"the cost model's prediction error {error_spread(errors)}; the choice "
                 f"{sum(regret) / len(regret):.1%} slower than the best on average, {max(regret):.0%} at worst")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(PAPER_MODELS))
    p.add_argument("--bandwidths", default="5,25,100", help="Mbit/s of the shaped link")
    p.add_argument("--image-size", type=int, help=f"px, of every model (default: {IMAGE_SIZE}, {IMAGE_SIZES})")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--iterations", type=int, default=4, help="timed steady-state iterations per candidate")
    p.add_argument("--long-iterations", type=int, default=6,
                   help="timed iterations at least of a long window (the choice's and its rivals')")
    p.add_argument("--window-s", type=float, default=3.5, help="seconds at least of a long window")
    p.add_argument("--max-rounds", type=int, default=2, help="bracketed long windows at most per rival (selection)")
    p.add_argument("--confirm", type=int, default=4,
                   help="fresh bracketed long windows of the rival that looks fastest, which decide the verdict")
    p.add_argument("--trial-s", type=float, default=TRIAL_SECONDS, help="seconds at least of a planner's trial")
    p.add_argument("--depth", type=int, default=DEFAULT_DEPTH, help="requests in flight, as in hapi.train")
    p.add_argument("--warmup", type=int, help="iterations before the clock starts (default: the depth)")
    p.add_argument("--quick", action="store_true", help="resnet18 and alexnet at 10 and 50 Mbit/s, 64 px")
    p.add_argument("--daemon-args", default="", help="extra options of the storage daemon, e.g. '--max-running 1'")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    if args.quick:  # explicit --models / --bandwidths / --iterations still win
        defaults = p.parse_args([])
        args.models = args.models if args.models != defaults.models else "resnet18,alexnet"
        args.bandwidths = args.bandwidths if args.bandwidths != defaults.bandwidths else "10,50"
        args.iterations = args.iterations if args.iterations != defaults.iterations else 3
        args.long_iterations = args.long_iterations if args.long_iterations != defaults.long_iterations else 4
        args.window_s, args.trial_s, args.max_rounds, args.confirm = 1.0, 0.5, 2, 2
        args.image_size = 64
    args.warmup = args.depth if args.warmup is None else args.warmup
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("urllib3").setLevel(logging.ERROR)
    reason = twohosts.available()
    if reason:
        print(f"cannot emulate two hosts here: {reason}", file=sys.stderr)
        return 2
    torch.set_num_threads(1)  # one core per host
    rows: list[dict] = []
    args.out.mkdir(parents=True, exist_ok=True)
    # Written case by case, so a run cut short keeps what it measured.
    with open(args.out / "sweep.csv", "w", newline="") as f, tempfile.TemporaryDirectory() as tmp, \
            twohosts.TwoHosts() as hosts:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        n = args.batch_size * (args.warmup + max(args.iterations, args.long_iterations) + args.depth)
        storage = hosts.start_storage_host(Path(tmp), "sweep", train_per_class=-(-n // 10),
                                           daemon_args=("--torch-threads", "1", *args.daemon_args.split()))
        samples = list(storage.manifest.split("train")[:n])
        client = StorageClient(storage.node)
        for bandwidth in [float(b) for b in args.bandwidths.split(",")]:
            hosts.shape(bandwidth)
            for name in args.models.split(","):
                case = sweep_model(name, client, storage.store, samples, args, bandwidth, Path(tmp, "profiles"))
                writer.writerows(case)
                f.flush()
                rows += case
    print(summarise(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
