"""``python -m experiments.gpu_check``: both tiers' GPU paths, tested and measured in one command.

Sized to finish in under five minutes on one H200 with 16 cores; on a host without a
CUDA device it says so in one line and exits with status 2. In order, as long as its
time budget lasts (a step that would not fit is reported as skipped):

1. the CUDA-only tests: every test named for the GPU in the test files that have them,
   each one's outcome recorded;
2. two tiers on this host: a storage daemon with ``--device cuda``, then another with
   ``--device cpu``, and ``python -m hapi.train --device cuda`` against each at split 0
   with uint8 images, at the freeze index and with ``--split auto``, and once
   all-in-compute (no daemon): samples/s, the shares of the run spent waiting for data and
   computing, bytes over the network, and the peak GPU memory of the trainer and the daemon;
3. several tenants: 1 and 4 concurrent jobs (``--split freeze``) on one daemon whose
   prefix runs on the GPU under a GPU-memory budget: their pace, and whether the daemon's
   reservations stayed within the budget.

Every subprocess runs under a timeout; a step that fails is a row saying why, never a
traceback. The results go to ``experiments/results/gpu/<gpu>-<date>.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import requests
import torch

from compute_side.daemon_process import local_daemon
from hapi.datasets import make_synthetic
from hapi.store import FileStore

log = logging.getLogger(__name__)

RESULTS = Path(__file__).parent / "results" / "gpu"
REPO = Path(__file__).resolve().parent.parent
NO_GPU = "no CUDA device on this host: gpu_check needs a GPU"
# The test files holding CUDA-only tests; each such test has "gpu" in its name.
CUDA_TEST_FILES = ("tests/test_devices.py", "tests/test_device_feed.py", "tests/test_storage_memory.py",
                   "tests/test_storage_app.py", "tests/test_sources.py", "tests/test_transforms.py")
# hapi.train, with the trainer's peak GPU memory printed as the process exits (torch's
# counter is per process, and hapi.train does not report it).
TRAIN_WITH_PEAK = (
    "import atexit, runpy, sys, torch\n"
    "atexit.register(lambda: print('gpu_check: trainer peak GPU bytes', torch.cuda.max_memory_allocated()"
    " if torch.cuda.is_initialized() else 0, flush=True))\n"
    "sys.argv = ['hapi.train', *sys.argv[1:]]\n"
    "runpy.run_module('hapi.train', run_name='__main__', alter_sys=True)\n"
)
MODES = {
    "split 0, uint8 images": ("--split", "0", "--dtype", "uint8"),
    "freeze": ("--split", "freeze"),
    "auto": ("--split", "auto", "--dtypes", "float32,bfloat16,uint8"),
}


@dataclass(frozen=True)
class CheckConfig:
    model: str = "resnet50"
    train_per_class: int = 12  # the synthetic set has 10 classes
    val_per_class: int = 3
    batch_size: int = 64
    max_sub_batch: int = 64  # the daemon's; on a GPU a larger sub-batch than the CPU's default pays
    gpu_memory_budget: str = "8GiB"  # the multitenant daemon's
    tenants: tuple[int, ...] = (1, 4)
    budget_s: float = 290.0  # the whole check; steps that would not fit are skipped
    step_timeout_s: float = 150.0
    out: Path = RESULTS


@dataclass
class Row:
    """One measured step: a training run, or a round of concurrent ones."""

    step: str
    status: str = "ok"  # ok, failed, timeout, skipped
    note: str = ""
    metrics: dict[str, float | str] = field(default_factory=dict)


class Clock:
    def __init__(self, budget_s: float) -> None:
        self.deadline = time.monotonic() + budget_s

    def left(self) -> float:
        return self.deadline - time.monotonic()


# --- running things ---------------------------------------------------------------


def run(command: list[str], timeout_s: float, log_path: Path, env: dict[str, str] | None = None) -> tuple[int, str]:
    """Run ``command`` to its end or ``timeout_s``; its output goes to ``log_path`` and is returned.
    A timeout kills its whole process group and returns 124."""
    process = start(command, log_path, env)
    return finish(process, timeout_s, log_path)


def start(command: list[str], log_path: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    with open(log_path, "wb") as f:
        return subprocess.Popen(command, stdout=f, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True,
                                env={**os.environ, **(env or {})})


def finish(process: subprocess.Popen, timeout_s: float, log_path: Path) -> tuple[int, str]:
    try:
        rc = process.wait(timeout=max(timeout_s, 1.0))
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        rc = 124
    return rc, log_path.read_text(errors="replace")


def tail(text: str, lines: int = 3) -> str:
    return " | ".join(line.strip() for line in text.strip().splitlines()[-lines:])[-300:]


# --- 1. the CUDA-only tests ----------------------------------------------------------


def cuda_tests(work: Path, clock: Clock, config: CheckConfig) -> tuple[Row, dict[str, str]]:
    report = work / "cuda-tests.xml"
    command = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-k", "gpu",
               f"--junitxml={report}", *CUDA_TEST_FILES]
    rc, text = run(command, min(config.step_timeout_s, clock.left()), work / "cuda-tests.log")
    outcomes = junit_outcomes(report) if report.is_file() else {}
    counts = {kind: sum(outcome == kind for outcome in outcomes.values()) for kind in ("passed", "failed", "skipped")}
    status = "timeout" if rc == 124 else "ok" if rc == 0 and counts["passed"] and not counts["failed"] else "failed"
    note = ", ".join(f"{n} {kind}" for kind, n in counts.items()) if outcomes else tail(text)
    return Row("CUDA-only tests", status, note), outcomes


def junit_outcomes(path: Path) -> dict[str, str]:
    """Each test case's outcome in a pytest JUnit XML report."""
    import xml.etree.ElementTree as ElementTree

    outcomes = {}
    for case in ElementTree.parse(path).iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        kinds = {child.tag for child in case}
        outcomes[name] = ("failed" if kinds & {"failure", "error"} else "skipped" if "skipped" in kinds
                          else "passed")
    return outcomes


