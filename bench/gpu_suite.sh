#!/usr/bin/env bash
# accelkit's GPU tests and benchmarks, in one call on a CUDA machine whose image already has torch.
# Packages the image lacks (deepspeed, mmengine and their pure-Python needs) travel as wheels in
# .whl/: mmengine needs addict, yapf (which needs platformdirs) and termcolor beside the image's own.
#
#   bash bench/gpu_suite.sh OUTDIR [tests] [overhead] [fsdp] [deepspeed] [checkpoint] [dstests] [dsckpt]
#        [coretests] [coregpu] [fstests] [dsz3] [fairscale] [fairscale16] [benchcli] [benchcompile]
#        [caitests] [caibench] [apextests] [apexbench] [peers] [fsdpbenchtest] [launchtests] [conformance]
#        [oom] [pretrainedgpu] [hfgpu] [mmamp] [fp8] [ckptio] [ckptab] [interference]
#   CAI_K=hybrid ... caitests     runs only the ColossalAI GPU tests whose name matches (pytest -k)
#
# Every part writes its log (and JSON) into OUTDIR; a failing part does not stop the others.
# ColossalAI's wheels (.whl/colossalai/, see docs/backends/colossalai.md) go into a site of their
# own, on the path of the ColossalAI parts only (they pin an older transformers than the image's).
# NVIDIA Apex has no wheel: the apex parts put APEX_SITE (where it was built) on the path.
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
CAI_SITE=/tmp/accelkit-cai-site
if [ ! -d "$CAI_SITE/colossalai" ] && ls .whl/colossalai/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$CAI_SITE" .whl/colossalai/*.whl
fi
export PYTHONPATH=$SITE
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c 'import torch, accelkit; print("torch", torch.__version__, "cuda", torch.version.cuda, "accelkit", accelkit.__version__)'
} 2>&1 | tee "$OUTDIR/env.txt"

part() { echo "== $1 ($(date -u +%H:%M:%S))"; }
# GPU tests that run in parts of their own (each inside its own timeout: fp8, oom, mmamp, launchtests,
# fsdpbenchtest, caitests, apextests, dstests, fstests), left out of tests and coregpu
OWN_PARTS=(--ignore=tests/test_fp8.py --ignore=tests/test_batch_size_finder.py
  --ignore=tests/test_mmengine_gpu.py --ignore=tests/test_launch.py
  --deselect=tests/test_fsdp.py::test_gpu_bench_runs_and_matches_loss
  --ignore=plugins/colossalai --ignore=plugins/apex --ignore=plugins/deepspeed --ignore=plugins/fairscale)
