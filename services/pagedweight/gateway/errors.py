"""Errors as the OpenAI API shapes them: `{"error": {"message", "type", "param", "code"}}`.

`code` is the HTTP status, as vLLM sends it. The status tells a client what to do: 4xx
means fix the request; 503 means this instance cannot take it now and a load balancer
should try another (queue full, no worker ready).
"""

from __future__ import annotations

import json
from http import HTTPStatus

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    408: "RequestTimeoutError",
    413: "RequestTooLargeError",  # not a BadRequestError: the request may be right, only too big
    429: "RateLimitError",
    431: "RequestHeaderFieldsTooLargeError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class APIError(Exception):
    """An error answered to the client; raised anywhere below the routes."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param)


def _printable(text: str | None) -> str | None:
    # a message may quote client input: lone surrogates in it must not break the JSON encoder
    return None if text is None else text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_body(status: int, message: str, param: str | None = None) -> dict:
    message, param = _printable(message), _printable(param)
    kind = ERROR_TYPES.get(status) or HTTPStatus(status).phrase.replace(" ", "") + "Error"
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def error_response(status: int, message: str, param: str | None = None, headers=None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)


def sse_error_event(err: APIError) -> str:
    """A mid-stream error, as vLLM sends it: one data event with the error body."""
    return f"data: {json.dumps(err.body())}\n\n"


async def api_error_handler(_: Request, err: APIError) -> JSONResponse:
    return error_response(err.status, err.message, err.param)


async def http_error_handler(_: Request, err: HTTPException) -> JSONResponse:
    """Errors the framework raises itself (an unparseable body such as 5,000 nested
    brackets, an unknown route, a wrong method) in the same body shape as ours."""
    return error_response(err.status_code, str(err.detail), headers=getattr(err, "headers", None))


async def validation_error_handler(_: Request, err: RequestValidationError) -> JSONResponse:
    """Malformed JSON and wrong types: 400 naming the first field at fault ("body" when the
    fault is the body as a whole: empty, not JSON, not an object)."""
    first = err.errors()[0] if err.errors() else {}
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    if first.get("type") == "json_invalid":
        return error_response(400, f"the request body is not valid JSON: {first.get('msg', '')}", "body")
    if first.get("type") == "missing" and not loc:
        return error_response(400, "the request body is empty: send a JSON object", "body")
    param = ".".join(loc) or "body"
    message = f"{param}: {first.get('msg', 'invalid value')}" if param else first.get("msg", "invalid request")
    return error_response(400, message, param)
