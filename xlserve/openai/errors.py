"""API errors in the OpenAI error shape, with the status that names the problem."""

from __future__ import annotations

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               413: "request_too_large", 415: "unsupported_media_type", 421: "misdirected_request",
               429: "rate_limit_error", 500: "internal_error", 502: "upstream_error", 503: "service_unavailable"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "error"),
                      "param": param, "code": code or status}}
