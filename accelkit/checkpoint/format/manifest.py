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
FORMAT_VERSION = "1.1"  # 1.1: fragments may carry xxh3_128 instead of sha256
MANIFEST_NAME = "accelkit.json"
EXTRA_NAME = "extra.json"
#: ``extra.json`` under a name of one save's own (``extra.<save>.json``), where saves of one name
#: may meet (object storage)
_EXTRA_OF_A_SAVE = re.compile(r"extra\.[0-9a-f]{12}\.json")


def extras_file(files: dict[str, Any]) -> str | None:
    """The name of the extras file among a manifest's ``files``, or None."""
    if EXTRA_NAME in files:
        return EXTRA_NAME
    return next((n for n in files if _EXTRA_OF_A_SAVE.fullmatch(str(n))), None)


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
    """One contiguous range ``[flat_offset, flat_offset + numel)`` of a flattened tensor, and
    the checksum of its bytes (``algorithm``: see :mod:`accelkit.checkpoint.format.digest`)."""

    file: str
    key: str
    flat_offset: int
    numel: int
    digest: str
    algorithm: str = "sha256"

    def to_json(self) -> dict[str, Any]:
        return {
            "file": self.file,
            "key": self.key,
            "flat_offset": self.flat_offset,
            "numel": self.numel,
            self.algorithm: self.digest,
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
                    *_digest_of(f),
                )
                for f in data["fragments"]
            ],
            meta={k: v for k, v in data.items() if k not in core},
        )


def _digest_of(fragment: dict[str, Any]) -> tuple[str, str]:
    """``(digest, algorithm)`` of a fragment record (the schema check ran: exactly one)."""
    from accelkit.checkpoint.format.digest import ALGORITHMS

    algorithm = next(a for a in ALGORITHMS if a in fragment)
    return str(fragment[algorithm]), algorithm


def canonical_bytes(data: dict[str, Any]) -> bytes:
    """What the checksum covers. NaN is allowed here only so that a crafted manifest holding one
    reaches the type checks, which name the field (a writer never writes NaN)."""
    body = {k: v for k, v in data.items() if k != "checksum"}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=True).encode()


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
            raw = path.read_bytes()
        except OSError as err:
            raise CheckpointError(f"{path}: unreadable manifest: {err}") from err
        return cls.parse(raw, str(path), Path(directory), verify_checksum=verify_checksum)

    @classmethod
    def parse(
        cls,
        raw: bytes,
        source: str,
        directory: str | os.PathLike | None = None,
        *,
        verify_checksum: bool = True,
    ) -> Manifest:
        """The manifest of the bytes ``raw`` (read once, wherever they are stored; ``source``
        names them in errors), checked as :meth:`read` checks a file."""
        path = source
        try:
            data = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise CheckpointError(f"{path}: unreadable manifest: {err}") from err
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise CheckpointError(f"{path}: not an accelkit checkpoint manifest")
        version = data.get("format_version")
        if not isinstance(version, str) or not re.fullmatch(r"\d+\.\d+", version):
            raise CheckpointError(
                f"{path}: field 'format_version' is {version!r}, not a version 'major.minor'; "
                "the manifest is malformed"
            )
        if version.split(".")[0] != FORMAT_VERSION.split(".")[0]:
            newer = int(version.split(".")[0]) > int(FORMAT_VERSION.split(".")[0])
            raise CheckpointError(
                f"{path}: field 'format_version' is {version}: not readable by this accelkit (reads "
                f"{FORMAT_VERSION.split('.')[0]}.x)"
                + ("; upgrade accelkit" if newer else "; convert it with an older accelkit")
            )
        if verify_checksum:
            expected = data.get("checksum")
            actual = hashlib.sha256(canonical_bytes(data)).hexdigest()
            if expected != actual:
                raise CheckpointError(
                    f"{path}: manifest checksum mismatch (stored {expected}, computed {actual}); "
                    "the manifest was modified or corrupted"
                )
        check_schema(data, path)
        tensors = [TensorEntry.from_json(t) for t in data["tensors"]]
        manifest = cls(data, tensors, Path(directory) if directory is not None else None)
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
        # bytes each file must hold: a crafted shape cannot make a reader allocate more than the
        # files the checkpoint really has
        bytes_used: dict[str, int] = {}
        for entry in self.tensors:
            element = ELEMENT_SIZES[entry.dtype]
            if entry.label in seen_labels:
                raise CheckpointError(f"{where}: tensor {entry.label} is listed twice")
            seen_labels.add(entry.label)
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
                bytes_used[frag.file] = bytes_used.get(frag.file, 0) + frag.numel * element
                size = files[frag.file].get("bytes")
                if size is not None and bytes_used[frag.file] > size:
                    raise CheckpointError(
                        f"{where}: tensor {entry.label} (shape {list(entry.shape)}) does not fit "
                        f"in {frag.file}: the tensors placed there need {bytes_used[frag.file]} "
                        f"bytes, the file has {size}; the shapes in the manifest are not what was "
                        "saved"
                    )
            if position != entry.numel:
                raise CheckpointError(
                    f"{where}: tensor {entry.label}: fragments cover {position} of "
                    f"{entry.numel} elements (shape {list(entry.shape)})"
                )


