"""Open the miss tier's sidecar as one more file of the read stack (after the model's shards)."""

from __future__ import annotations

import errno
import os

from .._errors import FormatError
from .._format.tier_sidecar import TierSidecar
from .._io.files import ShardFiles

__all__ = ("add_sidecar",)


def add_sidecar(files: ShardFiles, tier: TierSidecar) -> ShardFiles:
    """Append the sidecar's descriptor to ``files`` (opened as they are: ``O_DIRECT`` or buffered);
    blocking. ``files`` owns it from then on (its ``close`` closes it).

    Raises:
        FormatError: the sidecar changed since it was parsed.
        OSError: it cannot be opened (``O_DIRECT`` refused where the model's shards took it).
    """
    flags = os.O_RDONLY | os.O_CLOEXEC | (os.O_DIRECT if files.direct_io else 0)
    try:
        fd = os.open(tier.path, flags)
    except OSError as exc:
        if files.direct_io and exc.errno in (errno.EINVAL, errno.EOPNOTSUPP):
            raise OSError(
                exc.errno,
                f"the miss-tier sidecar {tier.path} cannot be opened with O_DIRECT like the model: "
                "put it on the model's file system",
            ) from exc
        raise
    if not tier.shard.matches(os.fstat(fd)):
        os.close(fd)
        raise FormatError(f"{tier.path} changed since it was parsed; reopen the model")
    files.fds = (*files.fds, fd)
    files.sizes = (*files.sizes, tier.shard.size)
    return files
