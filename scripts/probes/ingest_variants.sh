#!/usr/bin/env bash
# N = 1 object-storage ingest with variants at the rank, one device call (docs/benchmarks.md,
# ingest, "Eleventh look"): plain Run:ai (A) against the daemon (B), replicated and disjoint, two
# loads each, once per variant: owned tensors (the bench's default), borrowed views (no copy at
# the rank), and owned tensors copied by 4 and by 2 copying threads (LOCAL_WORLD_SIZE: the rank's
# share of the host's CPUs). Prints each bench's rows and the daemon's per-load lines. Run from the
# repository root; needs what benchmarks/device/ingest.sh needs (`weed`, the wheels in .whl/),
# which it unpacks and installs when missing:
#
#   scripts/probes/ingest_variants.sh [ROUNDS]
set -uo pipefail
mkdir -p /tmp/weed
if [ ! -x /tmp/weed/weed ]; then
    xz -dc .weed/weed.xz > /tmp/weed/weed.part && chmod +x /tmp/weed/weed.part && mv /tmp/weed/weed.part /tmp/weed/weed
fi
[ -d /tmp/site/runai_model_streamer ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PATH=/tmp/weed:$PATH PYTHONPATH=$PWD:$PWD/client:/tmp/site PYTHONUNBUFFERED=1
W=${WORK:-/tmp/iw}
echo "$(nproc) CPUs"
bench() {
    local name=$1 variables=$2
    shift 2
    env $variables timeout 150 python3 -m streamer_service bench --source seaweed --size "${SIZE:-4GiB}" --shm-budget 8GiB \
        --work-dir "$W" --ranks 1 --scenarios replicated,disjoint --modes A,B --reps 2 --warmup 0 "$@" > "/tmp/variant-$name.txt" 2>&1
    echo "== $name ($variables $*)"
    grep -E "^\| seaweed \|" "/tmp/variant-$name.txt"
    grep -ho "in [0-9.]* s; .*" "$W/daemon-seaweed/daemon.log" | sed 's/first submission.*first bytes/first bytes/'
}
for _ in $(seq 1 "${1:-1}"); do
    bench owned ""
    bench borrowed "" --borrowed
    bench threads4 LOCAL_WORLD_SIZE=4
    bench threads2 LOCAL_WORLD_SIZE=8
done
