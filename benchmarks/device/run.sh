#!/usr/bin/env bash
# A fresh process's first load on the lent GPU machine, in one call (docs/benchmarks.md, "A fresh
# process's first load"): the cold-start table (benchmarks/cold_start.py), our imports
# (benchmarks/import_time.py) and the CUDA tests as one suite in a fixed order. Run from the
# repository root:
#
#   benchmarks/device/run.sh
#
# Needs: python3 with torch, numpy, httpx, safetensors and pytest; the wheels in $WHEELS (.whl-cold/)
# (instanttensor 0.2.2, fastsafetensors 0.5.0, runai-model-streamer and -s3 0.17.0 with boto3,
# botocore, s3transfer and jmespath, which Run:ai imports for any load; fastapi (with annotated-doc and
# opentelemetry-api, which it imports from 0.165), starlette, uvicorn,
# pydantic, pydantic-core, pydantic-settings and their small dependencies),
# installed with ONE `pip install --target`; this checkout with client/streamer_client/_copier.abi3.so
# built (`pip install -e client`), which is the streamer-client and streamer-service it runs. Root,
# for the huge=always tmpfs (skipped where it cannot be mounted).
# Time: on the 16-core H200 host (2026-12-03) the cold-start rows with RELOADS=1 took about 300 s
# (setup 30 s, 13 rows x 4 rounds) and the profiles more than the 330 s that call had: give the
# bench a call of its own (TESTS=0 IMPORTS=0, timeout 600) and the tests and imports another (BENCH=0).
# Environment: SIZE_GB (6.44), PROCS (3), RELOADS (2), ROWS (all), PROFILE (1), BASELINE (another checkout's
# client/ and streamer_service/, e.g. `git archive` of a commit with the copier built: an A/B of each row of
# ours in the same rounds), BENCH (1), IMPORTS (1),
# TESTS (1), TESTS_S (the suite's time limit, at most what is left of LIMIT, 570 s), TEST_FILES and TEST_K
# (the suite's files and its -k expression; default: the CUDA tests and those of the data path), OUT (where
# the logs go).
set -uo pipefail

SIZE_GB=${SIZE_GB:-6.44}
PROCS=${PROCS:-3}
RELOADS=${RELOADS:-2}
ROWS=${ROWS:-}
OUT=${OUT:-/tmp/cold-start-out}
mkdir -p "$OUT"

rm -rf /tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "${WHEELS:-.whl-cold}"/*.whl || exit 1
export PYTHONPATH=$PWD/client:$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# The checkout runs from PYTHONPATH, not installed: register its in-process backend (the client
# finds it by its entry point) as `pip install` would.
python3 - <<'PY' || exit 1
import pathlib, tomllib
points = tomllib.loads(pathlib.Path("pyproject.toml").read_text())["project"]["entry-points"]
info = pathlib.Path("/tmp/site/streamer_service-0+checkout.dist-info")
info.mkdir(exist_ok=True)
(info / "METADATA").write_text("Metadata-Version: 2.1\nName: streamer-service\nVersion: 0+checkout\n")
(info / "entry_points.txt").write_text("".join(
    f"[{group}]\n" + "".join(f"{name} = {target}\n" for name, target in eps.items()) for group, eps in points.items()))
PY
# Bytecode as an installed package has it (pip compiles on install), outside the timed loads; the
# baseline's too, or its ranks compile their lazy imports inside the clock.
python3 -m compileall -q client/streamer_client streamer_service /tmp/site \
    ${BASELINE:+"$BASELINE/client/streamer_client" "$BASELINE/streamer_service"} >/dev/null 2>&1

{
    nproc; uname -r; python3 --version; ldd --version | head -1; getconf PAGE_SIZE
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    grep -E ' /dev/shm | /tmp ' /proc/mounts; cat /sys/kernel/mm/transparent_hugepage/shmem_enabled
    python3 -c "import streamer_client._native_copier as c; print('native copier', c.available(), c.COPY_THREADS, 'threads')"
} 2>&1 | tee "$OUT/machine.txt"

THP=/mnt/cold-start-thp
mkdir -p "$THP"
THP_ARGS=()
if mount -t tmpfs -o huge=always,size=$(python3 -c "print(int($SIZE_GB * 3 + 8))")G tmpfs "$THP"; then
    THP_ARGS=(--thp-dir "$THP")
else
    echo "no huge=always tmpfs: the huge-page rows are skipped"
fi

FLAGS=()
[ "${PROFILE:-1}" = 1 ] && FLAGS+=(--profile)
[ -n "${BASELINE:-}" ] && FLAGS+=(--baseline "$BASELINE")
if [ "${BENCH:-1}" = 1 ]; then
    python3 benchmarks/cold_start.py --size-gb "$SIZE_GB" --procs "$PROCS" --reloads "$RELOADS" --disk-dir /tmp \
        "${THP_ARGS[@]}" --rows "$ROWS" "${FLAGS[@]}" --out "$OUT" --json "$OUT/cold_start.json" 2>&1 | tee "$OUT/cold_start.log"
fi

if [ "${IMPORTS:-1}" = 1 ]; then
    python3 benchmarks/import_time.py --device cuda:0 --runs 5 ${BASELINE:+--baseline "$BASELINE"} 2>&1 | tee "$OUT/import_time.log" | tail -12
fi

LEFT=$((${LIMIT:-570} - SECONDS))
[ -n "${TESTS_S:-}" ] && [ "$TESTS_S" -lt "$LEFT" ] && LEFT=$TESTS_S
if [ "${TESTS:-1}" = 1 ] && [ "$LEFT" -ge 30 ]; then
    # One pytest process, this order: a test that asserts the process's page-locked ranges must
    # hold whichever tests ran before it.
    timeout "$LEFT" python3 -m pytest -p no:cacheprovider -q -n 0 ${TEST_FILES:-\
        tests/test_cuda.py tests/test_cuda_daemon.py tests/test_first_load.py tests/test_buffers.py \
        tests/test_delivery.py tests/test_segments.py tests/test_mapped.py tests/test_copier.py tests/test_shm.py tests/test_imports.py} \
        -k "${TEST_K:-not s3 and not gcs and not azure and not every_scheme_has_a_backend}" > "$OUT/tests.log" 2>&1
    echo "tests exit $?"
    grep -E "passed|failed|error" "$OUT/tests.log" | tail -3
fi
umount "$THP" 2>/dev/null
# The table, last (the reply carries the end of the output).
[ -f "$OUT/cold_start.log" ] && sed -n '/^Our first loads\|^path (every load/,$p' "$OUT/cold_start.log"
