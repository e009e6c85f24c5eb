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


def sweep_section(rows: list[dict], folder: Path) -> list[str]:
    cases: dict[tuple[str, float], list[dict]] = defaultdict(list)
    for r in rows:
        cases[(r["model"], float(r["bandwidth_mbit"]))].append(r)
    models = sorted({m for m, _ in cases})
    # Samples/s per mode per case; "auto" is the planner's choice.
    per_case = {}
    for key, case in cases.items():
        batch = int(case[0]["batch_size"])
        rate = {r["candidate"]: batch * 1e3 / float(r["measured_ms"]) for r in case}
        chosen = next(r for r in case if r["chosen"] == "True")
        freeze = max(case, key=lambda r: int(r["split"]))
        best = min(case, key=lambda r: float(r["measured_ms"]))
        baseline = next(r for r in case if r["split"] == ALL_IN_COMPUTE)
        per_case[key] = {"all-in-compute": rate[baseline["candidate"]], "auto": rate[chosen["candidate"]],
                         "freeze": rate[freeze["candidate"]], "chosen": chosen, "best": best,
                         "raw": float(baseline["bytes_per_sample"]),
                         "within": float(chosen["measured_ms"]) <= float(best["measured_ms"]) * 1.05}
    # Bandwidth normalised by what all-in-compute consumes at full compute speed (its rate at
    # the fastest link, times the raw bytes per sample).
    headline, lines = [], []
    fig, axes = plt.subplots(1, len(models), figsize=(3.2 * len(models), 3.2), squeeze=False)
    for ax, model in zip(axes[0], models):
        bws = sorted(bw for m, bw in per_case if m == model)
        full = per_case[(model, bws[-1])]
        need_mbit = full["all-in-compute"] * full["raw"] * 8 / 1e6
        for mode, style in (("all-in-compute", "o--"), ("freeze", "s:"), ("auto", "^-")):
            ax.plot([bw / need_mbit for bw in bws], [per_case[(model, bw)][mode] for bw in bws], style, label=mode)
        ax.set_xscale("log")
        ax.set_title(model)
        ax.set_xlabel("bandwidth / baseline need")
        speedups = {bw: per_case[(model, bw)]["auto"] / per_case[(model, bw)]["all-in-compute"] for bw in bws}
        top = max(speedups, key=speedups.get)
        chosen_bytes = min(float(per_case[(model, bw)]["chosen"]["bytes_per_sample"]) for bw in bws)
        headline.append({
            "model": model,
            "best speed-up (auto vs all-in-compute)": f"{speedups[top]:.2f}x at {top:g} Mbit/s",
            "worst": f"{min(speedups.values()):.2f}x at {min(speedups, key=speedups.get):g} Mbit/s",
            "bytes reduction (raw / chosen split)": f"{full['raw'] / chosen_bytes:.1f}x",
            "choice within 5% of best": f"{sum(per_case[(model, bw)]['within'] for bw in bws)}/{len(bws)}",
            "baseline needs": f"{need_mbit:.0f} Mbit/s",
        })
    axes[0][0].set_ylabel("samples/s")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(folder / "throughput.png", dpi=110)
    plt.close(fig)

    within = sum(c["within"] for c in per_case.values())
    errors = sorted(abs(float(r["predicted_ms"]) - float(r["measured_ms"])) / float(r["measured_ms"])
                    for r in rows if r.get("stopped_early") != "True")
    lines += ["## Headline", "", table(headline, list(headline[0])), "",
              f"Split choice best or within 5% of the measured best in **{within}/{len(per_case)} = "
              f"{within / len(per_case):.0%}** of (model, bandwidth) cases (paper: 86.8%; our goal: 95%). "
              f"Planner prediction error per candidate (those timed to the end): median "
              f"{errors[len(errors) // 2]:.0%}, 90th percentile {errors[int(len(errors) * 0.9)]:.0%}. Candidates "
              "slower than 3x the best so far were stopped early; their time is a lower bound.", "",
              "![throughput](results/split_sweep/throughput.png)", "",
              "Training throughput against bandwidth, normalised by what all-in-compute would consume at full "
              "compute speed (its samples/s on the fastest link times the raw bytes per sample).", "",
              "### Every case", "",
              table([{"model": m, "Mbit/s": f"{bw:g}", "chosen": c["chosen"]["candidate"],
                      "chosen ms/iter": c["chosen"]["measured_ms"], "best": c["best"]["candidate"],
                      "best ms/iter": c["best"]["measured_ms"], "auto / all-in-compute":
                      f"{c['auto'] / c['all-in-compute']:.2f}x", "freeze / all-in-compute":
                      f"{c['freeze'] / c['all-in-compute']:.2f}x"}
                     for (m, bw), c in sorted(per_case.items())],
                    ["model", "Mbit/s", "chosen", "chosen ms/iter", "best", "best ms/iter",
                     "auto / all-in-compute", "freeze / all-in-compute"]), ""]
    return lines


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
    out += ["Command: `sudo python -m experiments.split_sweep` (see its docstring for sizing).", ""]
    out += sweep_section(read(sweep), sweep.parent) if sweep.exists() else ["*No split sweep results yet.*", ""]

    sections = [
        ("Bytes and overlap", "overlap", "python -m experiments.overlap --split 6 / --split 4", None),
        ("Storage-side batch adaptation under a real memory limit", "storage_load",
         "python -m experiments.storage_load", "results.csv"),
        ("Multi-tenant: concurrent jobs on one storage node", "multitenant", "sudo python -m experiments.multitenant",
         "multitenant.csv"),
        ("Re-planning when the link changes", "replan", "sudo python -m experiments.replan_demo", None),
        ("Is the all-in-compute baseline fair?", "fetch_baseline", "python -m experiments.fetch_baseline",
         "fetch_baseline.csv"),
    ]
    for title, folder, command, name in sections:
        out += [f"## {title}", "", f"Command: `{command}`", ""]
        files = [results / folder / name] if name else sorted((results / folder).glob("*.csv"))
        files = [f for f in files if f.exists()]
        if not files:
            out += ["*No results yet.*", ""]
        for path in files:
            rows = read(path)
            if folder == "replan":
                out += replan_summary(rows)
                continue
            out += [f"`{path.relative_to(results.parent)}`", "", table(rows, list(rows[0])), ""]
    multitenant = results / "multitenant" / "multitenant.csv"
    if multitenant.exists():
        plot_multitenant(read(multitenant), multitenant.parent / "multitenant.png")
        out += ["![multitenant](results/multitenant/multitenant.png)", ""]
    report.write_text("\n".join(out))
    print(f"wrote {report}")


def replan_summary(rows: list[dict]) -> list[str]:
    segments, last = [], None
    for r in rows:
        key = (r["split"], r["link_mbit"])
        if key != last:
            segments.append({"from step": r["step"], "split": r["split"], "link Mbit/s": r["link_mbit"],
                             "KB/sample": r["kb_per_sample"]})
            last = key
    return ["Split -1 is all-in-compute (raw objects).", "", table(segments, list(segments[0])), ""]


def plot_multitenant(rows: list[dict], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(4.5, 3.2))
    for mode, style in (("hapi", "^-"), ("all-in-storage", "o--")):
        mine = [r for r in rows if r["mode"] == mode]
        ax.plot([int(r["jobs"]) for r in mine], [float(r["mean_job_s"]) for r in mine], style, label=mode)
    ax.set_xlabel("concurrent jobs")
    ax.set_ylabel("mean job time (s)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
