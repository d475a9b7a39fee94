"""Worker entry points run by accelkit.testing.run_ranks in each rank: the accelkit side and both references."""

from __future__ import annotations

import time
import traceback
from typing import Any

import dsk_accel
import dsk_reference


def _autocasts(s: dict[str, Any]) -> bool:
    return s["precision"].endswith("-mixed")


def compare(
    scenarios: list[dict[str, Any]],
    torch_reference: bool = True,
    twin: bool = False,
    keep_going: bool = False,
) -> list[dict[str, Any]]:
    """Each scenario on the accelkit side, on raw DeepSpeed and (once per distinct training) on
    raw PyTorch. Engines that autocast run last: DeepSpeed keeps "autocast is on" in module
    globals, which would leak into a raw DeepSpeed engine built after one (0.19.8).

    ``keep_going`` (the GPU tests): a scenario that raises is reported as ``{"error": ...}`` and
    the next one still runs, so one GPU run shows every failure."""
    order = sorted(range(len(scenarios)), key=lambda i: _autocasts(scenarios[i]))
    results: list[dict[str, Any]] = [{} for _ in scenarios]
    torch_cache: dict[str, Any] = {}
    for i in order:
        if not keep_going:
            _compare_one(scenarios[i], results[i], torch_reference, twin, torch_cache)
            continue
        try:
            _compare_one(scenarios[i], results[i], torch_reference, twin, torch_cache)
        except Exception:
            results[i]["error"] = traceback.format_exc()[-3000:]
    return results


def _compare_one(
    s: dict[str, Any],
    result: dict[str, Any],
    torch_reference: bool,
    twin: bool,
    torch_cache: dict[str, Any],
) -> None:
    started = time.perf_counter()
    result["accel"] = dsk_accel.train(s)
    result["deepspeed"] = dsk_reference.raw_deepspeed(s)
    if torch_reference and s["precision"] != "16-true":
        # raw PyTorch does not depend on the stage or offload (zero_init matters: under
        # bf16-true, zero.Init builds the weights in bf16; on CUDA, from the CUDA generator)
        ignored = ("stage", "offload_optimizer", "offload_param", "name", "config")
        key = repr(sorted((k, v) for k, v in s.items() if k not in ignored))
        if key not in torch_cache:
            torch_cache[key] = dsk_reference.raw_torch(s)
        result["torch"] = torch_cache[key]
        if twin:  # the negative twin: each window divided by its own length
            if "twin:" + key not in torch_cache:
                torch_cache["twin:" + key] = dsk_reference.raw_torch(dict(s, rule="own_length"))
            result["twin"] = torch_cache["twin:" + key]
    result["seconds"] = round(time.perf_counter() - started, 2)


def floors(
    seeds: list[int], precisions: list[str], stages: list[int], **common: Any
) -> list[dict[str, Any]]:
    """Measure how far raw DeepSpeed lands from raw PyTorch (the floor the tolerances are fixed
    from), and how far the negative twin (each window divided by its own length) lands."""
    out = []
    for precision in sorted(precisions, key=lambda p: p.endswith("-mixed")):
        for seed in seeds:
            s = dict(common, seed=seed, precision=precision)
            ref = dsk_reference.raw_torch(s)
            twin = dsk_reference.raw_torch(dict(s, rule="own_length"))
            for stage in stages:
                ds = dsk_reference.raw_deepspeed(dict(s, stage=stage))
                out.append(
                    {
                        "precision": precision,
                        "seed": seed,
                        "stage": stage,
                        "ref": ref,
                        "twin": twin,
                        "ds": ds,
                    }
                )
    return out