for p in "$@"; do
  case "$p" in
    dstests)
      part dstests
      ACCELKIT_GPU_REPORT="$OUTDIR" timeout 240 python3 -m pytest -q -rfEs -p no:cacheprovider -m gpu -o addopts="" --timeout 200 plugins/deepspeed/tests > "$OUTDIR/ds-tests.log" 2>&1
      sed -n '/GPU summary/,$p' "$OUTDIR/ds-tests.log" | tail -70
      tail -3 "$OUTDIR/ds-tests.log" ;;
    dsckpt)
      part dsckpt
      timeout 120 python3 bench/deepspeed_checkpoint.py --out "$OUTDIR/ds-checkpoint.json" > "$OUTDIR/ds-checkpoint.log" 2>&1
      grep -v -i warn "$OUTDIR/ds-checkpoint.log" | tail -16 ;;
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
      # every GPU test that has no part of its own (those parts follow the list in OWN_PARTS),
      # the ten slowest printed, and a summary line inside the timeout
      part tests
      ACCELKIT_GPU_REPORT="$OUTDIR" timeout 300 python3 -m pytest -q -rA -p no:cacheprovider -m gpu -o addopts="" --timeout 120 \
        --durations=10 "${OWN_PARTS[@]}" tests plugins > "$OUTDIR/gpu-tests.log" 2>&1
      echo "tests: exit $?"
      grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed|^[0-9.]+s (call|setup)" "$OUTDIR/gpu-tests.log" | tail -50 ;;
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
    ckptio)
      # the machine's limits, then both workloads (square Linears, GPT-2-shaped), each inside its own timeout
      part ckptio
      timeout 60 python3 bench/io_limits.py --gb 2 --out "$OUTDIR/io-limits.json" 2>&1 | tee "$OUTDIR/io-limits.log"
      for w in square gpt; do
        timeout 200 python3 bench/checkpoint_io.py --workload $w --gb 2 --repeats 3 \
          --methods accelkit,accelkit-async,dcp,torch --out "$OUTDIR/ckpt-$w.json" 2>&1 | tee "$OUTDIR/ckpt-$w.log" | grep -v -i warn
      done ;;
    interference)
      # what slows a launch-bound step while a checkpoint is written beside it (thread, process, GIL)
      part interference
      timeout 150 python3 bench/write_interference.py --gb 2 --repeats 3 --out "$OUTDIR/interference.json" 2>&1 | tee "$OUTDIR/interference.log" | grep -v -i warn ;;
    ckptab)
      # A/B: the same GPT workload with early writeback off (what the breakdown's fsync share costs)
      part ckptab
      ACCELKIT_NO_EARLY_WRITEBACK=1 timeout 120 python3 bench/checkpoint_io.py --workload gpt --gb 2 --repeats 3 \
        --methods accelkit,dcp --out "$OUTDIR/ckpt-gpt-nowb.json" 2>&1 | tee "$OUTDIR/ckpt-gpt-nowb.log" | grep -v -i warn ;;
    fairscale)
      part fairscale
      timeout 150 torchrun --nproc-per-node 1 plugins/fairscale/bench/fsdp_step_time.py > "$OUTDIR/fairscale.log" 2>&1
      grep -E "ratio|ms:" "$OUTDIR/fairscale.log" ;;
    coretests)
      part coretests
      ACCELKIT_GPU_REPORT="$OUTDIR" timeout 330 python3 -m pytest -q -rfEs -p no:cacheprovider -m gpu -o addopts="" --timeout 300 tests plugins/deepspeed plugins/fairscale > "$OUTDIR/core-tests.log" 2>&1
      grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed" "$OUTDIR/core-tests.log" | tail -30 ;;
    fairscale16)
      part fairscale16
      timeout 150 torchrun --nproc-per-node 1 plugins/fairscale/bench/fsdp_step_time.py --precision 16-mixed > "$OUTDIR/fairscale-16.log" 2>&1
      grep -E "ratio|ms:" "$OUTDIR/fairscale-16.log" ;;
    benchcompile)
      # raw torch.compile beside accelkit's compile path: cuda+compile's "vs raw" is raw+compile
      part benchcompile
      for b in 8 16; do
        timeout 280 python3 -m accelkit.cli bench --model gpt2-small --precision bf16-mixed --batch $b \
          --backends raw,raw+compile,cuda,cuda+compile --steps 20 --warmup 8 --repeats 5 --no-progress \
          --out "$OUTDIR/h200-gpt2-compile-b$b.json" > "$OUTDIR/bench-compile-b$b.log" 2>&1
        tail -12 "$OUTDIR/bench-compile-b$b.log"
      done ;;
    peers)
      # bench/peers.py: raw PyTorch, Lightning Fabric, HF Accelerate, accelkit in one process; raw
      # DeepSpeed ZeRO-1/2/3 beside accelkit deepspeed_stage_k in one process per stage (6-minute limit)
      part peers
      timeout 360 python3 bench/peers.py --timeout 170 --out "$OUTDIR/peers.json" \
        --keep "$OUTDIR/peers-processes" > "$OUTDIR/peers.log" 2>&1
      grep -v -i warn "$OUTDIR/peers.log" | tail -45 ;;
    caitests)
      part caitests
      PYTHONPATH=$CAI_SITE:$SITE ACCELKIT_GPU_REPORT="$OUTDIR" timeout 420 python3 -m pytest -q -rfEs -p no:cacheprovider -m gpu -o addopts="" --timeout 400 ${CAI_K:+-k "$CAI_K"} plugins/colossalai > "$OUTDIR/cai-tests.log" 2>&1
      grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed" "$OUTDIR/cai-tests.log" | tail -20 ;;
    conformance)
      # accelkit.testing.conformance on CUDA: the GPU-marked contracts (deepspeed_stage_2 on cuda,
      # fairscale_fsdp, colossalai_gemini, apex, apex_distributed_adam), slow cases included
      part conformance
      timeout 300 python3 -m pytest -q -rfEs -p no:cacheprovider -m gpu -o addopts="" --timeout 280 -k Contract \
        plugins/deepspeed/tests/test_deepspeed_conformance.py plugins/fairscale/tests/test_fairscale_conformance.py > "$OUTDIR/conformance-ds-fs.log" 2>&1
      PYTHONPATH=$CAI_SITE:$SITE timeout 300 python3 -m pytest -q -rfEs -p no:cacheprovider -m gpu -o addopts="" --timeout 280 -k Contract \
        plugins/colossalai/tests/test_colossalai_conformance.py > "$OUTDIR/conformance-cai.log" 2>&1
      PYTHONPATH=${APEX_SITE:-}:$SITE ACCELKIT_REQUIRE_APEX=1 timeout 300 python3 -m pytest -q -rfEs -p no:cacheprovider -m gpu -o addopts="" --timeout 280 -k Contract \
        plugins/apex/tests/test_apex_conformance.py > "$OUTDIR/conformance-apex.log" 2>&1
      grep -hE "^(FAILED|ERROR|SKIPPED)|passed|failed" "$OUTDIR"/conformance-*.log | tail -40 ;;
    caibench)
      part caibench
      for b in colossalai_zero colossalai_gemini; do
        PYTHONPATH=$CAI_SITE:$SITE timeout 200 torchrun --nproc-per-node 1 plugins/colossalai/bench/step_time.py --backend $b --repeats 7 --profile > "$OUTDIR/cai-bench-$b.log" 2>&1
        grep -E "ratio|Error|ms/step|ms:" "$OUTDIR/cai-bench-$b.log" | tail -8
      done ;;
    apextests)
      part apextests
      PYTHONPATH=${APEX_SITE:-}:$SITE ACCELKIT_REQUIRE_APEX=1 timeout 300 python3 -m pytest -q -rfEs -p no:cacheprovider -m gpu -o addopts="" --timeout 280 plugins/apex > "$OUTDIR/apex-tests.log" 2>&1
      grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed" "$OUTDIR/apex-tests.log" | tail -20 ;;
    apexbench)
      part apexbench
      PYTHONPATH=${APEX_SITE:-}:$SITE timeout 200 python3 plugins/apex/bench/step_time.py --repeats 5 --out "$OUTDIR/apex-step-time.json" > "$OUTDIR/apex-bench.log" 2>&1
      tail -10 "$OUTDIR/apex-bench.log" ;;
    coregpu)
      # the core's GPU tests less those with parts of their own (fp8, oom, mmamp, launchtests,
      # fsdpbenchtest): the whole file set once ran past 300 s with no summary
      part coregpu
      ACCELKIT_GPU_REPORT="$OUTDIR" timeout 300 python3 -m pytest -q -rfEs -p no:cacheprovider -m gpu -o addopts="" --timeout 120 \
        --durations=10 "${OWN_PARTS[@]}" tests > "$OUTDIR/core-gpu.log" 2>&1
      echo "coregpu: exit $?"
      grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed|estimate|^[0-9.]+s (call|setup)" "$OUTDIR/core-gpu.log" | tail -30 ;;
    fstests)
      part fstests
      timeout 240 python3 -m pytest -q -rfEsP -p no:cacheprovider -m gpu -o addopts="" --timeout 220 plugins/fairscale > "$OUTDIR/fs-tests.log" 2>&1
      grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed" "$OUTDIR/fs-tests.log" | tail -20 ;;
    dsz3)
      part dsz3
      ACCELKIT_GPU_REPORT="$OUTDIR" timeout 200 python3 -m pytest -q -rfEs -p no:cacheprovider -m gpu -o addopts="" --timeout 180 -k zero3_bf16_checkpoint plugins/deepspeed > "$OUTDIR/ds-z3-tests.log" 2>&1
      grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed" "$OUTDIR/ds-z3-tests.log" | tail -10 ;;
    fsdpbenchtest)
      part fsdpbenchtest
      timeout 300 python3 -m pytest -q -rfEs -s -p no:cacheprovider -m gpu -o addopts="" --timeout 280 -k test_gpu_bench_runs_and_matches_loss tests/test_fsdp.py > "$OUTDIR/fsdp-bench-test.log" 2>&1
      grep -E "rel |^(FAILED|ERROR|SKIPPED)|passed|failed" "$OUTDIR/fsdp-bench-test.log" | tail -10 ;;
    launchtests)
      part launchtests
      timeout 200 python3 -m pytest -q -rfEs -p no:cacheprovider -m gpu -o addopts="" --timeout 180 tests/test_launch.py > "$OUTDIR/launch-tests.log" 2>&1
      grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed" "$OUTDIR/launch-tests.log" | tail -10 ;;
    oom)
      # find_executable_batch_size against the CUDA allocator's own OOM on cuda and deepspeed_stage_2
      # (tests/test_batch_size_finder.py's gpu tests; about 60 s)
      part oom
      ACCELKIT_GPU_REPORT="$OUTDIR" timeout 170 python3 -m pytest -q -rfEs -p no:cacheprovider -m gpu -o addopts="" --timeout 160 tests/test_batch_size_finder.py > "$OUTDIR/oom-tests.log" 2>&1
      grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed" "$OUTDIR/oom-tests.log" | tail -10
      python3 - "$OUTDIR/batch-size-finder-gpu.jsonl" <<'PY' 2>&1 | tail -24
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    print(f"{r['test']}: found {r['attempts'][-1]['batch_size']}, predicted {r['predicted']}, "
          f"{r['seconds']} s, loss {r['loss']:.4g}, problems {r['problems']}")
    for a in r["attempts"]:
        print(f"  batch {a['batch_size']:>9}: starts at +{a['allocated_at_start'] / 2**20:.1f} MiB, "
              f"peak +{a['peak_allocated'] / 2**30:.1f} GiB, {a['seconds']} s, {a.get('error', 'fits')[:110]}")
    print(f"  after the call +{r['allocated_after_call'] / 2**20:.1f} MiB, after free_memory "
          f"+{r['allocated_after_free_memory'] / 2**20:.1f} MiB (baseline {r['baseline'] / 2**20:.1f} MiB)")
