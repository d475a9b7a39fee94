#!/usr/bin/env bash
# accelkit's GPU tests and benchmarks, in one call on a CUDA machine whose image already has torch.
# Packages the image lacks (deepspeed and its pure-Python needs) travel as wheels in .whl/.
#
#   bash bench/gpu_suite.sh OUTDIR [tests] [overhead] [fsdp] [deepspeed] [checkpoint] [dstests] [dsckpt]
#
# Every part writes its log (and JSON) into OUTDIR; a failing part does not stop the others.
set -u
OUTDIR=${1:?usage: gpu_suite.sh OUTDIR parts...}; shift
mkdir -p "$OUTDIR"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
SITE=/tmp/accelkit-site
if [ ! -d "$SITE/accelkit" ]; then
  if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl
  fi
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target "$SITE" .
  for plugin in plugins/*/; do
    python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target "$SITE" "$plugin" \
      || echo "plugin $plugin did not install"
  done
fi
export PYTHONPATH=$SITE
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c 'import torch, accelkit; print("torch", torch.__version__, "cuda", torch.version.cuda, "accelkit", accelkit.__version__)'
} 2>&1 | tee "$OUTDIR/env.txt"

part() { echo "== $1 ($(date -u +%H:%M:%S))"; }
for p in "$@"; do
  case "$p" in
    dstests)
      part dstests
      ACCELKIT_GPU_REPORT="$OUTDIR" timeout 240 python3 -m pytest -q -rfE -p no:cacheprovider -m gpu -o addopts="" --timeout 200 plugins/deepspeed/tests > "$OUTDIR/ds-tests.log" 2>&1
      sed -n '/GPU summary/,$p' "$OUTDIR/ds-tests.log" | tail -70
      tail -3 "$OUTDIR/ds-tests.log" ;;
    dsckpt)
      part dsckpt
      timeout 120 python3 bench/deepspeed_checkpoint.py --out "$OUTDIR/ds-checkpoint.json" > "$OUTDIR/ds-checkpoint.log" 2>&1
      grep -v -i warn "$OUTDIR/ds-checkpoint.log" | tail -14 ;;
    dsbench)
      part dsbench
      timeout 200 python3 bench/deepspeed_gpt.py --configs z2:bf16-true,z3:bf16-true --repeats 3 --out "$OUTDIR/deepspeed.json" > "$OUTDIR/deepspeed.log" 2>&1
      grep -v Warning "$OUTDIR/deepspeed.log" | tail -8 ;;
    alltests)
      part alltests
      ACCELKIT_GPU_REPORT="$OUTDIR" timeout 200 python3 -m pytest -q -rsf -p no:cacheprovider -m gpu -o addopts="" --timeout 150 tests plugins > "$OUTDIR/gpu-tests-full.log" 2>&1
      tail -25 "$OUTDIR/gpu-tests-full.log" ;;
    benchcli)
      part benchcli
      timeout 130 python3 -m accelkit.cli bench --model gpt2-small --precision bf16-mixed --batch 8 \
        --backends cuda,fsdp,deepspeed_stage_2 --steps 20 --warmup 5 --repeats 3 \
        --out "$OUTDIR/h200-gpt2-b8.json" --plot "$OUTDIR/h200-gpt2-b8.png" > "$OUTDIR/bench-cli.log" 2>&1
      tail -15 "$OUTDIR/bench-cli.log" ;;
    tests)
      part tests
      timeout 300 python3 -m pytest -q -rsf -p no:cacheprovider -m gpu -o addopts="" --timeout 240 tests plugins 2>&1 | tail -60 | tee "$OUTDIR/gpu-tests.log" ;;
    overhead)
      part overhead
      python3 bench/overhead.py --device cuda --model mlp --repeats 7 --out "$OUTDIR/overhead-mlp.json" 2>&1 | tail -15 | tee "$OUTDIR/overhead.log"
      python3 bench/overhead.py --device cuda --model gpt --repeats 5 --out "$OUTDIR/overhead-gpt.json" 2>&1 | tail -15 | tee -a "$OUTDIR/overhead.log" ;;
    fsdp)
      part fsdp
      timeout 200 python3 bench/fsdp_gpt.py --fused --steps 20 --repeats 5 --out "$OUTDIR/fsdp.json" 2>&1 | tail -20 | tee "$OUTDIR/fsdp.log" ;;
    deepspeed)
      part deepspeed
      timeout 280 python3 bench/deepspeed_gpt.py --sweep --out "$OUTDIR/deepspeed.json" 2>&1 | tail -40 | tee "$OUTDIR/deepspeed.log" ;;
    checkpoint)
      part checkpoint
      timeout 75 python3 bench/checkpoint_io.py --out "$OUTDIR/checkpoint.json" 2>&1 | tail -20 | tee "$OUTDIR/checkpoint.log" ;;
    fairscale)
      part fairscale
      timeout 150 python3 plugins/fairscale/bench/fsdp_step_time.py 2>&1 | tail -20 | tee "$OUTDIR/fairscale.log" ;;
    *) echo "unknown part $p" ;;
  esac
done
