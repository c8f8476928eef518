"""Reading a file out of a volume, with no sandbox running (over
:mod:`torpor.sandbox.storage.volume_files`).

::

    GET /v1/volumes/{id}/files?path=/facts.md      the file's bytes (application/octet-stream)

The path is inside the volume (its root is the volume's root, wherever sandboxes mount it).
Memory facts that cite ``SourceRef(volume=..., path=...)`` are checked through this route.
A volume attached read-write to a sandbox is read as the guest has flushed it (``sync`` in the
guest, or a pause); see :mod:`torpor.sandbox.storage.volume_files`.
"""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import APIRouter, Query, Request, Response

from torpor.config import LIMITS
from torpor.sandbox.storage.volume_files import read_volume_file
from torpor.server.deps import Manager, Tenant
from torpor.server.routes_checkpoints import checkpoints_of

__all__ = ["router"]

router = APIRouter(prefix="/v1", tags=["checkpoints"])


@router.get("/volumes/{id_or_name}/files")
async def read_file(
    id_or_name: str,
    path: Annotated[str, Query(min_length=1)],
    request: Request,
    manager: Manager,
    tenant: Tenant,
) -> Response:
    """A file's bytes. Raises VolumeNotFound, PathNotFound, InvalidArgument (a directory or
    link), PayloadTooLarge (over the server's file limit), EngineError, Conflict (in a
    cluster, the volume's latest image is on another node)."""
    cp = checkpoints_of(request, manager)
    limit = int(getattr(request.app.state, "max_file_bytes", LIMITS.max_file_bytes))
    # debugfs runs as a subprocess and the volume lock may wait: keep the event loop free.
    data = await asyncio.to_thread(
        read_volume_file,
        cp.volumes,
        id_or_name,
        path,
        tenant=tenant,
        max_bytes=limit,
        live=cp.attachments.live_ids,  # called under the volumes' lock
    )
    return Response(content=data, media_type="application/octet-stream")
