#!/usr/bin/env bash
# GPU measurements in named parts:  bash benchmarks/gpu_session.sh PART
#
# Each part runs a group of `blockpress bench` and benchmarks/*.py commands (benchmarks/README.md describes them),
# every bench run under a time limit, with its JSON, log.txt and summary.txt (failures, test output) under $OUT, and
# ends with summary tables: the bench runs, bench_serve.py's levels, and the --profile splits of a step.
#
# Parts (PRESET=real-26b: the 26B-A4B shapes, random weights built on the GPU; 1,024 prompt + 1,024 new tokens):
#   check    versions; the compiled-kernel and CUDA-only tests; a tiny bench of every engine; on CUDA also the
#            expert tile sweep (sweep_moe_tiles.py), the 8-bit linears vs cuBLAS (bench_linears.py) and the L2 rate
#            (l2_bandwidth.py)
#   bf16     bf16: eager baseline vs transformers and AR; Triton experts + fast sampler + CUDA graphs at batch 1-8 with
#            --profile; the same with --fuse-commit
#   quant    peak_memory.py's int4 predictions; fp8 and int4 experts at batch 1 and 4 with --profile; fp8 x fp8
#            (scaled_mm); int4 experts + int8 linears; int4 with --sc-topk 64 --fuse-commit
#   serve    bench_serve.py, int4 + int8 linears, 1 and 4 requests in flight: eager, then CUDA graphs + fused commit +
#            fast sampler
#   long     an 8K-token prompt with --prefill-chunk 2048 vs 0; int4 with --moe-sum kernel vs atomic
#   ctx      a 32K-token prompt, int4 + int8 linears, eager and graphed: peak_mem_bytes vs peak_memory.py's prediction
#   oneshot  int4 + int8 linears, fp8 and bf16 with every fast path (each retried without graphs if it measured
#            nothing), the GPU tests, then bf16 vs transformers
#   tune     sync_sites.py; bench_linears.py; sweep_moe_tiles.py for each precision in PRECS (default "int4 fp8"),
#            each winner then timed end to end
#   final    selected GPU tests; sync_sites.py --hf-tiny; the best int8 linear tiles end to end; fp8 and bf16 profiles
#   next     --compile on fp8, int4 + int8 linears and bf16, beside an uncompiled fp8 row; fp8 x fp8 experts and
#            linears; bench_linears.py with and without --fused
#   train    benchmarks/train_step.py: QLoRA steps (int4 experts + int8 linears, then int4 alone) with peak memory
#            beside train_memory.py's prediction; full fine-tuning steps of the tiny preset
#   swap     the expert and 8-bit projection kernels with the weight as the MMA's register operand (tiles swap=1):
#            compiled fp8 default vs swapped, int4 swapped, + int8 projections, + int4 MLP (--linears int4-mlp),
#            int4 default; SWEEP=1 also sweeps one layer's tiles and the projections first
#   attention the fixed-shape passes' attention in one Triton kernel reading the cache in place (--attention-kernel,
#            opt-in, never timed): its agreement tests on this GPU first, then the compiled + fused fp8 batch-1 step
#            without and with it (--profile on the kernel's); benchmarks/bench_attention.py's per-layer times
#   compiled the compiled step (one graph per kind of layer, custom ops, routing kernel) with fused commits: fp8
#            (beside the default row, both with --profile's kernels per step), int4 + int8 linears, int4, bf16
#   align    the compiled fp8 row before (gpu_baseline/) and after the one-launch align, with the fixed-shape
#            passes' profile; int4; the align kernel's test
#   defaults the rows as they run with today's defaults (no tile or attention flag): fp8 (--profile, AR), fp8 with fp8
#            activations in the experts (--experts w8a8, --profile), then in the fp8 projections too (--linears fp8),
#            int4, int4 + fp8 projections with fp8 activations, the projections alone (bench_linears.py, one canvas),
#            one layer's w8a8 tiles, the attention
#            kernel's split keys per layer and fp8 with --attention-split 2, int4, int4 with 512-token prefill chunks
#            and also at group 128 (<= 18 GB predicted), int4 + int4 MLP, fp8 at batch 4 against the older tiles, the
#            int4 MLP's tile sweep, bf16; structured output's walk with the logits on the GPU
#   sweep    after stack: one layer's expert tiles (defaults vs swap=1) for fp8 and int4; the attention tests; int4
#   stack    issue 30's untimed paths in one lease: the compiled fp8 row vs the same with swapped expert tiles and the
#            attention kernel (--profile); int4 with both, with and without the int4 MLP; unmerged; the kernels' tests
#   merged   the compiled + fused-commit fp8 step with each layer's q/k/v and gate/up projections merged (one GEMM
#            each; --profile: kernels per step) vs --no-merge-projections; the merged test file on the GPU first
#   engine   one fp8 batch-1 row run from gpu_baseline/ (another commit's tree, if present, e.g.
#            `mkdir gpu_baseline && git archive COMMIT blockpress | tar -x -C gpu_baseline`) and from this tree; the
#            GPU tests; the same row with --fuse-commit, with --experts scaled_mm and with --compile
#
# Environment:
#   OUT            where results go (default /tmp/blockpress-gpu); over 8 files, all but log.txt, summary.txt and
#                  gpu-tests.txt end in results.tar.gz (the device tool brings back 8)
#   PRESET         model size (default real-26b); PRESET=tiny runs the same steps on any machine (a dry run; on a
#                  CPU the CUDA-only flags are dropped)
#   STEP_LIMIT     seconds per bench run (default set per part)
#   BUDGET         seconds by which oneshot, tune, final, next or engine must finish (each run's limit shrinks to fit)
#   MOE_TILES      a --moe-tiles spec for the fast runs (e.g. the check part's tiles.json "best");
#                  MOE_TILES_FP8 / MOE_TILES_INT4 override it for the fp8 / int4 runs
#   PRECS, SWEEP_LIMIT   the tune part's precisions and seconds per tile sweep
# The transformers reference is pinned at 5.23: wheels in .whl/ are installed (to /tmp/site) before anything runs.
# To make them, once, on a machine with network access:
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: -d .whl transformers==5.23.0
set -uo pipefail
OUT=${OUT:-/tmp/blockpress-gpu}
PRESET=${PRESET:-real-26b}
PART=${1:?usage: gpu_session.sh defaults|sweep|stack|merged|attention|swap|compiled|align|engine|next|oneshot|tune|final|check|bf16|quant|serve|long|ctx}
# seconds per benchmark run, so that one hang cannot eat the call: a part stays under 9.5 minutes
case "$PART" in bf16) DEFAULT_LIMIT=180 ;; quant) DEFAULT_LIMIT=110 ;; long) DEFAULT_LIMIT=130 ;; ctx) DEFAULT_LIMIT=270 ;; *) DEFAULT_LIMIT=240 ;; esac  # serve: 2 x 240
STEP_LIMIT=${STEP_LIMIT:-$DEFAULT_LIMIT}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi
CUDA=$(python3 -c 'import torch; print(int(torch.cuda.is_available()))')
GPU_FLAGS="--cuda-graphs"; FAST=triton
[ -n "${MOE_TILES:-}" ] && GPU_FLAGS="$GPU_FLAGS --moe-tiles $MOE_TILES"  # from the check part's tile sweep
[ "$CUDA" = 1 ] || { GPU_FLAGS=""; FAST=grouped; }  # a CPU dry run: no graphs, no Triton interpreter (slow)
# the row most parts time: batch 1, fixed steps, every fast path but compile, no transformers or AR runs
ROW1="--batch 1 --modes fixed --experts $FAST --sampler fast --no-reference --repeats 3 --no-ar $GPU_FLAGS"

