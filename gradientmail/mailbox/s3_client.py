"""The boto3 S3 client of a mailbox: made on first use in each process, with this package's settings.

A client is never pickled and is made again after a fork (``ProcessClient``); ``make_client``
loads the service models once per process and lets the environment's or profile's retry
settings win over ``BOTOCORE_DEFAULTS``.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping
from typing import Any

import boto3
import botocore.config
import botocore.loaders
import botocore.session

__all__ = [
    "BOTOCORE_DEFAULTS",
    "make_client",
    "ProcessClient",
]


BOTOCORE_DEFAULTS: dict[str, Any] = {
    "retries": {"mode": "standard", "total_max_attempts": 3},
    "connect_timeout": 10,
    "read_timeout": 60,
}
"""Client settings unless the caller's ``config`` (or, for retries, the environment) says otherwise."""

# One lock for lazy client creation in all mailboxes; replaced in a forked child, where a
# thread of the parent may have held it at the moment of the fork.
_CLIENT_LOCK = threading.Lock()

# Service models are loaded once per process and shared by every client: a fresh boto3
# session parses them again (~0.3 s per client instead of ~0.04 s).
_LOADER: Any = None


def _reset_client_lock() -> None:
    global _CLIENT_LOCK
    _CLIENT_LOCK = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_client_lock)


class ProcessClient:
    """A boto3 S3 client made on first use in each process (again after a fork), never pickled.

    Args:
        factory: Makes the client instead of ``make_client`` (a fake in tests).
        settings: The keyword arguments of ``make_client``.
    """

    def __init__(self, factory: Callable[[], Any] | None = None, **settings: Any) -> None:
        self.factory = factory
        self.settings = settings
        self.client: Any = None
        self.pid = 0

    def get(self) -> Any:
        """This process's client."""
        client = self.client
        if client is not None and self.pid == os.getpid():
            return client
        with _CLIENT_LOCK:
            if self.client is None or self.pid != os.getpid():
                self.client = self.factory() if self.factory else make_client(**self.settings)
                self.pid = os.getpid()
            return self.client

    @property
    def endpoint_url(self) -> str | None:
        """The endpoint the client talks to, once it is made in this process."""
        made = self.client is not None and self.pid == os.getpid()
        return self.client.meta.endpoint_url if made else None

    def __getstate__(self) -> dict[str, Any]:
        return {"factory": self.factory, "settings": self.settings, "client": None, "pid": 0}  # no client


def make_client(
    *,
    endpoint_url: str | None,
    region_name: str | None,
    profile_name: str | None,
    client_kwargs: Mapping[str, Any],
    config: botocore.config.Config | Mapping[str, Any] | None,
) -> Any:
    """A new boto3 S3 client; credentials, profiles and ``AWS_*`` variables are read now.

    Raises:
        botocore.exceptions.NoCredentialsError: and the other ``CREDENTIAL_ERRORS``.
    """
    global _LOADER
    if _LOADER is None:
        _LOADER = botocore.loaders.create_loader(os.environ.get("AWS_DATA_PATH"))
    core = botocore.session.get_session()
    core.register_component("data_loader", _LOADER)
    session = boto3.session.Session(botocore_session=core, profile_name=profile_name, region_name=region_name)
    return session.client("s3", endpoint_url=endpoint_url, config=_client_config(core, config), **client_kwargs)


def _client_config(core: Any, config: botocore.config.Config | Mapping[str, Any] | None) -> botocore.config.Config:
    defaults = dict(BOTOCORE_DEFAULTS)
    # A retry setting in the environment or the profile wins over this module's default
    # (botocore lets any retry setting in a Config override both).
    profile = core.get_scoped_config()
    if any(os.environ.get(name) for name in ("AWS_RETRY_MODE", "AWS_MAX_ATTEMPTS")) or any(
        name in profile for name in ("retry_mode", "max_attempts")
    ):
        del defaults["retries"]
    merged = botocore.config.Config(**defaults)
    if isinstance(config, botocore.config.Config):
        merged = merged.merge(config)
    elif config:
        merged = merged.merge(botocore.config.Config(**config))
    return merged
