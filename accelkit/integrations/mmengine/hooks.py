"""``AccelkitCheckpointHook``: MMEngine's CheckpointHook, deleting old checkpoints only after the
new one is complete, and writing accelkit's log lines into the runner's log file.

MMEngine's hook (mmengine/hooks/checkpoint_hook.py, ``_save_checkpoint_with_step``) removes the
oldest checkpoint *before* writing the new one, so with ``max_keep_ckpts=1`` a crash during the
save leaves no checkpoint at all. This subclass writes first (accelkit's save is atomic: temporary
sibling, then rename) and then removes what ``max_keep_ckpts`` no longer keeps. AccelkitRunner
uses it in place of CheckpointHook automatically; with FlexibleRunner set
``default_hooks=dict(checkpoint=dict(type='AccelkitCheckpointHook', ...))``.

accelkit logs through the ``accelkit`` logger ("saved ...", warnings about a load), which prints
to the console only; MMEngine users read ``work_dir/<timestamp>/<timestamp>.log``. From
``before_run`` to the end of the run the hook hands those lines to the runner's log files as
well; the forwarder is detached on every way out (``after_run``, an exception in AccelkitRunner's
``train``/``val``/``test``, the runner's garbage collection, the next run's ``before_run``), and
it never reopens a log file that was closed.

``save_format`` chooses what a save writes: ``'accelkit'`` (the portable directory, the default),
``'pth'`` (the single ``.pth`` file MMEngine's own Runner writes, under the same name, for tools
outside this Python environment) or ``'both'`` (the directory, plus that file as
``<name>_mmengine.pth``).
"""

from __future__ import annotations

import logging
import os.path as osp
import shutil
import weakref
from typing import Any

from mmengine.dist import barrier, is_main_process
from mmengine.hooks import CheckpointHook
from mmengine.registry import HOOKS

from accelkit.checkpoint.store import is_remote
from accelkit.errors import ConfigError
from accelkit.integrations.mmengine.object_storage import check_backend_args, serve
from accelkit.log import LOGGER_NAME

#: what ``AccelkitCheckpointHook(save_format=...)`` takes
SAVE_FORMATS = ("accelkit", "pth", "both")


class RunnerLogFileHandler(logging.Handler):
    """Writes ``accelkit`` log records into the file handlers of a runner's MMLogger.

    Only the files: accelkit's own handler prints to the console already. Each file handler's
    level and filters apply, so ``log_level='WARNING'`` keeps accelkit's info lines out too.
    """

    def __init__(self, runner_logger: logging.Logger) -> None:
        super().__init__()
        self.runner_logger = runner_logger

    def emit(self, record: logging.LogRecord) -> None:
        for handler in self.runner_logger.handlers:
            if (
                isinstance(handler, logging.FileHandler)
                and handler.stream is not None  # a closed log is never reopened
                and record.levelno >= handler.level
            ):
                handler.handle(record)


def _forwarders(logger: logging.Logger) -> list[RunnerLogFileHandler]:
    return [h for h in logger.handlers if isinstance(h, RunnerLogFileHandler)]


def _detach(forwarder: RunnerLogFileHandler) -> None:
    logging.getLogger(LOGGER_NAME).removeHandler(forwarder)


def check_save_format(save_format: Any) -> str:
    if save_format not in SAVE_FORMATS:
        raise ConfigError(
            f"CheckpointHook save_format={save_format!r}: use 'accelkit' (accelkit's portable "
            "directory, the default), 'pth' (the single .pth file MMEngine's own Runner writes) "
            "or 'both' (the directory, plus that file as <name>_mmengine.pth)"
        )
    return save_format


def mmengine_file_name(filename: str) -> str:
    """Where ``save_format='both'`` puts the ``.pth`` next to directory ``filename``."""
    stem, ext = osp.splitext(filename)
    return f"{stem}_mmengine{ext or '.pth'}"


