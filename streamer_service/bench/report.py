"""The benchmark's output: progress while it runs, then a table (medians, min-max) and ratios, or JSON."""

from __future__ import annotations

import statistics
import sys
from collections import defaultdict
from dataclasses import dataclass

from .ranks import Mode
from .runner import RunResult

__all__ = ["Progress", "RatioRow", "SummaryRow", "format_tables", "missed_targets", "ratios", "summarize"]

# The targets shown beside the ratios they apply to (docs/benchmarks.md).
TIME_TARGETS = {("replicated", 4): 0.30, ("disjoint", None): 1.05}


class Progress:
    """A progress bar on stderr (a line per run when stderr is not a terminal)."""

    def __init__(self, total: int, stream=sys.stderr) -> None:
        self.total = total
        self.count = 0
        self.stream = stream
        self.tty = stream.isatty()
        self._label = ""

    def note(self, text: str) -> None:
        self._clear()
        print(f"bench: {text}", file=self.stream, flush=True)

    def step(self, label: str) -> None:
        self._label = label
        if self.tty:
            self._bar("")

    def done(self, result: RunResult) -> None:
        self.count += 1
        status = f"{result.wall_s:6.2f} s" if result.verified else "FAILED " + "; ".join(result.errors)[:200]
        if self.tty:
            self._bar(status)
            if not result.verified:
                print(file=self.stream)
        else:
            print(f"[{self.count}/{self.total}] {self._label}: {status}", file=self.stream, flush=True)

    def _bar(self, status: str) -> None:
        width = 30
        filled = width * self.count // max(self.total, 1)
        line = f"\r[{'#' * filled}{'.' * (width - filled)}] {self.count}/{self.total} {self._label} {status}"
        self.stream.write(line[:160].ljust(100))
        self.stream.flush()

    def _clear(self) -> None:
        if self.tty and self.count:
            self.stream.write("\n")


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


@dataclass(frozen=True)
class SummaryRow:
    """One source, scenario, rank count and contender, over the timed repetitions (the JSON
    report's ``summary`` entries: ``dataclasses.asdict``)."""

    source: str
    scenario: str
    ranks: int
    mode: str
    label: str
    reps: int  # verified timed repetitions
    failed: int
    verified: bool
    checks: list[str]
    wall_s_median: float | None
    wall_s_min: float | None
    wall_s_max: float | None
    storage_bytes_median: float | None
    unique_bytes: int
    delivered_bytes: float | None
    gb_per_s: float | None
    peak_shm_bytes: int | None
    peak_rss_ranks_bytes: int | None
    peak_rss_daemon_bytes: int | None
    max_rank_hwm_bytes: int | None


@dataclass(frozen=True)
class RatioRow:
    """B (daemon) over A (plain Run:ai) for one source, scenario and rank count."""

    source: str
    scenario: str
    ranks: int
    time_b_over_a: float | None
    time_target: float | None
    bytes_b_over_a: float | None
    bytes_target: float | None


def summarize(results: list[RunResult]) -> list[SummaryRow]:
    """One row per source, scenario, rank count and contender, over the timed repetitions."""
    groups: dict[tuple, list[RunResult]] = defaultdict(list)
    for r in results:
        groups[(r.source, r.scenario, r.ranks, r.mode)].append(r)
    rows = []
    for (source, scenario, ranks, mode), runs in groups.items():
        timed = [r for r in runs if r.rep >= 0] or runs
        ok = [r for r in timed if r.verified]
        walls = [r.wall_s for r in ok]
        wall = _median(walls)
        delivered = _median([r.delivered_bytes for r in ok])
        rows.append(SummaryRow(
            source=source, scenario=scenario, ranks=ranks, mode=mode, label=Mode(mode).label,
            reps=len(ok), failed=len(timed) - len(ok) + sum(not r.verified for r in runs if r.rep < 0),
            verified=all(r.verified for r in runs),
            checks=sorted({r.check for r in runs}),
            wall_s_median=wall, wall_s_min=min(walls) if walls else None, wall_s_max=max(walls) if walls else None,
            storage_bytes_median=_median([r.storage_bytes for r in ok]),
            unique_bytes=timed[0].unique_bytes,
            delivered_bytes=delivered,
            gb_per_s=delivered / wall / 1e9 if wall and delivered else None,
            peak_shm_bytes=max((r.peak_shm_bytes for r in ok if r.peak_shm_bytes is not None), default=None),
            peak_rss_ranks_bytes=max((r.peak_rss_ranks_bytes for r in ok), default=None),
            peak_rss_daemon_bytes=max((r.peak_rss_daemon_bytes for r in ok if r.peak_rss_daemon_bytes is not None),
                                      default=None),
            max_rank_hwm_bytes=max((r.max_rank_hwm_bytes for r in ok), default=None),
        ))  # fmt: skip
    return rows


