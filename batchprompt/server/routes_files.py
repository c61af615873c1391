"""OpenAI's Files routes, for the Batch API:

    POST   /v1/files                multipart/form-data: file, purpose=batch  -> File
    GET    /v1/files                after, limit (1-10000), order (desc|asc), purpose -> list
    GET    /v1/files/{id}           File
    GET    /v1/files/{id}/content   the bytes (a running batch's output: its rows so far)
    DELETE /v1/files/{id}           {"id", "object": "file", "deleted": true}

Uploads are at most --max-file-bytes (default 200 MB, OpenAI's limit)."""
from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, Response
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from . import batch_files
from .batch_api import BatchApi
from .batch_store import UnknownCursor
from .errors import ApiError
from .schemas import CLIENT_GONE, query_int

router = APIRouter()
CONTENT_TYPE = "application/octet-stream"


def batch_api(request: Request) -> BatchApi:
    return request.app.state.server.batch_api


@router.post("/v1/files")
async def upload(request: Request) -> dict:
    api = batch_api(request)
    try:
        form = await request.form(max_files=1, max_fields=16)
    except ClientDisconnect:
        raise ApiError(CLIENT_GONE, "the client went away while sending the file", "client_disconnected") from None
    except HTTPException as e:  # Starlette's multipart parser: two files, a broken body, a part too large
        raise ApiError(e.status_code, f"the upload cannot be read as multipart/form-data: {e.detail} Send one file "
                                      f"in a field named file, with purpose=batch (client.files.create(file=open(path, "
                                      f"'rb'), purpose='batch'))", "invalid_multipart", "file") from None
    try:
        upload = form.get("file")
        if isinstance(upload, str):  # a part without a filename is a text field to multipart
            raise ApiError(400, "the file part has no filename, so it arrived as a text field: give it a filename "
                                "(client.files.create(file=('requests.jsonl', data), purpose='batch'), or curl's "
                                "-F file=@requests.jsonl)", "missing_file", "file")
        if not isinstance(upload, UploadFile):
            raise ApiError(400, "send the file as multipart/form-data, in a field named file, with purpose=batch "
                                "(client.files.create(file=open(path, 'rb'), purpose='batch'))", "missing_file", "file")
        purpose = batch_files.check_purpose(form.get("purpose"))
        # As the openai client sends expires_after in a form: expires_after[anchor], expires_after[seconds].
        # Another shape (expires_after={...}, expires_after[x]) was ignored: the file never expired.
        odd = sorted(k for k in form.keys() if k.startswith("expires_after")
                     and k not in ("expires_after[anchor]", "expires_after[seconds]"))
        if odd:
            raise ApiError(400, f"{odd[0]} is not how expires_after is sent: give the form fields "
                                f"expires_after[anchor]=created_at and expires_after[seconds]=N (as the openai client "
                                f"sends files.create(..., expires_after={{...}}))", "invalid_parameter", "expires_after")
        expires_s = batch_files.expires_after(form.get("expires_after[anchor]"), form.get("expires_after[seconds]"),
                                              "expires_after")
        size = await asyncio.to_thread(_size, upload)
        limit = api.config.max_file_bytes
        if size > limit:
            raise ApiError(413, f"the file is {size:,} bytes; this server takes at most {limit:,} (its "
                                f"--max-file-bytes): split the requests into several batches", "file_too_large", "file")
        if size == 0:
            raise ApiError(400, "the file is empty: give one JSON request per line", "empty_file", "file")
        file_id = batch_files.new_file_id()
        path = api.dir.file_path(file_id)
        await asyncio.to_thread(batch_files.save_upload, upload.file, path)
        record = batch_files.new_record(file_id, upload.filename or "", purpose, size, expires_s=expires_s)
        try:
            await asyncio.to_thread(api.store.add_file, record)
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        return batch_files.file_json(record)
    finally:
        await form.close()


def _size(upload: UploadFile) -> int:
    upload.file.seek(0, 2)
    return upload.file.tell()


@router.get("/v1/files")
async def list_files(request: Request) -> dict:
    api = batch_api(request)
    limit = query_int(request, "limit", 10000, 1, 10000)
    order = request.query_params.get("order", "desc")
    if order not in ("asc", "desc"):
        raise ApiError(400, f"order must be asc or desc, got {order!r}", "invalid_parameter", "order")
    after, purpose = request.query_params.get("after"), request.query_params.get("purpose")
    try:
        records, more = await asyncio.to_thread(api.store.list_files, after, limit, order, purpose)
    except UnknownCursor:
        raise ApiError(400, f"after={after!r} names no file; give the id of the last file of the previous page",
                       "invalid_cursor", "after") from None
    data = [await api.file_object(r) for r in records]
    return page(data, more)


def page(data: list[dict], more: bool) -> dict:
    """OpenAI's list object (the client's cursor pages read `has_more` and the last id)."""
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": more}


@router.get("/v1/files/{file_id}")
async def get_file(file_id: str, request: Request) -> dict:
    api = batch_api(request)
    return await api.file_object(await api.get_file(file_id))


@router.get("/v1/files/{file_id}/content")
async def file_content(file_id: str, request: Request) -> Response:
    api = batch_api(request)
    record = await api.get_file(file_id)
    live = await api.live_content(record)
    if live is not None:
        return Response(live, media_type=CONTENT_TYPE)
    path = api.dir.file_path(record["id"])
    if not path.is_file():
        if record["kind"] is not None:  # a batch's output or error file, never written: the batch failed
            raise ApiError(404, f"the {record['kind']} file {file_id} of the batch {record['batch_id']} was not "
                                f"written (the batch failed: its errors say why)", "file_not_found", "file_id")
        raise ApiError(404, f"the contents of the file {file_id} are missing from {api.dir.files} (removed by "
                            f"hand?); delete the file and upload it again", "file_not_found", "file_id")
    return FileResponse(path, media_type=CONTENT_TYPE)


@router.delete("/v1/files/{file_id}")
async def delete_file(file_id: str, request: Request) -> dict:
    return await batch_api(request).delete_file(file_id)
