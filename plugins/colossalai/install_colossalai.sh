#!/usr/bin/env bash
# Install ColossalAI 0.5.0 for accelkit-colossalai without letting pip touch torch.
#
#   bash plugins/colossalai/install_colossalai.sh [PYTHON]      (default: python3)
#
# colossalai 0.5.0 pins torch<=2.5.1, so it is installed with --no-deps, then only what its
# Booster imports, with the installed torch pinned as a constraint. pip's warning that colossalai
# wants torch<=2.5.1 is expected.
set -euo pipefail
python="${1:-python3}"
torch_version="$("$python" -c 'import torch; print(torch.__version__.split("+")[0])')"
pin="$(mktemp)"
trap 'rm -f "$pin"' EXIT
echo "torch==$torch_version" >"$pin"
"$python" -m pip install -q --no-deps "colossalai==0.5.0"
"$python" -m pip install -q -c "$pin" numpy psutil einops contexttimer \
    "peft==0.13.2" "transformers==4.51.3" galore_torch
"$python" -c "import torch; assert torch.__version__.split('+')[0] == '$torch_version', torch.__version__"
echo "colossalai: installed next to torch $torch_version"
