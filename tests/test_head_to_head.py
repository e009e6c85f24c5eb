"""The head-to-head's bookkeeping: verdicts, tables and parsing, on values it has measured.

The runs below are issue 20's first head-to-head (ResNet-50 at 112 px, one epoch of 320
samples): at 25 Mbit/s auto took 1.78x the peer's time and moved 51.7 MB against the
40.7 MB of the all-in-compute job it trained as; at 5 Mbit/s freeze took 0.39x the peer's.
"""

import json

from experiments.head_to_head import (
    ALL_IN_COMPUTE,
    TABLE_HEADERS,
    Case,
    Run,
    block_boundaries,
    closing_line,
    format_table,
    judge,
    parse_args,
    table_rows,
    trained_split,
)

RESNET50_STAGES = ("conv1", "bn1", "relu", "maxpool", "layer1.0", "layer1.1", "layer1.2", "layer2.0", "layer2.1",
                   "layer2.2", "layer2.3", "layer3.0", "layer3.1", "layer3.2", "layer3.3", "layer3.4", "layer3.5",
                   "layer4.0", "layer4.1", "layer4.2", "avgpool", "flatten", "fc")
FREEZE = 22


def run(case: Case, variant: str, wall_s: float, mb: float, split: int | None = None, repeat: int = 0,
        stopped: bool = False, trained: int | None = None, batches_mb: float | None = None) -> Run:
    """A measured job; a HAPI job's batches carried ``batches_mb`` (default: its link's bytes
    less a 2% protocol overhead)."""
    if batches_mb is None and not variant.startswith("peer") and mb:
        batches_mb = mb / 1.02
    return Run(case.model, case.bandwidth, case.epochs, case.samples, repeat, variant, split, wall_s, stopped,
               int(mb * 0.97e6), int(mb * 0.03e6), trained if trained is not None else split,
               payload_bytes=int(batches_mb * 1e6) if batches_mb else None)


def issue_case_25() -> tuple[Case, list[Run]]:
    case = Case("resnet50", 25, 1, 320)
    peer = 50.0
    return case, [
        # Its batches carried what all-in-compute's did; 11 MB of probes came on top.
        run(case, "auto", 1.78 * peer, 51.7, trained=ALL_IN_COMPUTE, batches_mb=40.7 / 1.02),
        run(case, "peer w0", 1.10 * peer, 40.9), run(case, "peer w2", peer, 40.9),
        run(case, "peer w4", 1.02 * peer, 40.9),
        run(case, "freeze", 1.29 * peer, 0.9, FREEZE),
        run(case, "all-in-compute", 1.12 * peer, 40.7, ALL_IN_COMPUTE),
        run(case, "split 20", 1.35 * peer, 12.0, 20),
        run(case, "split 7", 120.0, 0.0, 7, stopped=True),  # given up: never the best
    ]


def test_auto_slower_than_the_peer_and_moving_more_than_its_mode_fails_both_verdicts() -> None:
    case, runs = issue_case_25()
    v = judge(case, runs, FREEZE)
    assert v.best_peer == "peer w2" and v.best_other == "peer w2"
    assert v.best_fixed == "split 20"  # the stopped split 7 is not a candidate
    assert round(v.auto_vs_best, 2) == 1.78 and not v.within
    assert {k: round(r, 2) for k, r in v.vs_peer.items()} == {"auto": 1.78, "freeze": 1.29, "all-in-compute": 1.12,
                                                              "best fixed": 1.35}
    assert v.auto_trained == "all-in-compute" and v.traffic_ok is False


def test_freeze_far_ahead_of_auto_at_5_mbit_is_a_miss_even_though_auto_beats_the_peer() -> None:
    case = Case("resnet50", 5, 1, 320)
    peer = 100.0
    runs = [run(case, "auto", 0.96 * peer, 1.2, trained=FREEZE, batches_mb=1.0 / 1.02),
            run(case, "peer w0", peer, 40.9),
            run(case, "freeze", 0.39 * peer, 1.0, FREEZE),
            run(case, "all-in-compute", 1.02 * peer, 40.7, ALL_IN_COMPUTE)]
    v = judge(case, runs, FREEZE)
    assert v.best_other == "freeze" and round(v.auto_vs_best, 2) == 2.46 and not v.within
    assert v.best_fixed is None and v.traffic_ok is False  # 1.2 MB on the link for 0.98 MB of batches
    assert table_rows([v])[0][6] == "-"
    stopped = judge(case, [*runs, run(case, "split 17", 61.0, 0.0, 17, stopped=True)], FREEZE)
    assert table_rows([stopped])[0][6] == ">61.0 (stopped)"  # never the best, but how far off is said


