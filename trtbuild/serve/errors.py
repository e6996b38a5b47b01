"""HTTP errors in OpenAI's JSON shape: ``{"error": {"message", "type", "param", "code"}}`` with a status."""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse


class APIError(Exception):
    """An error answered to the client; never a crash of the server."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """400 invalid_request_error."""
    return APIError(400, message, param=param, code=code)


def unauthorized() -> APIError:
    return APIError(
        401,
        "missing or wrong API key: send 'Authorization: Bearer <key>'",
        type="authentication_error",
        code="invalid_api_key",
    )


def too_large(limit: int) -> APIError:
    return APIError(413, f"request body larger than {limit} bytes", code="request_too_large")


def overloaded(retry_after: int) -> APIError:
    return APIError(
        429,
        "the server's queue is full; retry later",
        type="rate_limit_error",
        code="queue_full",
        headers={"Retry-After": str(retry_after)},
    )


def unavailable() -> APIError:
    return APIError(503, "the server is shutting down", type="service_unavailable", code="shutting_down")


def internal(message: str) -> APIError:
    return APIError(500, message, type="internal_error", code="internal_error")
