#!/usr/bin/env bash
# Object-storage ingest, variants of the daemon's sizing side by side (one device call): SeaweedFS on
# loopback, plain Run:ai (A) against the daemon (B). Prints each variant's table and the daemon's
# per-session pipeline line. Needs what benchmarks/device/ingest.sh needs; runs the working tree's code.
set -uo pipefail
export PYTHONUNBUFFERED=1
if [ ! -x /tmp/weed/weed ]; then mkdir -p /tmp/weed && xz -dc .weed/weed.xz > /tmp/weed/weed.part && chmod +x /tmp/weed/weed.part && mv /tmp/weed/weed.part /tmp/weed/weed; fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PATH=/tmp/weed:$PATH PYTHONPATH=$PWD:$PWD/client:/tmp/site
python3 -c "import fastapi, uvicorn, boto3, runai_model_streamer, streamer_service.daemon.api, streamer_service.bench.runner" || exit 1
W=${WORK:-/tmp/iw}; L=${OUT:-/tmp}/probe; mkdir -p "$W" "$L"
nproc; free -g | head -2
b() {
    tag=$1; shift
    echo "=== $tag: $*"; start=$(date +%s)
    timeout 200 python3 -m streamer_service bench --source seaweed --size "${SIZE:-4GiB}" --shm-budget 8GiB --work-dir "$W" \
        --json "$L/$tag.json" --check-targets "$@" > "$L/$tag.txt" 2>&1 || tail -5 "$L/$tag.txt"
    cp "$W/daemon-seaweed/daemon.log" "$L/$tag.daemon.log" 2>/dev/null
    grep -ho "in [0-9.]* s; .*" "$L/$tag.daemon.log"
    python3 benchmarks/ingest_table.py "$L/$tag.json" | grep -v "^$" | grep -v "Run:ai env"
    echo "($(( $(date +%s) - start )) s)"
}
for v in "$@"; do eval "$v"; done
tar czf "${OUT:-/tmp}/probe.tgz" -C "$(dirname "$L")" probe