# --- 2. two tiers on this host -----------------------------------------------------


def train_command(config: CheckConfig, store_url: str, work: Path, name: str, *mode: str) -> list[str]:
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower())
    return [sys.executable, "-c", TRAIN_WITH_PEAK, "--model", config.model, "--device", "cuda",
            "--store", store_url, "--batch-size", str(config.batch_size), "--request-size", str(config.batch_size),
            "--epochs", "1", "--feature-cache", "0", "--cache-dir", str(work / "cache"),
            "--output-dir", str(work / "runs" / slug), *mode]


def parse_train(text: str) -> dict[str, float | str]:
    """What hapi.train's closing report says, and the trainer's peak GPU memory."""
    found: dict[str, float | str] = {}
    trained = re.search(r"trained (\d+) samples in ([\d.]+) s: ([\d.]+) samples/s; "
                        r"waiting for data (\d+)%, computing (\d+)%", text)
    if trained:
        found.update(samples=int(trained.group(1)), samples_per_s=float(trained.group(3)),
                     wait_share=int(trained.group(4)) / 100, compute_share=int(trained.group(5)) / 100)
    network = re.search(r"over the network: ([\d.]+) MB vs ([\d.]+) MB", text)
    if network:
        found.update(network_mb=float(network.group(1)), raw_mb=float(network.group(2)))
    peak = re.search(r"gpu_check: trainer peak GPU bytes (\d+)", text)
    if peak:
        found["trainer_peak_gpu_mb"] = round(int(peak.group(1)) / 1e6, 1)
    split = re.search(r"HAPI: [^,]+, (split [^;]*?|all-in-compute[^;]*?) \(freeze index", text)
    if split:
        found["split"] = split.group(1)[:60]
    return found


def train_row(name: str, command: list[str], work: Path, clock: Clock, config: CheckConfig,
              node: str | None = None) -> Row:
    timeout = min(config.step_timeout_s, clock.left())
    if timeout < 20:
        return Row(name, "skipped", "out of time")
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower())
    rc, text = run(command, timeout, work / f"{slug}.log")
    metrics = parse_train(text)
    if node is not None:
        metrics.update(daemon_memory(node))
    if rc == 124:
        return Row(name, "timeout", f"over {timeout:.0f} s", metrics)
    if rc != 0 or "samples_per_s" not in metrics:
        return Row(name, "failed", f"exit {rc}: {tail(text)}", metrics)
    return Row(name, "ok", str(metrics.pop("split", "")), metrics)


def daemon_memory(node: str) -> dict[str, float]:
    """The daemon's GPU memory so far (its peak is over its whole life), from /v1/models."""
    try:
        info = requests.get(node + "/v1/models", timeout=10).json()["node"]
    except (requests.RequestException, ValueError, KeyError) as exc:
        log.warning("no memory reading from %s: %s", node, exc)
        return {}
    found = {}
    for name in ("gpu_memory_peak_allocated", "gpu_memory_reserved_peak", "gpu_memory_capacity"):
        if info.get(name) is not None:
            found[f"daemon_{name}_mb"] = round(info[name] / 1e6, 1)
    return found


