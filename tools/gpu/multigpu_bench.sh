#!/usr/bin/env bash
# Issues 7 and 50 on a machine with 2-8 H100s/H200s. Run from the repository root. Parts (--parts,
# comma-separated, or all):
#   suite      pytest tests/multigpu on NCCL (every registered dispatcher)
#   comm       our dispatch/combine for DeepSeek-V3 at EP 2, 4, 8 x 128 / 4096 tokens per rank,
#              every dispatcher, exact and capacity mode, beside the communication floor
#   layer      the full layer at EP8 (auto backends; torch_symm_mem in both layouts)
#   fp8        the fp8 block-scale layer on NCCL ranks: tests/multigpu/test_fp8_layer.py
#              (torch_a2a; its world sizes 1-4, those above the GPU count deselected with -k),
#              tests/multigpu/test_deepep_real.py -k fp8 (deepep_v2 at W 1, 2, 4, 8, where
#              `import deep_ep` works), and the launcher's fp8 layer validated against
#              reference_moe at the EP sizes above 4 that the test file does not reach
#              (torch_a2a, the tiny model, both layouts, exact and capacity mode)
#   bandwidth  dispatch + combine bandwidth of DeepSeek-V3 (H 7168, K 8), bf16 vs fp8 dispatch
#              (--quantization none / fp8_block), EP 2, 4, 8 x 128 / 4096 tokens per rank
#              (128: capacity mode, as a decode step; 4096: exact), both layouts in each run,
#              torch_a2a and deepep_v2 (where it imports): bytes received per rank per second
#              beside the same run's all_to_all_single of the same rows; with --deepep-dir,
#              DeepEP's own tests/elastic/test_ep.py at the same shapes for reference
#              (EP_DISABLE_GIN=1: one node, NVLink only)
#   eplb       --routing zipf:1.2 --redundant-experts 8 --rebalance-every 2 at each EP size:
#              weights moved per rebalance, its wall time, the busiest rank before and after
# Elastic recovery (issue 50's fourth part) waits for the elastic-EP issue and is not here.
#
# What lands in $OUT (flat): env.txt (GPUs, driver, torch/NCCL/NVSHMEM versions, multicast
# switches), PART.log (every command's output), PART.jsonl (the launcher's --json reports, one
# per line; comm, layer, fp8, bandwidth, eplb), deepep_test_ep.log (bandwidth with --deepep-dir)
# and summary.md (python -m ep_runtime.bench.summary over comm and layer; bandwidth per dispatch
# format; the eplb figures): paste into BENCHMARKS.md. A device command brings back at most 8
# files and may run at most 10 minutes: run one part per command, each with its own $OUT, and
# narrow a long part with --ep / --tokens (e.g. --parts bandwidth --ep 8); summary takes the
# .jsonl files of several runs.
# EP sizes above the GPU count (nvidia-smi -L, or --gpus) are skipped, and the summary says so.
# deepep_v2 joins where `import deep_ep` works (docs/deepep.md: build it with the system g++); on
# one node without GIN the adapter sets EP_DISABLE_GIN=1 itself.
#
# --cpu rehearses the launcher parts (eplb, bandwidth) on CPU ranks (gloo, --device cpu) with
# the tiny model (E 16, K 4, H 128, I 256), EP sizes not limited by a GPU count: a check of the
# commands and reports, not figures to compare with GPUs. Its defaults: --parts eplb, --ep 2,4.
#
# usage: tools/gpu/multigpu_bench.sh [--dry-run] [--cpu] [--gpus N]
#          [--parts all|suite,comm,layer,fp8,bandwidth,eplb] [--ep 2,4,8] [--tokens 128,4096]
#          [--iters N] [--python PYTHON] [--run-timeout S] [--deepep-dir DIR]
# default --parts: suite,comm,layer
set -euo pipefail

DRY_RUN=0
CPU=0
GPUS=""
PARTS=""
EP_LIST=""
TOKENS_LIST="128,4096"
ITERS=20
PYTHON="${PYTHON:-python3}"
RUN_TIMEOUT=240 # seconds per launcher run; a stuck run must not eat the session
DEEPEP_DIR=""
OUT="${OUT:-out}"
ALL_PARTS="suite,comm,layer,fp8,bandwidth,eplb"
CPU_PARTS="eplb,bandwidth" # the parts --cpu can rehearse
FP8_TEST_MAX_W=4 # tests/multigpu/test_fp8_layer.py's FP8_WORLD_SIZES end at 4

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }

