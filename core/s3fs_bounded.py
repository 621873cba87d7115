"""fsspec's s3:// with S3Store's bounds: registered for s3:// by store.py, imported on first use."""

from __future__ import annotations

from s3fs import S3FileSystem

from .retry import store_limits
from .store import bound_requests


class BoundedS3FileSystem(S3FileSystem):
    """The same per-attempt timeouts, attempts, retry log and deadline as S3Store. s3fs's own retry
    loop is off (one pass): botocore's retries are the one loop, so the deadline is never multiplied;
    a body cut short is retried by the caller (`with_retries`), as for S3Store."""

    retries = 1

    def __init__(self, *args, config_kwargs: dict | None = None, **kwargs):
        self._limits = store_limits()
        super().__init__(*args, config_kwargs={**self._limits.botocore_config(), **(config_kwargs or {})}, **kwargs)

    async def set_session(self, refresh=False, kwargs={}):  # noqa: B006 (s3fs's signature)
        client = await super().set_session(refresh, kwargs)
        bound_requests(client.meta.events, self._limits)  # unique ids: a refreshed session is hooked once
        return client
