#!/usr/bin/env bash
# Count gloo's exit aborts ("terminate called without an active exception") over N two-rank
# torchrun runs of a tiny DDP loop, raw PyTorch and through accelkit. CPU only.
# usage: bench/gloo_exit_abort.sh [N=40]   (PYTHONFAULTHANDLER=1 makes the race more frequent)
set -u
n=${1:-40}
python=${PYTHON:-.venv/bin/python}
work=$(mktemp -d)
cat >"$work/raw.py" <<'PY'
import torch, torch.distributed as dist
dist.init_process_group("gloo")
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(5):
    loss = model(torch.randn(2, 4)).sum(); loss.backward(); opt.step(); opt.zero_grad()
    total = loss.detach().clone(); dist.all_reduce(total); total.item()
dist.destroy_process_group()
PY
cat >"$work/accelkit_ddp.py" <<'PY'
import torch, accelkit
accel = accelkit.get("ddp", timeout=60.0)
net = torch.nn.Linear(4, 1)
model, opt = accel.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
for _ in range(5):
    loss = model(torch.randn(2, 4)).sum(); accel.backward(loss); accel.step()
    accel.all_reduce(loss.detach(), "mean").item()
PY
for script in raw accelkit_ddp; do
    aborts=0
    for i in $(seq 1 "$n"); do
        OMP_NUM_THREADS=1 "$python" -m torch.distributed.run --nproc-per-node 2 \
            --master-addr 127.0.0.1 --master-port $((29500 + RANDOM % 20000)) \
            "$work/$script.py" >"$work/$script-$i.log" 2>&1
        grep -q "terminate called without an active exception" "$work/$script-$i.log" && aborts=$((aborts + 1))
    done
    echo "$script: $aborts aborts in $n runs"
done
rm -rf "$work"
