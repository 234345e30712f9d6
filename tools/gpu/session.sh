#!/usr/bin/env bash
# Everything the single-H200 machine can check, in parts that each fit one 10-minute device
# call (run them back to back; carry .whl/, made by tools/gpu/prepare_wheels.sh plus the
# trimmed flashinfer-python 0.7.2.post1 and apache-tvm-ffi wheels, and transformers for hf):
#   bash tools/gpu/session.sh check     # Triton kernels vs their torch twins (tests at odd and at
#                                       # model shapes, per-op timings, kernels per forward), the
#                                       # CUDA pytest files at world size 1, python -m ep_runtime.bench
#   bash tools/gpu/session.sh hf        # python -m ep_runtime.bench.hf: transformers' MoE vs ours
#   bash tools/gpu/session.sh tests     # pytest (CUDA + multi-rank, auto's choice of DeepEP and
#                                       # FlashInfer and their refusals), NCCL/GIN probe
#   bash tools/gpu/session.sh launch    # the launcher: spawn, torchrun, Ray; presets; DSV3 memory
#   bash tools/gpu/session.sh bench     # BENCHMARKS.md figures: DSV3 EP8 shard and Qwen3 at W=1,
#                                       # exact and capacity (eager and CUDA-graph replay)
# Logs go to $OUT (the device tool's folder) or ./out.
set -uo pipefail
cd "$(dirname "$0")/../.."
part="${1:?usage: tools/gpu/session.sh check|hf|tests|launch|bench}"
OUT="${OUT:-out}"
mkdir -p "$OUT"
site=/tmp/ep_site
mkdir -p "$site"
python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" .whl/*.whl \
  >/dev/null 2>&1 || echo "carried wheels not installed"
export PYTHONPATH="$PWD:$site${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

section() { echo; echo "################ $* ($(date +%T))"; }

if [[ "$part" == check ]]; then
  exec > >(tee "$OUT/check.log") 2>&1
  section environment
  nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  section "Triton kernels: tests on CUDA (odd shapes, model shapes)"
  xdist=(); python3 -c "import xdist" 2>/dev/null && xdist=(-n 8)  # compiling dominates: spread it
  timeout 200 python3 -m pytest -q -p no:cacheprovider "${xdist[@]}" tests/kernels/test_kernels.py \
    tests/kernels/test_kernels_route.py tests/kernels/test_kernels_layer.py tests/kernels/test_kernels_at_model_shapes.py
  echo "kernel tests exit $?"
  section "Triton kernels: per-op timings, kernels per forward"
  timeout 200 python3 -m ep_runtime.bench.kernels --json "$OUT/kernels.json"
  echo "bench.kernels exit $?"
  section "pytest: CUDA tests and the suite at world size 1 (NCCL)"
  EP_TEST_WORLD_SIZES=1 EP_TEST_GROUP_TIMEOUT_S=60 timeout 200 python3 -m pytest -q \
    -p no:cacheprovider -n 4 --timeout 120 tests/multigpu/test_cuda.py \
    tests/multigpu/test_suite.py tests/test_validation.py tests/test_tolerance.py
  echo "pytest exit $?"
  section "python -m ep_runtime.bench"
  timeout 200 python3 -m ep_runtime.bench --layouts expanded standard --json "$OUT/bench.json"
  echo "bench exit $?"
elif [[ "$part" == hf ]]; then
  exec > >(tee "$OUT/hf.log") 2>&1
  section "python -m ep_runtime.bench.hf"
  timeout 400 python3 -m ep_runtime.bench.hf --json "$OUT/hf_bench.json"
  echo "bench.hf exit $?"
elif [[ "$part" == tests ]]; then
  exec > >(tee "$OUT/tests.log") 2>&1
  section environment
  nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv,noheader
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version(), 'gpus', torch.cuda.device_count())"
  section "NCCL / GIN probe"
  timeout 60 python3 -m ep_runtime.dispatch.nccl_probe
  # CUDA-only tests (auto's choice of DeepEP and FlashInfer, refusals timed) and the suite
  section "pytest: CUDA-only tests and the multi-rank suite (W=1 on NCCL, W=2/4 on gloo)"
  EP_TEST_GROUP_TIMEOUT_S=60 timeout 420 python3 -m pytest -q -p no:cacheprovider -rs \
    --timeout 240 --ignore=tests/launch/test_launch_ray.py --junitxml "$OUT/pytest.xml" tests
  echo "pytest exit $?"
elif [[ "$part" == launch ]]; then
  exec > >(tee "$OUT/launch.log") 2>&1
  section "launcher GPU checks"
  runs=/tmp/launch_runs
  OUT="$runs" timeout 560 bash tools/gpu/launch_check.sh
  echo "launch_check exit $?"
  tar czf "$OUT/launch_runs.tgz" -C "$runs" .
elif [[ "$part" == bench ]]; then
  exec > >(tee "$OUT/bench.log") 2>&1
  runs=/tmp/bench_runs
  mkdir -p "$runs"
  bench() {  # bench NAME ARGS...: one spawn-launcher run at W=1 on the GPU
    local name="$1"
    shift
    section "bench $name: $*"
    timeout 240 python3 -m ep_runtime.launch --launcher spawn --dp 1 --device cuda --iters 20 \
      --warmup 5 --json "$runs/$name.json" "$@" | tail -12
  }
  shard=(--model deepseek-v3 --num-experts 32)  # one EP8 rank's experts
  bench dsv3_shard_t128_exact "${shard[@]}" --tokens 128 --layout both
  bench dsv3_shard_t128_capacity "${shard[@]}" --tokens 128 --layout both --mode capacity
  bench dsv3_shard_t4096_exact "${shard[@]}" --tokens 4096 --layout both
  bench qwen3_t256_capacity --model qwen3-30b-a3b --tokens 256 --layout both --mode capacity
  bench qwen3_t4096_exact --model qwen3-30b-a3b --tokens 4096 --layout both
  tar czf "$OUT/bench_runs.tgz" -C "$runs" .
fi
