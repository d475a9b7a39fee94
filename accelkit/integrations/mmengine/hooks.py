"""``AccelkitCheckpointHook``: MMEngine's CheckpointHook, deleting old checkpoints only after the
new one is complete.

MMEngine's hook (mmengine/hooks/checkpoint_hook.py, ``_save_checkpoint_with_step``) removes the
oldest checkpoint *before* writing the new one, so with ``max_keep_ckpts=1`` a crash during the
save leaves no checkpoint at all. This subclass writes first (accelkit's save is atomic: temporary
sibling, then rename) and then removes what ``max_keep_ckpts`` no longer keeps. AccelkitRunner
uses it in place of CheckpointHook automatically; with FlexibleRunner set
``default_hooks=dict(checkpoint=dict(type='AccelkitCheckpointHook', ...))``.
"""

from __future__ import annotations

import os.path as osp
from typing import Any

from mmengine.dist import is_main_process
from mmengine.hooks import CheckpointHook
from mmengine.registry import HOOKS


@HOOKS.register_module()
class AccelkitCheckpointHook(CheckpointHook):
    def _remove_checkpoint(self, step: int) -> None:
        if not is_main_process():
            return
        path = self.file_backend.join_path(self.out_dir, self.filename_tmpl.format(step))
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
        runner.save_checkpoint(
            self.out_dir,
            ckpt_filename,
            self.file_client_args,
            save_optimizer=self.save_optimizer,
            save_param_scheduler=self.save_param_scheduler,
            meta=meta,
            by_epoch=self.by_epoch,
            backend_args=self.backend_args,
            **self.args,
        )
        if is_main_process():
            with open(osp.join(runner.work_dir, "last_checkpoint"), "w") as f:
                f.write(self.last_ckpt)
        if dropped is not None:
            self._remove_checkpoint(dropped)


def use_safe_rotation(hooks: list[Any]) -> None:
    """Turn every plain CheckpointHook in ``hooks`` into an AccelkitCheckpointHook, in place."""
    for hook in hooks:
        if type(hook) is CheckpointHook:
            hook.__class__ = AccelkitCheckpointHook