DEADLINE=${DEADLINE:-}  # oneshot: SECONDS by which every step must be done (each step's limit shrinks to fit)
limit() {  # limit SECONDS: that, or what is left before DEADLINE (0: no time left)
  local l=$1
  if [ -n "$DEADLINE" ]; then local left=$((DEADLINE - SECONDS - 5)); [ "$left" -lt "$l" ] && l=$left; fi
  [ "$l" -lt 15 ] && l=0
  echo "$l"
}

env_info() {  # the card, its clocks and the versions, into the log
  { nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv 2>/dev/null || echo "no nvidia-smi"
    python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__,
"transformers", transformers.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")'
  } 2>&1 | tee -a "$OUT/log.txt"
}

bench() {  # bench NAME ARGS...: one `blockpress bench` run, JSON in $OUT/NAME.json, log in $OUT/log.txt
  local name=$1; shift
  local lim; lim=$(limit "$STEP_LIMIT")
  [ "$lim" = 0 ] && { echo "!!! $name skipped: no time left" | tee -a "$OUT/log.txt"; return 1; }
  echo "=== $name (limit ${lim} s): blockpress bench --preset $PRESET $*" | tee -a "$OUT/log.txt"
  local t0=$SECONDS
  # BENCH_CWD: the folder whose blockpress runs (`python3 -m` puts the working folder first on the path)
  (cd "${BENCH_CWD:-.}" && python3 -c 'import blockpress; print("blockpress from", blockpress.__file__)' \
    && timeout "$lim" python3 -m blockpress bench --preset "$PRESET" --out "$OUT/$name.json" "$@") >>"$OUT/log.txt" 2>&1
  local rc=$?
  [ "$rc" = 0 ] || { echo "!!! $name failed or timed out (rc $rc); its log's end:"; grep -v '^{' "$OUT/log.txt" | tail -12; } \
    | tee -a "$OUT/summary.txt"
  echo "--- $name: $((SECONDS - t0)) s" | tee -a "$OUT/log.txt"
  return "$rc"
}

gpu_tests() {  # gpu_tests SECONDS PYTEST_ARGS...: a part's GPU tests (CUDA only), output in gpu-tests.txt, outcome lines
  local lim; lim=$(limit "$1"); shift  # into the summary
  [ "$lim" != 0 ] && [ "$CUDA" = 1 ] || return 0
  echo "=== gpu tests (limit $lim s): $*" | tee -a "$OUT/log.txt"
  timeout "$lim" python3 -m pytest -q -p no:cacheprovider "$@" 2>&1 | tee "$OUT/gpu-tests.txt" \
    | grep -E "passed|failed|^FAILED|^E " | head -16 | tee -a "$OUT/summary.txt"
}

case "$PART" in
  engine)
    # The one-engine redesign on a GPU, in one call: the same bench row before (the code of 9d31c23, copied into
    # gpu_baseline/, which the call carries) and after, on this card; the GPU tests; then what had never been timed:
    # the fused commit, fp8 x fp8 experts (scaled_mm) and compiled blocks, each against the same row. At most 8
    # files come back: 5 JSONs, log, summary, test output.
    DEADLINE=$((SECONDS + ${BUDGET:-420}))
    env_info
    ROW="$ROW1 --precision fp8"
    if [ -d gpu_baseline/blockpress ]; then
      BENCH_CWD=gpu_baseline STEP_LIMIT=75 bench before-fp8 $ROW
    fi
    STEP_LIMIT=75 bench after-fp8 $ROW
    lim=$(limit 150)
    if [ "$lim" != 0 ] && [ "$CUDA" = 1 ]; then
      echo "=== gpu tests (limit $lim s)" | tee -a "$OUT/log.txt"
      timeout "$lim" python3 -m pytest -q -p no:cacheprovider -n 8 -m "gpu or not slow" tests/test_kernels.py \
        tests/test_quant.py tests/test_linear_q.py tests/test_generate.py tests/test_cache_ring.py 2>&1 \
        | tee "$OUT/gpu-tests.txt" | tail -25 | tee -a "$OUT/summary.txt"
    fi
    STEP_LIMIT=60 bench after-fp8-fuse $ROW --fuse-commit
    STEP_LIMIT=60 bench after-fp8-w8a8 ${ROW/--experts $FAST/--experts scaled_mm}
    STEP_LIMIT=150 bench after-fp8-compile $ROW --compile
    python3 - "$OUT" <<'EOF' | tee -a "$OUT/summary.txt"
import json, os, sys
for name in ("before-fp8", "after-fp8", "after-fp8-fuse", "after-fp8-w8a8", "after-fp8-compile"):
    try:
        r = json.load(open(os.path.join(sys.argv[1], name + ".json")))
    except (OSError, ValueError):
        print(f"{name}: no result"); continue
    for run in r["runs"]:
        print(f"{name}: B={run['batch']} {run['mode']} {run['tok_s']:.1f} tok/s, {run.get('ms_per_step') or 0:.2f} ms/step,"
              f" peak {run['peak_mem_bytes'] / 1e9:.2f} GB, captures timed {run.get('graph_captures_timed')}"
              + (" (partial)" if r.get("partial") else ""))