@contextmanager
def daemon(store_url: str, work: Path, name: str, *args: str) -> Iterator[str]:
    with local_daemon(store_url, work / f"daemon-{name}.log", extra_args=args, start_timeout_s=90) as url:
        yield url


def two_tiers(store_url: str, work: Path, clock: Clock, config: CheckConfig) -> list[Row]:
    rows = []
    for device in ("cuda", "cpu"):
        args = ("--device", device, "--max-sub-batch", str(config.max_sub_batch))
        if clock.left() < 40:
            rows += [Row(f"daemon on {device}, {mode}", "skipped", "out of time") for mode in MODES]
            continue
        try:
            with daemon(store_url, work, device, *args) as node:
                for mode, flags in MODES.items():
                    name = f"daemon on {device}, {mode}"
                    rows.append(train_row(name, train_command(config, store_url, work, name, *flags,
                                                              "--storage-node", node), work, clock, config, node))
        except (RuntimeError, OSError, subprocess.SubprocessError) as exc:  # the daemon did not start
            rows.append(Row(f"daemon on {device}", "failed", str(exc)[-300:]))
        if device == "cuda":
            name = "all-in-compute (no daemon)"
            rows.append(train_row(name, train_command(config, store_url, work, name, "--split", "all-in-compute"),
                                  work, clock, config))
    return rows


# --- 3. several tenants on one GPU daemon --------------------------------------------


def tenants(store_url: str, work: Path, clock: Clock, config: CheckConfig) -> list[Row]:
    rows = []
    args = ("--device", "cuda", "--max-sub-batch", str(config.max_sub_batch),
            "--gpu-memory-budget", config.gpu_memory_budget)
    try:
        with daemon(store_url, work, "tenants", *args) as node:
            for n in config.tenants:
                rows.append(tenant_round(n, node, store_url, work, clock, config))
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        rows.append(Row("tenants", "failed", str(exc)[-300:]))
    return rows


def tenant_round(n: int, node: str, store_url: str, work: Path, clock: Clock, config: CheckConfig) -> Row:
    name = f"{n} concurrent job{'s' if n > 1 else ''}, freeze, GPU budget {config.gpu_memory_budget}"
    timeout = min(config.step_timeout_s, clock.left())
    if timeout < 30:
        return Row(name, "skipped", "out of time")
    started = time.monotonic()
    logs = [work / f"tenant-{n}-{i}.log" for i in range(n)]
    processes = [start(train_command(config, store_url, work, f"tenant {n} {i}", "--split", "freeze",
                                     "--storage-node", node), path) for i, path in enumerate(logs)]
    results = [finish(p, timeout - (time.monotonic() - started), path) for p, path in zip(processes, logs)]
    wall_s = time.monotonic() - started
    parsed = [parse_train(text) for _, text in results]
    metrics: dict[str, float | str] = {"wall_s": round(wall_s, 1), **daemon_memory(node)}
    paces = [p["samples_per_s"] for p in parsed if "samples_per_s" in p]
    if paces:
        metrics["samples_per_s"] = round(sum(paces), 1)  # all jobs together
        metrics["wait_share"] = round(sum(p["wait_share"] for p in parsed if "wait_share" in p) / len(paces), 2)
    metrics["refused"] = refused(node)
    bad = [(rc, text) for rc, text in results if rc != 0]
    if bad:
        status = "timeout" if any(rc == 124 for rc, _ in bad) else "failed"
        return Row(name, status, f"{len(bad)} of {n} jobs: exit {bad[0][0]}: {tail(bad[0][1])}", metrics)
    return Row(name, "ok", gpu_budget_note(metrics), metrics)


def gpu_budget_note(metrics: dict[str, float | str]) -> str:
    """Whether the daemon's GPU reservations stayed within its budget; a reading the daemon
    did not give is unknown, never a pass."""
    peak = metrics.get("daemon_gpu_memory_reserved_peak_mb")
    capacity = metrics.get("daemon_gpu_memory_capacity_mb")
    if peak is None or capacity is None:
        return "GPU reservations not measured"
    return "reservations within the GPU budget" if peak <= capacity else "RESERVED OVER THE GPU BUDGET"


