"""The benchmark's output: progress while it runs, then a table (medians, min-max) and ratios, or JSON."""

from __future__ import annotations

import statistics
import sys
from collections import defaultdict
from dataclasses import dataclass

from .ranks import Mode
from .runner import RunResult

__all__ = [
    "TIME_TARGETS",
    "Progress",
    "RatioRow",
    "SummaryRow",
    "TimeTargets",
    "Verdict",
    "format_tables",
    "missed_byte_ratios",
    "missed_time_targets",
    "ratios",
    "summarize",
    "verdict",
]


@dataclass(frozen=True)
class TimeTargets:
    """The time B÷A targets and the runs they are set for: a machine of ``machine``'s class (at
    least ``cpus`` cores) loading a checkpoint of at least ``checkpoint_bytes``. On a smaller
    machine or checkpoint they are references: where the bench's own processes share few cores,
    or a load takes milliseconds, noise moves the ratios across them."""

    machine: str
    cpus: int
    checkpoint: str
    checkpoint_bytes: int
    by_row: dict[tuple[str, int | None], float]  # (scenario, ranks; None: any) -> B÷A at most

    def for_row(self, scenario: str, ranks: int) -> float | None:
        return self.by_row.get((scenario, ranks), self.by_row.get((scenario, None)))

    def hold_for(self, cpus: int | None, checkpoint_bytes: int) -> bool:
        """Whether a run on ``cpus`` cores with a checkpoint of ``checkpoint_bytes`` is one they are set for."""
        return (cpus or 0) >= self.cpus and checkpoint_bytes >= self.checkpoint_bytes

    @property
    def set_for(self) -> str:
        return f"{self.machine}, {self.checkpoint}"


# The one definition of the time targets shown beside the ratios they apply to (docs/benchmarks.md).
TIME_TARGETS = TimeTargets(
    machine="16-core GPU host",
    cpus=16,
    checkpoint="2 GiB",
    checkpoint_bytes=2 * 2**30,
    by_row={
        ("replicated", 1): 1 / 0.95,  # single-rank daemon throughput >= 0.95 of plain Run:ai
        ("replicated", 4): 0.30,
        ("disjoint", None): 1.05,
    },
)


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
        out.append(RatioRow(
            source=source, scenario=scenario, ranks=ranks,
            time_b_over_a=time_ratio, time_target=TIME_TARGETS.for_row(scenario, ranks),
            bytes_b_over_a=sb / sa if sa and sb is not None else None,
            bytes_target=1 / ranks if scenario == "replicated" else None,
        ))  # fmt: skip
    return out


BYTES_SLACK = 0.005
"""How far above its target a bytes ratio may be (the table's last printed digit is 0.001):
headers and listings the daemon reads on top of the tensors."""


def missed_byte_ratios(ratio_rows: list[RatioRow]) -> list[str]:
    """Each storage-byte ratio off its row's exact target, naming the row, e.g.
    ``seaweed replicated N=2: bytes B÷A 0.520, target = 0.500``. A source that counts no bytes
    (``-`` in the table) has nothing to miss."""
    return [
        f"{r.source} {r.scenario} N={r.ranks}: bytes B÷A {r.bytes_b_over_a:.3f}, target = {r.bytes_target:.3f}"
        for r in ratio_rows
        if r.bytes_target is not None and r.bytes_b_over_a is not None and r.bytes_b_over_a > r.bytes_target + BYTES_SLACK
    ]


def missed_time_targets(ratio_rows: list[RatioRow], word: str = "target") -> list[str]:
    """Each time ratio over its row's target, naming the row, e.g.
    ``local disjoint N=2: time B÷A 2.24, target ≤ 1.05`` (``word``: target or reference); a row
    without a measurement misses too."""
    return [
        f"{r.source} {r.scenario} N={r.ranks}: time B÷A {_num(r.time_b_over_a, '.2f')}, {word} ≤ {r.time_target:.2f}"
        for r in ratio_rows
        if r.time_target is not None and (r.time_b_over_a is None or r.time_b_over_a > r.time_target)
    ]


