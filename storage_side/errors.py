"""Errors a request can end in, each with the HTTP status and code it is answered with."""

from __future__ import annotations


class RequestError(ValueError):
    """The request is well-formed JSON but asks for something this node cannot do (now)."""

    def __init__(self, status: int, code: str, message: str, **extra: object) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.extra = extra  # more fields for the JSON body
        self.headers: dict[str, str] = {}


class Busy(RequestError):
    """Not enough memory now: 503, and when to come back."""

    def __init__(self, code: str, message: str, retry_after_s: int) -> None:
        super().__init__(503, code, message, retry_after_s=retry_after_s)
        self.headers = {"Retry-After": str(retry_after_s)}
