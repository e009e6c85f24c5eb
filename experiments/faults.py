"""Faults and attacks: dead, hung or lost storage nodes, a killed trainer, a hostile client.

Training faults: ResNet-18 at a small image size on a ``file://`` store with two local
daemons (fresh ones for every row), the same seed and arguments in every row, so each
fault is measured against the undisturbed run of the same invocation:

- time: the training command's wall time (both attempts where it was resumed) over the
  undisturbed run's;
- exactly once: the ledger ``hapi.train.read_ledger`` reads from metrics.jsonl holds every
  training sample exactly once in every epoch;
- head: the trained head against the undisturbed run's, identical or the largest difference.

A fault strikes after ``--fault-after`` steps of the first epoch. ``python -m hapi.train``
runs as a child process, as a user runs it. ``--split auto`` is trained too, against a run
fixed at the split it chose: planning must not change what is learned.

Attacks on a daemon (``python -m storage_side``, served as a user serves it, with a small
``--memory-budget``; ``experiments/attacks.py`` builds them):

- fuzzed requests: hypothesis-drawn bodies (near-valid, arbitrary JSON, raw bytes) to
  /v1/extract and /v1/profile: the status distribution, and no 5xx, no answer but JSON;
- bombs: each crafted object and the profile abuse, its status and the daemon's peak
  resident memory (the kernel's VmHWM, reset before each) against the budget;
- slow clients: 40 and 200 half-open connections held while /healthz is timed.

    python -m experiments.faults [--quick] [--only attacks|training]

prints one table, fault/attack -> outcome, and whether each meets issue 21's bar.
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
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import requests
import torch

from compute_side.daemon_process import LocalDaemon, local_daemon_process
from experiments import attacks
from hapi.datasets import make_synthetic
from hapi.planner import ALL_IN_COMPUTE
from hapi.store import FileStore
from hapi.train import read_ledger
from hapi.transforms import TransformSpec


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
                "--epochs", str(epochs), "--checkpoint-every", "2", "--cache-dir", str(root / "cache"),
                # Every epoch's features from the nodes: a feature cache would serve later epochs without
                # them (no fault to meet), and its misses regroup requests (a convolution's float result
                # depends on the batch it runs in), so heads would differ by rounding for that alone.
                "--feature-cache", "0")
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


@dataclass(frozen=True)
class Row:
    """One line of the table: a fault or an attack, what came of it, whether that meets issue 21's bar."""

    what: str
    outcome: str
    ok: bool | None  # None: nothing to judge


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


def auto_against_fixed(setup: Setup, run_dir: Path, fault_after: int, reference: Path | None) -> Outcome:
    """``--split auto``, then a run fixed at the split auto trained on most: the same head."""
    with daemons(setup, 2) as nodes:
        urls = [d.url for d in nodes]
        returncode, _, seconds = Trainer.start(setup, run_dir, urls, "--split", "auto").finish()
        if returncode != 0:
            return Outcome("--split auto vs its chosen split, fixed", seconds, returncode, None, None, "auto failed")
        used = Counter(s["split"] for s in step_records(run_dir))
        chosen = used.most_common(1)[0][0]
        fixed = reference
        if reference is None or {s["split"] for s in step_records(reference)} != {chosen}:
            fixed = run_dir.parent / f"{run_dir.name}-fixed"
            Trainer.start(setup, fixed, urls, "--split", "all-in-compute" if chosen == ALL_IN_COMPUTE
                          else str(chosen)).finish()
    splits = ", ".join(f"{'all-in-compute' if s == ALL_IN_COMPUTE else f'split {s}'} x{n}"
                       for s, n in sorted(used.items()))
    # Steps explored at other splits ran their frozen stages elsewhere or in other batches: equal
    # within float rounding, no more. A run that kept to one split must match bit for bit.
    explored = "explored: " if len(used) > 1 else ""
    return Outcome("--split auto vs its chosen split, fixed", seconds, returncode, exactly_once(setup, run_dir),
                   head_diff(run_dir, fixed), f"{explored}auto's steps {splits}; head against a run at --split "
                   f"{'all-in-compute' if chosen == ALL_IN_COMPUTE else chosen}")


