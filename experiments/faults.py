"""Faults during training: what a dead, hung or lost storage node and a killed trainer cost.

ResNet-18 at a small image size on a ``file://`` store with two local daemons (fresh ones
for every row), the same seed and arguments in every row, so each fault is measured
against the undisturbed run of the same invocation:

- time: the training command's wall time (both attempts where it was resumed) over the
  undisturbed run's;
- exactly once: the ledger ``hapi.train.read_ledger`` reads from metrics.jsonl holds every
  training sample exactly once in every epoch;
- head: the trained head against the undisturbed run's, identical or the largest difference.

A fault strikes after ``--fault-after`` steps of the first epoch. ``python -m hapi.train``
runs as a child process, as a user runs it.

    python -m experiments.faults [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from compute_side.daemon_process import LocalDaemon, local_daemon_process
from hapi.datasets import make_synthetic
from hapi.store import FileStore
from hapi.train import read_ledger


@dataclass(frozen=True)
class Setup:
    """One data set and the training arguments every row shares."""

    root: Path  # scratch: the store, daemon logs, runs
    store_url: str
    train_keys: frozenset[str]
    epochs: int
    train_args: tuple[str, ...]
    request_size: int

    @classmethod
    def create(cls, root: Path, per_class: int, image_size: int, batch_size: int, epochs: int) -> Setup:
        manifest = make_synthetic(FileStore(root / "data"), per_class, 1)
        request_size = max(1, batch_size // 2)
        args = ("--model", "resnet18", "--image-size", str(image_size), "--split", "freeze", "--seed", "0",
                "--batch-size", str(batch_size), "--request-size", str(request_size), "--depth", "2",
                "--epochs", str(epochs), "--checkpoint-every", "2", "--cache-dir", str(root / "cache"))
        return cls(root, (root / "data").as_uri(), frozenset(s.key for s in manifest.split("train")), epochs, args,
                   request_size)


@dataclass(frozen=True)
class Outcome:
    fault: str
    seconds: float
    returncode: int
    exactly_once: bool | None  # None: no training outcome to check (the trainer was killed for good)
    head_diff: float | None  # largest absolute difference from the undisturbed head; None: no head
    note: str = ""


@dataclass
class Trainer:
    """One ``python -m hapi.train`` attempt, watched through its metrics.jsonl."""

    process: subprocess.Popen
    run_dir: Path
    started: float

    @classmethod
    def start(cls, setup: Setup, run_dir: Path, nodes: list[str], *extra: str) -> Trainer:
        node_args = [a for url in nodes for a in ("--storage-node", url)]
        store_args = ["--store", setup.store_url] if nodes else []
        command = [sys.executable, "-m", "hapi.train", *setup.train_args, *store_args, *node_args,
                   "--output-dir", str(run_dir), *extra]
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   env={**os.environ, "PYTHONUNBUFFERED": "1"})
        return cls(process, run_dir, time.perf_counter())

    def wait_steps(self, steps: int, timeout_s: float = 120.0) -> None:
        """Until this attempt has logged ``steps`` training steps."""
        deadline = time.monotonic() + timeout_s
        while self.steps_logged() < steps:
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"trainer ended or stalled before step {steps}: {self.process.stderr.read()}")
            time.sleep(0.05)

    def steps_logged(self) -> int:
        path = self.run_dir / "metrics.jsonl"
        if not path.is_file():
            return 0
        lines = [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]
        attempt = max((r["attempt"] for r in lines), default=0)
        return sum(1 for r in lines if r["attempt"] == attempt and "step" in r)

    def finish(self, timeout_s: float = 300.0) -> tuple[int, str, float]:
        """(exit status, stderr, seconds since the start)."""
        _, err = self.process.communicate(timeout=timeout_s)
        return self.process.returncode, err, time.perf_counter() - self.started


@contextmanager
def daemons(setup: Setup, count: int) -> Iterator[list[LocalDaemon]]:
    """``count`` fresh daemons; a stopped one is continued before it is stopped for good."""
    # Each request runs its prefix in one sub-batch, whatever else the node has in flight:
    # the float result of a convolution depends on the batch it runs in (batch 1 differs),
    # and heads of different runs are compared bit for bit.
    pinned = ("--min-sub-batch", str(setup.request_size), "--max-sub-batch", str(setup.request_size))
    with ExitStack() as stack:
        started = [stack.enter_context(local_daemon_process(setup.store_url, setup.root / f"daemon-{i}.log", pinned))
                   for i in range(count)]
        stack.callback(lambda: [_signal(d, signal.SIGCONT) for d in started])
        yield started


def _signal(daemon: LocalDaemon, signum: int) -> None:
    try:
        os.killpg(daemon.pid, signum)
    except ProcessLookupError:
        pass


def trained_head(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "checkpoint.pt", weights_only=True)["trainer"]["trainable"]


def head_diff(run_dir: Path, reference: Path | None) -> float | None:
    if reference is None or not (run_dir / "checkpoint.pt").is_file():
        return None
    ours, theirs = trained_head(run_dir), trained_head(reference)
    return max(((ours[k].float() - theirs[k].float()).abs().max().item() for k in theirs), default=0.0)


def step_records(run_dir: Path) -> list[dict]:
    """Every step line of a run's metrics.jsonl, of all its attempts."""
    lines = (json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines())
    return [r for r in lines if "step" in r]