def ratios(rows: list[SummaryRow]) -> list[RatioRow]:
    """B / A per source, scenario and rank count: wall time and bytes read from storage."""
    by_key = {(r.source, r.scenario, r.ranks, r.mode): r for r in rows}
    out = []
    for (source, scenario, ranks, mode), a in by_key.items():
        b = by_key.get((source, scenario, ranks, Mode.DAEMON.value))
        if mode != Mode.RUNAI.value or b is None:
            continue
        time_ratio = b.wall_s_median / a.wall_s_median if a.wall_s_median and b.wall_s_median else None
        sa, sb = a.storage_bytes_median, b.storage_bytes_median
        target = TIME_TARGETS.get((scenario, ranks), TIME_TARGETS.get((scenario, None)))
        if scenario == "replicated" and ranks == 1:
            target = 1 / 0.95  # single-rank daemon throughput >= 0.95 of plain Run:ai
        out.append(RatioRow(
            source=source, scenario=scenario, ranks=ranks,
            time_b_over_a=time_ratio, time_target=target,
            bytes_b_over_a=sb / sa if sa and sb is not None else None,
            bytes_target=1 / ranks if scenario == "replicated" else None,
        ))  # fmt: skip
    return out


BYTES_SLACK = 0.005
"""How far above its target a bytes ratio may be (the table's last printed digit is 0.001):
headers and listings the daemon reads on top of the tensors."""


def missed_targets(ratio_rows: list[RatioRow]) -> list[str]:
    """Each ratio that misses its row's own target, naming the row, e.g.
    ``local disjoint N=2: time B÷A 2.24, target ≤ 1.05``; a row without a measurement misses too."""
    missed = []
    for r in ratio_rows:
        row = f"{r.source} {r.scenario} N={r.ranks}"
        if r.time_target is not None and (r.time_b_over_a is None or r.time_b_over_a > r.time_target):
            missed.append(f"{row}: time B÷A {_num(r.time_b_over_a, '.2f')}, target ≤ {r.time_target:.2f}")
        if r.bytes_target is not None and (r.bytes_b_over_a is None or r.bytes_b_over_a > r.bytes_target + BYTES_SLACK):
            missed.append(f"{row}: bytes B÷A {_num(r.bytes_b_over_a, '.3f')}, target = {r.bytes_target:.3f}")
    return missed


def _gb(value) -> str:
    return "-" if value is None else f"{value / 1e9:.2f}"


def _num(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def format_tables(rows: list[SummaryRow], ratio_rows: list[RatioRow]) -> str:
    """Markdown tables: the measurements, then the B / A ratios."""
    lines = [
        "| source | scenario | N | contender | wall s (median) | min–max | storage GB | × unique | GB/s | peak shm GB "
        "| peak RSS ranks GB | peak RSS daemon GB | bytes checked |",
        "| --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        spread = "-" if r.wall_s_min is None else f"{r.wall_s_min:.2f}–{r.wall_s_max:.2f}"
        times = "-" if r.storage_bytes_median is None or not r.unique_bytes else f"{r.storage_bytes_median / r.unique_bytes:.2f}"
        checked = ("ok" if r.verified else f"FAILED ({r.failed})") + f", {'+'.join(r.checks)}"
        lines.append(
            f"| {r.source} | {r.scenario} | {r.ranks} | {r.label} | {_num(r.wall_s_median, '.2f')} | {spread} "
            f"| {_gb(r.storage_bytes_median)} | {times} | {_num(r.gb_per_s, '.2f')} | {_gb(r.peak_shm_bytes)} "
            f"| {_gb(r.peak_rss_ranks_bytes)} | {_gb(r.peak_rss_daemon_bytes)} | {checked} |"
        )
    if ratio_rows:
        lines += [
            "",
            "| source | scenario | N | time B÷A | target | bytes B÷A | target |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
        ]
        for r in ratio_rows:
            lines.append(
                f"| {r.source} | {r.scenario} | {r.ranks} | {_num(r.time_b_over_a, '.2f')} "
                f"| {'≤ ' + format(r.time_target, '.2f') if r.time_target else ''} | {_num(r.bytes_b_over_a, '.3f')} "
                f"| {'= ' + format(r.bytes_target, '.3f') if r.bytes_target else ''} |"
            )
    return "\n".join(lines)