@dataclass(frozen=True)
class Verdict:
    """What a bench run's exit status says, and the closing lines that say why.

    A run is correct when every run's bytes matched safetensors with no errors and every
    storage-byte ratio is exact; that alone is the exit status. A time ratio over its target is
    reported, and fails the run only with ``check_targets``. Where the run is not on the machine
    class and checkpoint size the time targets are set for (:data:`TIME_TARGETS`), they are
    shown as references."""

    verified: bool  # every run's bytes matched safetensors, and no run failed
    ratio_rows: list[RatioRow]
    cpus: int | None
    checkpoint_bytes: int
    check_targets: bool

    @property
    def targets_hold(self) -> bool:
        """Whether this run is on the machine class and checkpoint size the time targets are set for."""
        return TIME_TARGETS.hold_for(self.cpus, self.checkpoint_bytes)

    @property
    def time_word(self) -> str:
        """What a time ratio's bound is on this run: a target, or a reference."""
        return "target" if self.targets_hold or self.check_targets else "reference"

    @property
    def missed_byte_ratios(self) -> list[str]:
        return missed_byte_ratios(self.ratio_rows)

    @property
    def missed_time_targets(self) -> list[str]:
        return missed_time_targets(self.ratio_rows, self.time_word)

    @property
    def correct(self) -> bool:
        return self.verified and not self.missed_byte_ratios

    @property
    def ok(self) -> bool:
        """The exit status: 0 when true."""
        return self.correct and not (self.check_targets and self.missed_time_targets)

    def lines(self) -> list[str]:
        """The closing lines: the time ratios over their bound (one line), then the verdict."""
        out = []
        if missed := self.missed_time_targets:
            where = "" if self.targets_hold else f"; this run: {self.cpus} CPUs, {self.checkpoint_bytes / 1e9:.2f} GB"
            if self.check_targets:
                head, note = "bench: FAILED: ", f"--check-targets{where}"
            elif self.targets_hold:
                head, note = "bench: ", "not a verdict without --check-targets"
            else:
                head, note = "bench: ", f"a reference, not a verdict{where}"
            out.append(
                f"{head}time B÷A over its {self.time_word}, set for a {TIME_TARGETS.machine} and a "
                f"{TIME_TARGETS.checkpoint} checkpoint ({note}): {'; '.join(missed)}"
            )
        if not self.verified:
            out.append("bench: FAILED: runs that failed or bytes that did not match safetensors (see the table)")
        out += [f"bench: FAILED: storage bytes off their exact ratio: {line}" for line in self.missed_byte_ratios]
        if self.ok:
            met = " and every time B÷A met its target" if self.check_targets else ""
            out.append(f"bench: OK, every run's bytes matched safetensors, every storage-byte ratio was exact{met}")
        return out


def verdict(
    runs: list[RunResult], ratio_rows: list[RatioRow], *, cpus: int | None, checkpoint_bytes: int, check_targets: bool = False
) -> Verdict:
    """The verdict on a bench's runs and their B÷A rows, on ``cpus`` cores with a checkpoint of
    ``checkpoint_bytes``; ``check_targets``: a time ratio over its target fails the run too."""
    return Verdict(all(r.verified for r in runs), ratio_rows, cpus, checkpoint_bytes, check_targets)


def _gb(value) -> str:
    return "-" if value is None else f"{value / 1e9:.2f}"


def _num(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def format_tables(rows: list[SummaryRow], ratio_rows: list[RatioRow], time_word: str = "target") -> str:
    """Markdown tables: the measurements, then the B / A ratios, the time ratios' bounds headed
    ``time_word`` (target or reference) and the runs they are set for."""
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
            f"| source | scenario | N | time B÷A | {time_word} ({TIME_TARGETS.set_for}) | bytes B÷A | target |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
        ]
        for r in ratio_rows:
            lines.append(
                f"| {r.source} | {r.scenario} | {r.ranks} | {_num(r.time_b_over_a, '.2f')} "
                f"| {'≤ ' + format(r.time_target, '.2f') if r.time_target else ''} | {_num(r.bytes_b_over_a, '.3f')} "
                f"| {'= ' + format(r.bytes_target, '.3f') if r.bytes_target else ''} |"
            )
    return "\n".join(lines)