def test_auto_within_5_percent_on_the_median_of_repeats_passes() -> None:
    case = Case("resnet18", 25, 5, 128)
    runs = [run(case, "auto", t, 6.1, repeat=i, trained=10) for i, t in enumerate((31.0, 29.8, 45.0))]
    runs += [run(case, "split 10", t, 6.0, 10, repeat=i) for i, t in enumerate((29.8, 29.6, 30.1))]
    runs += [run(case, "peer w2", 33.0, 55.0), run(case, "freeze", 34.0, 4.0, 11),
             run(case, "all-in-compute", 36.0, 54.8, ALL_IN_COMPUTE)]
    v = judge(case, runs, 11)
    assert v.times["auto"] == 31.0 and v.times["split 10"] == 29.8  # medians: one slow repeat does not decide
    assert v.within and v.traffic_ok  # 31.0 <= 1.05 x 29.8; 6.1 MB <= 1.02 x 6.0 MB
    rows = table_rows([v])
    verdicts = [rows[0][TABLE_HEADERS.index(name)] for name in ("auto within 5%", "traffic <= its batches'")]
    assert rows[0][:4] == ["resnet18", "25", "5x128", "31.0"] and verdicts == ["yes", "yes"]
    assert rows[0][-2:] == ["-", "-"]  # no run of auto without its cache


def test_traffic_verdict_is_unknown_without_autos_batches_and_holds_at_a_split_no_mode_ran() -> None:
    case, runs = issue_case_25()
    runs[0] = run(case, "auto", 60.0, 5.0, trained=13)  # its batches: 4.9 MB at split 13
    assert judge(case, runs, FREEZE).traffic_ok is True
    runs[0] = Run(case.model, case.bandwidth, 1, 320, 0, "auto", None, 60.0, False, 5_000_000, 0, 13)
    assert judge(case, runs, FREEZE).traffic_ok is None


def test_tables_and_closing_line() -> None:
    case, runs = issue_case_25()
    verdicts = [judge(case, runs, FREEZE)]
    markdown = format_table(TABLE_HEADERS, table_rows(verdicts), markdown=True)
    assert markdown.splitlines()[0].startswith("| model | Mbit/s | job | auto s |")
    assert "| 1.78 (peer w2) |" in markdown and "| NO | NO |" in markdown
    plain = format_table(TABLE_HEADERS, table_rows(verdicts)).splitlines()
    assert len(plain) == 2 and len(plain[0]) == len(plain[1])  # columns aligned
    assert closing_line(verdicts).startswith("auto within 5% of the best of {peer, freeze, all-in-compute, best "
                                             "fixed split}: 0/1 cases (worst 1.78x")


def test_block_boundaries_are_where_groups_of_blocks_start_and_end() -> None:
    assert block_boundaries(RESNET50_STAGES, FREEZE, most=6) == [4, 7, 11, 17, 20]
    assert block_boundaries(RESNET50_STAGES, FREEZE, most=3) == [4, 11, 20]
    assert block_boundaries(RESNET50_STAGES[:15], 11, most=6) == [4, 7]  # never at or past the freeze index


def test_trained_split_is_where_most_samples_trained(tmp_path) -> None:
    steps = [{"epoch": 0, "step": i, "samples": 32, "split": 22} for i in range(9)]
    steps += [{"epoch": 0, "step": 9, "samples": 32, "split": 0}, {"epoch": 0, "train": {}, "val": {}}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    assert trained_split(tmp_path, "") == 22  # a late re-plan does not make split 0 the mode
    text = "HAPI: resnet50, split 22/23: storage runs up to 'flatten'\nre-planned: now all-in-compute: raw objects"
    assert trained_split(tmp_path / "none", text) == ALL_IN_COMPUTE


def test_a_table_s_command_measures_the_same_cases_again() -> None:
    settings = parse_args(["--models", "resnet18", "--bandwidths", "25,12.5", "--repeats", "3", "--workers", "2",
                           "--max-fixed", "2", "--uncached"])
    argv = settings.command.split()[4:]  # after "sudo python -m experiments.head_to_head"
    assert parse_args(argv) == settings
    assert parse_args([]).command.endswith("--max-fixed 5 --give-up 1.5 --cache fresh")
