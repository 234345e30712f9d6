#!/usr/bin/env bash
# Issue 7 on a machine with 2-8 H200s: the multi-rank suite on NCCL, the communication floor and
# our dispatch/combine for DeepSeek-V3 at EP = 2, 4, 8 x 128 / 4096 tokens per rank, and the full
# layer at EP8. Run from the repository root. Everything lands in $OUT (at most 7 files, flat):
#   env.txt      GPUs, driver, torch/NCCL/NVSHMEM versions, multicast switches
#   suite.log    pytest tests/multigpu/test_suite.py on NCCL (every registered dispatcher)
#   comm.log     launcher output of every communication point
#   comm.jsonl   their --json reports, one per line
#   layer.log    launcher output of the full layer at EP8
#   layer.jsonl  its --json reports
#   summary.md   python -m ep_runtime.bench.summary over both .jsonl files: paste into BENCHMARKS.md
# EP sizes above the GPU count (nvidia-smi -L) are skipped, and the summary says so.
# deepep_v2 joins the communication points where `import deep_ep` works (docs/deepep.md: build
# it with the system g++); on one node without GIN the adapter sets EP_DISABLE_GIN=1 itself.
# One device command may run at most 10 minutes: run the parts in separate commands if needed
# (--parts suite, --parts comm, --parts layer), each with its own $OUT; ep_runtime.bench.summary takes
# the .jsonl files of several runs.
#
# --ep and --tokens narrow the communication points (e.g. --parts comm --ep 8 --tokens 4096).
#
# usage: tools/gpu/multigpu_bench.sh [--dry-run] [--gpus N] [--parts suite,comm,layer]
#          [--ep 2,4,8] [--tokens 128,4096] [--iters N] [--python PYTHON] [--run-timeout S]
set -euo pipefail

DRY_RUN=0
GPUS=""
PARTS="suite,comm,layer"
EP_LIST="2,4,8"
TOKENS_LIST="128,4096"
ITERS=20
PYTHON="${PYTHON:-python3}"
RUN_TIMEOUT=240 # seconds per launcher run; a stuck run must not eat the session
OUT="${OUT:-out}"

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }

while [[ $# -gt 0 ]]; do
  case "$1" in
    --dry-run) DRY_RUN=1 ;;
    --gpus) GPUS="$2"; shift ;;
    --parts) PARTS="$2"; shift ;;
    --ep) EP_LIST="$2"; shift ;;
    --tokens) TOKENS_LIST="$2"; shift ;;
    --iters) ITERS="$2"; shift ;;
    --python) PYTHON="$2"; shift ;;
    --run-timeout) RUN_TIMEOUT="$2"; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "unknown argument: $1" >&2; usage >&2; exit 2 ;;
  esac
  shift
done
for part in ${PARTS//,/ }; do
  [[ "$part" =~ ^(suite|comm|layer)$ ]] || { echo "--parts: unknown part '$part'" >&2; exit 2; }
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
  if (( ep <= GPUS )); then EP_SIZES+=("$ep"); else SKIPPED+=("$ep"); fi
done
SKIP_NOTE="${SKIPPED[*]:+EP ${SKIPPED[*]} skipped: this machine has $GPUS GPU(s).}"

COMM_DISPATCHERS=(torch_a2a torch_symm_mem)
if "$PYTHON" -c 'import deep_ep' >/dev/null 2>&1; then COMM_DISPATCHERS+=(deepep_v2); fi

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

launch() { # launch LOG JSON ARGS...: one launcher run, DeepSeek-V3 on CUDA, spawn, own timeout
  local log="$1" json="$2"; shift 2
  run "$log" timeout "$RUN_TIMEOUT" "$PYTHON" -m ep_runtime.launch --launcher spawn \
    --device cuda --model deepseek-v3 --iters "$ITERS" --warmup 5 --timeout 120 \
    --json "$json" "$@"
}

# note TEXT [FILE]: say it, and when running for real, also append it to FILE
note() {
  echo "$1"
  if (( ! DRY_RUN )) && [[ -n "${2:-}" ]]; then echo "$1" >> "$2"; fi
}

echo "GPUs: $GPUS; EP sizes: ${EP_SIZES[*]:-none}; parts: $PARTS; dispatchers: ${COMM_DISPATCHERS[*]}; OUT: $OUT"
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
    EP_TEST_WORLD_SIZES="${sizes%,}" EP_TEST_GROUP_TIMEOUT_S=120 \
      run "$OUT/suite.log" "$PYTHON" -m pytest -q -rs tests/multigpu
  fi
fi

if has_part comm; then
  for ep in "${EP_SIZES[@]}"; do
    for tokens in ${TOKENS_LIST//,/ }; do
      for dispatcher in "${COMM_DISPATCHERS[@]}"; do
        for mode in exact capacity; do
          launch "$OUT/comm.log" "$SCRATCH/comm_ep${ep}_t${tokens}_${dispatcher}_${mode}.json" \
            --dp "$ep" --tokens "$tokens" --dispatcher "$dispatcher" --mode "$mode"
        done
      done
    done
  done
fi

if has_part layer && [[ " ${EP_SIZES[*]} " == *" 8 "* ]]; then
  # the command as given (auto backends, exact, 128 tokens), then symmetric memory
  launch "$OUT/layer.log" "$SCRATCH/layer_auto.json" --dp 8
  launch "$OUT/layer.log" "$SCRATCH/layer_symm_mem.json" --dp 8 --dispatcher torch_symm_mem \
    --mode capacity --layout both
elif has_part layer; then
  note "layer part skipped: EP8 needs 8 GPUs (and --ep with 8), found $GPUS" "$OUT/layer.log"
fi

if (( DRY_RUN )); then
  echo "dry run: nothing was started"
  exit 0
fi

JSONLS=()
for part in comm layer; do
  reports=("$SCRATCH"/"$part"_*.json)
  [[ -e "${reports[0]}" ]] || continue
  "$PYTHON" -c 'import json, sys; print("".join(json.dumps(json.load(open(p))) + "\n" for p in sys.argv[1:]), end="")' \
    "${reports[@]}" > "$OUT/$part.jsonl"
  JSONLS+=("$OUT/$part.jsonl")
done
if (( ${#JSONLS[@]} )); then
  {
    "$PYTHON" -m ep_runtime.bench.summary "${JSONLS[@]}" || FAILURES=$((FAILURES + 1))
    if [[ -n "$SKIP_NOTE" ]]; then printf '\n%s\n' "$SKIP_NOTE"; fi
  } > "$OUT/summary.md"
fi
echo "failed commands: $FAILURES (see the logs in $OUT)"
(( FAILURES == 0 ))
