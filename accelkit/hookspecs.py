"""Hook specifications of the ``accelkit`` plugin system.

A plugin is any module or object with functions marked ``@accelkit.hookimpl`` and exposed through
an entry point of group ``accelkit``. Hooks are small and cheap: a plugin registers *names and
factories*; its backend library is imported only when a backend of that name is built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from accelkit.backend_specs import BackendRegistry

PROJECT_NAME = "accelkit"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def accelkit_register_backends(registry: BackendRegistry) -> None:
    """Register backend names with ``registry.add(name, factory, ...)``.

    Called once, at the first :func:`accelkit.get` or ``accelkit env``. Must not import the
    backend library: pass the factory as a ``"module:attribute"`` string, or import inside it.
    """


@hookspec
def accelkit_env_report() -> dict[str, Any]:
    """Return ``{"library": version or None}`` for the libraries this plugin depends on.

    Shown by ``accelkit env``. Read versions with ``importlib.metadata`` rather than importing.
    """


@hookspec
def accelkit_checkpoint_importers() -> dict[str, Any]:
    """Return ``{format_name: importer}`` for foreign checkpoint formats ``accelkit convert`` reads.

    An importer is an object with ``detect(path) -> bool`` and
    ``convert(path, dst, *, trust_pickle: bool) -> None``. It reads a pickle only under
    ``trust_pickle`` and only through ``accelkit.sdk.restricted_torch_load`` with the classes its
    format holds (docs/plugins.md, "Reading pickled checkpoints").
    """


@hookspec
def accelkit_checkpoint_exporters() -> dict[str, Any]:
    """Return ``{target_name: exporter}`` for ``accelkit convert SRC DST --to target_name``.

    An exporter is a callable ``(src, dst) -> Path`` that writes the portable checkpoint ``src``
    in another framework's format at ``dst``. Import that framework inside the call, not here.
    """


@hookspec
def accelkit_checkpoint_stores() -> dict[str, Any]:
    """Return ``{scheme: factory}`` for checkpoint stores of other URL schemes (``gs``, ``az``).

    ``factory(storage_options: dict | None) -> accelkit.sdk.Store``: a store of objects is
    usually ``accelkit.sdk.BucketStore(scheme, bucket_for)`` over a ``Bucket`` of its service
    (docs/plugins.md, "Checkpoint stores"). Import the service's client inside the factory.
    """


@hookspec(firstresult=True)
def accelkit_estimate_memory(backend: str, model_stats: dict[str, Any], options: dict[str, Any]):
    """Return the per-device memory estimate (bytes, as a dict) of ``backend`` for a model, or None.

    ``model_stats`` holds the model's counts (``params``, ``trainable_params``, ...), the traced
    ``activation_bytes`` and ``step_peak(kind, ...)``; ``options`` holds ``world_size``,
    ``precision``, ``optimizer``, ``device_type``, ``backend_options`` and ``mesh``: every key is
    listed in docs/performance.md, "Writing the hook for a plugin". Used by ``accelkit plan``;
    the first plugin that knows the backend answers.
    """


@hookspec
def accelkit_loggers() -> dict[str, Any]:
    """Return ``{name: factory}`` of experiment trackers for :meth:`Accelerator.log`."""
