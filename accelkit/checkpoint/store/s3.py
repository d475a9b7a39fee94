"""The S3 store: :class:`~accelkit.checkpoint.store.bucket.BucketStore` over
:class:`~accelkit.checkpoint.store.s3_client.S3Bucket` (boto3, imported on first use)."""

from __future__ import annotations

from typing import Any

from accelkit.checkpoint.store.bucket import BucketStore


def s3_store(storage_options: dict[str, Any] | None = None) -> BucketStore:
    """The store of ``s3://`` locations, with ``storage_options`` over the AWS_* configuration
    (an unknown key is refused at the first request, naming the known ones)."""

    def bucket_for(name: str) -> Any:
        from accelkit.checkpoint.store.s3_client import bucket_for as s3_bucket

        return s3_bucket(name, storage_options)

    return BucketStore("s3", bucket_for)