FAULTS: dict[str, Callable[[Setup, Path, int, Path | None], Outcome]] = {
    "kill-one": node_fault(signal.SIGKILL, 2, "kill -9 of one of two nodes"),
    "stop-one": node_fault(signal.SIGSTOP, 2, "SIGSTOP of one of two nodes (to the end)"),
    "kill-only": node_fault(signal.SIGKILL, 1, "kill -9 of the only node"),
    "kill-trainer": trainer_fault(signal.SIGKILL, "kill -9 of the trainer, then --resume"),
    "term-trainer": trainer_fault(signal.SIGTERM, "SIGTERM of the trainer, then --resume"),
    "own-daemon": local_daemon_dies_with_trainer,
    "auto-split": auto_against_fixed,
}

FLOAT_TOLERANCE = 1e-4  # features computed by another node or here: equal within float rounding


def meets(name: str, o: Outcome) -> bool:
    """Whether a training row meets issue 21's bar (``name``: a key of FAULTS, or "none")."""
    if name == "own-daemon":
        return o.note.startswith("daemon gone")
    completed = o.returncode == 0 and bool(o.exactly_once)
    if name in ("kill-trainer", "term-trainer") or (name == "auto-split" and "explored" not in o.note):
        return completed and o.head_diff == 0  # the same computation, resumed or planned: bit for bit
    if name == "none":
        return completed
    return completed and o.head_diff is not None and o.head_diff <= FLOAT_TOLERANCE


def training_row(name: str, o: Outcome, reference_s: float) -> Row:
    if name == "own-daemon":
        return Row(o.fault, o.note, meets(name, o))
    head = "-" if o.head_diff is None else "identical" if o.head_diff == 0 else f"max diff {o.head_diff:.1e}"
    text = (f"exit {o.returncode}, {o.seconds:.1f} s = {o.seconds / reference_s:.2f}x undisturbed, "
            f"each sample once: {_yes_no(o.exactly_once)}, head: {head}")
    return Row(o.fault, text + (f"; {o.note}" if o.note else ""), meets(name, o))


def training_rows(root: Path, args: argparse.Namespace) -> tuple[str, list[Row]]:
    setup = Setup.create(root, args.per_class, args.image_size, args.batch_size, args.epochs)
    title = (f"training: resnet18 at {args.image_size} px, {len(setup.train_keys)} samples, batch "
             f"{args.batch_size}, {args.epochs} epochs, split freeze, two daemons unless said; faults after "
             f"{args.fault_after} steps")
    print(title, flush=True)
    reference = root / "runs" / "none"
    runs = [("none", undisturbed(setup, reference, args.fault_after, reference))]
    for name in args.faults.split(","):
        runs.append((name, FAULTS[name](setup, root / "runs" / name, args.fault_after, reference)))
        print(f"  {runs[-1][1].fault}: done", flush=True)
    # Once more at the end: the spread of two undisturbed runs is the noise the ratios sit in,
    # and their heads show what "identical" means between runs.
    runs.append(("none", undisturbed(setup, root / "runs" / "none-again", args.fault_after, reference,
                                     "none, again at the end")))
    reference_s = (runs[0][1].seconds + runs[-1][1].seconds) / 2
    return title + "; x undisturbed: over the mean of the two undisturbed runs", \
        [training_row(name, o, reference_s) for name, o in runs]


# --- attacks on a served daemon ------------------------------------------------------------

ATTACK_TRANSFORM = TransformSpec(crop_size=32, resize_size=40).to_dict()
ATTACK_SPLIT = 4
OBJECT_CAP = 256 << 10  # --max-object-bytes of the attacked daemon


