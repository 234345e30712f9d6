#!/usr/bin/env bash
# Submit `python -m ep_runtime.launch` to a running Ray cluster as a job, shipping this checkout.
#
#   export RAY_ADDRESS=http://HEAD:8265        # the head's dashboard (ray job submit reads it)
#   launch/submit.sh --dp 16 --model deepseek-v3 --json out.json
#
# Everything after the script name goes to the launcher. Token auth (Ray >= 2.59 local clusters,
# all clusters from 2.61) needs RAY_AUTH_MODE=token on the submitting side too.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(dirname "$here")"
export RAY_AUTH_MODE="${RAY_AUTH_MODE:-token}"
exec ray job submit \
  --runtime-env "$here/runtime_env.yaml" \
  --working-dir "$repo" \
  -- python -m ep_runtime.launch --address auto "$@"