while [[ $# -gt 0 ]]; do
  case "$1" in
    --dry-run) DRY_RUN=1 ;;
    --cpu) CPU=1 ;;
    --gpus) GPUS="$2"; shift ;;
    --parts) PARTS="$2"; shift ;;
    --ep) EP_LIST="$2"; shift ;;
    --tokens) TOKENS_LIST="$2"; shift ;;
    --iters) ITERS="$2"; shift ;;
    --python) PYTHON="$2"; shift ;;
    --run-timeout) RUN_TIMEOUT="$2"; shift ;;
    --deepep-dir) DEEPEP_DIR="$2"; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "unknown argument: $1" >&2; usage >&2; exit 2 ;;
  esac
  shift
done
if (( CPU )); then
  PARTS="${PARTS:-eplb}" EP_LIST="${EP_LIST:-2,4}" DEVICE=cpu MODEL=tiny
else
  PARTS="${PARTS:-suite,comm,layer}" EP_LIST="${EP_LIST:-2,4,8}" DEVICE=cuda MODEL=deepseek-v3
fi
if [[ "$PARTS" == all ]]; then PARTS="$ALL_PARTS"; fi
for part in ${PARTS//,/ }; do
  [[ ",$ALL_PARTS," == *",$part,"* ]] || { echo "--parts: unknown part '$part'" >&2; exit 2; }
  if (( CPU )) && [[ ",$CPU_PARTS," != *",$part,"* ]]; then
    echo "--cpu: expected parts among $CPU_PARTS (the others need GPUs), given '$part'" >&2
    exit 2
  fi
done
has_part() { [[ ",$PARTS," == *",$1,"* ]]; }

# NVLink multicast stays off everywhere (it can take the host's GPUs out of service).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export EP_TEST_GROUP_TIMEOUT_S="${EP_TEST_GROUP_TIMEOUT_S:-180}" # NVSHMEM init + first kernels

if [[ -z "$GPUS" ]]; then
  GPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
fi
EP_SIZES=()
SKIPPED=()
for ep in ${EP_LIST//,/ }; do
  if (( CPU || ep <= GPUS )); then EP_SIZES+=("$ep"); else SKIPPED+=("$ep"); fi
done
SKIP_NOTE="${SKIPPED[*]:+EP ${SKIPPED[*]} skipped: this machine has $GPUS GPU(s).}"

COMM_DISPATCHERS=(torch_a2a torch_symm_mem)
BANDWIDTH_DISPATCHERS=(torch_a2a)
HAVE_DEEP_EP=0
if (( ! CPU )) && "$PYTHON" -c 'import deep_ep' >/dev/null 2>&1; then
  HAVE_DEEP_EP=1
  COMM_DISPATCHERS+=(deepep_v2)
  BANDWIDTH_DISPATCHERS+=(deepep_v2)
fi

SCRATCH=$(mktemp -d)
trap 'rm -rf "$SCRATCH"' EXIT

# run LOG CMD...: print the command (dry run) or run it with output appended to LOG; a failed
# command is recorded and the script goes on, so one bad point does not hide the others.
FAILURES=0
run() {
  local log="$1"; shift
  if (( DRY_RUN )); then
    printf '%q ' "$@"; printf ' >> %s\n' "$log"
    return 0
  fi
  echo "### $*" >> "$log"
  local status=0
  "$@" >> "$log" 2>&1 || status=$?
  echo "### exit status $status" >> "$log"
  (( status == 0 )) || FAILURES=$((FAILURES + 1))
}

launch() { # launch LOG JSON MODEL ARGS...: one launcher run on $DEVICE, spawn, own timeout
  local log="$1" json="$2" model="$3"; shift 3
  run "$log" timeout "$RUN_TIMEOUT" "$PYTHON" -m ep_runtime.launch --launcher spawn \
    --device "$DEVICE" --model "$model" --iters "$ITERS" --warmup 5 --timeout 120 \
    --json "$json" "$@"
}

# note TEXT [FILE]: say it, and when running for real, also append it to FILE
note() {
  echo "$1"
  if (( ! DRY_RUN )) && [[ -n "${2:-}" ]]; then echo "$1" >> "$2"; fi
}

echo "device: $DEVICE; GPUs: $GPUS; EP sizes: ${EP_SIZES[*]:-none}; parts: $PARTS; OUT: $OUT"
echo "dispatchers: comm ${COMM_DISPATCHERS[*]}; bandwidth ${BANDWIDTH_DISPATCHERS[*]}"
if [[ -n "$SKIP_NOTE" ]]; then echo "$SKIP_NOTE"; fi
if (( ! DRY_RUN )); then
  mkdir -p "$OUT"
  {
    nvidia-smi -L || true
    nvidia-smi topo -m || true
    "$PYTHON" -c 'import torch, torch.distributed._symmetric_memory as s; print("torch", torch.__version__, "nccl", torch.cuda.nccl.version(), "nvshmem", s.is_nvshmem_available())' || true
    env | grep -E '^(NCCL_NVLS_ENABLE|TORCH_SYMM_MEM_DISABLE_MULTICAST|NVSHMEM_DISABLE_NVLS|NVSHMEM_SYMMETRIC_SIZE)=' || true
    echo "$SKIP_NOTE"
  } > "$OUT/env.txt" 2>&1
fi

if has_part suite; then
  if (( GPUS < 2 )); then
    note "suite skipped: needs >= 2 GPUs, found $GPUS" "$OUT/suite.log"
  else
    sizes=$(for w in 1 2 4 8; do (( w <= GPUS )) && printf '%s,' "$w"; done)
    run "$OUT/suite.log" env EP_TEST_WORLD_SIZES="${sizes%,}" EP_TEST_GROUP_TIMEOUT_S=120 \
      "$PYTHON" -m pytest -q -rs tests/multigpu
  fi
fi

if has_part comm; then
  for ep in "${EP_SIZES[@]}"; do
    for tokens in ${TOKENS_LIST//,/ }; do
      for dispatcher in "${COMM_DISPATCHERS[@]}"; do
        for mode in exact capacity; do
          launch "$OUT/comm.log" "$SCRATCH/comm_ep${ep}_t${tokens}_${dispatcher}_${mode}.json" \
            "$MODEL" --dp "$ep" --tokens "$tokens" --dispatcher "$dispatcher" --mode "$mode"
        done
      done
    done
  done
fi

if has_part layer && [[ " ${EP_SIZES[*]} " == *" 8 "* ]]; then
  # the issue's command as given (auto backends, exact, 128 tokens), then symmetric memory
  launch "$OUT/layer.log" "$SCRATCH/layer_auto.json" "$MODEL" --dp 8
  launch "$OUT/layer.log" "$SCRATCH/layer_symm_mem.json" "$MODEL" --dp 8 \
    --dispatcher torch_symm_mem --mode capacity --layout both
elif has_part layer; then
  note "layer part skipped: EP8 needs 8 GPUs (and --ep with 8), found $GPUS" "$OUT/layer.log"
fi

if has_part fp8; then
  if (( GPUS < 2 )); then
    note "fp8 part skipped: needs >= 2 GPUs, found $GPUS" "$OUT/fp8.log"
  else
    # EP_TEST_BACKEND=nccl: fail rather than fall back to gloo, so world sizes above the GPU
    # count are deselected (the matrix's ids carry -wW-; the file's other cases run at W = 2)
    deselect=""
    for (( w = GPUS + 1; w <= FP8_TEST_MAX_W; w++ )); do
      deselect+="${deselect:+ and }not -w$w-"
    done
    run "$OUT/fp8.log" env EP_TEST_BACKEND=nccl "$PYTHON" -m pytest -q -rs \
      tests/multigpu/test_fp8_layer.py ${deselect:+-k "$deselect"}
    if (( HAVE_DEEP_EP )); then # its world sizes above the GPU count skip themselves
      run "$OUT/fp8.log" env EP_TEST_BACKEND=nccl "$PYTHON" -m pytest -q -rs \
        tests/multigpu/test_deepep_real.py -k fp8
    else
      note "fp8 on deepep_v2 skipped: 'import deep_ep' fails with $PYTHON" "$OUT/fp8.log"
    fi
    for ep in "${EP_SIZES[@]}"; do
      (( ep > FP8_TEST_MAX_W )) || continue
      for mode in exact capacity; do
        launch "$OUT/fp8.log" "$SCRATCH/fp8_ep${ep}_${mode}.json" tiny --dp "$ep" \
          --dispatcher torch_a2a --quantization fp8_block --layout both --mode "$mode"
      done
    done
  fi
fi

if has_part bandwidth; then
  for ep in "${EP_SIZES[@]}"; do
    for tokens in ${TOKENS_LIST//,/ }; do
      mode=exact
      if (( tokens <= 128 )); then mode=capacity; fi # a decode step
      for dispatcher in "${BANDWIDTH_DISPATCHERS[@]}"; do
        for quantization in none fp8_block; do
          launch "$OUT/bandwidth.log" \
            "$SCRATCH/bandwidth_${quantization}_ep${ep}_t${tokens}_${dispatcher}.json" \
            "$MODEL" --dp "$ep" --tokens "$tokens" --dispatcher "$dispatcher" --mode "$mode" \
            --quantization "$quantization" --layout both
        done
      done
    done
  done
  test_ep="$DEEPEP_DIR/tests/elastic/test_ep.py"
  if [[ -z "$DEEPEP_DIR" ]]; then
    note "DeepEP's own figures skipped: no --deepep-dir (a DeepEP checkout)" "$OUT/bandwidth.log"
  elif (( CPU )); then
    note "DeepEP's own figures skipped: --cpu (DeepEP runs on GPUs)" "$OUT/bandwidth.log"
  elif [[ ! -f "$test_ep" ]]; then
    note "DeepEP's own figures skipped: $test_ep not found" "$OUT/bandwidth.log"
  else
    # its first case only; --use-fp8-dispatch picks the format where the checkout has it (at
    # dd758ca it has not, and the first case dispatches fp8)
    formats=("")
    if grep -q -- '--use-fp8-dispatch' "$test_ep"; then formats=(0 1); fi
    for ep in "${EP_SIZES[@]}"; do
      for tokens in ${TOKENS_LIST//,/ }; do
        for fp8 in "${formats[@]}"; do
          run "$OUT/deepep_test_ep.log" timeout "$RUN_TIMEOUT" env EP_DISABLE_GIN=1 \
            "$PYTHON" "$test_ep" --num-processes "$ep" --num-tokens "$tokens" --hidden 7168 \
            --num-topk 8 --num-experts 256 --test-first-only ${fp8:+--use-fp8-dispatch "$fp8"}
        done
      done
    done
  fi
fi

if has_part eplb; then
  if (( ${#EP_SIZES[@]} == 0 )); then
    note "eplb part skipped: no EP size of --ep fits $GPUS GPU(s)" "$OUT/eplb.log"
  fi
  for ep in "${EP_SIZES[@]}"; do
    launch "$OUT/eplb.log" "$SCRATCH/eplb_ep${ep}.json" "$MODEL" --dp "$ep" \
      --routing zipf:1.2 --redundant-experts 8 --rebalance-every 2
  done
fi

if (( DRY_RUN )); then
  echo "dry run: nothing was started"
  exit 0
fi

shopt -s nullglob # from here a glob without a match is no word
for part in comm layer fp8 bandwidth eplb; do
  reports=("$SCRATCH"/"$part"_*.json)
  (( ${#reports[@]} )) || continue
  "$PYTHON" -c 'import json, sys; print("".join(json.dumps(json.load(open(p))) + "\n" for p in sys.argv[1:]), end="")' \
    "${reports[@]}" > "$OUT/$part.jsonl"
done

# summary SECTION FILES...: a bench.summary table of these reports under a heading
summary() {
  printf '## %s\n\n' "$1"; shift
  "$PYTHON" -m ep_runtime.bench.summary "$@" || FAILURES=$((FAILURES + 1))
  echo
}

eplb_figures() { # the eplb reports: per run, each layout's rebalances and load
  "$PYTHON" - "$@" <<'PY'
import json, sys

print("## eplb\n")
print("| EP | device | layout | ok | rebalances | MiB moved (all, most in one) | ms per rebalance "
      "(median, max) | busiest rank / mean: before | after |")
print("|" + "---|" * 9)
for path in sys.argv[1:]:
    report = json.load(open(path))
    for case in report.get("cases", []):
        load, moves = case["eplb"], case["eplb"]["rebalances"]
        mib = [m["bytes_moved"] / 2**20 for m in moves]
        ms = sorted(m["seconds"] * 1e3 for m in moves)
        median = ms[len(ms) // 2] if ms else 0.0
        busiest = " | ".join(
            "" if s is None
            else f"{s['rank_max'] / s['rank_mean']:.3f} ({s['rank_max']:g} / {s['rank_mean']:g})"
            for s in (load["before"], load["after"])
        )
        print(f"| {report['world_size']} | {report['device']} | {case['layout']} "
              f"| {'yes' if case['passed'] else '**NO**'} | {len(moves)} "
              f"| {sum(mib):.2f}, {max(mib, default=0):.2f} "
              f"| {median:.1f}, {max(ms, default=0):.1f} | {busiest} |")
for path in sys.argv[1:]:
    report = json.load(open(path))
    if "cases" not in report:
        print(f"\nFAILED run (W={report.get('world_size')}): {report.get('error', '?')}")
PY
}

{
  reports=("$SCRATCH"/comm_*.json "$SCRATCH"/layer_*.json)
  if (( ${#reports[@]} )); then summary "comm and layer" "${reports[@]}"; fi
  for quantization in none fp8_block; do
    reports=("$SCRATCH"/bandwidth_"$quantization"_*.json)
    if (( ${#reports[@]} )); then
      summary "bandwidth, --quantization $quantization" "${reports[@]}"
    fi
  done
  reports=("$SCRATCH"/eplb_*.json)
  if (( ${#reports[@]} )); then eplb_figures "${reports[@]}" || FAILURES=$((FAILURES + 1)); fi
  if [[ -n "$SKIP_NOTE" ]]; then printf '\n%s\n' "$SKIP_NOTE"; fi
} > "$SCRATCH/summary.md"
if [[ -s "$SCRATCH/summary.md" ]]; then cp "$SCRATCH/summary.md" "$OUT/summary.md"; fi
echo "failed commands: $FAILURES (see the logs in $OUT)"
(( FAILURES == 0 ))