PY
      ;;
    pretrainedgpu)
      # accel.load_pretrained of a GPT-2-small-shaped sharded checkpoint (fp32 and bf16 files) into
      # fsdp and deepspeed_stage_3, one rank: GB/s, peak host RSS and device memory (about 75 s)
      part pretrainedgpu
      timeout 280 python3 bench/pretrained_gpu.py --timeout 120 --out "$OUTDIR/pretrained-gpu.json" > "$OUTDIR/pretrained-gpu.log" 2>&1
      tail -12 "$OUTDIR/pretrained-gpu.log" ;;
    hfgpu)
      # issue 31: a Transformers Llama of 1.1B parameters built inside init_module() on fsdp and
      # deepspeed_stage_3, loaded from save_pretrained output (bf16 shards) and stepped, against
      # from_pretrained(device_map) + accelerate; one process per side, each row printed as it ends
      part hfgpu
      timeout 240 python3 bench/hf_gpu.py --timeout 70 --out "$OUTDIR/hf-gpu.json" 2>&1 | tee "$OUTDIR/hf-gpu.log" \
        | grep --line-buffered -E "^(source|fsdp|deepspeed|hf |device|Traceback)" ;;
    mmamp)
      # MMEngine's AmpOptimWrapper (bf16, fp16, loss_scale) under plain MMEngine, AccelkitRunner on
      # cuda and on deepspeed_stage_2 (tests/test_mmengine_gpu.py); about 1.5 minutes expected
      part mmamp
      ACCELKIT_GPU_REPORT="$OUTDIR" timeout 300 python3 -m pytest -q -rfEs -p no:cacheprovider -m gpu -o addopts="" --timeout 200 tests/test_mmengine_gpu.py > "$OUTDIR/mmamp-tests.log" 2>&1
      grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed" "$OUTDIR/mmamp-tests.log" | tail -20
      cut -c1-300 "$OUTDIR/mmengine-amp-gpu.jsonl" 2>/dev/null ;;
    fp8)
      # precision="fp8-mixed" (torchao float8, wheel in .whl/): the GPU tests of tests/test_fp8.py
      # (300 steps fp8 vs bf16 on cuda, fsdp world size 1 with float8 all-gather), then
      # `accelkit bench` bf16-mixed against fp8-mixed on gpt-2048, compiled, interleaved;
      # about 4 minutes expected (tests ~1.5, bench ~2.5 with compilation)
      part fp8
      ACCELKIT_GPU_REPORT="$OUTDIR" timeout 240 python3 -m pytest -q -rfEs -p no:cacheprovider -m gpu -o addopts="" --timeout 220 tests/test_fp8.py > "$OUTDIR/fp8-tests.log" 2>&1
      grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed" "$OUTDIR/fp8-tests.log" | tail -10
      cut -c1-400 "$OUTDIR/fp8-gpu.jsonl" 2>/dev/null
      timeout 330 python3 -m accelkit.cli bench --model gpt-2048 --precision bf16-mixed,fp8-mixed \
        --backends cuda+compile --batch 8 --steps 10 --warmup 5 --repeats 3 --no-baseline --no-progress \
        --timeout 300 --out "$OUTDIR/h200-fp8-gpt2048.json" > "$OUTDIR/bench-fp8.log" 2>&1
      tail -12 "$OUTDIR/bench-fp8.log" ;;
    *) echo "unknown part $p" ;;
  esac
done