def refused(node: str) -> float:
    """Requests the daemon refused for load or size so far (413 / 503)."""
    try:
        text = requests.get(node + "/metrics", timeout=10).text
    except requests.RequestException:
        return float("nan")
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("hapi_storage_refused_total"))


# --- the report -----------------------------------------------------------------------

COLUMNS = (("samples_per_s", "samples/s"), ("wait_share", "waiting"), ("compute_share", "computing"),
           ("network_mb", "network MB"), ("trainer_peak_gpu_mb", "trainer peak GPU MB"),
           ("daemon_gpu_memory_peak_allocated_mb", "daemon peak GPU MB"),
           ("daemon_gpu_memory_reserved_peak_mb", "daemon reserved peak MB"), ("wall_s", "wall s"),
           ("refused", "refused"))


def markdown(gpu: str, rows: list[Row], tests: dict[str, str], config: CheckConfig) -> str:
    lines = [f"# GPU check: {gpu}, {time.strftime('%Y-%m-%d %H:%M')}", "",
             f"{config.model}, synthetic set {config.train_per_class * 10} train / {config.val_per_class * 10} val "
             f"samples, batch {config.batch_size}, daemon sub-batch up to {config.max_sub_batch}; the trainer on "
             "cuda in every row. The daemon's peak GPU memory is over its life so far (one daemon per device "
             "serves its three modes in turn).", "",
             "| step | status | " + " | ".join(title for _, title in COLUMNS) + " | note |",
             "|---" * (len(COLUMNS) + 3) + "|"]
    for row in rows:
        cells = [_cell(key, row.metrics.get(key)) for key, _ in COLUMNS]
        lines.append(f"| {row.step} | {row.status} | " + " | ".join(cells) + f" | {row.note.replace('|', '/')} |")
    if tests:
        lines += ["", "## CUDA-only tests", "", "| test | outcome |", "|---|---|"]
        lines += [f"| {name} | {outcome} |" for name, outcome in sorted(tests.items())]
    return "\n".join(lines) + "\n"


def _cell(key: str, value: float | str | None) -> str:
    if value is None:
        return "-"
    return f"{value:.0%}" if key.endswith("_share") else str(value)


def main(argv: list[str] | None = None) -> int:
    defaults = CheckConfig()
    p = argparse.ArgumentParser(prog="python -m experiments.gpu_check", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=defaults.model)
    p.add_argument("--train-per-class", type=int, default=defaults.train_per_class)
    p.add_argument("--budget", type=float, default=defaults.budget_s, help="seconds for the whole check")
    p.add_argument("--skip-tests", action="store_true", help="measure only")
    p.add_argument("--out", type=Path, default=defaults.out)
    p.add_argument("--work", type=Path, help="keep the data set, logs and runs here (default: a temporary "
                                             "directory, removed at the end)")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print(NO_GPU, file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    config = CheckConfig(model=a.model, train_per_class=a.train_per_class, budget_s=a.budget, out=a.out)
    clock = Clock(config.budget_s)
    gpu = torch.cuda.get_device_name()
    rows: list[Row] = []
    tests: dict[str, str] = {}
    with ExitStack() as stack:
        if a.work is not None:
            a.work.mkdir(parents=True, exist_ok=True)
        work = a.work or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="gpu-check-")))
        store = FileStore(work / "store")
        make_synthetic(store, config.train_per_class, config.val_per_class)
        if not a.skip_tests:
            log.info("CUDA-only tests")
            row, tests = cuda_tests(work, clock, config)
            rows.append(row)
        log.info("two tiers on this host")
        rows += two_tiers(store.url, work, clock, config)
        log.info("tenants")
        rows += tenants(store.url, work, clock, config)
        config.out.mkdir(parents=True, exist_ok=True)
        stem = config.out / f"{re.sub(r'[^A-Za-z0-9]+', '-', gpu).strip('-')}-{time.strftime('%Y-%m-%d')}"
        stem.with_suffix(".md").write_text(markdown(gpu, rows, tests, config))
        stem.with_suffix(".json").write_text(json.dumps(
            {"gpu": gpu, "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "torch": torch.__version__,
             "config": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(config).items()},
             "rows": [asdict(row) for row in rows], "tests": tests}, indent=1))
        print(stem.with_suffix(".md").read_text())
        print(f"written: {stem}.md and .json")
    return 0 if all(row.status in ("ok", "skipped") for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