def _element_sizes() -> dict[str, int]:
    from accelkit.checkpoint.format.safetensors_io import DTYPES_BY_NAME

    return {name: dtype.itemsize for name, dtype in DTYPES_BY_NAME.items()}


#: bytes per element of every dtype a manifest may name
ELEMENT_SIZES = _element_sizes()


def _field(where: Path, name: str, value: Any, expected: str) -> CheckpointError:
    return CheckpointError(
        f"{where}: field {name!r} is {str(value)[:80]!r}, expected {expected}; the manifest is "
        "malformed (crafted or damaged), so nothing was loaded"
    )


def _int(where: Path, name: str, value: Any, *, minimum: int = 0) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise _field(where, name, value, f"an integer >= {minimum}")


def check_schema(data: dict[str, Any], where: Path) -> None:
    """Type-check every manifest field a reader relies on, naming the field and the file."""
    from accelkit.checkpoint.format.digest import ALGORITHMS

    _int(where, "world_size", data.get("world_size"), minimum=1)
    for name in ("step", "applied_steps"):
        if data.get(name) is not None:
            _int(where, name, data[name])
    for name, kind in (("files", dict), ("objects", dict), ("tensors", list)):
        if not isinstance(data.get(name), kind):
            raise _field(where, name, data.get(name), f"a JSON {kind.__name__}")
    for name, info in data["files"].items():
        if not isinstance(info, dict):
            raise _field(where, f"files.{name}", info, "an object")
        if "bytes" in info:
            _int(where, f"files.{name}.bytes", info["bytes"])
    for name, info in data["objects"].items():
        if not isinstance(info, dict) or not isinstance(info.get("type"), str):
            raise _field(where, f"objects.{name}", info, "an object with a string 'type'")
    for field_name in ("backend_state", "rng", "rank_state"):
        if not isinstance(data.get(field_name, {}), dict):
            raise _field(where, field_name, data.get(field_name), "a JSON object")
    for i, t in enumerate(data["tensors"]):
        label = f"tensors[{i}]"
        if not isinstance(t, dict):
            raise _field(where, label, t, "an object")
        for key in ("object", "fqn", "kind"):
            if not isinstance(t.get(key), str):
                raise _field(where, f"{label}.{key}", t.get(key), "a string")
        label = f"tensors[{i}] ({t['object']}:{t['kind']}:{t['fqn']})"
        if t.get("dtype") not in ELEMENT_SIZES:
            raise _field(where, f"{label}.dtype", t.get("dtype"), "a known dtype name")
        shape = t.get("shape")
        if not isinstance(shape, list):
            raise _field(where, f"{label}.shape", shape, "a list of integers >= 0")
        for n in shape:
            _int(where, f"{label}.shape", n)
        fragments = t.get("fragments")
        if not isinstance(fragments, list):
            raise _field(where, f"{label}.fragments", fragments, "a list")
        for j, f in enumerate(fragments):
            at = f"{label}.fragments[{j}]"
            if not isinstance(f, dict):
                raise _field(where, at, f, "an object")
            for key in ("file", "key"):
                if not isinstance(f.get(key), str):
                    raise _field(where, f"{at}.{key}", f.get(key), "a string")
            _int(where, f"{at}.flat_offset", f.get("flat_offset"))
            _int(where, f"{at}.numel", f.get("numel"), minimum=1)
            present = [a for a in ALGORITHMS if a in f]
            if len(present) != 1:
                raise _field(
                    where, f"{at} checksum", present, f"exactly one of {', '.join(ALGORITHMS)}"
                )
            algorithm = present[0]
            value = f[algorithm]
            if not isinstance(value, str) or not re.fullmatch(
                f"[0-9a-f]{{{ALGORITHMS[algorithm]}}}", value
            ):
                raise _field(
                    where,
                    f"{at}.{algorithm}",
                    value,
                    f"{ALGORITHMS[algorithm]} lowercase hex digits",
                )
