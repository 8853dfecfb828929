#!/usr/bin/env bash
# An A/B of a fresh daemon's first load from object storage with and without a retention budget,
# one device call: another checkout's code (BASELINE: `git archive <commit> client streamer_service
# pyproject.toml` unpacked, with client/streamer_client/_copier.abi3.so copied in) and this tree's,
# in alternating benches, each a fresh SeaweedFS and daemon, each tree run from its own root.
# Prints each bench's rows and the daemon's per-load pipeline lines (docs/benchmarks.md, ingest,
# "Tenth look"). Run after benchmarks/device/ingest.sh, which unpacks `weed`, installs the wheels
# into /tmp/site and keeps the checkpoint in $WORK:
#
#   scripts/probes/retention_ab.sh BASELINE [ROUNDS]
set -uo pipefail
baseline=${1:?usage: retention_ab.sh BASELINE [ROUNDS]}
export PATH=/tmp/weed:$PATH PYTHONUNBUFFERED=1
W=${WORK:-/tmp/iw}
for round in $(seq 1 "${2:-2}"); do
    for tree in "$baseline" .; do
        name=$([ "$tree" = . ] && echo this-tree || echo baseline)
        for retention in 0 "${RETENTION:-12GiB}"; do
            more=(); [ "$retention" = 0 ] || more=(--retention-budget "$retention")
            # From the tree's own root: `python -m` puts the working directory first on sys.path.
            (cd "$tree" && PYTHONPATH=$PWD:$PWD/client:/tmp/site timeout 120 python3 -m streamer_service bench \
                --source seaweed --size "${SIZE:-4GiB}" --shm-budget 8GiB --work-dir "$W" --ranks 1 \
                --scenarios replicated --modes A,B --reps 2 --warmup 0 "${more[@]}") > "/tmp/rab-$name-$retention-$round.txt" 2>&1
            echo "== round $round $name, retention $retention"
            grep -h "rep [12]/2" "/tmp/rab-$name-$retention-$round.txt"
            grep -ho "in [0-9.]* s; .*" "$W/daemon-seaweed/daemon.log" | sed 's/first submission.*first bytes/first bytes/'
        done
    done
done
