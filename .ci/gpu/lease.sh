#!/usr/bin/env bash
# One lent-GPU session in one call: `make gpu-install`, the CUDA tests, the sanitizer, then the
# benchmarks one file at a time (each file's JSON is kept even if a later one runs out of time).
# Leases are minutes long, so every stage has its own limit, all of them share DEADLINE_S (a stage
# gets what is left; under 15 s it is skipped, so the call returns its logs inside the device tool's
# limit), and the tests a per-test limit: a hung kernel costs a minute, not the lease. Full logs and
# JSONs go to $OUT (the device tool brings that folder back; elsewhere build/lease); with more than
# 7 files there (the tool returns 8) they are packed into $OUT/lease.tgz. A summary with each log's
# tail is printed last.
#
#   bash .ci/gpu/lease.sh                      # needs wheelhouse/ from `make gpu-wheels gpu-kernels`
#   BENCH_FILES="moe" STAGES="build test" bash .ci/gpu/lease.sh
#   STAGES="build sanitize test breakdown" TEST_ARGS="tests/kernels/moe/test_moe_cuda.py" bash .ci/gpu/lease.sh
#   STAGES="build sweep" bash .ci/gpu/lease.sh     # time every tile and knob of the Hopper kernels
#   STAGES="bench" BENCH_K="mixtral-T4096 or N16384-H4096" bash .ci/gpu/lease.sh   # -k: a few cases
#   STAGES="profile" bash .ci/gpu/lease.sh    # Nsight Compute on benchmarks/ncu_targets.py's kernels
#   STAGES="build driver" bash .ci/gpu/lease.sh   # the driver's training runs on the GPU (.ci/gpu/driver_runs.py)
#
# The benchmarks run with PYKERNELS_BENCH_RETIME=0: the gate judges the one run (benchmarks/gate_plugin.py)
# instead of timing failing rules again (on the 2026-11-27 lease: every case of the three failing LoRA
# ops, twice), which, stopped by the stage's limit, loses the file's JSON (written when the session ends).
#
# A 15-minute lease (2026-11-27, second lease: build 184 s, tests 170 s on 12 processes, sanitizer
# 56 s, sweep 45 s; then every case of a benchmark file in 20-60 s, the breakdown 22 s): a first
# call of DEADLINE_S=555 with STAGES="build test sanitize sweep", then at once (the machine stays
# warm 30 s) STAGES="bench" and "breakdown" calls for what time is left (benchmarks/results/h100.md).
# With the prebuilt kernels (2026-11-29, H200: build 98 s, driver runs 232 + 138 s, tests 204 s, sweep 73 s):
# STAGES="build driver test sweep" in a first call of DEADLINE_S=565, the rest in a second
# (benchmarks/results/h200.md).
set -u
shopt -s nullglob  # no log yet: no line for it
cd "$(dirname "$0")/../.."
OUT=${OUT:-build/lease}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
STAGES=${STAGES-"build test sanitize driver bench"}  # set and empty: no stage
BENCH_FILES=${BENCH_FILES:-"moe logprobs lora"}
BENCH_K=${BENCH_K:-}  # a pytest -k expression selecting benchmark cases; empty: every case of each file
PY=${GPU_PYTHON:-python3}  # the image's python, with its CUDA torch
TEST_TIMEOUT_S=${TEST_TIMEOUT_S:-90}
DEADLINE=$(($(date +%s) + ${DEADLINE_S:-3600}))
TEST_ARGS=${TEST_ARGS:-}  # test files / node ids to run instead of every CUDA test (.ci/gpu/test.py)
DRIVER_ARGS=${DRIVER_ARGS:-}  # .ci/gpu/driver_runs.py's options, e.g. "--runs lora,speed-ours,speed-torch --steps 30"
summary=()
failed=0

step() {  # step NAME LOG LIMIT_S COMMAND...: runs COMMAND under LIMIT_S (or what is left), appending to $OUT/LOG.log
    local name=$1 log=$2 limit=$3 start rc left
    shift 3
    left=$((DEADLINE - $(date +%s)))
    [ "$left" -lt "$limit" ] && limit=$left
    if [ "$limit" -lt 15 ]; then
        summary+=("$name: skipped, ${left} s left of DEADLINE_S")
        failed=1
        return 1
    fi
    start=$(date +%s)
    echo "== $name (limit $limit s): $*" | tee -a "$OUT/$log.log"
    # the stage stops itself 10 s before the timeout (.ci/gpu/stage.py), which is left for a hang
    GPU_STAGE_BUDGET_S=$((limit - 10)) timeout -k 10 "$limit" "$@" >>"$OUT/$log.log" 2>&1
    rc=$?
    summary+=("$name: exit $rc, $(($(date +%s) - start)) s")
    [ $rc -eq 0 ] || failed=1
    return $rc
}

