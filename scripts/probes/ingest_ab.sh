#!/usr/bin/env bash
# An A/B of the daemon's object-storage ingest at N = 1, one device call: another checkout's code
# (BASELINE: `git archive <commit> client streamer_service pyproject.toml` unpacked, with
# client/streamer_client/_copier.abi3.so copied in) and this tree's, in alternating benches, each
# with its own SeaweedFS and daemon, each tree run from its own root. Prints each bench's rows and
# the daemon's per-load pipeline lines (docs/benchmarks.md, ingest, "Eighth look" and "Tenth
# look"). Run after benchmarks/device/ingest.sh, which unpacks `weed`, installs the wheels into
# /tmp/site and keeps the checkpoint in $WORK:
#
#   scripts/probes/ingest_ab.sh BASELINE [ROUNDS]
#
# Each tree's bench: replicated and disjoint, A and B, two loads each. With RETENTION set (e.g.
# 12GiB), two benches a tree instead, replicated only: a fresh daemon without a retention budget,
# then one with it (B's first load is the fresh daemon's first; its second, a reload from memory).
# With FRESH=1, one bench a tree, replicated only, three loads: a fresh daemon's first load against
# its next two (docs/benchmarks.md, ingest, "Twelfth look").
set -uo pipefail
baseline=${1:?usage: ingest_ab.sh BASELINE [ROUNDS]}
export PATH=/tmp/weed:$PATH PYTHONUNBUFFERED=1
W=${WORK:-/tmp/iw}
reps=2
if [ -n "${RETENTION:-}" ]; then variants=(0 "$RETENTION") scenarios=replicated; else variants=(0) scenarios=replicated,disjoint; fi
if [ -n "${FRESH:-}" ]; then variants=(0) scenarios=replicated reps=3; fi
for round in $(seq 1 "${2:-2}"); do
    for tree in "$baseline" .; do
        name=$([ "$tree" = . ] && echo this-tree || echo baseline)
        for retention in "${variants[@]}"; do
            more=(); [ "$retention" = 0 ] || more=(--retention-budget "$retention")
            out=/tmp/ab-$name-$retention-$round.txt
            # From the tree's own root: `python -m` puts the working directory first on sys.path, ahead
            # of PYTHONPATH, and the bench's daemon and ranks inherit it.
            (cd "$tree" && PYTHONPATH=$PWD:$PWD/client:/tmp/site timeout 150 python3 -m streamer_service bench \
                --source seaweed --size "${SIZE:-4GiB}" --shm-budget 8GiB --work-dir "$W" --ranks 1 \
                --scenarios "$scenarios" --modes A,B --reps "$reps" --warmup 0 "${more[@]}") > "$out" 2>&1
            echo "== round $round $name, retention $retention"
            grep -E "^\| seaweed \|" "$out"
            grep -h "rep [1-9]/$reps" "$out"
            grep -ho "in [0-9.]* s; .*" "$W/daemon-seaweed/daemon.log" | sed 's/first submission.*first bytes/first bytes/'
            grep -ho "storage backends .*" "$W/daemon-seaweed/daemon.log"
        done
    done
done
