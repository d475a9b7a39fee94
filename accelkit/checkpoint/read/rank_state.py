"""Per-rank backend state (:meth:`~accelkit.backend.Backend.rank_state_dict`) on load.

Every rank saves its own under the manifest's ``rank_state.<rank>`` (its tensors in its own
file, object ``__backend__.<rank>``). At the saved world size each rank gets back what it saved.
A backend that keeps no per-rank state (another backend continuing the run) gets nothing. At
another world size the backend's ``rank_state_on_resize`` decides, in the load's validate phase so
that a refusal writes nothing: ``"refuse"`` fails, ``"drop"`` warns and skips, ``"merge"`` hands
over every saved rank's state, each decoded when first looked up.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from typing import Any

from accelkit.backend import Backend
from accelkit.checkpoint.format.codec import decode
from accelkit.checkpoint.format.manifest import BACKEND_OBJECT
from accelkit.errors import CheckpointError

log = logging.getLogger("accelkit")

POLICIES = ("refuse", "drop", "merge")


class SavedRankStates(Mapping[int, dict[str, Any]]):
    """Every saved rank's state, decoded on first lookup (read them during the load: the
    checkpoint's files are closed afterwards)."""

    def __init__(self, reader: Any, saved: dict[str, Any]) -> None:
        self._reader = reader
        self._saved = {int(rank): data for rank, data in saved.items()}
        self._decoded: dict[int, dict[str, Any]] = {}

    def __getitem__(self, rank: int) -> dict[str, Any]:
        if rank not in self._decoded:
            if rank not in self._saved:
                raise KeyError(rank)
            self._decoded[rank] = decode_rank_state(self._reader, rank, self._saved[rank])
        return self._decoded[rank]

    def __iter__(self) -> Iterator[int]:
        return iter(sorted(self._saved))

    def __len__(self) -> int:
        return len(self._saved)


def decode_rank_state(reader: Any, rank: int, data: Any) -> dict[str, Any]:
    """Rank ``rank``'s saved state, its tensors read from that rank's file."""
    try:
        state = decode(data, reader.tensor_source(f"{BACKEND_OBJECT}.{rank}", "state"))
    except CheckpointError:
        raise
    except Exception as err:  # bad base64, a malformed tag: name the field and the file
        raise CheckpointError(
            f"{reader.manifest_path}: field 'rank_state.{rank}' cannot be decoded "
            f"({type(err).__name__}: {err}); nothing was loaded"
        ) from err
    if not isinstance(state, dict):
        raise CheckpointError(
            f"{reader.manifest_path}: field 'rank_state.{rank}' is a {type(state).__name__}, not "
            "an object; nothing was loaded"
        )
    return state


def read_rank_states(backend: Any, reader: Any) -> tuple[Mapping[int, Any], int] | None:
    """What ``backend.load_rank_state_dict`` gets from this checkpoint, with the saved world
    size; None when it is not to be called (no per-rank state, or dropped by the policy)."""
    saved = reader.manifest.data.get("rank_state")
    if not saved or type(backend).load_rank_state_dict is Backend.load_rank_state_dict:
        return None  # none saved, or a backend that keeps none (another backend's run goes on)
    saved_world, world = reader.manifest.world_size, backend.world_size
    if saved_world == world:
        own = saved.get(str(backend.rank))
        mine = {} if own is None else {backend.rank: decode_rank_state(reader, backend.rank, own)}
        return mine, saved_world
    policy = getattr(type(backend), "rank_state_on_resize", "refuse")
    name = getattr(backend, "name", "?")
    if policy == "merge":
        return SavedRankStates(reader, saved), saved_world
    if policy == "drop":
        if backend.rank == 0:
            log.warning(
                "%s: backend %r saved per-rank state at world size %d; at world size %d it "
                "starts that state afresh (its rank_state_on_resize is 'drop')",
                reader.directory,
                name,
                saved_world,
                world,
            )
        return None
    if policy != "refuse":
        raise CheckpointError(
            f"backend {name!r}: rank_state_on_resize is {policy!r}; it must be one of "
            f"{', '.join(POLICIES)}"
        )
    raise CheckpointError(
        f"{reader.directory} holds per-rank state of backend {name!r} saved at world size "
        f"{saved_world}, which it cannot carry to world size {world}: resume on {saved_world} "
        "processes. Nothing was loaded."
    )
