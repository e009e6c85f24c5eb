"""Smoke tests: experiments run end to end in their --quick sizes and feed the report."""

import csv
import subprocess
import sys

import pytest

from experiments import twohosts


def _run(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_overlap_quick_feeds_the_report(tmp_path) -> None:
    results = tmp_path / "results"
    out = _run("experiments.overlap", "--quick", "--out", str(results / "overlap"))
    assert "depth 2" in out and "compute alone" in out
    rows = list(csv.DictReader(open(next((results / "overlap").glob("overlap-*.csv")))))
    assert [r["measurement"] for r in rows] == ["storage alone", "compute alone", "depth 0", "depth 2"]
    assert all(float(r["ms_per_iteration"]) > 0 for r in rows)
    _run("experiments.report", "--results", str(results), "--output", str(tmp_path / "REPORT.md"))
    report = (tmp_path / "REPORT.md").read_text()
    assert "## Overlap ablation" in report and "| depth 2 |" in report
    assert "*No split sweep results yet.*" in report  # a missing experiment is said, not hidden


@pytest.mark.skipif(twohosts.available() is not None, reason=f"two emulated hosts: {twohosts.available()}")
def test_split_sweep_runs_on_two_emulated_hosts_and_feeds_the_report(tmp_path) -> None:
    results = tmp_path / "results"
    out = _run("experiments.split_sweep", "--quick", "--models", "resnet18", "--bandwidths", "20",
               "--iterations", "2", "--out", str(results / "split_sweep"))
    assert "choice best or within 5% of best: " in out
    rows = list(csv.DictReader(open(results / "split_sweep" / "sweep.csv")))
    assert len(rows) == 1 + 12  # all-in-compute and splits 0..11 of resnet18
    assert sum(r["chosen"] == "True" for r in rows) == 1
    assert all(float(r["measured_ms"]) > 0 for r in rows)
    _run("experiments.report", "--results", str(results), "--output", str(tmp_path / "REPORT.md"))
    report = (tmp_path / "REPORT.md").read_text()
    assert "## Headline" in report and "| resnet18 |" in report and "## Where HAPI loses" in report
    assert (results / "split_sweep" / "throughput.png").stat().st_size > 0
