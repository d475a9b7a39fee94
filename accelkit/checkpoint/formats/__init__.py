"""Converters by source format, one module each: accelkit's own checkpoint out to one file
(:mod:`.portable`), Hugging Face (:mod:`.hf`), torch.distributed.checkpoint (:mod:`.dcp`),
plain state-dict files (:mod:`.state_dict`) and Lightning/Fabric (:mod:`.lightning`).

The other formats live with the code that knows them and register through hooks: DeepSpeed's and
ColossalAI's importers in their plugins (``accelkit_checkpoint_importers``), MMEngine's export in
:mod:`accelkit.integrations.mmengine` (``accelkit_checkpoint_exporters``).
:mod:`accelkit.checkpoint.formats.convert` picks the converter for a path.
"""
