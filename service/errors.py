"""Errors as OpenAI sends them: ``{"error": {message, type, param, code}}``, right status."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec
from starlette.responses import Response

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """A request that ends in an error response; raised anywhere in a handler."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, code=self.code, param=self.param)

    def response(self) -> Response:
        return Response(
            msgspec.json.encode(self.body()),
            status_code=self.status,
            headers=self.headers,
            media_type="application/json",
        )


def error_body(
    status: int, message: str, *, code: str | None = None, param: str | None = None
) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": ERROR_TYPES.get(status, "invalid_request_error"),
            "param": param,
            "code": code,
        }
    }
