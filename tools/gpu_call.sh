#!/usr/bin/env bash
# One call on a lent GPU machine (docs/contributing.md), its stages in order, within LIMIT seconds (default 585):
#   build     the extension in place with CUTLASS (carry third_party/cutlass; refused without it unless NO_CUTLASS=1)
#             (setup.py build_ext --inplace; skipped where fused_ops/_C*.so of the same sources is there: a
#             machine kept warm between chained calls keeps it), its .so also into $OUT as C.so.xz.* pieces with
#             C.so.sources (a hash of setup.py and csrc/, and "cutlass"): copied into .gpu_so/ and carried, a later
#             machine unpacks them instead of building while the sources hash the same
#   sanitize  bench/sanitize.py under compute-sanitizer memcheck, then racecheck
#   tests     the CUDA cases (-k "not cpu") of $TESTS (default: every test file), 8 processes, at most $TCAP s
#   grid32    bench/configs.py float32, resumed from .gpu_so/grid/ (carry it back between calls), JSON into $OUT
#   grid16    the same under bfloat16 autocast
#   models32  bench/models.py (the main job's models, eval and training, every peer), JSON and log into $OUT
#   models16  the same under bfloat16 autocast
#   any other word: run as a shell command
#   LIMIT=585 TESTS="test_rewrites.py" bash tools/gpu_call.sh build sanitize tests grid32
# FUSED_OPS_COMMIT names the tree in the results (default: the commit in .gpu_so/commit, else "unknown"): keep it
# the same across the calls of one grid, whose --resume keeps the rows of the same commit only.
set -o pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export FUSED_OPS_COMMIT=${FUSED_OPS_COMMIT:-$(cat .gpu_so/commit 2>/dev/null || echo unknown)} PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" .gpu_so/grid
T0=$(date +%s); LIMIT=${LIMIT:-585}
left() { echo $(( LIMIT - ($(date +%s) - T0) )); }
for stage in "$@"; do
  echo "=== $stage at $(( $(date +%s) - T0 )) s"
  case $stage in
  build)
    # (a build's record: its sources' hash and whether it had CUTLASS's headers; without them B's and D's
    # convolutions take cuDNN's paths, whose timings and sanitizer runs are not the library's: session 26 lost
    # its GPU timings of B and D so)
    with=$([ -z "$NO_CUTLASS" ] && echo cutlass || echo no-cutlass)
    # (build/gpu_call.sources: the sources of the fused_ops/_C*.so a warm machine kept; another tree's is rebuilt)
    sources="$(cat setup.py $(find csrc -type f | LC_ALL=C sort) | sha1sum | cut -c1-16) $with"
    stamp=build/gpu_call.sources
    if ls fused_ops/_C*.so >/dev/null 2>&1 && [ "$(cat $stamp 2>/dev/null)" = "$sources" ]; then echo "already built"
    elif rm -f fused_ops/_C*.so && mkdir -p build && [ "$(cat .gpu_so/C.so.sources 2>/dev/null)" = "$sources" ]; then
      cat .gpu_so/C.so.xz.* | xz -d > fused_ops/_C.so && echo "$sources" > $stamp &&
        echo "unpacked .gpu_so's build of these sources ($with)"
    elif [ "$with" = cutlass ] && [ ! -d third_party/cutlass/include/cutlass ]; then
      echo "build: third_party/cutlass is missing: carry it (make cutlass here first), or NO_CUTLASS=1"; exit 1
    else
      MAX_JOBS=$(nproc) TORCH_CUDA_ARCH_LIST=9.0 python3 setup.py build_ext --inplace > "$OUT/build.log" 2>&1 \
        || { tail -30 "$OUT/build.log"; exit 1; }
      echo "$sources" > $stamp; echo "lines with 'warning': $(grep -ci warning "$OUT/build.log")"
      xz -T0 -c fused_ops/_C*.so | split -b 15M - "$OUT/C.so.xz."; echo "$sources" > "$OUT/C.so.sources"
    fi ;;
  sanitize)
    for tool in memcheck racecheck; do
      timeout $(( $(left) - 5 )) compute-sanitizer --tool $tool --error-exitcode 1 python3 bench/sanitize.py \
        > /tmp/sanitize.log 2>&1
      echo "$tool rc=$? $(tail -1 /tmp/sanitize.log)"; cat /tmp/sanitize.log >> "$OUT/sanitize.log"
    done ;;
  tests)
    (cd tests && timeout "${TCAP:-$(( $(left) - 10 ))}" python3 -m pytest -q -n 8 -c ../pytest.ini --rootdir .. \
      -k "not cpu" ${TESTS:-.} 2>&1 | tee "$OUT/tests.log" | grep -v -i benchmark | tail -25) ;;
  grid32|grid16)
    precision=(); [ "$stage" = grid16 ] && precision=(--autocast bfloat16)
    timeout -s INT $(( $(left) - 8 )) python3 bench/configs.py --device cuda --resume --out .gpu_so/grid \
      "${precision[@]}" > "$OUT/$stage.log" 2>&1
    echo "rc=$?"; tail -4 "$OUT/$stage.log"; cp .gpu_so/grid/*.json "$OUT/" ;;
  models32|models16)
    precision=(); [ "$stage" = models16 ] && precision=(--autocast bfloat16)
    timeout $(( $(left) - 8 )) python3 bench/models.py --out "$OUT" "${precision[@]}" > "$OUT/$stage.log" 2>&1
    echo "rc=$?"; tail -12 "$OUT/$stage.log" ;;
  *) eval "$stage" ;;
  esac
done
echo "=== end at $(( $(date +%s) - T0 )) s"