EOF
    ;;
  oneshot)
    # One device call for a lease of 15 minutes (machine start included): the issue's three precisions at batch 1
    # and 4 with every fast path, each with a fallback that drops CUDA graphs if the first try measured nothing, the compiled
    # kernels' and CUDA-only tests, then the transformers reference in what time is left. Every bench run writes its
    # JSON after each measured run (partial), so a step cut off by the deadline keeps what it measured.
    DEADLINE=$((SECONDS + ${BUDGET:-500}))
    env_info
    FAST_ARGS="--modes fixed --experts $FAST --sampler fast --no-reference --repeats 3"
    STEP_LIMIT=140 bench int4-lin8 --batch 1,4 --precision int4 --linears int8 $FAST_ARGS $GPU_FLAGS --ar-tokens 256 \
      --profile || [ -s "$OUT/int4-lin8.json" ] || STEP_LIMIT=90 bench int4-lin8-eager --batch 1 --precision int4 --linears int8 $FAST_ARGS --no-ar
    STEP_LIMIT=100 bench fp8 --batch 1,4 --precision fp8 $FAST_ARGS $GPU_FLAGS --ar-tokens 256 \
      || [ -s "$OUT/fp8.json" ] || STEP_LIMIT=80 bench fp8-eager --batch 1 --precision fp8 $FAST_ARGS --no-ar
    STEP_LIMIT=90 bench bf16 --batch 1 $FAST_ARGS $GPU_FLAGS --ar-tokens 256 \
      || [ -s "$OUT/bf16.json" ] || STEP_LIMIT=80 bench bf16-eager --batch 1 $FAST_ARGS --no-ar
    lim=$(limit 100)
    if [ "$lim" != 0 ] && [ "$CUDA" = 1 ]; then
      echo "=== gpu tests (limit $lim s)" | tee -a "$OUT/log.txt"
      timeout "$lim" python3 -m pytest -q -p no:cacheprovider -n 8 -m "gpu or not slow" tests/test_kernels.py \
        tests/test_quant.py tests/test_linear_q.py "tests/test_generate.py::test_fixed_steps_do_not_synchronise_on_cuda" \
        "tests/test_cache_ring.py::test_captured_graphs_on_a_ring_match_the_eager_passes" 2>&1 \
        | tee "$OUT/gpu-tests-full.txt" | tail -25 | tee -a "$OUT/summary.txt"
    fi
    # transformers 5.23 on the same weights (bf16, batch 1, one timed run): the ratio the issue asks for
    STEP_LIMIT=400 bench bf16-vs-transformers --batch 1 --modes fixed --experts grouped --attention sdpa_gqa \
      --repeats 1 --no-ar
    ;;
  tune)
    # The second call of a 15-minute lease, after oneshot's profile: where the host waits for the GPU (sync_sites.py),
    # the int8 projection kernel's tiles against cuBLAS (bench_linears.py), and the expert kernels' tiles for int4 and
    # fp8 at batch 1 (sweep_moe_tiles.py), each winner then timed end to end (bench --moe-tiles <best>).
    DEADLINE=$((SECONDS + ${BUDGET:-500}))
    lim=$(limit 40); [ "$lim" != 0 ] && timeout "$lim" python3 benchmarks/sync_sites.py 2>&1 | grep -v '^{' \
      | tee -a "$OUT/log.txt" | tee -a "$OUT/summary.txt"
    lim=$(limit 80); [ "$lim" != 0 ] && timeout "$lim" python3 benchmarks/bench_linears.py --preset "$PRESET" --rows 1,256 \
      2>&1 | tee "$OUT/linears.txt" | grep -v '^{' | tail -20 | tee -a "$OUT/summary.txt"
    GRID="bm=32,64;bn=64,128,256;bk=64,128;warps=4,8"
    for prec in ${PRECS:-int4 fp8}; do
      lim=$(limit ${SWEEP_LIMIT:-150}); [ "$lim" = 0 ] && break
      echo "=== tiles $prec (limit $lim s)" | tee -a "$OUT/log.txt"
      timeout "$lim" python3 benchmarks/sweep_moe_tiles.py --preset "$PRESET" --precision $prec --batch 1 --grid "$GRID" \
        --out "$OUT/tiles-$prec.json" 2>&1 | grep -v '^{' >>"$OUT/log.txt"
      best=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['best']['$prec']['spec'])" \
        "$OUT/tiles-$prec.json" 2>/dev/null)
      grep -A12 "| $prec: tiles" "$OUT/log.txt" | tee -a "$OUT/summary.txt"
      lin=""; [ "$prec" = int4 ] && lin="--linears int8"
      [ -n "$best" ] && STEP_LIMIT=80 bench $prec-tuned --batch 1 --precision $prec $lin --modes fixed --experts $FAST \
        --sampler fast --no-reference --repeats 3 $GPU_FLAGS --no-ar --moe-tiles "$best"
    done
    lim=$(limit 40); [ "$lim" != 0 ] && timeout "$lim" python3 benchmarks/sync_sites.py --sampler fast 2>&1 \
      | grep -v '^{' | tee -a "$OUT/summary.txt"
    ;;
  final)
    # The last call of a 15-minute lease: the tests that failed on the GPU in oneshot (device mix-ups in tests, torch
    # 2.11's CPU _scaled_mm) and the compiled split-K linears; where the tiny model's generation synchronises; the
    # int8 kernel's tile variants (bench_linears.py), the best for a canvas then end to end; an eager kernel profile
    # of fp8 and bf16 steps beside int4's.
    DEADLINE=$((SECONDS + ${BUDGET:-330}))
    lim=$(limit 70); [ "$lim" != 0 ] && timeout "$lim" python3 -m pytest -q -p no:cacheprovider -n 8 \
      "tests/test_kernels.py::test_sdpa_gqa_folds_grouped_heads_into_the_query_length" \
      "tests/test_kernels.py::test_sc_topk_decoder_on_a_confident_trained_model" tests/test_linear_q.py \
      "tests/test_quant.py::test_load_quantises_layer_by_layer_while_loading" tests/test_generate.py -m "gpu or not slow" \
      2>&1 | tee "$OUT/gpu-tests-full.txt" | grep -E "passed|failed|^FAILED|^E " | head -30 | tee -a "$OUT/summary.txt"
    lim=$(limit 40); [ "$lim" != 0 ] && timeout "$lim" python3 benchmarks/sync_sites.py --hf-tiny 2>&1 | grep -v '^{' \
      | tail -25 | tee -a "$OUT/summary.txt"
    lim=$(limit 90); [ "$lim" != 0 ] && timeout "$lim" python3 benchmarks/bench_linears.py --preset "$PRESET" --rows 1,256 \
      >"$OUT/linears.txt" 2>&1; grep -E "variants:|one pass" "$OUT/linears.txt" | tee -a "$OUT/summary.txt"
    best=$(python3 -c "import json,sys; print(json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])['best_int8_spec']['256'])" \
      "$OUT/linears.txt" 2>/dev/null)
    echo "best int8 linear tiles at 256 rows: ${best:-none}" | tee -a "$OUT/summary.txt"
    FAST_ARGS="--modes fixed --experts $FAST --sampler fast --no-reference --repeats 3"
    [ -n "$best" ] && STEP_LIMIT=80 bench int4-lin8-tiles --batch 1 --precision int4 --linears int8 $FAST_ARGS $GPU_FLAGS \
      --ar-tokens 128 --linear-tiles "$best"
    STEP_LIMIT=70 bench fp8-profile --batch 1 --precision fp8 $FAST_ARGS $GPU_FLAGS --no-ar --profile
    STEP_LIMIT=60 bench bf16-profile --batch 1 $FAST_ARGS $GPU_FLAGS --no-ar --profile
    ;;
  next)
    # For the next lease, after 2026-11-25's H200 measurements (benchmarks/results/2026-11-25-h200.md): what the step
    # spends outside the experts (~12 of ~24 ms of kernels) against torch.compile'd blocks, each beside its baseline
    # in the same call; and vLLM's fp8 recipe (fp8 x fp8 experts and projections, scaled_mm), not yet timed.
    DEADLINE=$((SECONDS + ${BUDGET:-500}))
    FAST_ARGS="--modes fixed --experts $FAST --sampler fast --no-reference --no-ar --repeats 3"
    STEP_LIMIT=60 bench fp8-base --batch 1 --precision fp8 $FAST_ARGS $GPU_FLAGS
    STEP_LIMIT=120 bench fp8-compiled --batch 1 --precision fp8 $FAST_ARGS $GPU_FLAGS --compile --profile
    [ "$CUDA" = 1 ] && STEP_LIMIT=60 bench fp8-w8a8 --batch 1 --precision fp8 --linears fp8 --modes fixed \
      --experts scaled_mm --sampler fast --no-reference --no-ar --repeats 3 $GPU_FLAGS
    STEP_LIMIT=120 bench int4-lin8-compiled --batch 1,4 --precision int4 --linears int8 $FAST_ARGS $GPU_FLAGS --compile
    STEP_LIMIT=120 bench bf16-compiled --batch 1 $FAST_ARGS $GPU_FLAGS --compile
    # would fusing q/k/v and gate/up into one projection each pay? (a pass's GEMMs, separate vs fused shapes)
    for fused in "" --fused; do
      lim=$(limit 90); [ "$lim" != 0 ] && echo "=== linears $fused" | tee -a "$OUT/summary.txt" && timeout "$lim" \
        python3 benchmarks/bench_linears.py --preset "$PRESET" --rows 1,256 $fused 2>&1 | grep -E "one pass" \
        | tee -a "$OUT/summary.txt"
    done
    ;;
  compiled)
    # issue 30's items 1-2 on a GPU (2026-11-26): compiled blocks as one graph per kind of layer with no break (the
    # experts, 8-bit projections and routing are custom ops; the layer's K/V buffers are graph inputs, not a
    # per-layer constant) and the one-kernel routing, against the default row in the same call. The GPU tests of
    # both first; the fp8 rows with --profile (eager kernels: kernels per step, uncompiled then compiled).
    DEADLINE=$((SECONDS + ${BUDGET:-420}))
    env_info
    ROW="$ROW1"
    gpu_tests 75 -n 8 tests/test_route.py tests/test_compiled.py
    STEP_LIMIT=70 bench fp8 $ROW --precision fp8 --profile
    STEP_LIMIT=170 bench fp8-compiled $ROW --precision fp8 --compile --fuse-commit --profile
    STEP_LIMIT=130 bench int4-lin8-compiled $ROW --precision int4 --linears int8 --compile --fuse-commit
    STEP_LIMIT=130 bench int4-compiled $ROW --precision int4 --compile --fuse-commit
    STEP_LIMIT=130 bench bf16-compiled $ROW --compile --fuse-commit
    ;;
  align)
    # after part 'compiled': the one-launch align and eager prefill, the compiled fp8 row before (gpu_baseline/: the
    # tree of 7486795, `git archive 7486795 blockpress | tar -x -C gpu_baseline`, carried) and after in one call,
    # the after row with --profile of the fixed-shape passes (the kernels a graph replays); int4; the align test
    DEADLINE=$((SECONDS + ${BUDGET:-300}))
    env_info
    ROW="$ROW1 --compile --fuse-commit"
    gpu_tests 40 tests/test_kernels.py -k align
    STEP_LIMIT=110 bench fp8-after $ROW --precision fp8 --profile
    [ -d gpu_baseline/blockpress ] && BENCH_CWD=gpu_baseline STEP_LIMIT=90 bench fp8-before $ROW --precision fp8
    STEP_LIMIT=80 bench int4-after $ROW --precision int4
    ;;
  attention)
    # The fixed-shape passes' attention in one Triton kernel that reads K/V from the cache in place (kernels/
    # attention_fixed.py; --attention-kernel, off by default: never timed). A batch-1 step of the 26B model spent 2.62
    # of 21.7 ms in attention on an H100 (2026-11-26-h100-compiled.md: SDPA's memory-efficient kernel with a mask over
    # the cache, head dim 512 / 8 query heads per KV head on the full layers, a gathered window on the sliding ones).
    # First its agreement tests compiled for this GPU (fp32 and bf16, the 26B shapes against the torch reference;
    # a failed first-use check in the bench would fall back to the torch path with a warning, grepped below), then the
    # kernel alone per layer against today's path (bench_attention.py), then the compiled + fused fp8 step without
    # and with it, --profile on the kernel's (its attention ms beside the 2.62).
    DEADLINE=$((SECONDS + ${BUDGET:-480}))
    env_info
    ROW="$ROW1 --compile --fuse-commit --precision fp8"
    gpu_tests 120 -n 8 -m "gpu or not slow" tests/test_attention_kernel.py
    lim=$(limit 60)
    [ "$lim" != 0 ] && timeout "$lim" python3 benchmarks/bench_attention.py --preset "$PRESET" \
      --tiles "dv=128|bm=128|bn=32|bn=16,stages=3|warps=4" --out "$OUT/attention-layers.json" 2>&1 | grep -v '^{' | tee -a "$OUT/log.txt" | tee -a "$OUT/summary.txt"
    STEP_LIMIT=120 bench fp8-default $ROW
    STEP_LIMIT=120 bench fp8-attention $ROW --attention-kernel --profile
    grep -h "attention kernel is off" "$OUT/log.txt" | head -3 | tee -a "$OUT/summary.txt"
    ;;
  defaults)
    # after 2026-11-27-h100-stack.md, which made the swapped fp8 tiles and the attention kernel Hopper's defaults
    # from rows run with flags: the rows as they now run with no tile or attention flag, most important first. fp8
    # (--profile: the experts' and attention's kernel time); int4 (the attention kernel on, never timed with the
    # default int4 tiles); fp8 at batch 4, where bm=auto now picks 64 for swapped tiles (untimed), against the older
    # tiles; int4 + int4 MLP (the <= 18 GB row); bf16 (never timed compiled)
    DEADLINE=$((SECONDS + ${BUDGET:-480}))
    env_info
    ROW="$ROW1 --compile --fuse-commit"
    # the LM head in vocabulary slices and the self-conditioning probabilities in the logits buffer (2026-11-27, CPU
    # only): the 26B shapes against the one product (prints the share of bit-equal logits); the split attention; the
    # fast sampler applying the soft cap to the LM head's product (libdevice's tanh, compiled: bit for bit the soft-cap
    # kernel's logits sampled?); the kernels' fixes of 2026-11-28's fuzz, compiled (a temperature per row in the fused
    # sampler, -inf logits, rows that see no key, routing); the logit bias inside the fused sampler (2026-11-29, CPU
    # only: the kernel against the capped logits plus the bias, and in the engine); pre-quantised fp8 / int4 / int8
    # checkpoints loaded onto the GPU and the int8 embedding table's kernels (2026-11-29, CPU only)
    gpu_tests 60 -s -k "lm_head_slices or keys_split or 26b_shapes or soft_cap or before_the_cap or per_row or minus_inf \
      or sees_no_key or after_the_cap or fused_kernel or checkpoint_loads or int4_attention or int8_lm_head \
      or soft_embedding_through or int8_embeddings or quant_rows or w8a8" tests/test_kernels.py \
      tests/test_attention_kernel.py tests/test_route.py tests/test_logit_bias.py tests/test_prequantized.py \
      tests/test_linear_q.py tests/test_quant.py
    grep -h "bit-equal" "$OUT/gpu-tests.txt" | tee -a "$OUT/summary.txt"
    # with our AR decode (issue 30 item 9, never timed compiled + graphed): 256 greedy tokens, batch 1
    STEP_LIMIT=110 bench fp8 ${ROW/--no-ar/--ar-tokens 256} --precision fp8 --profile
    # fp8 x fp8 experts in the Triton kernels (--experts w8a8, 2026-11-29, CPU only: compile_report.py has their
    # K-tile loops at 135 / 106 instructions against weight-only fp8's 529 / 295, e4m3 wgmma, no weight converted);
    # the step against the fp8 row above (--profile: the experts' kernel time against its 12.9 ms; a CPU dry run: its
    # torch reference); after the int4 rows, one layer's kernels, fp8 against fp8-a8 at the default tiles and a few
    # others (the copy rate against the 85 % goal)
    STEP_LIMIT=90 bench fp8-w8a8 ${ROW/--experts $FAST/--experts w8a8} --precision fp8 --profile
    # every fp8 weight with fp8 activations, vLLM's FP8 recipe (2026-11-29, CPU only): the projections in fp8 too,
    # through our w8a8 linear kernel (compile_report.py: no weight converted, 99 instructions a K tile against the
    # weight-only kernel's 163); the dense GEMMs' kernel time against the fp8 row's 3.3 ms
    STEP_LIMIT=90 bench fp8-w8a8-all ${ROW/--experts $FAST/--experts w8a8} --precision fp8 --linears fp8 --profile
    # int4's peak: peak_memory.py predicts 17.91 GB with the fast sampler reading the LM head's bf16 product
    # (2026-11-27-cpu-fused-softcap.md; 18.2 GB was measured before that and the graphs' smaller pool)
    STEP_LIMIT=80 bench int4 $ROW --precision int4
    # int4 experts beside fp8 projections with fp8 activations: 1.65 GB less than bf16 projections (the <= 18 GB
    # target) if the w8a8 kernel is no slower than cuBLAS bf16 (the int8 kernel cost 2.9 ms a step)
    STEP_LIMIT=80 bench int4-lin8a8 ${ROW/--experts $FAST/--experts w8a8} --precision int4 --linears fp8
    # the projections alone, one canvas: cuBLAS bf16 against the w8a8 kernel (two tiles) and torch._scaled_mm
    lim=$(limit 60)
    [ "$lim" != 0 ] && [ "$CUDA" = 1 ] && timeout "$lim" python3 benchmarks/bench_linears.py --preset "$PRESET" \
      --rows 256 --fused 2>&1 | tee "$OUT/linears.txt" | grep "one pass" | tee -a "$OUT/log.txt" \
      | tee -a "$OUT/summary.txt"
    # the embedding table / LM head in int8 (2026-11-29, CPU only): predicted 17.17 GB; the LM head and the soft
    # embedding through the int8 kernel (the latter reading the table down its columns, new): half the table's bytes
    STEP_LIMIT=80 bench int4-emb8 $ROW --precision int4 --embeddings int8
    # the w8a8 experts' one-layer sweep (see the fp8-w8a8 row)
    lim=$(limit 70)
    [ "$lim" != 0 ] && [ "$CUDA" = 1 ] && timeout "$lim" python3 benchmarks/sweep_moe_tiles.py --preset "$PRESET" \
      --precision fp8,fp8-a8 --batch 1 --grid "bm=auto,32;bn=64,128;bk=128,256;swap=1|bm=auto;bn=128;bk=128" \
      --out "$OUT/tiles-a8.json" 2>&1 | grep -v '^{' | tee -a "$OUT/log.txt" | tail -24
    # the attention kernel took 2.58 ms a step on 64 (sliding) / 128 (full) programs for 132 SMs: the keys of each row
    # block in 2-4 runs (SPLIT, merged by a second kernel; never timed), per layer against the default
    lim=$(limit 60)
    [ "$lim" != 0 ] && timeout "$lim" python3 benchmarks/bench_attention.py --preset "$PRESET" \
      --tiles "split=2|split=3|split=4|dv=128,split=2" --out "$OUT/attention-split.json" 2>&1 | grep -v '^{' \
      | tee -a "$OUT/log.txt" | tee -a "$OUT/summary.txt"
    [ "$CUDA" = 1 ] && STEP_LIMIT=80 bench fp8-split2 $ROW --precision fp8 --attention-split 2
    # blockpress tune (2026-11-29, CPU only): the product's own tuner on the real shapes, fp8 x fp8 experts on the
    # quick grid, the fp8 x fp8 projections' tiles over a pass, and the attention kernel's tiles and key runs per kind
    # of layer, first (2026-11-29: --quick's 10 of the 20 candidates that compile for sm_90 without spilling); its file
    # goes to $OUT
    # (the rows above ran on the defaults, untuned)
    lim=$(limit 120)
    [ "$lim" != 0 ] && [ "$CUDA" = 1 ] && BLOCKPRESS_TUNED="$OUT/tuned.json" timeout "$lim" python3 -m blockpress \
      tune --preset "$PRESET" --precision fp8 --linears fp8 --fp8-activations --quick 2>&1 | grep -v '^{' \
      | tee -a "$OUT/log.txt" | tail -20 | tee -a "$OUT/summary.txt"
    # ... and the step with what it kept (its JSON's backends name them under "tuned"), against fp8-w8a8-all
    [ -f "$OUT/tuned.json" ] && BLOCKPRESS_TUNED="$OUT/tuned.json" STEP_LIMIT=90 bench fp8-w8a8-all-tuned \
      ${ROW/--experts $FAST/--experts w8a8} --precision fp8 --linears fp8
    # the <= 18 GB candidates with no slower kernel: 512-token prefill chunks (a ring of 1,536 slots in the sliding
    # layers; the same numbers), predicted 17.73 GB; and int4 scales per 128 inputs where the dim allows (gate/up; a
    # small quality cost, benchmarks/results/2026-11-27-cpu-memory-attention.md), 17.49 GB
    STEP_LIMIT=80 bench int4-c512 $ROW --precision int4 --prefill-chunk 512
    STEP_LIMIT=80 bench int4-g128-c512 $ROW --precision int4 --group-size 128 --prefill-chunk 512
    STEP_LIMIT=80 bench int4-mlp4 $ROW --precision int4 --linears int4-mlp
    STEP_LIMIT=90 bench fp8-b4 ${ROW/--batch 1/--batch 4} --precision fp8
    [ "$CUDA" = 1 ] && STEP_LIMIT=90 bench fp8-b4-oldtiles ${ROW/--batch 1/--batch 4} --precision fp8 \
      --moe-tiles "bm=auto,bn=128,bk=64"
    # the int4 MLP cost 2.9 ms a step on swapped tiles (2026-11-27-h100-stack.md): ~9 MB of int4 weights a layer
    # in ~0.1 ms, on ~34-44 programs at the experts' tiles; its own tiles, one layer
    lim=$(limit 70)
    [ "$lim" != 0 ] && [ "$CUDA" = 1 ] && timeout "$lim" python3 benchmarks/sweep_moe_tiles.py --preset "$PRESET" \
      --mlp --precision int4 --grid "bm=auto,32,64;bn=32,64,128;bk=64,128|bm=auto,64;bn=64,128;bk=64,128;swap=1" \
      --out "$OUT/tiles-mlp.json" 2>&1 | grep -v '^{' | tee -a "$OUT/log.txt" | tail -14
    STEP_LIMIT=130 bench bf16 $ROW
    grep -h "is off on" "$OUT/log.txt" | sort -u | head -5 | tee -a "$OUT/summary.txt"
    # structured output's host walk with the logits on the GPU (2026-11-28-cpu-structured-walk.md: 0.19 s a walk at
    # 262,144 tokens on a CPU, 0.13 s of it the top-k) and its device test
    lim=$(limit 60)
    [ "$lim" != 0 ] && [ "$CUDA" = 1 ] && timeout "$lim" python3 benchmarks/constraint_walk.py --vocab 262144 \
      --steps 8 --device cuda 2>&1 | grep -v '^{' | tee -a "$OUT/log.txt" | tee -a "$OUT/summary.txt"
    [ "$CUDA" = 1 ] && gpu_tests 40 -k "walk_over_logits" tests/test_structured.py
    # a Python loop over prompts of many lengths: captures once per power-of-two cache size (2026-11-28-cpu-audit.md:
    # 46 captures -> 4 on the KJV model's 24 prompts); what a capture costs here against a replayed call
    lim=$(limit 90)
    DEV=""; [ "$CUDA" = 1 ] && DEV="--device cuda"
    [ "$lim" != 0 ] && timeout "$lim" python3 benchmarks/graph_captures.py --preset "$PRESET" --prompts 12 \
      --max-prompt 1000 --new-tokens 256 $DEV 2>&1 | tail -1 | tee -a "$OUT/log.txt" | tee -a "$OUT/summary.txt"
    ;;
  sweep)
    # after part 'stack' (whose fp8 experts with swap=1 tiles took 12.89 ms a step against 12.57 with the defaults):
    # one real-shaped layer's expert kernels, the default tiles against every swapped setting (sweep_moe_tiles.py:
    # ms, GB/s and the fraction of the copy rate, the issue's 85 % / 75 % goals), fp8 then int4; the attention
    # kernel's GPU tests (fp32 at head dim 512 now stages K/V once); int4 with the default tiles and no attention
    # kernel, beside part stack's int4 row
    DEADLINE=$((SECONDS + ${BUDGET:-360}))
    env_info
    GRID="bm=auto,16,32;bn=64,128;bk=64,128;swap=1"  # the defaults come first by themselves
    for prec in fp8 int4; do
      lim=$(limit ${SWEEP_LIMIT:-100}); [ "$lim" = 0 ] || [ "$CUDA" != 1 ] && break
      echo "=== tiles $prec (limit $lim s)" | tee -a "$OUT/log.txt"
      timeout "$lim" python3 benchmarks/sweep_moe_tiles.py --preset "$PRESET" --precision $prec --batch 1 \
        --grid "$GRID" --out "$OUT/tiles-$prec.json" 2>&1 | grep -v '^{' | tee -a "$OUT/log.txt" | tail -20
    done
    gpu_tests 60 -n 8 tests/test_attention_kernel.py
    STEP_LIMIT=80 bench int4-default $ROW1 --compile --fuse-commit --precision int4
    ;;
  stack)
    # issue 30's untimed paths in one lease (the 15-minute ones fit one part): the compiled + fused fp8 row as it
    # ships (merged projections) against the same row with the swapped expert tiles (weight as the register
    # operand) and the in-place attention kernel (--profile: each part's kernel time, the experts' and attention's
    # beside 2026-11-26-h100-compiled.md's 12.6 and 2.6 ms); int4 with the same two and the int4 MLP (the <= 18 GB
    # row) and without it; then unmerged projections; the two kernels' GPU agreement tests with what time is left
    # (a kernel that fails its first-use check falls back with a warning, grepped below)
    DEADLINE=$((SECONDS + ${BUDGET:-480}))
    env_info
    ROW="$ROW1 --compile --fuse-commit"
    SW="bm=auto,bn=128,bk=64,swap=1"
    [ "$CUDA" = 1 ] || SW=""  # a CPU dry run: the grouped experts take no tiles
    STACK="${SW:+--moe-tiles $SW} --attention-kernel"
    STEP_LIMIT=110 bench fp8-default $ROW --precision fp8
    STEP_LIMIT=120 bench fp8-stack $ROW --precision fp8 $STACK --profile
    STEP_LIMIT=100 bench int4-mlp4-stack $ROW --precision int4 $STACK --linears int4-mlp
    STEP_LIMIT=90 bench int4-stack $ROW --precision int4 $STACK
    STEP_LIMIT=100 bench fp8-unmerged $ROW --precision fp8 --no-merge-projections
    gpu_tests 90 -n 8 -m "gpu or not slow" tests/test_attention_kernel.py tests/test_kernels.py tests/test_quant.py \
      -k "attention or match_loop or triton_path or other_tiles"
    grep -h "is off on" "$OUT/log.txt" | sort -u | head -5 | tee -a "$OUT/summary.txt"
    ;;
  swap)
    # For the next lease: the expert and 8-bit projection kernels with the weight tile as the MMA's first operand
    # (tiles swap=1: Hopper's wgmma reads it from registers, so fp8 / int4 / int8 weights converted in registers skip
    # shared memory; a block of 16-32 expert assignments uses wgmma at all, and a projection takes a whole canvas per
    # block, converting each weight once; compile_report.py shows HGMMA with a register A for both, mma.sync or two
    # shared-memory operands without). The compiled rows end to end, most important first (the deadline drops the
    # tail): fp8 default vs swapped, int4 swapped, int4 + int8 projections swapped, int4 + int4 MLP, int4 default.
    # SWEEP=1 first sweeps one layer's tiles (swap 0 and 1) and the projections (bench_linears.py).
    DEADLINE=$((SECONDS + ${BUDGET:-480}))
    env_info
    ROW="$ROW1 --compile --fuse-commit"
    SW="bm=auto,bn=128,bk=64,swap=1"
    # the swapped kernels compiled for this GPU against the torch paths (bf16 and fp32) first
    gpu_tests 60 -n 8 tests/test_kernels.py tests/test_quant.py tests/test_linear_q.py \
      -k "match_loop or triton_path or other_tiles"
    if [ -n "${SWEEP:-}" ]; then
      for prec in fp8 int4; do
        lim=$(limit ${SWEEP_LIMIT:-60}); [ "$lim" = 0 ] && break
        echo "=== tiles $prec (limit $lim s)" | tee -a "$OUT/log.txt"
        timeout "$lim" python3 benchmarks/sweep_moe_tiles.py --preset "$PRESET" --precision $prec --batch 1 \
          --grid "bm=auto,16,32;bn=64,128;bk=64,128;swap=0,1" --out "$OUT/tiles-$prec.json" 2>&1 | grep -v '^{' >>"$OUT/log.txt"
        grep -A12 "| $prec: tiles" "$OUT/log.txt" | tee -a "$OUT/summary.txt"
      done
      lim=$(limit 60); [ "$lim" != 0 ] && timeout "$lim" python3 benchmarks/bench_linears.py --preset "$PRESET" \
        --rows 256 2>&1 | grep -E "variants:|one pass" | tee -a "$OUT/summary.txt"
    fi
    STEP_LIMIT=100 bench fp8-default $ROW --precision fp8
    STEP_LIMIT=100 bench fp8-swap $ROW --precision fp8 --moe-tiles "$SW" --profile  # the experts' kernel time
    STEP_LIMIT=80 bench int4-swap $ROW --precision int4 --moe-tiles "$SW" --profile
    STEP_LIMIT=80 bench int4-lin8-swap $ROW --precision int4 --moe-tiles "$SW" --linears int8 --linear-tiles swap=1
    # the dense MLP in int4 on the experts' kernels (--linears int4-mlp): peak_memory.py predicts 17.32 GB against
    # int4's 18.11 (measured 18.25 on an H100), without the 8-bit projection kernel
    STEP_LIMIT=80 bench int4-mlp4-swap $ROW --precision int4 --moe-tiles "$SW" --linears int4-mlp
    STEP_LIMIT=80 bench int4-default $ROW --precision int4
    ;;
  merged)
    # issue 30 item 1: q/k/v and gate/up as one GEMM each per layer (205 projection launches a pass -> ~120, the same
    # bytes). The compiled fp8 row with merged projections (the default; --profile: kernels_per_step) and without,
    # on this card in one call; the merged path's tests here first (its GEMMs against the separate ones on CUDA)
    DEADLINE=$((SECONDS + ${BUDGET:-360}))
    env_info
    ROW="$ROW1 --compile --fuse-commit --precision fp8"
    gpu_tests 60 tests/test_merged_projections.py
    STEP_LIMIT=130 bench fp8-merged $ROW --merge-projections --profile
    STEP_LIMIT=110 bench fp8-unmerged $ROW --no-merge-projections
    ;;
  check)
    env_info
    # compiled Triton kernels (not the interpreter), the CUDA graph and fp8 grouped-GEMM tests
    timeout 300 python3 -m pytest -q -p no:cacheprovider --durations=10 tests/test_kernels.py tests/test_quant.py tests/test_linear_q.py \
      tests/test_bench.py \
      "tests/test_generate.py::test_fixed_steps_do_not_synchronise_on_cuda" \
      "tests/test_cache_ring.py::test_captured_graphs_on_a_ring_match_the_eager_passes" \
      2>&1 | tee "$OUT/gpu-tests-full.txt" | tail -40 | tee "$OUT/gpu-tests.txt"
    bench tiny-all --batch 1,2 --modes fixed,adaptive --new-tokens 64 --experts auto $GPU_FLAGS
    # the expert kernels' tiles on one layer of the real shapes, bf16/fp8/int4 (the defaults are untuned); the
    # winner goes to the next parts as MOE_TILES="<best spec>" (bench --moe-tiles)
    if [ "$CUDA" = 1 ]; then
      echo "=== tiles: benchmarks/sweep_moe_tiles.py --preset $PRESET" | tee -a "$OUT/log.txt"
      timeout 240 python3 benchmarks/sweep_moe_tiles.py --preset "$PRESET" --out "$OUT/tiles.json" \
        2>&1 | tee -a "$OUT/log.txt" | grep -v '^{' | tail -40 || echo "!!! tiles failed or timed out" | tee -a "$OUT/log.txt"
      # the int8 linear kernel vs cuBLAS bf16 on every projection shape, 1 / 256 / 512 / 1024 rows
      echo "=== linears: benchmarks/bench_linears.py --preset $PRESET" | tee -a "$OUT/log.txt"
      timeout 120 python3 benchmarks/bench_linears.py --preset "$PRESET" 2>&1 | tee "$OUT/linears.txt" \
        | tee -a "$OUT/log.txt" | grep -v '^{' | tail -20 || echo "!!! linears failed or timed out" | tee -a "$OUT/log.txt"
      # L2 vs device-memory read rate: what compile_report.py's L2 -> SM traffic is to be read against (~10 s)
      echo "=== l2: benchmarks/l2_bandwidth.py" | tee -a "$OUT/log.txt"
      timeout 60 python3 benchmarks/l2_bandwidth.py 2>&1 | tee "$OUT/l2.txt" | tee -a "$OUT/log.txt" | grep -v '^{' | tail -8 \
        || echo "!!! l2 failed or timed out" | tee -a "$OUT/log.txt"
    fi
    ;;
  bf16)
    bench bf16-base --batch 1 --modes fixed --experts grouped --attention sdpa_gqa
    bench bf16-fast --batch 1,2,4,8 --modes fixed --experts $FAST --attention sdpa_gqa --sampler fast $GPU_FLAGS \
      --no-reference --ar-tokens 256 --profile
    bench bf16-fused --batch 1 --modes fixed --experts $FAST --attention sdpa_gqa --sampler fast $GPU_FLAGS \
      --fuse-commit --no-reference --no-ar
    ;;
  quant)
    # the predicted peak (meta-device accounting, seconds), next to the int4 run's measured peak_mem_bytes
    python3 benchmarks/peak_memory.py --preset "$PRESET" --precision int4 2>&1 | grep -v '^{' | tee -a "$OUT/log.txt"
    python3 benchmarks/peak_memory.py --preset "$PRESET" --precision int4 --linears int8 2>&1 | grep -v '^{' \
      | tee -a "$OUT/log.txt"
    bench fp8 --batch 1,4 --precision fp8 --modes fixed --experts $FAST --sampler fast $GPU_FLAGS --no-reference \
      --ar-tokens 256 --profile ${MOE_TILES_FP8:+--moe-tiles $MOE_TILES_FP8}
    # vLLM's FP8 recipe: fp8 weights and fp8 activations in the experts and the projections (w8a8, scaled_mm)
    [ "$CUDA" = 1 ] && bench fp8-w8a8 --batch 1 --precision fp8 --linears fp8 --modes fixed --experts scaled_mm \
      --sampler fast $GPU_FLAGS --no-reference --no-ar
    bench int4 --batch 1,4 --precision int4 --modes fixed --experts $FAST --sampler fast $GPU_FLAGS --no-reference \
      --ar-tokens 256 --profile ${MOE_TILES_INT4:+--moe-tiles $MOE_TILES_INT4}
    # attention and dense-MLP projections in int8 too: 1.65 GB less to hold; per step at 256 rows they sit at the
    # ridge point (bf16 0.98 ms of bytes vs 0.85 ms of math at peak), so the step gains little, the AR step a lot
    bench int4-lin8 --batch 1 --precision int4 --linears int8 --modes fixed --experts $FAST --sampler fast $GPU_FLAGS \
      --no-reference --ar-tokens 256 ${MOE_TILES_INT4:+--moe-tiles $MOE_TILES_INT4}
    bench int4-topk --batch 1 --precision int4 --modes fixed --experts $FAST --sampler fast $GPU_FLAGS --sc-topk 64 \
      --fuse-commit --no-reference --no-ar
    ;;
  serve)
    # the server's scheduler under closed-loop load (benchmarks/bench_serve.py), int4 experts + int8 linears (the
    # 16 GiB configuration), as served by default, then with CUDA graphs (slots), fused commits and the fused sampler;
    # 1 and 4 requests in flight
    for run in eager graphs; do
      flags=""; [ "$run" = graphs ] && flags="$GPU_FLAGS --fuse-commit --sampler fast"
      echo "=== serve-$run: benchmarks/bench_serve.py --preset $PRESET $flags" | tee -a "$OUT/log.txt"
      t0=$SECONDS
      timeout "$STEP_LIMIT" python3 benchmarks/bench_serve.py --preset "$PRESET" --precision int4 --linears int8 \
        --concurrency 1,4 --requests 4 --prompt-tokens 1024 --new-tokens 256 --steps 16 --out "$OUT/serve-$run.json" \
        $flags >>"$OUT/log.txt" 2>&1 || echo "!!! serve-$run failed or timed out (rc $?)" | tee -a "$OUT/log.txt"
      echo "--- serve-$run: $((SECONDS - t0)) s" | tee -a "$OUT/log.txt"
    done
    ;;
  long)
    # prefill of an 8K-token prompt (int4 experts + int8 linears): 2,048 tokens a chunk (the default) against the
    # whole prompt in one pass; prefill_ms and peak_mem_bytes are the numbers to compare (with 2048 the sliding layers
    # also keep a ring of 1,024 + 2,048 positions: peak_memory.py predicts 16.66 GB; with 0 every position)
    LONG=8192; [ "$PRESET" = real-26b ] || LONG=3000  # a dry run's preset holds 4,096 positions
    for chunk in 2048 0; do
      bench long-prefill-$chunk --batch 1 --precision int4 --linears int8 --modes fixed --experts $FAST --sampler fast \
        $GPU_FLAGS --prompt-tokens $LONG --new-tokens 256 --prefill-chunk $chunk --no-reference --no-ar
    done
    # the experts' sum over a token's K outputs: a third kernel over the [A, H] per-assignment outputs (0.69 GB a
    # step written and read) against fp32 atomic adds in the down kernel; ms/step is the number to compare
    for sum in kernel atomic; do
      bench int4-sum-$sum --batch 1 --precision int4 --modes fixed --experts $FAST --sampler fast $GPU_FLAGS \
        --moe-sum $sum --no-reference --no-ar ${MOE_TILES_INT4:+--moe-tiles $MOE_TILES_INT4}
    done
    ;;
  ctx)
    # a 32K-token context (int4 experts + int8 linears, 256 new tokens, fast sampler): the sliding layers' ring, the
    # eager decoder's in-place canvas, prefill and commits for the cache alone, and attention on SDPA's fused kernels
    # (benchmarks/README.md items 26-29). peak_mem_bytes against benchmarks/peak_memory.py's prediction (eager
    # 17.29 GB, CUDA graphs 17.75 GB; plus the CUDA context and the allocator's rounding); prefill_ms and ms/step
    CTX=32768; [ "$PRESET" = real-26b ] || CTX=3000  # a dry run's preset holds 4,096 positions
    bench ctx-eager --batch 1 --precision int4 --linears int8 --modes fixed --experts $FAST --sampler fast \
      --prompt-tokens $CTX --new-tokens 256 --no-reference --no-ar
    bench ctx-graphs --batch 1 --precision int4 --linears int8 --modes fixed --experts $FAST --sampler fast \
      $GPU_FLAGS --prompt-tokens $CTX --new-tokens 256 --no-reference --no-ar
    ;;
  train)
    # training on one GPU (benchmarks/train_step.py): QLoRA steps of the preset with random weights (int4 experts +
    # int8 projections, rank 16; then int4 alone), tokens/s and torch's peak allocation beside train_memory.py's
    # prediction (21.61 / 23.25 GB on the 26B, benchmarks/results/2026-11-26-train-memory-fsdp.md), then the same
    # steps on the tiny preset with every weight trained (full SFT tokens/s)
    env_info
    for row in "int4-int8 --precision int4 --linears int8 --lora 16" "int4 --precision int4 --lora 16" \
               "tiny-full --preset tiny --precision native --lora 0"; do
      set -- $row; name=$1; shift
      lim=$(limit "${STEP_LIMIT:-240}")
      [ "$lim" = 0 ] && { echo "!!! train-$name skipped: no time left" | tee -a "$OUT/log.txt"; continue; }
      echo "=== train-$name (limit $lim s): benchmarks/train_step.py $*" | tee -a "$OUT/log.txt"
      PRESET_ARG="--preset $PRESET"; case "$*" in *--preset*) PRESET_ARG="";; esac
      timeout "$lim" python3 benchmarks/train_step.py $PRESET_ARG "$@" --steps 3 > "$OUT/train-$name.txt" 2>&1 \
        || { echo "!!! train-$name failed or timed out"; tail -5 "$OUT/train-$name.txt"; } | tee -a "$OUT/summary.txt"
      grep -v '^{' "$OUT/train-$name.txt" | tail -6 | tee -a "$OUT/log.txt"
    done
    ;;
  *) echo "unknown part $PART (defaults, sweep, stack, merged, attention, swap, compiled, align, engine, next, oneshot, tune, final, check, bf16, quant, serve, long, ctx or train)"; exit 2 ;;
