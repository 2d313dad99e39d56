"""E2B's template build API: register a build, hand out upload addresses for COPY files, start the build, and
page through its status and log. The SDKs' ``Template.build`` drives exactly this sequence.

Upload addresses are this node's own ``PUT /templates/{id}/files/{hash}`` with a token in the query (an HMAC of
the template id and hash under the node's API key): the SDK sends the archive with no API key, as it would to
a presigned bucket URL.
"""

from __future__ import annotations

import gzip
import hashlib
import hmac
import os
import secrets
from pathlib import Path

import trio
from quart import request

from ..template_models import (
    BuildLogEntry,
    BuildStatusReason,
    TemplateBuildInfo,
    TemplateBuildRequest,
    TemplateBuildStart,
    TemplateFileUpload,
    TemplateRequestResponse,
)
from ...templates import touch
from ..context import ApiContext, Handler
from ..errors import ApiError
from ..query import BuildStatusQuery, UploadQuery

def _upload_token(api: ApiContext, template_id: str, files_hash: str) -> str:
    return hmac.new(api.node.api_key.encode(), f"{template_id}:{files_hash}".encode(), hashlib.sha256).hexdigest()


async def create_template(api: ApiContext, body: TemplateBuildRequest) -> TemplateRequestResponse:
    req = await api.sandboxes.templates.register_build(body.name, tags=body.tags, cpu_count=body.cpu_count,
                                                       memory_mb=body.memory_mb,
                                                       min_free_disk_mb=body.min_free_disk_mb)
    return TemplateRequestResponse(template_id=req.template_id, build_id=req.build_id, names=[req.alias],
                                   tags=req.tags, aliases=[req.alias])


async def start_template_build(api: ApiContext, templateID: str, buildID: str, body: TemplateBuildStart) -> None:
    """The recipe's rules (one source, each step's arguments, a COPY's filesHash) are its model's."""
    await api.sandboxes.templates.start_build(templateID, buildID, body.to_recipe())


async def get_template_build_status(api: ApiContext, templateID: str, buildID: str,
                                    query: BuildStatusQuery) -> TemplateBuildInfo:
    view = await api.sandboxes.templates.build_status(templateID, buildID, query.logs_offset)
    entries = [BuildLogEntry.of(e) for e in view.entries]
    reason = None
    if view.error is not None:
        reason = BuildStatusReason(message=view.error, step=view.error_step)
    return TemplateBuildInfo(template_id=view.template_id, build_id=view.build_id, status=view.status,
                             logs=[f"{e.timestamp.isoformat()} {e.message}" for e in view.entries],
                             log_entries=entries, reason=reason)


async def get_template_files(api: ApiContext, templateID: str, hash: str) -> TemplateFileUpload:
    templates = api.sandboxes.templates
    if (templates.files_dir / f"{hash}.tar").is_file():
        touch([templates.files_dir / f"{hash}.tar"])  # the build that follows uses it: its expiry starts again
        return TemplateFileUpload(present=True)
    base = request.host_url.rstrip("/")
    url = f"{base}/templates/{templateID}/files/{hash}?token={_upload_token(api, templateID, hash)}"
    return TemplateFileUpload(present=False, url=url)


async def upload_template_files(api: ApiContext, templateID: str, hash: str, query: UploadQuery) -> None:
    """The hash's format is checked by the app (the route's path pattern), the token here."""
    if not hmac.compare_digest(query.token.encode(), _upload_token(api, templateID, hash).encode()):
        raise ApiError(401, "invalid or missing upload token")
    files_dir: Path = api.sandboxes.templates.files_dir
    files_dir.mkdir(parents=True, exist_ok=True)
    tmp = files_dir / f".{hash}.{secrets.token_hex(4)}.part"
    try:
        with tmp.open("wb") as f:
            async for chunk in request.body:
                await trio.to_thread.run_sync(f.write, chunk)
        await trio.to_thread.run_sync(_finish_upload, tmp, files_dir / f"{hash}.tar")
    finally:
        tmp.unlink(missing_ok=True)


def _finish_upload(tmp: Path, final: Path) -> None:
    """Store the archive as a plain tar (the SDK gzips by default); atomically, so a build never sees half."""
    with tmp.open("rb") as f:
        gzipped = f.read(2) == b"\x1f\x8b"
    if gzipped:
        plain = tmp.with_suffix(".tar.part")
        try:
            with gzip.open(tmp, "rb") as src, plain.open("wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
        except (OSError, EOFError) as exc:
            plain.unlink(missing_ok=True)
            raise ApiError(400, f"the uploaded archive is not a valid gzip stream: {exc}") from None
        os.replace(plain, final)
    else:
        os.replace(tmp, final)


HANDLERS: dict[str, Handler] = {
    "create_template": create_template,
    "start_template_build": start_template_build,
    "get_template_build_status": get_template_build_status,
    "get_template_files": get_template_files,
    "upload_template_files": upload_template_files,
}
