"""What a checkpoint is, byte by byte: the manifest, the safetensors rank files and their
checksums, the JSON codec, canonical names, RNG state, and the pinned host memory copies go
through. Imports nothing else of the checkpoint package."""
