"""Restricted unpickling: how ``trust_pickle`` reads a pickled foreign checkpoint.

A pickle is a program, so it is never run as one: the unpickler here resolves only the globals
of a :class:`PickleAllowlist` and refuses any other before anything is called. Every importer
of a pickled format (torch files, DCP's ``.metadata``, MMEngine's ``.pth``, and the plugins'
importers through :mod:`accelkit.sdk`) reads through it: ``trust_pickle`` picks a longer list,
never an unrestricted load.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
from collections.abc import Iterable, Iterator
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


#: how torch pickles a tensor that carries Python attributes (``tensor.ds_id = ...``): allowed only
#: where a list names the attributes, and then only as checked by :func:`_check_tensor_attributes`
REBUILD_FROM_TYPE = "torch._tensor._rebuild_from_type_v2"


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
    list does not hold, each with the object it resolves to (a stand-in may take a class's or a
    builtin's name). ``instance_types``: types whose instances an allowed callable returns and the
    file may then fill (numpy's dtype classes). ``tensor_attributes``: the Python attributes a
    plain tensor in the file may carry (DeepSpeed's ``ds_id``); empty, such a tensor is refused.
    """

    names: frozenset[str]
    bindings: tuple[tuple[str, Any], ...] = ()
    instance_types: tuple[type, ...] = ()
    tensor_attributes: frozenset[str] = frozenset()

    def extended(
        self,
        bindings: dict[str, Any],
        instance_types: tuple[type, ...] = (),
        tensor_attributes: Iterable[str] = (),
    ) -> PickleAllowlist:
        """This list and ``bindings`` (``"module.Name"`` -> the object the name resolves to)."""
        return PickleAllowlist(
            self.names | frozenset(bindings),
            self.bindings + tuple(bindings.items()),
            self.instance_types + instance_types,
            self.tensor_attributes | frozenset(tensor_attributes),
        )


