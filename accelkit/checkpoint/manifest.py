"""The manifest ``accelkit.json``: what a checkpoint holds and where each byte of it lives.

It is plain JSON a person can read. Its ``checksum`` field is the SHA-256 of the rest of the
manifest in canonical form, so a bit flip in the manifest is caught like one in the data.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from accelkit.errors import CheckpointError

FORMAT = "accelkit.checkpoint"
#: major.minor. Readers accept any minor of their major; a new major is refused with a message.
FORMAT_VERSION = "1.0"
MANIFEST_NAME = "accelkit.json"
EXTRA_NAME = "extra.json"
#: reserved object names (user state keys may not start with "__")
EXTRA_OBJECT = "__extra__"
RNG_OBJECT = "__rng__"
BACKEND_OBJECT = "__backend__"


#: what a file named in the manifest may look like: no directories, no "..", no hidden files
_SAFE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


def rank_file_name(rank: int) -> str:
    return f"rank-{rank:05d}.safetensors"


@dataclass
class FragmentRecord:
    """One contiguous range ``[flat_offset, flat_offset + numel)`` of a flattened tensor."""

    file: str
    key: str
    flat_offset: int
    numel: int
    sha256: str

    def to_json(self) -> dict[str, Any]:
        return {
            "file": self.file,
            "key": self.key,
            "flat_offset": self.flat_offset,
            "numel": self.numel,
            "sha256": self.sha256,
        }


@dataclass
class TensorEntry:
    """One logical tensor: a parameter, a buffer, a master weight or an optimizer state."""

    object: str
    fqn: str
    kind: str
    shape: tuple[int, ...]
    dtype: str
    fragments: list[FragmentRecord] = field(default_factory=list)
    #: other names of a tied tensor, and fields a backend adds (trainable, upcast, gathered)
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def aliases(self) -> list[str]:
        return list(self.meta.get("aliases", []))

    @property
    def label(self) -> str:
        return f"{self.object}:{self.kind}:{self.fqn}"

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "object": self.object,
            "fqn": self.fqn,
            "kind": self.kind,
            "shape": list(self.shape),
            "dtype": self.dtype,
        }
        out.update({k: v for k, v in self.meta.items() if v not in (None, [], {})})
        out["fragments"] = [f.to_json() for f in self.fragments]
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TensorEntry:
        core = {"object", "fqn", "kind", "shape", "dtype", "fragments"}
        return cls(
            object=str(data["object"]),
            fqn=str(data["fqn"]),
            kind=str(data["kind"]),
            shape=tuple(int(s) for s in data["shape"]),
            dtype=str(data["dtype"]),
            fragments=[
                FragmentRecord(
                    str(f["file"]),
                    str(f["key"]),
                    int(f["flat_offset"]),
                    int(f["numel"]),
                    str(f["sha256"]),
                )
                for f in data["fragments"]
            ],
            meta={k: v for k, v in data.items() if k not in core},
        )


def canonical_bytes(data: dict[str, Any]) -> bytes:
    body = {k: v for k, v in data.items() if k != "checksum"}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


@dataclass
class Manifest:
    """The parsed manifest. ``data`` is the raw JSON; ``tensors`` the parsed tensor entries."""

    data: dict[str, Any]
    tensors: list[TensorEntry]
    path: Path | None = None

    @property
    def world_size(self) -> int:
        return int(self.data["world_size"])

    @property
    def objects(self) -> dict[str, dict[str, Any]]:
        return self.data.get("objects", {})

    @property
    def files(self) -> dict[str, dict[str, Any]]:
        return self.data.get("files", {})

    def to_json_text(self) -> str:
        data = dict(self.data)
        data["tensors"] = [t.to_json() for t in self.tensors]
        data["checksum"] = hashlib.sha256(canonical_bytes(data)).hexdigest()
        self.data = data
        return json.dumps(data, indent=1, allow_nan=False) + "\n"

    @classmethod
    def read(cls, directory: str | os.PathLike, *, verify_checksum: bool = True) -> Manifest:
        path = Path(directory) / MANIFEST_NAME
        if not path.is_file():
            raise CheckpointError(
                f"{directory}: no {MANIFEST_NAME} here; not an accelkit checkpoint, or one whose "
                "save did not complete"
            )
        try:
            data = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise CheckpointError(f"{path}: unreadable manifest: {err}") from err
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise CheckpointError(f"{path}: not an accelkit checkpoint manifest")
        version = str(data.get("format_version", "?"))
        if version.split(".")[0] != FORMAT_VERSION.split(".")[0]:
            raise CheckpointError(
                f"{path}: format version {version} is not readable by this accelkit (reads "
                f"{FORMAT_VERSION.split('.')[0]}.x); upgrade accelkit"
            )
        if verify_checksum:
            expected = data.get("checksum")
            actual = hashlib.sha256(canonical_bytes(data)).hexdigest()
            if expected != actual:
                raise CheckpointError(
                    f"{path}: manifest checksum mismatch (stored {expected}, computed {actual}); "
                    "the manifest was modified or corrupted"
                )
        try:
            tensors = [TensorEntry.from_json(t) for t in data.get("tensors", [])]
        except (KeyError, TypeError, ValueError) as err:
            raise CheckpointError(f"{path}: malformed tensor entry: {err!r}") from err
        manifest = cls(data, tensors, Path(directory))
        manifest.validate()
        return manifest

    def validate(self) -> None:
        """Structural checks that need no data: fragments tile each tensor exactly, every file
        referenced is listed, keys are unique per file."""
        where = self.path / MANIFEST_NAME if self.path else MANIFEST_NAME
        files = self.files
        for name in files:
            if not isinstance(name, str) or not _SAFE_NAME.fullmatch(name):
                raise CheckpointError(
                    f"{where}: file name {name!r} is not a plain file name in the checkpoint "
                    "directory; refusing to read outside it"
                )
        seen_labels: set[str] = set()
        seen_keys: set[tuple[str, str]] = set()
        for entry in self.tensors:
            if entry.label in seen_labels:
                raise CheckpointError(f"{where}: tensor {entry.label} is listed twice")
            seen_labels.add(entry.label)
            if any(s < 0 for s in entry.shape):
                raise CheckpointError(f"{where}: tensor {entry.label} has shape {entry.shape}")
            position = 0
            for frag in sorted(entry.fragments, key=lambda f: f.flat_offset):
                if frag.file not in files:
                    raise CheckpointError(
                        f"{where}: tensor {entry.label} refers to file {frag.file}, which the "
                        "manifest does not list"
                    )
                if (frag.file, frag.key) in seen_keys:
                    raise CheckpointError(
                        f"{where}: key {frag.key} of {frag.file} is used twice (tensor {entry.label})"
                    )
                seen_keys.add((frag.file, frag.key))
                if frag.numel <= 0:
                    raise CheckpointError(
                        f"{where}: tensor {entry.label}: fragment {frag.key} in {frag.file} has "
                        f"numel {frag.numel}"
                    )
                if frag.flat_offset != position:
                    problem = "overlaps" if frag.flat_offset < position else "leaves a gap before"
                    raise CheckpointError(
                        f"{where}: tensor {entry.label}: fragment {frag.key} in {frag.file} at "
                        f"flat_offset {frag.flat_offset} (numel {frag.numel}) {problem} "
                        f"position {position}; the fragments do not tile the tensor"
                    )
                position += frag.numel
            if position != entry.numel:
                raise CheckpointError(
                    f"{where}: tensor {entry.label}: fragments cover {position} of "
                    f"{entry.numel} elements (shape {list(entry.shape)})"
                )
