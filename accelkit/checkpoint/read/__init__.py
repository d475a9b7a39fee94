"""Reading a checkpoint: ranges of any tensor, each fragment checked against its checksum
(:mod:`.reader`, :mod:`.verify`), pretrained safetensors, per-rank backend state, and the partial
local copy an object-storage load reads through (:mod:`.ranged_copy`)."""