class StandIn:
    """Takes the place of another library's class in an allowlist, for an importer that only
    reads fields: ``{"lib.module.Class": StandIn}``. Each object the file makes is a new StandIn
    holding the fields the file stores (and ``args``, what the file passed to make it); nothing
    of the class itself runs, and its library need not be installed."""

    def __new__(cls, *args: Any) -> StandIn:
        made = super().__new__(cls)
        made.args = args
        return made

    def __init__(self, *args: Any) -> None:
        pass

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"StandIn({fields})"


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
    map_location: Any = "cpu",
) -> Any:
    """``torch.load`` that unpickles only what ``allowlist`` allows; else :class:`PickleRefused`.

    Every global the file's pickles name is read first (torch's own parser of them, on the same
    bytes), and a name outside ``allowlist.names`` refuses the file before anything is called;
    then ``torch.load(weights_only=True)`` runs with the allowlist's bindings, so torch's
    restricted unpickler also checks each call and each object filled. ``hint`` (what to do)
    ends each refusal; ``name`` names a ``source`` that is not a path in it. ``mmap`` maps the
    tensors of a file given by path (a legacy, non-zip file is read without). ``map_location``
    as for ``torch.load``.
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
        allowed = allowlist.names | ({REBUILD_FROM_TYPE} if allowlist.tensor_attributes else set())
        refused = tuple(sorted(named - allowed))
        if refused:
            raise PickleRefused(
                f"{where}: refused to unpickle: it names {', '.join(refused)}, which accelkit's "
                f"restricted unpickler does not allow (nothing in the file was run). {hint}",
                refused,
            )
        if REBUILD_FROM_TYPE in named:
            _check_tensor_attributes(file, allowlist.tensor_attributes, where, hint)
        mmap = mmap and is_path and _is_zip(file)
        file.seek(0)
        with _bound(allowlist):
            try:
                return torch.load(
                    where if mmap else file,
                    map_location=map_location,
                    weights_only=True,
                    mmap=mmap,
                )
            except PickleRefused as err:
                raise PickleRefused(f"{where}: {err}. {hint}", err.refused) from None
            except pickle.UnpicklingError as err:
                raise PickleRefused(
                    f"{where}: refused to unpickle: {_unpickler_reason(err)}. {hint}"
                ) from None


def pickle_globals(path: str | os.PathLike) -> set[str]:
    """Every global (``"module.name"``) the pickles of the ``torch.save`` file at ``path`` name,
    read without unpickling anything: what an allowlist for files like it has to hold."""
    with open(path, "rb") as file:
        return _pickle_globals(file)


def _is_zip(file: IO[bytes]) -> bool:
    from torch.serialization import _is_zipfile

    file.seek(0)
    return _is_zipfile(file)


def _pickles(file: IO[bytes]) -> Iterator[IO[bytes]]:
    """The pickles ``torch.load`` reads from ``file``, each positioned at its start (a legacy
    file's come one after another in the file itself)."""
    from torch.serialization import _open_zipfile_reader

    if _is_zip(file):
        file.seek(0)
        with _open_zipfile_reader(file) as archive:
            yield io.BytesIO(archive.get_record("data.pkl"))
        return
    file.seek(0)
    for _ in range(5):  # the legacy format: magic number, protocol, system info, data, storage keys
        yield file


def _pickle_globals(file: IO[bytes]) -> set[str]:
    """Every global the pickles that ``torch.load`` reads from ``file`` name, as torch reads
    them (its own record lookup, opcode parser and name mapping)."""
    from torch._weights_only_unpickler import get_globals_in_pkl

    names: set[str] = set()
    for pickled in _pickles(file):
        try:
            names |= get_globals_in_pkl(pickled)
        except EOFError:  # a short file: torch.load fails on it too, after these names are checked
            break
    return names


class _Named:
    """A global as :class:`_CallShapes` sees it: its name, nothing resolved."""

    def __init__(self, name: str) -> None:
        self.name = name


class _Made:
    """An object a pickle makes, as :class:`_CallShapes` sees it: what it was made from. It takes
    items and fields as a container would, and keeps none."""

    def __init__(self, made_by: Any) -> None:
        self.made_by = made_by

    def __setitem__(self, key: Any, value: Any) -> None:
        pass

    def append(self, item: Any) -> None:
        pass

    def extend(self, items: Any) -> None:
        pass

    def add(self, item: Any) -> None:
        pass


class _CallShapes(pickle._Unpickler):
    """Reads a pickle without resolving a name or calling anything (each global stays a
    :class:`_Named`, each call and new object a :class:`_Made`), keeping the arguments of every
    call of :data:`REBUILD_FROM_TYPE`: what the file would hand that function, seen before it
    runs. The stack and memo follow pickle's own code, so the real load hands the same
    objects."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, file: IO[bytes]) -> None:
        super().__init__(file)
        self.rebuilds: list[Any] = []

    def find_class(self, module: str, name: str) -> Any:
        return _Named(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        return _Made(None)

    def load_reduce(self) -> None:
        args = self.stack.pop()
        func = self.stack[-1]
        if isinstance(func, _Named) and func.name == REBUILD_FROM_TYPE:
            self.rebuilds.append(args)
        self.stack[-1] = _Made(func)

    def load_newobj(self) -> None:
        self.stack.pop()
        self.stack[-1] = _Made(self.stack[-1])

    def load_newobj_ex(self) -> None:
        del self.stack[-2:]
        self.stack[-1] = _Made(self.stack[-1])

    def load_build(self) -> None:
        self.stack.pop()

    def _instantiate(self, klass: Any, args: Any) -> None:
        self.append(_Made(klass))

    dispatch[pickle.REDUCE[0]] = load_reduce
    dispatch[pickle.NEWOBJ[0]] = load_newobj
    dispatch[pickle.NEWOBJ_EX[0]] = load_newobj_ex
    dispatch[pickle.BUILD[0]] = load_build


#: what a tensor with attributes may be rebuilt as, and from
_TENSOR_TYPES = ("torch.Tensor", "torch.nn.parameter.Parameter")
_TENSOR_REBUILDER_NAMES = tuple(f"torch._utils.{name}" for name in TENSOR_REBUILDERS)


def _is_plain_tensor_rebuild(args: Any, attributes: frozenset[str]) -> bool:
    """``args`` of one :data:`REBUILD_FROM_TYPE` call: ``(reconstructor, type, its arguments,
    state)``, the state a dict of fields (or a pair of dicts: fields and slots)."""
    if not (isinstance(args, tuple) and len(args) == 4):
        return False
    func, new_type, _, state = args
    dicts = state if isinstance(state, tuple) and len(state) == 2 else (state,)
    return (
        isinstance(func, _Named)
        and func.name in _TENSOR_REBUILDER_NAMES
        and isinstance(new_type, _Named)
        and new_type.name in _TENSOR_TYPES
        and all(fields is None or isinstance(fields, dict) for fields in dicts)
        and all(isinstance(k, str) and k in attributes for f in dicts for k in f or {})
    )


def _check_tensor_attributes(
    file: IO[bytes], attributes: frozenset[str], where: str, hint: str
) -> None:
    """Refuse the file unless each call of :data:`REBUILD_FROM_TYPE` is how torch pickles a plain
    tensor with attributes: a tensor reconstructor named in the file, ``torch.Tensor`` or
    ``Parameter``, and fields among ``attributes``. So the function is handed no other function
    and no other type, and sets no other attribute."""
    for pickled in _pickles(file):
        shapes = _CallShapes(pickled)
        try:
            shapes.load()
        except EOFError:
            break
        except (pickle.UnpicklingError, ValueError, TypeError, IndexError, KeyError) as err:
            raise PickleRefused(
                f"{where}: refused to unpickle: its pickle cannot be read ({err}). {hint}"
            ) from None
        for args in shapes.rebuilds:
            if not _is_plain_tensor_rebuild(args, attributes):
                raise PickleRefused(
                    f"{where}: refused to unpickle: it calls {REBUILD_FROM_TYPE} with more than "
                    f"a plain tensor and the attributes {sorted(attributes) or 'none'} (nothing in "
                    f"the file was run). {hint}",
                    (REBUILD_FROM_TYPE,),
                )


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
