"""Errors as the OpenAI API reports them: ``{"error": {message, type, param, code}}``
with the HTTP status that fits. Every non-2xx answer of the server goes through
``error_response``; handlers installed by ``install_error_handlers`` make sure
FastAPI's own errors (validation, malformed JSON, unknown routes) do too."""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    499: "client_closed_request",
    500: "internal_server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An error to answer with; raise it anywhere below a route."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {
        "error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"), "param": param, "code": code}
    }


def error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status)


_LEADING_NAME = re.compile(r"^([A-Za-z_][\w.\[\]]*)(?::| must| token id)")


def bad_request(exc: ValueError, renames: dict[str, str] | None = None) -> APIError:
    """A 400 for a ValueError from the runtime's validation, whose message starts
    with the offending field's name (``"top_p must be in (0, 1]"``,
    ``"max_new_tokens: prompt ... exceeds"``). ``renames`` maps the runtime's
    names to the API's (``max_new_tokens`` -> ``max_tokens``)."""
    message = str(exc)
    match = _LEADING_NAME.match(message)
    if match is None:
        return APIError(400, message)
    name = match.group(1)
    param = (renames or {}).get(name, name)
    return APIError(400, param + message[len(name) :], param=param)


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "none"})


def _is_type_tag(part: str) -> bool:
    """Pydantic puts the tried member of a union in ``loc`` (``str``, ``list[int]``,
    ``constrained-int``)."""
    return "[" in part or part.startswith(("function-", "constrained-")) or part in _TYPE_TAGS


def _loc_to_param(loc: tuple[Any, ...]) -> str | None:
    """``("body", "messages", 0, "role")`` -> ``"messages[0].role"``."""
    parts = [p for p in loc if p not in ("body", "query", "path")]
    param = ""
    for part in parts:
        if isinstance(part, int):
            param += f"[{part}]"
        elif not _is_type_tag(str(part)):
            param += ("." if param else "") + str(part)
    return param or None


def _error_param(error: Mapping[str, Any]) -> str | None:
    """The field at fault: named by the validator in ``ctx["param"]`` when the
    error's location cannot say it (a check of the whole body), else its location."""
    ctx = error.get("ctx") or {}
    param = ctx.get("param")
    if isinstance(param, str):
        return param
    return _loc_to_param(tuple(error.get("loc", ())))


def validation_summary(errors: Sequence[Mapping[str, Any]]) -> tuple[str | None, str]:
    """The param and message of a 400 for pydantic's errors. A value that matches
    no member of a union gets one error per member; the deepest location is the
    most specific (``messages[0].content[0].type`` over ``messages[0].content``),
    and the messages of all the members tried there are joined with "or"."""
    if not errors:
        return None, "invalid request"
    params = [_error_param(e) for e in errors]
    depth = [len(re.findall(r"[.\[]", p)) + 1 if p else 0 for p in params]
    chosen = params[depth.index(max(depth))]
    messages: list[str] = []
    for error, param in zip(errors, params, strict=True):
        if param == chosen:
            message = "field required" if error.get("type") == "missing" else error.get("msg", "invalid value")
            if message not in messages:
                messages.append(message)
    return chosen, " or ".join(messages)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param, exc.code)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        # Malformed JSON lands here too (pydantic error type "json_invalid").
        errors = exc.errors()
        if errors and errors[0].get("type") == "json_invalid":
            return error_response(400, f"the request body is not valid JSON: {errors[0].get('msg', '')}")
        param, message = validation_summary(errors)
        return error_response(400, f"{param}: {message}" if param else message, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("internal error serving %s %s", request.method, request.url.path)
        return error_response(500, f"internal server error: {type(exc).__name__}: {exc}")
