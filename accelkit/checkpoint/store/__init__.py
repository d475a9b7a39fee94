"""Where a checkpoint's bytes live and how a save is committed there: a directory
(:mod:`.posix`: temporary sibling, fsync, rename) or S3-compatible object storage (:mod:`.s3`:
the manifest written last and conditionally). Stands on the format alone."""