def _family(pid: int) -> list[int]:
    """``pid`` and its descendants (a gunicorn daemon's worker is its child)."""
    family, i = [pid], 0
    while i < len(family):
        for task in Path(f"/proc/{family[i]}/task").glob("*"):
            try:
                family += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                pass
        i += 1
    return family


def peak_rss_bytes(pid: int) -> int:
    """The largest VmHWM (peak resident memory, as the kernel counts it) of ``pid`` and its descendants."""
    peaks = [0]
    for p in _family(pid):
        try:
            status = Path(f"/proc/{p}/status").read_text()
        except OSError:
            continue
        peaks += [int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmHWM:")]
    return max(peaks)


def reset_peak_rss(pid: int) -> bool:
    """Start VmHWM afresh at the current resident size (``clear_refs`` 5); False where the kernel refuses."""
    try:
        for p in _family(pid):
            Path(f"/proc/{p}/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _answer(response: requests.Response) -> str:
    """Status and the JSON error code, e.g. ``413 image_too_large`` (a 200 carries features, not JSON)."""
    if response.status_code == 200:
        return "200"
    if not _is_json(response):
        return f"{response.status_code} (not JSON)"
    try:
        body = response.json()
    except ValueError:
        return f"{response.status_code} (not JSON)"
    return f"{response.status_code} {body.get('error', '') if isinstance(body, dict) else ''}".strip()


def _is_json(response: requests.Response) -> bool:
    return response.headers.get("Content-Type", "").startswith("application/json")


def bomb_rows(daemon: LocalDaemon, good_key: str, budget: int) -> list[Row]:
    """Each bomb, and the profile abuse, alone: its answer and the daemon's peak memory meanwhile."""
    budget_mb = f"of the {budget / 1e6:.0f} MB budget"
    extract = {"model": "resnet18", "split": ATTACK_SPLIT, "transform": ATTACK_TRANSFORM}
    requests.post(daemon.url + "/v1/extract", json={**extract, "keys": [good_key]}, timeout=120).raise_for_status()
    rest = peak_rss_bytes(daemon.pid)
    rows = [Row("daemon started, resnet18 loaded (1 sample served)",
                f"peak RSS {rest / 1e6:.0f} MB {budget_mb}", rest <= budget)]
    sizes = {key: len(blob) for key, blob in attacks.BOMBS.items()}
    bombs = [(f"JPEG of {sizes['bomb/huge-header.jpg']} B claiming 30000x30000", "bomb/huge-header.jpg"),
             (f"GIF of {sizes['bomb/700-frames.gif'] / 1e3:.0f} kB: 700 frames on 1000x1000", "bomb/700-frames.gif"),
             (f"tar of {sizes['bomb/sparse.tar']} B, a sparse member declaring 2 GiB", attacks.SPARSE_MEMBER_KEY),
             (f"object of {len(attacks.oversized_jpeg()) / 1e3:.0f} kB over --max-object-bytes "
              f"{OBJECT_CAP >> 10} KiB", attacks.OVERSIZED_KEY),
             (f"PNG of {sizes['bomb/huge-header.png']} B claiming 60000x60000", "bomb/huge-header.png"),
             ("PNG of 1x20000 pixels (resizes to 40x800000)", "bomb/thread.png")]
    profile_abuse = (f"profile abuse: batch_sizes [1]*100, repeats 20 ({len(json.dumps(attacks.PROFILE_ABUSE))} B)",
                     "/v1/profile", attacks.PROFILE_ABUSE)
    requested = [*((what, "/v1/extract", {**extract, "keys": [key]}) for what, key in bombs), profile_abuse]
    for what, path, body in requested:
        fresh = reset_peak_rss(daemon.pid)
        started = time.perf_counter()
        try:
            response = requests.post(daemon.url + path, json=body, timeout=300)
            answer, served = _answer(response), response.status_code < 500
        except requests.RequestException as exc:
            answer, served = f"no answer ({type(exc).__name__})", False
        seconds = time.perf_counter() - started
        peak = peak_rss_bytes(daemon.pid)
        since = "" if fresh else " (since start: VmHWM could not be reset)"
        rows.append(Row(what, f"{answer} in {seconds:.2f} s; peak RSS {peak / 1e6:.0f} MB {budget_mb}{since}",
                        served and peak <= budget))
    return rows


def fuzz_row(daemon: LocalDaemon, count: int) -> Row:
    """``count`` fuzzed requests, half to /v1/extract and half to /v1/profile (the same bodies)."""
    payloads = attacks.fuzzed_payloads((count + 1) // 2)
    statuses: Counter[str] = Counter()
    not_json = 0
    started = time.perf_counter()
    with requests.Session() as session:
        for payload in payloads:
            for path in ("/v1/extract", "/v1/profile"):
                try:
                    response = session.post(daemon.url + path, data=payload, timeout=60,
                                            headers={"Content-Type": "application/json"})
                    statuses[str(response.status_code)] += 1
                    not_json += response.status_code != 200 and not _is_json(response)
                except requests.RequestException as exc:
                    statuses[type(exc).__name__] += 1
    seconds = time.perf_counter() - started
    sent = sum(statuses.values())
    server_errors = sum(n for s, n in statuses.items() if not s.isdigit() or int(s) >= 500)
    distribution = ", ".join(f"{s} x{n}" for s, n in sorted(statuses.items()))
    return Row(f"fuzzed requests to /v1/extract and /v1/profile ({len(payloads)} bodies)",
               f"{sent} sent in {seconds:.0f} s: {distribution}; 5xx or no answer: {server_errors}; "
               f"not JSON: {not_json}", server_errors == 0 and not_json == 0)


def protocol_row(daemon: LocalDaemon) -> Row:
    """Errors below the app: a long URL, too many headers, a body over the limit."""
    answers = []
    long_url, (path, headers) = attacks.LONG_URL[0], attacks.MANY_HEADERS
    json_type = {"Content-Type": "application/json"}
    sends = [("100 kB URL", lambda: requests.get(daemon.url + long_url, timeout=10)),
             ("1000 headers", lambda: requests.get(daemon.url + path, headers=headers, timeout=10)),
             ("2 MiB body", lambda: requests.post(daemon.url + "/v1/extract", data=b"{" + b" " * (2 << 20),
                                                  headers=json_type, timeout=10))]
    for what, send in sends:
        try:
            response = send()
            answers.append((what, _answer(response), 400 <= response.status_code < 500 and _is_json(response)))
        except requests.RequestException as exc:
            answers.append((what, f"no answer ({type(exc).__name__})", False))
    return Row("protocol errors: " + ", ".join(w for w, _, _ in answers),
               "; ".join(a for _, a, _ in answers), all(ok for _, _, ok in answers))


def slow_client_row(daemon: LocalDaemon, clients: int, good_key: str) -> Row:
    """``clients`` half-open connections held while /healthz (5 times) and one extract are timed."""
    port = int(daemon.url.rsplit(":", 1)[1])
    body = {"model": "resnet18", "split": ATTACK_SPLIT, "transform": ATTACK_TRANSFORM, "keys": [good_key]}
    with attacks.half_open_connections(port, clients):
        time.sleep(0.2)
        latencies = []
        for _ in range(5):
            try:
                latencies.append(attacks.healthz_s(daemon.url, timeout_s=10))
            except (requests.RequestException, RuntimeError):
                latencies.append(float("inf"))
        started = time.perf_counter()
        try:
            extract = f"{_answer(requests.post(daemon.url + '/v1/extract', json=body, timeout=10))} in " \
                      f"{(time.perf_counter() - started) * 1e3:.0f} ms"
        except requests.RequestException as exc:
            extract = f"no answer ({type(exc).__name__})"
    worst = max(latencies)
    healthz = "timed out" if worst == float("inf") else f"{worst * 1e3:.0f} ms"
    return Row(f"{clients} slow clients (half-open connections held)",
               f"/healthz worst of 5: {healthz}; /v1/extract of 1 sample: {extract}", worst < 1.0)


def attack_rows(root: Path, args: argparse.Namespace) -> tuple[str, list[Row]]:
    store = FileStore(root / "attack-store")
    good_key = make_synthetic(store, 1, 0).split("train")[0].key
    attacks.put_bombs(store)
    budget = int(args.memory_budget)
    title = (f"attacks on one served daemon (python -m storage_side, waitress): --memory-budget {budget / 1e9:.2f} GB, "
             f"--max-object-bytes {OBJECT_CAP >> 10} KiB, 2 I/O threads, 1 torch thread; resnet18 split "
             f"{ATTACK_SPLIT} at 32 px")
    print(title, flush=True)
    options = ("--memory-budget", str(budget), "--max-object-bytes", str(OBJECT_CAP), "--io-threads", "2",
               "--torch-threads", "1")
    with local_daemon_process(store.url, root / "attacked-daemon.log", options) as daemon:
        rows = bomb_rows(daemon, good_key, budget)
        print("  bombs: done", flush=True)
        rows.append(fuzz_row(daemon, args.fuzz))
        rows.append(protocol_row(daemon))
        print("  fuzzing: done", flush=True)
        rows += [slow_client_row(daemon, clients, good_key) for clients in (40, 200)]
        alive = attacks.healthz_s(daemon.url) < 1.0
    rows.append(Row("the daemon after all of the above", "healthy" if alive else "slow", alive))
    return title, rows


# --- the table -----------------------------------------------------------------------------


def table(sections: list[tuple[str, list[Row]]]) -> str:
    width = max(len(r.what) for _, rows in sections for r in rows)
    lines = [f"{'fault / attack':{width}s}  meets  outcome"]
    for title, rows in sections:
        lines += ["", f"== {title}"]
        lines += [f"{r.what:{width}s}  {_yes_no(r.ok):5s}  {r.outcome}" for r in rows]
    return "\n".join(lines)


def _yes_no(value: bool | None) -> str:
    return "-" if value is None else "yes" if value else "NO"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", choices=("attacks", "training"), help="run one half (default: both)")
    p.add_argument("--per-class", type=int, default=24, help="training samples per class (10 classes)")
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--fault-after", type=int, default=4, help="steps of the first epoch before the fault")
    p.add_argument("--faults", default=",".join(FAULTS), help=f"some of {','.join(FAULTS)}")
    p.add_argument("--fuzz", type=int, default=1000, help="fuzzed requests, half to each endpoint")
    p.add_argument("--memory-budget", type=float, default=1.3e9, help="bytes, of the attacked daemon")
    p.add_argument("--quick", action="store_true", help="8 samples per class, batch 8, fault after 3 steps, "
                                                        "200 fuzzed requests")
    args = p.parse_args()
    if args.quick:
        args.per_class, args.batch_size, args.fault_after, args.fuzz = 8, 8, 3, 200
    started = time.perf_counter()
    sections = []
    with tempfile.TemporaryDirectory(prefix="hapi-faults-") as tmp:
        if args.only != "attacks":
            sections.append(training_rows(Path(tmp), args))
        if args.only != "training":
            sections.append(attack_rows(Path(tmp), args))
    print(table(sections))
    print(f"\nmeets: issue 21's bar (training: the run completes with every sample once; the head identical "
          f"where the same computation is resumed or planned, within {FLOAT_TOLERANCE:g} where features came "
          f"from another node, the fallback or auto's exploring steps; the local daemon dies with its trainer. "
          f"attacks: no 5xx, JSON answers, peak RSS within the budget, /healthz under 1 s). "
          f"{time.perf_counter() - started:.0f} s in all.")


if __name__ == "__main__":
    main()
