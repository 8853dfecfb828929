"""One table from the JSON reports of benchmarks/device/ingest.sh: the issue's rows, a fresh
daemon's loads, then retention.

    python benchmarks/ingest_table.py MAIN.json [FRESH.json [RETENTION.json]]

MAIN: ``bench --modes A,B[,C] --reps R --warmup 1``; FRESH: ``bench --modes A,B --ranks 1
--scenarios replicated --reps 2 --warmup 0`` (B's repetition 1 is a fresh daemon's first load, 2
its second, both sample-checked; A's read before each warms the bench's new storage server);
RETENTION: the same with ``--retention-budget ...`` (repetition 1 streams into kept segments, 2
is served from memory). The targets are those of TARGETS below
(B ÷ A per scenario and rank count) and the two ≤ 1.10 rows.
"""

from __future__ import annotations

import json
import statistics
import sys

TARGETS = {("replicated", 1): 1.0, ("disjoint", 1): 1.0, ("replicated", 4): 0.27, ("disjoint", 4): 0.6}


def _runs(path: str) -> tuple[dict, list[dict]]:
    report = json.load(open(path))
    return report, report["runs"]


def _median(runs: list[dict], **match) -> float | None:
    walls = [r["wall_s"] for r in runs if r["verified"] and all(r[k] == v for k, v in match.items())]
    return statistics.median(walls) if walls else None


def _reps(path: str) -> list[dict]:
    """The verified B runs of a ``--warmup 0`` report, in repetition order."""
    _, runs = _runs(path)
    return sorted((r for r in runs if r["mode"] == "B" and r["verified"]), key=lambda r: r["rep"])


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None or not b else f"{a / b:.2f}"


def main(argv: list[str]) -> int:
    report, runs = _runs(argv[0])
    timed = [r for r in runs if r["rep"] >= 0]
    gb = report["config"]["checkpoint_bytes"] / 1e9
    print(f"\n{report['machine'].get('cpus')} CPUs; {gb:.2f} GB; shm budget {report['config']['shm_budget']}; "
          f"Run:ai env {report['config']['runai_env']}; medians of {report['config']['reps']}\n")  # fmt: skip
    print("| row | A plain Run:ai | B daemon | C embedded | B ÷ A | target | B storage ÷ unique |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    groups = dict.fromkeys((r["scenario"], r["ranks"]) for r in timed)
    for scenario, n in groups:
        a, b, c = (_median(timed, scenario=scenario, ranks=n, mode=m) for m in "ABC")
        stored = [r["storage_bytes"] / r["unique_bytes"] for r in timed
                  if r["mode"] == "B" and r["scenario"] == scenario and r["ranks"] == n and r["storage_bytes"]]  # fmt: skip
        target = TARGETS.get((scenario, n))
        print(f"| {scenario} N={n} | {_s(a)} s | {_s(b)} s | {_s(c)} s | {_ratio(b, a)} | "
              f"{'≤ ' + format(target, '.2f') if target else ''} | {max(stored):.3f} |" if stored else
              f"| {scenario} N={n} | {_s(a)} s | {_s(b)} s | {_s(c)} s | {_ratio(b, a)} | | - |")  # fmt: skip
    print()
    print("| daemon load (N=1, replicated) | s | GB/s | ratio | target |")
    print("| --- | ---: | ---: | ---: | ---: |")
    fresh = _reps(argv[1]) if len(argv) > 1 else []
    first = fresh[0]["wall_s"] if fresh else None
    second = fresh[1]["wall_s"] if len(fresh) > 1 else None
    if first:
        print(f"| fresh daemon, first load | {first:.2f} | {gb / first:.2f} | {_ratio(first, second)} × its second | ≤ 1.10 |")
    if second:
        print(f"| its second load | {second:.2f} | {gb / second:.2f} | | |")
    kept = _reps(argv[2]) if len(argv) > 2 else []
    if kept:
        cold = kept[0]["wall_s"]
        print(f"| retention on: fresh daemon, first load (cold) | {cold:.2f} | {gb / cold:.2f} | "
              f"{_ratio(cold, first)} × without ({_ratio(cold, second)} × its second) | ≤ 1.10 |")  # fmt: skip
    if len(kept) > 1:
        warm = kept[1]["wall_s"]
        print(f"| retention on: reload from memory | {warm:.2f} | {gb / warm:.2f} | storage bytes {kept[1]['storage_bytes']} | |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
