#!/usr/bin/env bash
# A tensor-parallel node's load on the lent GPU machine, in one call (docs/benchmarks.md,
# "Tensor-parallel node"): benchmarks/tp_node.py with TP = 8 fresh rank processes, every one on
# cuda:0 (the one GPU), five rows (ours sliced cold and warm, ours without slices, vLLM's own
# safetensors path, plain Run:ai per rank) and the page-locked host-to-GPU rate, in the same run.
# Run from the repository root:
#
#   benchmarks/device/tp.sh
#
# Needs: python3 with torch, numpy, httpx and safetensors; the wheels in $WHEELS (.whl-cold/), the
# set benchmarks/device/run.sh installs (runai-model-streamer and -s3 0.17.0 with boto3, botocore,
# s3transfer and jmespath; fastapi, starlette, uvicorn, pydantic, pydantic-core, pydantic-settings
# and their small dependencies, for the daemon; instanttensor and fastsafetensors are installed
# and not used), installed with ONE `pip install --target`; this checkout with
# client/streamer_client/_copier.abi3.so built (built here with gcc where it is missing): the
# ranks' host copies are counted at the copier.
# Time: not run on a GPU machine yet. Sized to fit one call (600 s at most) on a 16-core H100 host:
# a 6.4 GB checkpoint, 3 rounds of 5 rows after one round not counted; --time-limit starts no round
# that would end past LIMIT seconds, and the table then gives the rounds done.
# Environment: SIZE_GB (6.4), RANKS (8), ROUNDS (3), ROWS (cold,warm,full,vllm,runai), CHECK (1:
# every rank checks every tensor bit-exact; 0: not), LIMIT (480, the bench's --time-limit), OUT
# (where the log and the JSON go).
set -uo pipefail

SIZE_GB=${SIZE_GB:-6.4}
RANKS=${RANKS:-8}
ROUNDS=${ROUNDS:-3}
ROWS=${ROWS:-cold,warm,full,vllm,runai}
OUT=${OUT:-/tmp/tp-node-out}
mkdir -p "$OUT"

rm -rf /tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "${WHEELS:-.whl-cold}"/*.whl || exit 1
export PYTHONPATH=$PWD/client:$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
if [ ! -f client/streamer_client/_copier.abi3.so ]; then
    gcc -O2 -pthread -shared -fPIC $(python3-config --includes) client/streamer_client/_copier.c \
        -o client/streamer_client/_copier.abi3.so || exit 1
fi
# Bytecode as an installed package has it, outside the timed loads.
python3 -m compileall -q client/streamer_client streamer_service /tmp/site >/dev/null 2>&1

{
    nproc; uname -r; python3 --version; getconf PAGE_SIZE; free -g | head -2
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    grep -E ' /dev/shm | /tmp ' /proc/mounts; cat /sys/kernel/mm/transparent_hugepage/shmem_enabled
    python3 -c "import streamer_client._native_copier as c; print('native copier', c.available(), c.COPY_THREADS, 'threads')"
} 2>&1 | tee "$OUT/machine.txt"

FLAGS=()
[ "${CHECK:-1}" = 1 ] || FLAGS+=(--no-check)
python3 benchmarks/tp_node.py --device cuda:0 --ranks "$RANKS" --size-gb "$SIZE_GB" --rounds "$ROUNDS" --rows "$ROWS" \
    --disk-dir /tmp --time-limit "${LIMIT:-480}" "${FLAGS[@]}" --json "$OUT/tp_node.json" 2>&1 | tee "$OUT/tp_node.log"
exit "${PIPESTATUS[0]}"
