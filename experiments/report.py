"""Generates ``experiments/REPORT.md`` and its plots from the CSVs under ``results/``.

Every figure in the report comes from a CSV that an experiment script wrote on this
machine; the report names the command behind each. Sections whose CSV is missing say so.

    python -m experiments.report
"""

from __future__ import annotations

import argparse
import csv
import os
import platform
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import NullFormatter  # noqa: E402

from experiments.split_sweep import (  # noqa: E402
    GIVE_UP_FACTOR,
    RETIME_WITHIN,
    RIVALS,
    SHARE_TOLERANCE,
    error_spread,
    regret_spread,
    verdict,
)

HERE = Path(__file__).parent
RESULTS = HERE / "results"
REPORT = HERE / "REPORT.md"
ALL_IN_COMPUTE = "-1"


def read(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    mem = int(Path("/proc/meminfo").read_text().split()[1]) / 2**20
    return f"{cpu}, {len(os.sched_getaffinity(0))} cores, {mem:.0f} GiB, no GPU"


def table(rows: list[dict], columns: list[str]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(r[c]) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def _ratio(slow: dict, fast: dict) -> str:
    """slow / fast time per iteration, marked where a stopped-early run makes it a bound."""
    value = f"{float(slow['measured_ms']) / float(fast['measured_ms']):.2f}x"
    slow_bound, fast_bound = slow["stopped_early"] == "True", fast["stopped_early"] == "True"
    if slow_bound and fast_bound:
        return "?"
    return ("≥" if slow_bound else "≤" if fast_bound else "") + value


def _where(row: dict) -> str:
    if " + " in row["candidate"]:  # a mix: its parts, without their dtypes
        return " + ".join(" ".join(part.split()[:3]) if "split" in part else part
                          for part in row["candidate"].split(" + "))
    return "all-in-compute" if row["split"] == ALL_IN_COMPUTE else f"split {row['split']}"


def _bytes_per_sample(row: dict, case: list[dict]) -> float | None:
    """What a candidate moves per sample: a mix's is its parts' bytes weighted by their shares
    (its own row carries none); None where a part's bytes are unknown."""
    if " + " not in row["candidate"]:
        return float(row["bytes_per_sample"]) or None
    singles = {r["candidate"]: float(r["bytes_per_sample"]) for r in case}
    total = 0.0
    for part in row["candidate"].split(" + "):
        share, _, label = part.partition("% ")
        if not singles.get(label):
            return None
        total += float(share) / 100 * singles[label]
    return total


def _kb(row: dict, case: list[dict]) -> str:
    moved = _bytes_per_sample(row, case)
    return f"{'?' if moved is None else f'{moved / 1e3:.1f}'} KB ({_where(row)})"


def judge(rows: list[dict]) -> dict[tuple[str, int, float], dict]:
    """Each (model, batch, bandwidth) case of a sweep: its choice, best, baseline and freeze rows."""
    cases: dict[tuple[str, int, float], list[dict]] = defaultdict(list)
    for r in rows:
        cases[(r["model"], int(r["batch_size"]), float(r["bandwidth_mbit"]))].append(r)
    per_case = {}
    for key, case in cases.items():
        v = verdict(case)
        # A shared plan's row carries its deepest part's split but no bytes of its own, nor does
        # a candidate missing from the run's --explain table: the baseline and freeze are rows
        # of one candidate whose bytes are known.
        singles = [r for r in case if "%" not in r["candidate"]]
        known = [r for r in singles if float(r["bytes_per_sample"]) > 0]
        per_case[key] = {"chosen": v.chosen, "best": v.best, "batch": key[1], "regret": v.regret,
                         "baseline": next(r for r in singles if r["split"] == ALL_IN_COMPUTE),
                         "freeze": max(known, key=lambda r: int(r["split"])),
                         "within": v.within, "within_by_selection": v.within_by_selection, "rows": case}
    return per_case


def every_case(per_case: dict[tuple[str, int, float], dict]) -> str:
    return table([{"model": m, "batch": b, "Mbit/s": f"{bw:g}", "chosen": c["chosen"]["candidate"],
                   "chosen ms/iter": c["chosen"]["measured_ms"], "best": c["best"]["candidate"],
                   "choice vs best": f"+{c['regret']:.1%}",
                   "auto vs all-in-compute": _ratio(c["baseline"], c["chosen"]),
                   "freeze vs all-in-compute": _ratio(c["baseline"], c["freeze"])}
                  for (m, b, bw), c in sorted(per_case.items())],
                 ["model", "batch", "Mbit/s", "chosen", "chosen ms/iter", "best", "choice vs best",
                  "auto vs all-in-compute", "freeze vs all-in-compute"])


def sweep_section(rows: list[dict], folder: Path) -> list[str]:
    per_case = judge(rows)
    groups = sorted({(m, b) for m, b, _ in per_case})  # one plot and headline row per (model, batch)

    def rate(row: dict) -> float:
        return int(row["batch_size"]) * 1e3 / float(row["measured_ms"])

    # Bandwidth normalised by what all-in-compute consumes at full compute speed: its rate
    # on the fastest link times the raw bytes per sample.
    headline, bytes_rows = [], []
    fig, axes = plt.subplots(1, len(groups), figsize=(3.2 * len(groups), 3.2), squeeze=False)
    for ax, (model, batch) in zip(axes[0], groups):
        bws = sorted(bw for m, b, bw in per_case if (m, b) == (model, batch))
        mine = [per_case[(model, batch, bw)] for bw in bws]
        full = mine[-1]
        raw = float(full["baseline"]["bytes_per_sample"])
        need_mbit = rate(full["baseline"]) * raw * 8 / 1e6
        for mode, style in (("baseline", "o--"), ("freeze", "s:"), ("chosen", "^-")):
            ax.plot([bw / need_mbit for bw in bws], [rate(c[mode]) for c in mine], style,
                    label={"baseline": "all-in-compute", "freeze": "freeze", "chosen": "auto"}[mode])
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())  # narrow log ranges: minor labels overlap
        ax.set_title(f"{model}, batch {batch}")
        ax.set_xlabel("bandwidth / baseline need")
        speedups = {bw: float(c["baseline"]["measured_ms"]) / float(c["chosen"]["measured_ms"])
                    for bw, c in zip(bws, mine)}
        top = per_case[(model, batch, max(speedups, key=speedups.get))]
        bottom = per_case[(model, batch, min(speedups, key=speedups.get))]
        headline.append({
            "model": model,
            "input": f"{full['baseline']['image_size']} px, batch {full['batch']}",
            "best speed-up (auto vs all-in-compute)": f"{_ratio(top['baseline'], top['chosen'])} at "
                                                      f"{max(speedups, key=speedups.get):g} Mbit/s",
            "worst": f"{_ratio(bottom['baseline'], bottom['chosen'])} at {min(speedups, key=speedups.get):g} Mbit/s",
            "bytes reduction (raw / freeze)": f"{raw / float(full['freeze']['bytes_per_sample']):.1f}x",
            "choice within 5% of best": f"{sum(c['within'] for c in mine)}/{len(bws)}",
            "baseline needs": f"{need_mbit:.0f} Mbit/s",
        })
        bytes_rows.append({"model": f"{model}, batch {batch}", "raw KB/sample": f"{raw / 1e3:.1f}",
                           "freeze KB/sample": f"{float(full['freeze']['bytes_per_sample']) / 1e3:.1f}",
                           "raw / freeze": f"{raw / float(full['freeze']['bytes_per_sample']):.1f}x",
                           **{f"auto at {bw:g} Mbit/s": _kb(c["chosen"], c["rows"]) for bw, c in zip(bws, mine)}})
    axes[0][0].set_ylabel("samples/s")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(folder / "throughput.png", dpi=110)
    plt.close(fig)

    timed = [r for r in rows if r["stopped_early"] != "True"]
    short = min(int(r["timed_iterations"]) for r in timed)
    long = min(int(r["timed_iterations"]) for r in timed if r["long_windows_ms"])
    modelled = [r for r in timed if r["predicted_ms"] != ""]
    errors = [abs(float(r["predicted_ms"]) - float(r["measured_ms"])) / float(r["measured_ms"]) for r in modelled]
    plot_predictions(modelled, folder / "predictions.png")
    within = sum(c["within"] for c in per_case.values())
    within_by_selection = sum(c["within_by_selection"] for c in per_case.values())
    # How much slower the choice trained than the best candidate: the cost of a miss, not only its count.
    regret = sorted(c["regret"] for c in per_case.values())
    losses = [f"{m} (batch {b}) at {bw:g} Mbit/s: auto {_ratio(c['baseline'], c['chosen'])} of all-in-compute "
              f"({c['chosen']['candidate']})" for (m, b, bw), c in sorted(per_case.items())
              if float(c["chosen"]["measured_ms"]) > float(c["baseline"]["measured_ms"])]
    freeze_losses = [f"{m} (batch {b}) at {bw:g} Mbit/s ({_ratio(c['baseline'], c['freeze'])})"
                     for (m, b, bw), c in sorted(per_case.items())
                     if float(c["freeze"]["measured_ms"]) > float(c["baseline"]["measured_ms"])]
    misses = [f"{m} (batch {b}) at {bw:g} Mbit/s: chose {c['chosen']['candidate']}, {c['regret']:.1%} slower "
              f"than {c['best']['candidate']} (confirmed at {c['best']['confirm_ratios']} of the choice)"
              for (m, b, bw), c in sorted(per_case.items()) if not c["within"]]
    return [
        "## Headline", "", table(headline, list(headline[0])), "",
        f"Split choice best or within 5% of the measured best in **{within}/{len(per_case)} = "
        f"{within / len(per_case):.0%}** of (model, batch size, bandwidth) cases (paper: 86.8%; our goal: 95%). "
        "The choice is the split a short `hapi.train --split auto` run settled on (its last training step's), "
        "judged on the steady-state pace of every candidate timed afterwards; how much slower it trained than "
        f"the best: {regret_spread(regret)}. The calibrated cost model's prediction error per candidate (the "
        f"run's `--explain` table at its end, {len(modelled)} candidates timed to the end): "
        f"{error_spread(errors)}. Every candidate "
        f"was first timed over {short} iterations; candidates slower than {GIVE_UP_FACTOR}x the best so far were "
        "stopped early (or not started when their bytes alone would take that long on the link): their time is "
        "a lower bound, and a ratio built on one is marked ≥ or ≤. The machine's speed drifts by tens of percent "
        "within a minute, so the verdict does not compare times taken a minute apart: the candidates screened "
        f"within {RETIME_WITHIN - 1:.0%} of the best ({RIVALS} fastest at most: the choice's rivals) were timed "
        f"in long windows of {long} iterations or more, each bracketed by long windows of the choice, and a "
        "rival's time relative to the choice is the median of its ratios to the mean of its brackets; a rival "
        "got more windows while that median was within two standard errors of the 5% line (selection). The "
        "lowest of several noisy medians is biased low (the winner's curse), so the rival that looked fastest, "
        "when by selection it made the choice a miss, was timed in fresh bracketed windows, and their median "
        "alone is the verdict (confirmation); a choice selection found within 5% stands, since the bias runs "
        f"against it. By the selection windows alone, the choice was within 5% of the best in "
        f"{within_by_selection}/{len(per_case)} cases. A candidate's ms/iter is the median of its own long windows "
        "(its screening window when it had none); a mix's windows grow until their batches hold its shares "
        f"within {SHARE_TOLERANCE:.0%}, and start after as many batches as they time (its node must get ahead of "
        "batches that cost it unevenly). Every window and ratio is in the CSV.",
        "",
        "![throughput](results/split_sweep/throughput.png)", "",
        "Training throughput against bandwidth, normalised by what all-in-compute would consume at full "
        "compute speed (its samples/s on the fastest link times the raw bytes per sample).", "",
        "![predictions](results/split_sweep/predictions.png)", "",
        "## Bytes moved storage → compute", "",
        "Per sample, as the planner counts them (the JPEG object for all-in-compute; the split's float32 output "
        "otherwise). The paper reports up to 8.3x less.", "",
        table(bytes_rows, list(bytes_rows[0])), "",
        "## Where HAPI loses", "",
        "Cases where the planner's choice trained slower than all-in-compute: "
        + ("; ".join(losses) or "none") + ".", "",
        "Cases where pushing every frozen stage down (freeze) trained slower than all-in-compute: "
        + ("; ".join(freeze_losses) or "none") + ".", "",
        "Cases where the choice was more than 5% slower than the best candidate: " + ("; ".join(misses) or "none")
        + ".", "",
        "### Every case", "",
        every_case(per_case), "",
    ]


def plot_predictions(timed: list[dict], path: Path) -> None:
    if not timed:
        return
    fig, ax = plt.subplots(figsize=(4.5, 4))
    for model in sorted({r["model"] for r in timed}):
        mine = [r for r in timed if r["model"] == model]
        ax.scatter([float(r["measured_ms"]) for r in mine], [float(r["predicted_ms"]) for r in mine], s=10,
                   label=model)
    top = max(max(float(r["measured_ms"]), float(r["predicted_ms"])) for r in timed)
    ax.plot([1, top], [1, top], "k:", linewidth=0.8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured ms/iteration")
    ax.set_ylabel("predicted ms/iteration")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=RESULTS, help="folder of the experiments' CSVs")
    parser.add_argument("--output", type=Path, default=REPORT)
    args = parser.parse_args()
    write_report(args.results, args.output)


def write_report(results: Path, report: Path) -> None:
    out = ["# HAPI: results on this machine", "",
           f"Generated by `python -m experiments.report` from the CSVs in `experiments/results/`. Machine: "
           f"{machine()}. Two hosts are emulated on it: the storage host (OpenStack Swift with s3api + the "
           "storage daemon) in a network namespace pinned to core 0, the compute host (the trainer) on core 1, "
           "joined by a veth link shaped with `tc tbf`. Models are randomly initialised: these runs measure time "
           "and bytes, not accuracy. Ratios are measured side by side in one run.", ""]
    sweep = results / "split_sweep" / "sweep.csv"
    paper = read(sweep) if sweep.exists() else []
    out += ["Command: `sudo python -m experiments.split_sweep` (see its docstring for sizing).", ""]
    out += sweep_section(paper, sweep.parent) if paper else ["*No split sweep results yet.*", ""]
    heldout = results / "split_sweep" / "heldout.csv"
    if heldout.exists():
        out += heldout_section(read(heldout), paper)
    out += head_to_head_section(results / "head_to_head" / "table.md")

    sections = [
        ("Overlap ablation: with and without the pipeline", "overlap",
         "python -m experiments.overlap --split 6 (and --split 4)"),
        ("Storage-side batch adaptation under a real memory limit", "storage_load",
         "python -m experiments.storage_load (and --budget 1.0)"),
        ("Multi-tenant: concurrent jobs on one storage node", "multitenant", "sudo python -m experiments.multitenant"),
        ("Re-planning when the link changes", "replan", "sudo python -m experiments.replan_demo"),
        ("Is the all-in-compute baseline fair?", "fetch_baseline", "python -m experiments.fetch_baseline"),
    ]
    for title, folder, command in sections:
        out += [f"## {title}", "", f"Command: `{command}`", ""]
        files = sorted((results / folder).rglob("*.csv"))
        if not files:
            out += ["*No results yet.*", ""]
        for path in files:
            rows = read(path)
            if folder == "replan":
                out += replan_summary(rows)
                continue
            out += [f"`{path.relative_to(results.parent)}`", "", table(rows, list(rows[0])), ""]
            if folder == "multitenant":
                plot_multitenant(rows, path.with_suffix(".png"))
                out += [f"![multitenant]({path.with_suffix('.png').relative_to(results.parent)})", "",
                        multitenant_summary(rows), ""]
    report.write_text("\n".join(out))
    print(f"wrote {report}")


def heldout_section(rows: list[dict], paper_rows: list[dict]) -> list[str]:
    """The choice on cases beyond the paper's, and over every case with the paper's."""
    per_case = judge(rows)
    within = sum(c["within"] for c in per_case.values())
    everything = {**judge(paper_rows), **per_case}
    total = sum(c["within"] for c in everything.values())
    return [
        "## Choice on cases beyond the paper's", "",
        "Commands: `sudo python -m experiments.split_sweep --models resnet101,vgg16,mobilenet_v3_large "
        "--bandwidths 10,50 --batch-sizes 8,16` (models, bandwidths and batch sizes other than the paper's) and "
        "`--models resnet50 --bandwidths 10,50 --batch-sizes 16` (with the mobilenet_v3_large batch 16 cases, "
        "the four cases of the issue that asked for the online planner), judged as above. The planner's rule "
        "for moves was shaped by two of their misses (mobilenet_v3_large 10 Mbit/s and resnet50 50 Mbit/s, "
        "batch 16), so they are no longer cases it was not developed on.", "",
        f"Choice best or within 5% of the measured best in **{within}/{len(per_case)}** of these cases; "
        f"{regret_spread([c['regret'] for c in per_case.values()])}. With the paper's cases above: "
        f"**{total}/{len(everything)} = {total / len(everything):.0%}**, "
        f"{regret_spread([c['regret'] for c in everything.values()])}.", "",
        every_case(per_case), "",
    ]


def head_to_head_section(path: Path) -> list[str]:
    """The case table, then the cases re-run with --repeats (a single run's miss checked
    against its noise), one folder each; every table names the command that measured it."""
    out = ["## Against s3torchconnector: whole-command wall time", ""]
    if not path.exists():
        return out + ["Command: `sudo python -m experiments.head_to_head`", "", "*No results yet.*", ""]
    out += [_without_title(path), ""]
    for again in sorted(path.parent.glob("*/table.md")):
        out += [f"### Re-run: {again.parent.name}", "", _without_title(again), ""]
    return out


def _without_title(path: Path) -> str:
    return "\n".join(line for line in path.read_text().splitlines() if not line.startswith("# ")).strip()


def replan_summary(rows: list[dict]) -> list[str]:
    segments, last = [], None
    for r in rows:
        key = (r["split"], r["link_mbit"])
        if key != last:
            segments.append({"from step": r["step"], "split": r["split"], "link Mbit/s": r["link_mbit"],
                             "KB/sample": r["kb_per_sample"]})
            last = key
    return ["Split -1 is all-in-compute (raw objects).", "", table(segments, list(segments[0])), ""]


def multitenant_summary(rows: list[dict]) -> str:
    most = max(int(r["jobs"]) for r in rows)
    at = {r["mode"]: r for r in rows if int(r["jobs"]) == most}
    hapi, local = at["hapi"], at["all-in-storage"]
    return (f"At {most} concurrent jobs, all-in-storage against HAPI (auto): mean job time "
            f"{float(local['mean_job_s']) / float(hapi['mean_job_s']):.2f}x, makespan "
            f"{float(local['makespan_s']) / float(hapi['makespan_s']):.2f}x, the jobs' own training time "
            f"{float(local['mean_train_s']) / float(hapi['mean_train_s']):.2f}x (above 1: HAPI faster). A job's wall "
            "time includes starting Python and torch and planning, which on one core per host weighs as much as "
            "training these small jobs.")


def plot_multitenant(rows: list[dict], path: Path) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.2))
    for ax, column, label in ((axes[0], "mean_job_s", "mean job time (s)"), (axes[1], "makespan_s", "makespan (s)")):
        for mode, style in (("hapi", "^-"), ("hapi-freeze", "s:"), ("all-in-storage", "o--")):
            mine = [r for r in rows if r["mode"] == mode]
            ax.plot([int(r["jobs"]) for r in mine], [float(r[column]) for r in mine], style, label=mode)
        ax.set_xlabel("concurrent jobs")
        ax.set_ylabel(label)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
