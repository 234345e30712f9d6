#!/usr/bin/env bash
# On the CPU machine, from anywhere: put into .whl/ (ignored by git, carried with a device run)
# what tools/gpu/launch_check.sh needs on the GPU machine (Python 3.12, torch 2.11, no rich, no
# ray: the 'launch' extra, from wheels).
#   tools/gpu/prepare_wheels.sh             # rich + a slimmed Ray (about 45 MB in all)
#   WITH_RAY=0 tools/gpu/prepare_wheels.sh  # rich only: the spawn and torchrun launchers
set -euo pipefail
cd "$(dirname "$0")/../.."
python="${PYTHON:-python3}"
mkdir -p .whl
download() {
  "$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux_2_28_x86_64 -d .whl "$@"
}
download rich markdown-it-py mdurl pygments
if [[ "${WITH_RAY:-1}" == 1 ]]; then
  download ray==2.60.0 jsonschema jsonschema-specifications referencing rpds-py
  # Ray's wheel is 79 MB; without Java jars and the libraries we do not use it is about 42 MB.
  "$python" - <<'PY'
import glob, os, zipfile
DROP = ("ray/jars/", "ray/rllib/", "ray/tune/", "ray/serve/", "ray/data/", "ray/train/", "ray/llm/")
for wheel in glob.glob(".whl/ray-2.60.0-cp312-*.whl"):
    slim = ".whl/ray-2.60.0-slim.zip"
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(slim, "w", zipfile.ZIP_DEFLATED) as dst:
        for item in src.infolist():
            if not item.filename.startswith(DROP):
                dst.writestr(item, src.read(item))
    os.remove(wheel)
    print(f"{slim}: {os.path.getsize(slim) / 2**20:.0f} MiB")
PY
fi
du -sh .whl