def exactly_once(setup: Setup, run_dir: Path) -> bool:
    ledger = read_ledger(run_dir / "metrics.jsonl")
    return (sorted(ledger) == list(range(setup.epochs))
            and all(len(keys) == len(setup.train_keys) and set(keys) == setup.train_keys for keys in ledger.values()))


def outcome(setup: Setup, fault: str, run_dir: Path, reference: Path | None, returncode: int, seconds: float,
            note: str = "") -> Outcome:
    return Outcome(fault, seconds, returncode, exactly_once(setup, run_dir), head_diff(run_dir, reference), note)


# --- the faults -----------------------------------------------------------------------


def undisturbed(setup: Setup, run_dir: Path, fault_after: int, reference: Path | None,
                name: str = "none (two nodes)") -> Outcome:
    with daemons(setup, 2) as nodes:
        returncode, _, seconds = Trainer.start(setup, run_dir, [d.url for d in nodes]).finish()
    return outcome(setup, name, run_dir, reference, returncode, seconds)


def node_fault(signum: int, count: int, name: str) -> Callable[[Setup, Path, int, Path | None], Outcome]:
    """Signal the first of ``count`` daemons mid-epoch; it stays so until the run ends."""
    def run(setup: Setup, run_dir: Path, fault_after: int, reference: Path | None) -> Outcome:
        with daemons(setup, count) as nodes:
            trainer = Trainer.start(setup, run_dir, [d.url for d in nodes])
            trainer.wait_steps(fault_after)
            _signal(nodes[0], signum)
            returncode, err, seconds = trainer.finish()
        warnings = err.count("no storage node answers")
        return outcome(setup, name, run_dir, reference, returncode, seconds,
                       f"fallback warned {warnings}x" if count == 1 else "")
    return run


def trainer_fault(signum: int, name: str) -> Callable[[Setup, Path, int, Path | None], Outcome]:
    """Signal the trainer mid-epoch, then ``--resume`` from its last checkpoint."""
    def run(setup: Setup, run_dir: Path, fault_after: int, reference: Path | None) -> Outcome:
        with daemons(setup, 2) as nodes:
            urls = [d.url for d in nodes]
            first = Trainer.start(setup, run_dir, urls)
            first.wait_steps(fault_after)
            first.process.send_signal(signum)
            first_rc, _, first_s = first.finish()
            resumed = Trainer.start(setup, run_dir, urls, "--resume", str(run_dir / "checkpoint.pt"))
            returncode, _, second_s = resumed.finish()
        return outcome(setup, name, run_dir, reference, returncode, first_s + second_s,
                       f"first attempt exited {first_rc}")
    return run


