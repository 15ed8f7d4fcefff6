"""A run's bucket: created when missing, and a missing bucket told from a refused request.

Some stores answer 403 for a bucket that does not exist; one ``HeadBucket`` tells the two apart
(``bucket_is_missing``), so a final failure names the right cause.
"""

from __future__ import annotations

from typing import Any

import botocore.exceptions

from gradientmail.mailbox.s3_common import error_fields

__all__ = ["bucket_is_missing", "ensure_bucket"]


def _no_such_bucket(exc: botocore.exceptions.ClientError) -> bool:
    code, status, _ = error_fields(exc)
    return code in ("NoSuchBucket", "404", "NotFound") or status == 404


def bucket_is_missing(client: Any, bucket: str) -> bool:
    """One ``HeadBucket``: True only when the store says the bucket does not exist (404)."""
    try:
        client.head_bucket(Bucket=bucket)
    except botocore.exceptions.ClientError as exc:
        return _no_such_bucket(exc)
    except Exception:  # unreachable, or anything else: keep the first explanation
        return False
    return False


def ensure_bucket(client: Any, bucket: str) -> bool:
    """Create ``bucket`` unless it exists and is yours: True if created, False if it was there.

    Idempotent, so a recipe can run it on every machine: a second call (or a race with another
    machine) is not an error. Outside ``us-east-1`` the bucket is made in the client's region.

    Raises:
        botocore.exceptions.ClientError: the name is another account's (``BucketAlreadyExists``)
            or the credentials may not see or create it.
    """
    try:
        client.head_bucket(Bucket=bucket)
        return False
    except botocore.exceptions.ClientError as exc:
        if not _no_such_bucket(exc):
            raise
    region = client.meta.region_name
    options: dict[str, Any] = {}
    if region and region != "us-east-1":
        options["CreateBucketConfiguration"] = {"LocationConstraint": region}
    try:
        client.create_bucket(Bucket=bucket, **options)
    except botocore.exceptions.ClientError as exc:
        if error_fields(exc)[0] == "BucketAlreadyOwnedByYou":
            return False
        raise
    return True
