"""OpenAI's Files and Batches API over HTTP (FastAPI): the routes, authentication and limits.

    POST /v1/files (multipart: file, purpose=batch)      GET /v1/files, /v1/files/{id}, /v1/files/{id}/content
    DELETE /v1/files/{id}                                 POST /v1/batches, GET /v1/batches (after, limit)
    GET /v1/batches/{id}                                  POST /v1/batches/{id}/cancel

Errors have OpenAI's shape (``{"error": {"message", "type", "param", "code"}}``) and status codes (400, 401, 404), so
the official client raises its own exceptions. Every request needs ``Authorization: Bearer <key>`` with one of the
server's keys (compared in constant time) unless the server runs without auth; what a key creates only that key
can see.
"""
from __future__ import annotations

import hashlib
import hmac
import json

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response

from pipeline.serve.store import Store
from pipeline.serve.worker import ENDPOINTS, MAX_BYTES, MAX_LINES

MAX_JSON_BYTES = 1 << 20          # a batch-creation body


class ApiError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.code, self.param, self.kind = status, message, code, param, kind


def _error(status: int, message: str, code=None, param=None, kind="invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status_code=status)


def create_app(store: Store, api_keys: list[str] | None, window: str = "24h", window_s: float = 86400) -> FastAPI:
    """``api_keys`` None: no authentication (the caller allows it only on a loopback host)."""
    app = FastAPI(title="batchgen", docs_url=None, redoc_url=None, openapi_url=None)
    _error_handlers(app)
    owner = _authenticator([k.encode() for k in api_keys] if api_keys is not None else None)
    _file_routes(app, store, owner)
    _batch_routes(app, store, owner, window, window_s)
    return app


def _error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_, e: ApiError):
        return _error(e.status, e.message, e.code, e.param, e.kind)

    @app.exception_handler(RequestValidationError)
    async def _bad_request(_, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        where = ".".join(str(x) for x in first.get("loc", ())[1:]) or None
        return _error(400, f"{where or 'request'}: {first.get('msg', 'invalid request')}", "invalid_request", where)


def _authenticator(keys: list[bytes] | None):
    """``owner(request)``: the hash of the request's key (401 unless it is one of ``keys``); "" without keys."""
    def owner(request: Request) -> str:
        if keys is None:
            return ""
        auth = request.headers.get("authorization", "")
        token = auth[7:].encode() if auth.lower().startswith("bearer ") else b""
        ok = False
        for k in keys:                      # every key compared, in constant time each
            ok |= hmac.compare_digest(token, k)
        if not token or not ok:
            raise ApiError(401, "Incorrect API key provided.", "invalid_api_key", kind="authentication_error")
        return hashlib.sha256(token).hexdigest()
    return owner


def _not_found(what: str, ident: str) -> ApiError:
    return ApiError(404, f"No such {what}: '{ident[:64]}'", f"{what}_not_found" if what == "batch" else None, "id")


def _found(obj: dict | None, what: str, ident: str) -> dict:
    """``obj``, or a 404 naming ``what`` (another key's object is not found either)."""
    if obj is None:
        raise _not_found(what, ident)
    return obj


def _file_routes(app: FastAPI, store: Store, owner) -> None:
    @app.post("/v1/files")
    async def upload(request: Request):
        who = owner(request)
        size = int(request.headers.get("content-length") or 0)
        if size > MAX_BYTES + (1 << 20):
            raise ApiError(400, f"File is too large: at most {MAX_BYTES // 2**20} MB", "file_too_large", "file")
        form = await request.form(max_files=1, max_fields=4)
        purpose, upload = form.get("purpose"), form.get("file")
        if purpose != "batch":
            raise ApiError(400, f"purpose must be 'batch', got {purpose!r}", "invalid_purpose", "purpose")
        if upload is None or isinstance(upload, str):
            raise ApiError(400, "a file is required", "missing_required_parameter", "file")
        fid = store.new_file_id()
        path = store.file_path(fid)
        tmp = path.with_name(path.name + ".tmp")
        n, lines = 0, 0
        try:
            with open(tmp, "wb") as fh:
                while chunk := await upload.read(1 << 20):
                    n += len(chunk)
                    if n > MAX_BYTES:
                        raise ApiError(400, f"File is too large: at most {MAX_BYTES // 2**20} MB", "file_too_large",
                                       "file")
                    lines += chunk.count(b"\n")
                    fh.write(chunk)
            if lines > MAX_LINES + 1:
                raise ApiError(400, f"File has {lines} lines; a batch input holds at most {MAX_LINES}",
                               "too_many_lines", "file")
            tmp.replace(path)
        finally:
            tmp.unlink(missing_ok=True)
        name = (upload.filename or "upload.jsonl").replace("/", "_")[:255]
        return store.add_file(fid, who, name, n, "batch")

    @app.get("/v1/files")
    async def list_files(request: Request):
        return {"object": "list", "data": store.list_files(owner(request)), "has_more": False}

    @app.get("/v1/files/{file_id}")
    async def get_file(file_id: str, request: Request):
        return _found(store.get_file(file_id, owner(request)), "file", file_id)

    @app.get("/v1/files/{file_id}/content")
    async def file_content(file_id: str, request: Request):
        _found(store.get_file(file_id, owner(request)), "file", file_id)
        return Response(store.file_path(file_id).read_bytes(), media_type="application/jsonl")

    @app.delete("/v1/files/{file_id}")
    async def delete_file(file_id: str, request: Request):
        if not store.delete_file(file_id, owner(request)):
            raise _not_found("file", file_id)
        return {"id": file_id, "object": "file", "deleted": True}



def _batch_routes(app: FastAPI, store: Store, owner, window: str, window_s: float) -> None:
    @app.post("/v1/batches")
    async def create_batch(request: Request):
        who = owner(request)
        raw = await request.body()
        if len(raw) > MAX_JSON_BYTES:
            raise ApiError(400, "request body too large", "invalid_request")
        try:
            body = json.loads(raw)
        except ValueError:
            raise ApiError(400, "the request body is not valid JSON", "invalid_request") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object", "invalid_request")
        fid, endpoint = body.get("input_file_id"), body.get("endpoint")
        if not isinstance(fid, str) or store.get_file(fid, who) is None:
            raise ApiError(400, f"input_file_id {fid!r} is not a file of yours", "invalid_request", "input_file_id")
        if endpoint not in ENDPOINTS:
            raise ApiError(400, f"endpoint {endpoint!r} is not supported (supported: {', '.join(ENDPOINTS)})",
                           "invalid_request", "endpoint")
        if body.get("completion_window") != window:
            raise ApiError(400, f"completion_window must be {window!r}", "invalid_request", "completion_window")
        meta = body.get("metadata")
        if meta is not None and (not isinstance(meta, dict) or len(meta) > 16 or any(
                not isinstance(k, str) or len(k) > 64 or not isinstance(v, str) or len(v) > 512
                for k, v in meta.items())):
            raise ApiError(400, "metadata: at most 16 string keys (64 chars) with string values (512 chars)",
                           "invalid_request", "metadata")
        return store.add_batch(who, fid, endpoint, window, window_s, meta)

    @app.get("/v1/batches")
    async def list_batches(request: Request, after: str | None = None, limit: int = 20):
        if not 1 <= limit <= 100:
            raise ApiError(400, "limit must be between 1 and 100", "invalid_request", "limit")
        data, more = store.list_batches(owner(request), after, limit)
        return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None, "has_more": more}

    @app.get("/v1/batches/{batch_id}")
    async def get_batch(batch_id: str, request: Request):
        return _found(store.get_batch(batch_id, owner(request)), "batch", batch_id)

    @app.post("/v1/batches/{batch_id}/cancel")
    async def cancel_batch(batch_id: str, request: Request):
        who = owner(request)
        b = _found(store.get_batch(batch_id, who), "batch", batch_id)
        if not store.cancel(batch_id) and b["status"] not in ("cancelling", "cancelled"):
            raise ApiError(409, f"Cannot cancel a batch with status '{b['status']}'.", "invalid_state")
        return store.get_batch(batch_id, who)


__all__ = ["create_app", "ApiError"]