def local_daemon_dies_with_trainer(setup: Setup, run_dir: Path, fault_after: int,
                                   reference: Path | None) -> Outcome:
    """The embedded default: kill -9 the trainer; its daemon must go too."""
    trainer = Trainer.start(setup, run_dir, [], "--train-per-class", "2", "--val-per-class", "1")
    trainer.wait_steps(1)
    children = subprocess.run(["pgrep", "-P", str(trainer.process.pid)], capture_output=True, text=True)
    daemon_pids = [int(p) for p in children.stdout.split()]
    trainer.process.kill()
    trainer.process.wait()
    killed = time.perf_counter()
    while any(_alive(p) for p in daemon_pids) and time.perf_counter() - killed < 30:
        time.sleep(0.05)
    gone_s = time.perf_counter() - killed
    left = [p for p in daemon_pids if _alive(p)]
    note = (f"daemon still running: {left}" if left else f"daemon gone {gone_s:.1f} s after") if daemon_pids \
        else "no daemon found"
    return Outcome("kill -9 of a trainer with its own daemon", gone_s, -signal.SIGKILL, None, None, note)


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting to be reaped does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


FAULTS: dict[str, Callable[[Setup, Path, int, Path | None], Outcome]] = {
    "kill-one": node_fault(signal.SIGKILL, 2, "kill -9 of one of two nodes"),
    "stop-one": node_fault(signal.SIGSTOP, 2, "SIGSTOP of one of two nodes (to the end)"),
    "kill-only": node_fault(signal.SIGKILL, 1, "kill -9 of the only node"),
    "kill-trainer": trainer_fault(signal.SIGKILL, "kill -9 of the trainer, then --resume"),
    "term-trainer": trainer_fault(signal.SIGTERM, "SIGTERM of the trainer, then --resume"),
    "own-daemon": local_daemon_dies_with_trainer,
}


def table(rows: list[Outcome], reference_s: float) -> str:
    lines = [f"{'fault':44s} {'exit':>4s} {'seconds':>8s} {'vs none':>8s} {'each sample once':>16s} "
             f"{'head vs undisturbed':>20s}  note"]
    for r in rows:
        head = "-" if r.head_diff is None else "identical" if r.head_diff == 0 else f"max diff {r.head_diff:.1e}"
        ratio = "-" if r.fault.startswith("kill -9 of a trainer with") else f"{r.seconds / reference_s:.2f}x"
        lines.append(f"{r.fault:44s} {r.returncode:4d} {r.seconds:8.1f} {ratio:>8s} "
                     f"{_yes_no(r.exactly_once):>16s} {head:>20s}  {r.note}")
    return "\n".join(lines)


def _yes_no(value: bool | None) -> str:
    return "-" if value is None else "yes" if value else "NO"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--per-class", type=int, default=24, help="training samples per class (10 classes)")
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--fault-after", type=int, default=4, help="steps of the first epoch before the fault")
    p.add_argument("--faults", default=",".join(FAULTS), help=f"some of {','.join(FAULTS)}")
    p.add_argument("--quick", action="store_true", help="8 samples per class, batch 8, fault after 3 steps")
    args = p.parse_args()
    if args.quick:
        args.per_class, args.batch_size, args.fault_after = 8, 8, 3
    with tempfile.TemporaryDirectory(prefix="hapi-faults-") as tmp:
        setup = Setup.create(Path(tmp), args.per_class, args.image_size, args.batch_size, args.epochs)
        print(f"resnet18 at {args.image_size} px, {len(setup.train_keys)} training samples, batch "
              f"{args.batch_size}, {args.epochs} epochs, split freeze, file:// store; faults after "
              f"{args.fault_after} steps", flush=True)
        reference = Path(tmp, "runs", "none")
        rows = [undisturbed(setup, reference, args.fault_after, reference)]
        for name in args.faults.split(","):
            rows.append(FAULTS[name](setup, Path(tmp, "runs", name), args.fault_after, reference))
            print(f"  {rows[-1].fault}: done", flush=True)
        # Once more at the end: the spread of two undisturbed runs is the noise the ratios sit in,
        # and their heads show what "identical" means between runs.
        rows.append(undisturbed(setup, Path(tmp, "runs", "none-again"), args.fault_after, reference,
                                "none, again at the end"))
    print(table(rows, (rows[0].seconds + rows[-1].seconds) / 2))
    print("vs none: over the mean of the two undisturbed runs")


if __name__ == "__main__":
    main()
