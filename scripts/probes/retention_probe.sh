#!/usr/bin/env bash
# A retained and an unretained cold load on fresh daemons, each with the host sampled every 50 ms
# (scripts/probes/host_sampler.py), one device call (docs/benchmarks.md, ingest, "Seventh look").
# Needs what benchmarks/device/ingest.sh needs (.weed/, .whl/, the native copier); runs the working
# tree's code. Writes to $OUT: each bench's output, its daemon log and its samples.
set -uo pipefail
mkdir -p /tmp/weed "${OUT:=/tmp/retention-probe}"
[ -x /tmp/weed/weed ] || { xz -dc .weed/weed.xz > /tmp/weed/weed.part && chmod +x /tmp/weed/weed.part && mv /tmp/weed/weed.part /tmp/weed/weed; }
rm -rf /tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PATH=/tmp/weed:$PATH PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/client:/tmp/site
W=${WORK:-/tmp/iw}
nproc
bench() {  # the checkpoint is made (and uploaded) by the first
    timeout "${BENCH_S:-120}" python3 -m streamer_service bench --source seaweed --size "${SIZE:-4GiB}" --shm-budget 8GiB \
        --work-dir "$W" --ranks 1 --scenarios replicated "$@"
}
bench --modes A --reps 1 --warmup 0 > "$OUT/make.txt" 2>&1
for name in retained unretained; do
    more=(); [ $name = retained ] && more=(--retention-budget "${RETENTION:-12GiB}")
    python3 scripts/probes/host_sampler.py "$OUT/samples-$name.txt" 40 &
    sampler=$!
    bench --modes A,B --reps 2 --warmup 0 "${more[@]}" > "$OUT/$name.txt" 2>&1
    kill $sampler 2>/dev/null; wait $sampler 2>/dev/null
    cp "$W/daemon-seaweed/daemon.log" "$OUT/daemon-$name.log"
    grep -h "rep [12]/2" "$OUT/$name.txt" | sed "s/^/$name: /"
    grep -h "in [0-9.]* s; " "$OUT/daemon-$name.log" | sed "s/^/$name: /"
done
