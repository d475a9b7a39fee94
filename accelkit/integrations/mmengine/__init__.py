"""MMEngine on any accelkit backend, with one config change.

Classic Runner::

    custom_imports = dict(imports=['accelkit.integrations.mmengine'])
    runner_type = 'AccelkitRunner'
    accelkit = dict(backend='deepspeed', config=dict(zero_stage=2))

FlexibleRunner::

    strategy = dict(type='AccelkitStrategy', backend='ddp', precision='bf16-mixed')

Importing this package registers ``AccelkitRunner`` (RUNNERS), ``AccelkitStrategy``
(STRATEGIES), ``AccelkitOptimWrapper`` (OPTIM_WRAPPERS), ``AccelkitModelWrapper``
(MODEL_WRAPPERS) and ``AccelkitCheckpointHook`` (HOOKS) in MMEngine's registries, and makes
MMEngine's ``CheckpointLoader`` open accelkit checkpoint directories
(:mod:`~accelkit.integrations.mmengine.checkpoint_loader`), and serves ``s3://`` to MMEngine's
file layer (:mod:`~accelkit.integrations.mmengine.object_storage`). It needs
``pip install accelkit[mmengine]``; ``import accelkit`` alone never imports MMEngine.
"""

from __future__ import annotations

try:
    import mmengine  # noqa: F401
except ImportError as err:  # pragma: no cover - depends on the environment
    from accelkit.errors import PluginMissingError

    raise PluginMissingError(
        "accelkit.integrations.mmengine needs MMEngine: pip install 'accelkit[mmengine]'"
    ) from err

from accelkit.integrations.mmengine import checkpoint_loader, object_storage
from accelkit.integrations.mmengine.hooks import AccelkitCheckpointHook
from accelkit.integrations.mmengine.model_wrapper import AccelkitModelWrapper
from accelkit.integrations.mmengine.optim_wrapper import AccelkitOptimWrapper
from accelkit.integrations.mmengine.runner import AccelkitRunner
from accelkit.integrations.mmengine.strategy import AccelkitStrategy

checkpoint_loader.register()
object_storage.register()  # s3:// paths for CheckpointHook(out_dir=...) and backend_args

__all__ = [
    "AccelkitCheckpointHook",
    "AccelkitModelWrapper",
    "AccelkitOptimWrapper",
    "AccelkitRunner",
    "AccelkitStrategy",
]
