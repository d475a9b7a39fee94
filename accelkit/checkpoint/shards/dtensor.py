"""DTensor geometry for the portable checkpoint: where this rank's shard lies in the flattened
global tensor, whether that is one flat range, and which rank writes a replicated piece. No
backend is named: any DTensor works."""

from __future__ import annotations

import functools
import math
from typing import Any


def is_dtensor(tensor: Any) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    return isinstance(tensor, DTensor)


def local_region(tensor: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(local shape, global offset) of this rank's piece of a DTensor."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(
        tensor.shape, tensor.device_mesh, tensor.placements
    )
    return tuple(shape), tuple(offset)


def flat_range(
    global_shape: tuple[int, ...], local_shape: tuple[int, ...], offset: tuple[int, ...]
) -> tuple[int, int] | None:
    """The flat range a box covers, or None if the box is not contiguous once flattened."""
    numel = math.prod(local_shape)
    if numel == 0:
        return (0, 0)
    k = next((i for i, (lo, g) in enumerate(zip(local_shape, global_shape)) if lo != g), None)
    if k is None:
        return (0, numel)
    if any(local_shape[i] != 1 for i in range(k)) or any(
        local_shape[i] != global_shape[i] for i in range(k + 1, len(global_shape))
    ):
        return None
    strides = [math.prod(global_shape[i + 1 :]) for i in range(len(global_shape))]
    return (sum(o * s for o, s in zip(offset, strides)), numel)


def _first_of_other_dims(mesh: Any) -> bool:
    """On an N-D mesh a DTensor may live on a slice of it (FSDP2's data-parallel dimensions,
    without ``tp``): the slices hold the same pieces, so only the first slice writes them. The
    pipeline dimension (``pp``) is not such a copy: its slices hold other stages' tensors."""
    root_of = getattr(mesh, "_get_root_mesh", None)  # the mesh's own (newer torch)
    if root_of is None:  # older torch: the module-level registry, deprecated since
        try:
            from torch.distributed.device_mesh import _mesh_resources

            root_of = functools.partial(_mesh_resources.get_root_mesh, mesh)
        except (ImportError, AttributeError):  # pragma: no cover - older torch
            return True
    root = root_of()
    names, root_names = mesh.mesh_dim_names, root.mesh_dim_names
    if root is mesh or not names or not root_names or not set(names) <= set(root_names):
        return True
    return all(root.get_local_rank(d) == 0 for d in root_names if d not in names and d != "pp")


def needs_gather(tensor: Any) -> bool:
    """Whether a DTensor's pieces are not flat ranges (Partial, _StridedShard, a shard of a
    later dimension: a tensor-parallel row-wise weight), so every rank must gather it. Decided
    from the placements and the global shape alone: every rank holding the tensor takes the
    same path (a rank that skipped the gather would leave its peers' collective and the
    replica planner's load counts out of step: pieces no rank writes)."""
    from torch.distributed.tensor import Replicate, Shard

    shape = tuple(tensor.shape)
    for placement in tensor.placements:
        if type(placement) is Replicate:
            continue
        if type(placement) is not Shard or math.prod(shape[: placement.dim]) != 1:
            return True
    return False


def dtensor_writes_here(tensor: Any) -> bool | None:
    """True if this rank writes its local shard, False if another rank writes the piece it
    holds; None (on every rank alike) if the tensor needs a gather."""
    from torch.distributed.tensor import Replicate

    if needs_gather(tensor):
        return None
    mesh = tensor.device_mesh
    coord = mesh.get_coordinate()
    if coord is None or not _first_of_other_dims(mesh):
        return False
    return all(
        c == 0 for placement, c in zip(tensor.placements, coord) if type(placement) is Replicate
    )
