#!/usr/bin/env bash
# An A/B of a daemon-side change on the cold-start rows, one device call: the rows of this tree,
# then the same rows of another whole checkout (BASELINE: `git archive <commit> client
# streamer_service pyproject.toml` unpacked, with client/streamer_client/_copier.abi3.so copied
# in; this tree's benchmarks/ is copied over it, so that both run the same bench), each run of
# benchmarks/device/run.sh from its own tree's root, so that its daemon is that tree's too
# (`benchmarks/cold_start.py --baseline` swaps the ranks' code only); then the
# device tests of this tree. Prints each table, the tests' summary and, per load, the daemon's
# pipeline line (load time, first bytes, read span, getting buffers, waiting for a release, the
# ring's slots). Carry .whl-cold, the baseline and the copier; from the repository root:
#
#   scripts/probes/cold_start_ab.sh BASELINE
#
# Environment: ROWS (default: InstantTensor on 4 KiB tmpfs and the daemon rows), PROCS (3),
# TESTS_S (150; 0 skips the tests), OUT (where the outputs go).
set -uo pipefail
baseline=$(cd "${1:?usage: cold_start_ab.sh BASELINE}" && pwd)
root=$PWD
OUT=${OUT:-/tmp/cold-start-ab}
mkdir -p "$OUT"
ROWS=${ROWS:-"InstantTensor 0.2.2, tmpfs (4 KiB);daemon warm restart;daemon, 1 rank;daemon, 4 fresh;plain Run:ai, 4"}

lines() {  # the daemon's line for each load, its figures only
    grep -ho "[0-9] ranks): .*" "$1"/daemon-*.log | python3 -c '
import re, sys
for line in sys.stdin:
    def g(p):
        m = re.search(p, line)
        return m.group(1) if m else "-"
    print(g(r"(\d) ranks"), "ranks, load", g(r"in ([\d.]+) s;"), "s, first bytes", g(r"first bytes after ([\d.]+)"),
          "s, read span", g(r"read span ([\d.]+)"), "s, buffers", g(r"([\d.]+) s getting"),
          "s, release", g(r"([\d.]+) s waiting for a rel"), "s, ring", g(r"ring of (\d+)"))'
}

rm -rf "$baseline/benchmarks" && cp -r "$root/benchmarks" "$baseline/"
for tree in this "$baseline"; do
    dir=$root name=this
    [ "$tree" != this ] && dir=$tree name=baseline
    (cd "$dir" && PROCS=${PROCS:-3} RELOADS=1 PROFILE=0 IMPORTS=0 TESTS=0 WHEELS=$root/.whl-cold OUT="/tmp/cs-$name" \
        ROWS="$ROWS" timeout 280 benchmarks/device/run.sh) > "$OUT/$name.txt" 2>&1
    echo "== $name"
    sed -n '/^Our first loads\|^path (every load/,$p' "/tmp/cs-$name/cold_start.log" 2>/dev/null || tail -n 20 "$OUT/$name.txt"
    lines "/tmp/cs-$name" | tee "$OUT/$name-lines.txt"
done
if [ "${TESTS_S:-150}" -gt 0 ]; then
    BENCH=0 IMPORTS=0 TESTS_S=${TESTS_S:-150} WHEELS=.whl-cold OUT=/tmp/cs-tests benchmarks/device/run.sh > "$OUT/tests.txt" 2>&1
    tail -n 3 "$OUT/tests.txt"
fi
