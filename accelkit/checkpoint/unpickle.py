"""Restricted unpickling: how ``trust_pickle`` reads a pickled foreign checkpoint.

A pickle is a program, so it is never run as one: the unpickler here resolves only the globals
of a :class:`PickleAllowlist` and refuses any other before anything is called. Every importer
of a pickled format (torch files, DCP's ``.metadata``, MMEngine's ``.pth``) reads through it.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, Any

import torch

from accelkit.errors import CheckpointError

PICKLE_HINT = (
    "is a pickle. Pass --trust-pickle (trust_pickle=True) to read it with accelkit's restricted "
    "unpickler: tensors, plain containers and numpy values, and no other global"
)


# A pickle is a program: each global it names is looked up, and may be called. trust_pickle never
# means "run it": every pickled input is read by an unpickler that resolves only the globals of a
# PickleAllowlist and refuses any other before anything is called. No allowed callable looks up an
# attribute, imports or evaluates by a name taken from the file (``_codecs.encode`` finds the codec
# the file names in Python's codec registry, nowhere else), or calls a function the file hands it;
# so a file can build tensors, containers and the listed types, and nothing else.

#: torch's tensor reconstructors a restricted load allows. Left out of torch's own weights_only
#: list: ``_rebuild_from_type_v2`` (calls whatever function the file hands it, then sets the
#: attributes the file names), ``_rebuild_parameter_with_state`` (sets the attributes the file
#: names), ``_rebuild_wrapper_subclass`` (builds any tensor subclass) and the rebuilders of device
#: tensors without storage (``_rebuild_device_tensor_from_cpu_tensor`` calls ``.to`` on an object
#: from the file).
TENSOR_REBUILDERS = (
    "_rebuild_tensor",
    "_rebuild_tensor_v2",
    "_rebuild_tensor_v3",
    "_rebuild_parameter",
    "_rebuild_qtensor",
    "_rebuild_sparse_tensor",
    "_rebuild_nested_tensor",
    "_rebuild_meta_tensor_no_storage",
)


#: containers and values a ``torch.save`` of tensors names (``_codecs.encode`` is how pickle
#: protocol 2 writes ``bytes``, ``_get_layout`` how torch writes a tensor layout)
TENSOR_CONTAINERS = (
    "collections.OrderedDict",
    "collections.Counter",
    "builtins.set",
    "builtins.bytearray",
    "builtins.complex",
    "_codecs.encode",
    "torch.Size",
    "torch.device",
    "torch.Tensor",
    "torch.nn.parameter.Parameter",
    "torch.serialization._get_layout",
)


#: what to do about a refused pickle, for ``accelkit convert``
CONVERT_REFUSED_HINT = (
    "accelkit unpickles nothing beyond its allowlist, with or without --trust-pickle. If you know "
    "where the file comes from and what else it holds, load it in your own code and save the "
    "tensors you need (.safetensors, or a torch.save of a plain state dict), then convert that"
)


class PickleRefused(CheckpointError):
    """A pickle names or calls something its restricted reader does not allow (nothing that the
    allowlist lacks was looked up or called)."""

    def __init__(self, message: str, refused: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        #: the refused globals (``module.name``) where the file named them
        self.refused = refused


@dataclass(frozen=True)
class PickleAllowlist:
    """The globals a restricted load lets a pickle name, and what each one is bound to.

    ``names``: every global the file may name. ``bindings``: the names torch's own weights_only
    list does not hold, each with the object it resolves to (a stand-in may take a builtin's
    name). ``instance_types``: types whose instances an allowed callable returns and the file may
    then fill (numpy's dtype classes).
    """

    names: frozenset[str]
    bindings: tuple[tuple[str, Any], ...] = ()
    instance_types: tuple[type, ...] = ()

    def extended(
        self, bindings: dict[str, Any], instance_types: tuple[type, ...] = ()
    ) -> PickleAllowlist:
        return PickleAllowlist(
            self.names | frozenset(bindings),
            self.bindings + tuple(bindings.items()),
            self.instance_types + instance_types,
        )


def tensor_allowlist() -> PickleAllowlist:
    """What a ``torch.save`` of tensors in plain containers names: :data:`TENSOR_REBUILDERS`,
    :data:`TENSOR_CONTAINERS`, and torch's dtypes, quantization schemes and storage types."""
    from torch._weights_only_unpickler import _get_allowed_globals

    kept = {f"torch._utils.{name}" for name in TENSOR_REBUILDERS} | set(TENSOR_CONTAINERS)
    names = {
        name
        for name, value in _get_allowed_globals().items()
        if name in kept
        or name.endswith("Storage")
        or isinstance(value, (torch.dtype, torch.qscheme))
    }
    return PickleAllowlist(frozenset(names))


def numpy_allowlist(base: PickleAllowlist) -> PickleAllowlist:
    """``base`` plus numpy arrays and scalars as numpy 1 and 2 pickle them (``ndarray``,
    ``dtype``, ``multiarray._reconstruct`` and ``multiarray.scalar``, under ``numpy.core`` and
    ``numpy._core``); the dtypes a file may fill are bool, integer, float and complex ones."""
    try:
        import numpy as np
    except ImportError:
        return base
    core = getattr(np, "_core", None) or np.core  # numpy 2, numpy 1
    bindings: dict[str, Any] = {"numpy.ndarray": np.ndarray, "numpy.dtype": np.dtype}
    for package in ("numpy.core", "numpy._core"):
        bindings[f"{package}.multiarray._reconstruct"] = core.multiarray._reconstruct
        bindings[f"{package}.multiarray.scalar"] = core.multiarray.scalar
    kinds = "?" + np.typecodes["AllInteger"] + np.typecodes["AllFloat"]
    return base.extended(bindings, tuple(dict.fromkeys(type(np.dtype(c)) for c in kinds)))


def conversion_allowlist() -> PickleAllowlist:
    """What ``accelkit convert --trust-pickle`` reads: tensors, containers and numpy values."""
    return numpy_allowlist(tensor_allowlist())


def restricted_torch_load(
    source: str | os.PathLike | IO[bytes],
    allowlist: PickleAllowlist,
    *,
    hint: str,
    mmap: bool = False,
    name: str | None = None,
) -> Any:
    """``torch.load`` that unpickles only what ``allowlist`` allows; else :class:`PickleRefused`.

    Every global the file's pickles name is read first (torch's own parser of them, on the same
    bytes), and a name outside ``allowlist.names`` refuses the file before anything is called;
    then ``torch.load(weights_only=True)`` runs with the allowlist's bindings, so torch's
    restricted unpickler also checks each call and each object filled. ``hint`` (what to do)
    ends each refusal; ``name`` names a ``source`` that is not a path in it. ``mmap`` maps the
    tensors of a file given by path.
    """
    is_path = isinstance(source, (str, os.PathLike))
    where = os.fspath(source) if is_path else name or "the pickle"
    with contextlib.ExitStack() as stack:
        file = stack.enter_context(open(source, "rb")) if is_path else source
        try:
            named = _pickle_globals(file)
        except (pickle.UnpicklingError, EOFError, RuntimeError, ValueError) as err:
            raise CheckpointError(
                f"{where}: not a torch.save file accelkit can read ({type(err).__name__}: {err})"
            ) from None
        refused = tuple(sorted(named - allowlist.names))
        if refused:
            raise PickleRefused(
                f"{where}: refused to unpickle: it names {', '.join(refused)}, which accelkit's "
                f"restricted unpickler does not allow (nothing in the file was run). {hint}",
                refused,
            )
        file.seek(0)
        with _bound(allowlist):
            try:
                return torch.load(
                    where if mmap and is_path else file,
                    map_location="cpu",
                    weights_only=True,
                    mmap=mmap and is_path,
                )
            except PickleRefused as err:
                raise PickleRefused(f"{where}: {err}. {hint}", err.refused) from None
            except pickle.UnpicklingError as err:
                raise PickleRefused(
                    f"{where}: refused to unpickle: {_unpickler_reason(err)}. {hint}"
                ) from None


def _pickle_globals(file: IO[bytes]) -> set[str]:
    """Every global the pickles that ``torch.load`` reads from ``file`` name, as torch reads
    them (its own record lookup, opcode parser and name mapping)."""
    from torch._weights_only_unpickler import get_globals_in_pkl
    from torch.serialization import _is_zipfile, _open_zipfile_reader

    file.seek(0)
    if _is_zipfile(file):
        with _open_zipfile_reader(file) as archive:
            return get_globals_in_pkl(io.BytesIO(archive.get_record("data.pkl")))
    names: set[str] = set()
    for _ in range(5):  # the legacy format: magic number, protocol, system info, data, storage keys
        try:
            names |= get_globals_in_pkl(file)
        except EOFError:  # a short file: torch.load fails on it too, after these names are checked
            break
    return names


def _unpickler_reason(err: pickle.UnpicklingError) -> str:
    """torch's own reason, without its advice to load with ``weights_only=False``."""
    text = str(err).split("WeightsUnpickler error:", 1)[-1]
    return next((part.strip() for part in text.split("\n\n") if part.strip()), type(err).__name__)


def safe_global_name(entry: Any) -> str:
    return entry[1] if isinstance(entry, tuple) else f"{entry.__module__}.{entry.__qualname__}"


@contextlib.contextmanager
def _bound(allowlist: PickleAllowlist) -> Iterator[None]:
    """Register ``allowlist``'s bindings with torch for one load, setting aside what the process
    registered under the same names (torch would pick either one)."""
    from torch.serialization import add_safe_globals, clear_safe_globals, get_safe_globals

    ours = [(obj, name) for name, obj in allowlist.bindings] + list(allowlist.instance_types)
    taken = {safe_global_name(entry) for entry in ours}
    before = get_safe_globals()
    clear_safe_globals()
    add_safe_globals([entry for entry in before if safe_global_name(entry) not in taken] + ours)
    try:
        yield
    finally:
        clear_safe_globals()
        add_safe_globals(before)


class RestrictedUnpickler(pickle._Unpickler):
    """Python's unpickler limited to ``allowed`` (``"module.name"`` -> object), for pickles that
    are not ``torch.save`` files (torch.distributed.checkpoint's ``.metadata``).

    A global outside ``allowed`` is refused; a call only of an allowed object; a new instance
    only of an allowed class; filling an object's state only for an instance made by this load
    (nothing shared, a class or an enum member, can be changed); no persistent ids, extension
    codes or protocol-0 instance opcodes.
    """

    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, file: IO[bytes], allowed: dict[str, Any]) -> None:
        super().__init__(file)
        self._allowed = allowed
        self._allowed_ids = {id(value) for value in allowed.values()}
        self._made: dict[int, Any] = {}  # instances made here, by id (held, so ids stay unique)

    def find_class(self, module: str, name: str) -> Any:
        key = f"{module}.{name}"
        if key not in self._allowed:
            raise PickleRefused(
                f"refused to unpickle: it names {key}, which this restricted unpickler does not "
                "allow (nothing in the file was run)",
                (key,),
            )
        return self._allowed[key]

    def _require_allowed(self, obj: Any, what: str) -> None:
        if id(obj) not in self._allowed_ids:
            raise PickleRefused(f"refused to unpickle: it {what} {type(obj).__name__} object")

    def load_reduce(self) -> None:
        self._require_allowed(self.stack[-2], "calls a")
        super().load_reduce()

    def load_newobj(self) -> None:
        self._require_allowed(self.stack[-2], "instantiates a")
        super().load_newobj()
        self._made[id(self.stack[-1])] = self.stack[-1]

    def load_newobj_ex(self) -> None:
        self._require_allowed(self.stack[-3], "instantiates a")
        super().load_newobj_ex()
        self._made[id(self.stack[-1])] = self.stack[-1]

    def load_build(self) -> None:
        inst = self.stack[-2]
        if self._made.get(id(inst)) is not inst:
            raise PickleRefused(
                f"refused to unpickle: it sets the state of a {type(inst).__name__} it did not make"
            )
        super().load_build()

    def _refuse_opcode(self) -> None:
        raise PickleRefused("refused to unpickle: it uses an opcode this unpickler does not allow")

    dispatch[pickle.REDUCE[0]] = load_reduce
    dispatch[pickle.NEWOBJ[0]] = load_newobj
    dispatch[pickle.NEWOBJ_EX[0]] = load_newobj_ex
    dispatch[pickle.BUILD[0]] = load_build
    for _opcode in (pickle.INST, pickle.OBJ, pickle.EXT1, pickle.EXT2, pickle.EXT4):
        dispatch[_opcode[0]] = _refuse_opcode
    del _opcode


def torch_load(path: str | os.PathLike, trust_pickle: bool) -> Any:
    if not trust_pickle:
        raise CheckpointError(f"{path} {PICKLE_HINT}")
    return restricted_torch_load(path, conversion_allowlist(), hint=CONVERT_REFUSED_HINT, mmap=True)