# at most 8 files come back from a lease: 5 logs and one JSON per benchmark file
device=$(nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,memory.used \
    --format=csv,noheader 2>&1)
per_test=(--timeout="$TEST_TIMEOUT_S" --timeout-method=thread)  # thread: a hung CUDA call ends the run
if ! "$PY" -c "import pytest_timeout" 2>/dev/null; then
    per_test=()
    echo "no pytest-timeout: tests run without a per-test limit"
fi
for stage in $STAGES; do
    case $stage in
    build) step build build 300 make gpu-install GPU_PYTHON="$PY" || break ;;
    test)
        if [ -n "$TEST_ARGS" ]; then  # word-split on purpose: a list of files / node ids
            step test test 240 "$PY" -m pytest $TEST_ARGS -m "cuda and not slow" -q -p no:cacheprovider \
                "${per_test[@]}" -rfE
        else
            step test test 240 "$PY" .ci/gpu/test.py -- "${per_test[@]}" -rfE
        fi ;;
    sanitize) step sanitize sanitize 150 "$PY" .ci/gpu/sanitize.py ;;
    driver) step driver driver 240 "$PY" .ci/gpu/driver_runs.py $DRIVER_ARGS ;;  # python -m driver.train on the GPU, our kernels forced
    bench)
        select=()
        [ -n "$BENCH_K" ] && select=(-k "$BENCH_K")
        for family in $BENCH_FILES; do
            step "bench-$family" bench 200 env PYKERNELS_BENCH_RETIME=0 "$PY" -m pytest --benchmark \
                "benchmarks/test_bench_$family.py" "${select[@]}" -q -p no:cacheprovider \
                --benchmark-json="$OUT/bench-$family.json"
        done ;;
    breakdown) step breakdown breakdown 150 "$PY" -m benchmarks.kernel_breakdown --top 8 ;;
    sweep) step sweep sweep 240 "$PY" -m benchmarks.tile_sweep ;;  # every tile of the Hopper kernels, one build
    profile)  # ncu (NCU: its path) on issue 20's unexplained gaps; --clock-control none leaves the clocks alone.
        # ncu writes its messages to stdout with the CSV: when no table comes of it, the CSV's tail says why.
        step profile profile 150 bash -c '"$1" --profile-from-start off --clock-control none --csv --page details \
            --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
            "$2" -m benchmarks.ncu_targets > "$3"; rc=$?
            "$2" -m benchmarks.ncu_summary "$3" || { rc=1; tail -n 20 "$3"; }; exit $rc' \
            profile "${NCU:-ncu}" "$PY" "$OUT/ncu.csv" ;;
    *) echo "unknown stage $stage (build, test, sanitize, driver, bench, breakdown, sweep, profile)"; exit 2 ;;
    esac
done

echo
echo "device: $device"
for log in "$OUT"/*.log; do
    echo "---- $(basename "$log") (last lines)"
    grep -E "FAILED|ERROR|Error|error:|passed|failed|wall time|^kernels:|========= (ERROR|RACECHECK|LEAK)" "$log" |
        tail -25
done
[ -f "$OUT/driver.log" ] && { echo "---- driver.log"; grep -E "^\||^update, |^gpu-driver-runs" "$OUT/driver.log" | tail -20; }
[ -f "$OUT/breakdown.log" ] && { echo "---- breakdown.log"; grep -v "^==" "$OUT/breakdown.log" | tail -60; }
[ -f "$OUT/sweep.log" ] && { echo "---- sweep.log"; grep -v "^==" "$OUT/sweep.log" | tail -150; }
[ -f "$OUT/profile.log" ] && { echo "---- profile.log"; grep -v "^==" "$OUT/profile.log" | tail -30; }
echo "---- stages"
printf '%s\n' "${summary[@]}"
kept=("$OUT"/*.log "$OUT"/*.json)
if [ "${#kept[@]}" -gt 7 ]; then  # the device tool returns 8 files: one archive instead
    tar czf "$OUT/lease.tgz" -C "$OUT" "${kept[@]##*/}" && rm -f "${kept[@]}"
    echo "---- ${#kept[@]} logs and JSONs packed into $OUT/lease.tgz"
fi
exit $failed