@HOOKS.register_module()
class AccelkitCheckpointHook(CheckpointHook):
    """MMEngine's CheckpointHook (same arguments, same files) with three differences: an old
    checkpoint is deleted only after the new one is complete (``max_keep_ckpts`` never leaves
    zero checkpoints after a crash), accelkit's log lines ("saved ...") go into the runner's
    log file while the runner runs, and ``save_format`` (``'accelkit'``, ``'pth'`` or
    ``'both'``, see the module) may add or substitute MMEngine's single ``.pth`` file.
    AccelkitRunner puts it in place of CheckpointHook, ``save_format`` included."""

    def __init__(self, *args: Any, save_format: str = "accelkit", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.save_format = check_save_format(save_format)
        # before anything is written: refused when the runner is built, not at the first save
        check_backend_args(self.backend_args, "CheckpointHook backend_args")

    def before_train(self, runner: Any) -> None:
        serve(self.out_dir)  # a store plugin's scheme (gs://) for MMEngine's file layer
        super().before_train(runner)

    def before_run(self, runner: Any) -> None:
        super().before_run(runner)
        logger = logging.getLogger(LOGGER_NAME)
        current = _forwarders(logger)
        if getattr(self, "_forwarder", None) is not None and self._forwarder in current:
            self._runs += 1  # a nested run (val() inside train()) keeps the outer forwarder
            return
        for stale in current:  # left by a run that raised before its after_run
            logger.removeHandler(stale)
        self._forwarder: RunnerLogFileHandler | None = RunnerLogFileHandler(runner.logger)
        self._runs = 1
        logger.addHandler(self._forwarder)
        try:  # a runner dropped mid-run (FlexibleRunner has no exception path of its own)
            weakref.finalize(runner, _detach, self._forwarder)
        except TypeError:  # an object without weak references: the paths above still apply
            pass
        runner.logger.info(
            "AccelkitCheckpointHook: MMEngine's CheckpointHook; it deletes old checkpoints only "
            "after the new one is complete, and writes accelkit's log lines into this log file"
        )

    def after_run(self, runner: Any) -> None:
        super().after_run(runner)
        forwarder = getattr(self, "_forwarder", None)
        if forwarder is None:
            return
        self._runs -= 1
        if self._runs == 0:
            self.detach_log_forwarder()

    def detach_log_forwarder(self) -> None:
        """Stop writing accelkit's lines into the runner's log (the run ended, or raised)."""
        forwarder = getattr(self, "_forwarder", None)
        if forwarder is not None:
            _detach(forwarder)
        self._forwarder = None
        self._runs = 0

    def _remove_checkpoint(self, step: int) -> None:
        if not is_main_process():
            return
        name = self.filename_tmpl.format(step)
        for filename in (name, mmengine_file_name(name)):
            path = self.file_backend.join_path(self.out_dir, filename)
            if self.file_backend.isfile(path):
                self.file_backend.remove(path)
            elif self.file_backend.isdir(path):
                self.file_backend.rmtree(path)

    def _save_checkpoint_with_step(self, runner: Any, step: int, meta: dict) -> None:
        dropped = None
        if self.max_keep_ckpts > 0 and not (self.keep_ckpt_ids and self.keep_ckpt_ids[-1] == step):
            if len(self.keep_ckpt_ids) == self.max_keep_ckpts:
                dropped = self.keep_ckpt_ids.popleft()
            self.keep_ckpt_ids.append(step)
            runner.message_hub.update_info("keep_ckpt_ids", list(self.keep_ckpt_ids))

        ckpt_filename = self.filename_tmpl.format(step)
        self.last_ckpt = self.file_backend.join_path(self.out_dir, ckpt_filename)
        runner.message_hub.update_info("last_ckpt", self.last_ckpt)
        save_format = getattr(self, "save_format", "accelkit")
        if save_format != "accelkit" and is_remote(self.out_dir):
            raise ConfigError(
                f"CheckpointHook save_format={save_format!r} writes MMEngine's .pth beside the "
                f"checkpoint on a local disk; out_dir {self.out_dir} is object storage: use "
                "save_format='accelkit' there (`accelkit convert <url> model.pth` exports one)"
            )
        # 'pth': the directory is written under a hidden name, exported, then removed
        written = f".{ckpt_filename}.accelkit-staging" if save_format == "pth" else ckpt_filename
        runner.save_checkpoint(
            self.out_dir,
            written,
            self.file_client_args,
            save_optimizer=self.save_optimizer,
            save_param_scheduler=self.save_param_scheduler,
            meta=meta,
            by_epoch=self.by_epoch,
            backend_args=self.backend_args,
            **self.args,
        )
        if save_format != "accelkit":
            self._write_pth(runner, written, ckpt_filename, save_format)
        if is_main_process():
            with open(osp.join(runner.work_dir, "last_checkpoint"), "w") as f:
                f.write(self.last_ckpt)
        if dropped is not None:
            self._remove_checkpoint(dropped)

    def _write_pth(self, runner: Any, written: str, ckpt_filename: str, save_format: str) -> None:
        """Rank 0 exports the directory just written to MMEngine's ``.pth`` (a temporary
        sibling, then a rename); the others wait, so that the file exists on return."""
        from accelkit.integrations.mmengine.checkpoint import export_mmengine

        directory = osp.join(self.out_dir, written)
        target = ckpt_filename if save_format == "pth" else mmengine_file_name(ckpt_filename)
        try:
            if is_main_process():
                export_mmengine(directory, osp.join(self.out_dir, target))
                if save_format == "pth":
                    shutil.rmtree(directory)
        finally:
            barrier()


def use_safe_rotation(hooks: list[Any]) -> None:
    """Turn every plain CheckpointHook in ``hooks`` into an AccelkitCheckpointHook, in place
    (a ``save_format`` among its arguments becomes the hook's own)."""
    for hook in hooks:
        if type(hook) is CheckpointHook:
            hook.__class__ = AccelkitCheckpointHook
            hook.save_format = check_save_format(hook.args.pop("save_format", "accelkit"))
            check_backend_args(hook.backend_args, "CheckpointHook backend_args")