esac
[ -s "$OUT/summary.txt" ] && { echo; echo "=== failures and tests"; cat "$OUT/summary.txt"; }

python3 - "$OUT" <<'EOF'
import glob, json, sys

def f(r, k, fmt, scale=1.0):
    return format(r[k] * scale, fmt) if isinstance(r.get(k), (int, float)) else "-"

if any(json.load(open(p)).get("runs") for p in glob.glob(f"{sys.argv[1]}/*.json")):
    print("\n| run | engine | B | mode | tok/s | excl. prompt | prefill ms | ms/step | ms/commit | step floor frac | roofline frac | GB/s | peak GB | captures in timed runs |")
    print("|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
for path in sorted(glob.glob(f"{sys.argv[1]}/*.json")):
    res = json.load(open(path))
    for r in res.get("runs", []):
        print(f"| {path.split('/')[-1][:-5]} | {r.get('engine')} | {r.get('batch')} | {r.get('mode')} | "
              f"{f(r, 'tok_s', '.0f')} | {f(r, 'tok_s_excl_prompt', '.0f')} | {f(r, 'prefill_ms', '.0f')} | "
              f"{f(r, 'ms_per_step', '.2f')} | "
              f"{f(r, 'ms_per_commit', '.2f')} | {f(r, 'floor_fraction', '.2f')} | {f(r, 'floor_fraction_roofline', '.2f')} | "
              f"{f(r, 'achieved_gbs', '.0f')} | "
              f"{f(r, 'peak_mem_bytes', '.1f', 1e-9)} | {r.get('graph_captures_timed', '-')} |")
serves = [(path.split('/')[-1][:-5], json.load(open(path))) for path in sorted(glob.glob(f"{sys.argv[1]}/serve-*.json"))]
if serves:  # bench_serve.py: aggregate and per-request rates under load
    print("\n| serve run | in flight | tok/s | request tok/s p50 | 1st commit p50 ms | rows/step | ms/step | peak GB | captures in timed part |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n, res in serves:
        for lv in res["levels"]:
            print(f"| {n} | {lv['concurrency']} | {f(lv, 'tok_s', '.0f')} | {f(lv, 'request_tok_s_p50', '.0f')} | "
                  f"{f(lv, 'first_commit_ms_p50', '.0f')} | {f(lv, 'rows_per_step', '.2f')} | "
                  f"{f(lv, 'ms_per_batched_step', '.2f')} | {f(lv, 'peak_mem_bytes', '.1f', 1e-9)} | "
                  f"{lv.get('graph_captures_timed', '-')} |")
profiles = [(path.split('/')[-1][:-5], json.load(open(path)).get("profile")) for path in sorted(glob.glob(f"{sys.argv[1]}/*.json"))]
profiles = [(n, p) for n, p in profiles if p]
if profiles:  # where a step's time goes (eager kernels, --profile): the answer when a target is missed
    parts = ["experts", "attention", "decoder, rest", "sampler"]
    classes = ["dense GEMM", "norm", "other"]
    print("\n| run (B, eager) | kernels/step | wall ms/step | busy | gap | " + " | ".join(parts) + " | experts GB/s | "
          + " | ".join(f"kernels: {c}" for c in classes) + " |")
    print("|---|" + "---:|" * (5 + len(parts) + len(classes)))
    for n, p in profiles:
        print(f"| {n} (B={p.get('batch')}) | {p.get('kernels_per_step', 0):.0f} | {p['wall_ms_per_step']:.2f} | {p['busy_ms_per_step']:.2f} | "
              f"{p['gap_ms_per_step']:.2f} | " + " | ".join(f"{p['by_part_ms'].get(c, 0):.2f}" for c in parts) +
              f" | {p.get('experts_achieved_gbs', 0):.0f} | " +
              " | ".join(f"{p['by_class_ms'].get(c, 0):.2f}" for c in classes) + " |")
EOF

# the device tool brings back at most 8 files from $OUT: past that, everything but the log, the summary and the
# test output goes into one archive (tar -xzf results.tar.gz)
mapfile -t files < <(cd "$OUT" && ls -1 | grep -v -x -e log.txt -e summary.txt -e gpu-tests.txt -e results.tar.gz)
if [ "$(ls -1 "$OUT" | wc -l)" -gt 8 ] && [ "${#files[@]}" -gt 0 ]; then
  tar -czf "$OUT/results.tar.gz" -C "$OUT" --remove-files "${files[@]}" && echo "results packed: $OUT/results.tar.gz"
fi
