#!/usr/bin/env bash
# GPU acceptance runs of the launcher, for the 1×H200 machine (Python 3.12, torch 2.11, no ray and
# no rich there): first run tools/gpu/prepare_wheels.sh on the CPU machine so .whl/ travels with
# the checkout, then on the device, from the repo root:
#   bash tools/gpu/launch_check.sh
# Reports go to $OUT (the device tool's folder) or ./out. Exit status 0 only if every run passed.
# DEVICE=cpu SMALL=1 bash tools/gpu/launch_check.sh rehearses the script on a CPU machine.
#
# On a machine with 8 GPUs, the same launcher runs real EP8 (each rank builds only its 32 of
# DeepSeek-V3's 256 experts, 2.8 GB of bf16 weights, and validates on a token sample):
#   python3 -m ep_runtime.launch --launcher spawn --dp 8 --device cuda --model deepseek-v3
#   torchrun --standalone --nproc-per-node 8 -m ep_runtime.launch --model deepseek-v3
#   python3 -m ep_runtime.launch --dp 8 --device cuda --model deepseek-v3        # Ray
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-out}"
DEVICE="${DEVICE:-cuda}"
mkdir -p "$OUT"

site="$(mktemp -d)"
if ! python3 -c "import rich" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --target "$site" \
    .whl/rich-*.whl .whl/markdown_it_py-*.whl .whl/mdurl-*.whl .whl/pygments-*.whl || exit 2
fi
if ! python3 -c "import ray" 2>/dev/null && [[ -f .whl/ray-2.60.0-slim.zip ]]; then
  python3 -m pip install -q --no-index --no-deps --target "$site" \
    .whl/jsonschema-*.whl .whl/jsonschema_specifications-*.whl .whl/referencing-*.whl \
    .whl/rpds_py-*.whl
  python3 -m zipfile -e .whl/ray-2.60.0-slim.zip "$site"  # zip extraction drops the run bits:
  find "$site/ray/core" "$site/ray/_private" -type f -exec chmod +x {} +
fi
export PYTHONPATH="$PWD:$site${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"

failed=()
launch() {  # launch NAME ARGS...: one run, its JSON in $OUT/NAME.json
  local name="$1"
  shift
  echo "=== $name: python3 -m ep_runtime.launch $*"
  local started=$SECONDS
  if ! timeout 400 python3 -m ep_runtime.launch --device "$DEVICE" --json "$OUT/$name.json" "$@"; then
    failed+=("$name")
  fi
  echo "=== $name: $((SECONDS - started)) s"
}

shrink=()
[[ "${SMALL:-0}" == 1 ]] && shrink=(--hidden 256 --intermediate 128 --tokens 32)

# 1. spawn launcher (no Ray), NCCL world of 1: the default model, both layouts, both modes
launch spawn_tiny --launcher spawn --dp 1 --layout both
launch spawn_tiny_capacity --launcher spawn --dp 1 --layout both --mode capacity
# 2. every preset at its own shape, through the spawn launcher
for model in deepseek-v2-lite qwen3-30b-a3b mixtral-8x7b nemotron-3-nano; do
  launch "spawn_$model" --launcher spawn --dp 1 --model "$model" "${shrink[@]}"
done
# 3. DeepSeek-V3: one EP8 rank's weight shard (32 experts, 2.8 GB bf16) at prefill size, then
#    the whole layer on one GPU (256 experts, 22.5 GB): peak_memory_bytes per rank in the JSON
launch spawn_dsv3_ep8_shard --launcher spawn --dp 1 --model deepseek-v3 --num-experts 32 \
  --tokens 4096 "${shrink[@]}"
launch spawn_dsv3_full --launcher spawn --dp 1 --model deepseek-v3 "${shrink[@]}"
# 4. torchrun (env:// rendezvous), the same rank code
echo "=== torchrun"
if ! timeout 300 torchrun --standalone --nproc-per-node 1 -m ep_runtime.launch --device "$DEVICE" \
  --json "$OUT/torchrun_tiny.json"; then
  failed+=(torchrun_tiny)
fi
# 5. Ray: placement group with a GPU bundle, NOSET device selection, NCCL
if python3 -c "import ray" 2>/dev/null; then
  launch ray_tiny --launcher ray --address local --dp 1 --plot "$OUT/ray_tiny.png"
  launch ray_dsv3_ep8_shard --launcher ray --address local --dp 1 --model deepseek-v3 \
    --num-experts 32 "${shrink[@]}"
else
  echo "=== ray: not importable (run tools/gpu/prepare_wheels.sh first); skipped"
  failed+=(ray_missing)
fi

python3 - "$OUT" <<'PY'
import json, pathlib, sys
print(f"{'run':28} {'ok':>3} {'W':>2} {'backends':34} {'rel err':>8} {'layer ms':>9} {'peak GB':>8}")
for path in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    r = json.loads(path.read_text())
    if "per_rank" not in r:
        print(f"{path.stem:28} {'no':>3} {r.get('error', '')[:80]}")
        continue
    peak = max(x["peak_memory_bytes"] for x in r["per_rank"]) / 1e9
    backends = f"{r['dispatcher']}/{r['experts']}/{r['layout']}"
    print(f"{path.stem:28} {'yes' if r['passed'] else 'NO':>3} {r['world_size']:>2} {backends:34} "
          f"{r['max_rel_err']:8.1e} {r['phases']['layer']['median_ms']:9.3f} {peak:8.2f}")
PY
if ((${#failed[@]})); then
  echo "FAILED: ${failed[*]}"
  exit 1
fi
echo "all launcher GPU checks passed"
