"""The one error body every 4xx / 5xx answer carries, and the exception that produces it.

{"error": "too_many_rows", "message": "...", "field": "query", "column": null, "row": null,
 "limit": 10000, "details": null}: `error` is a stable code for programs, `message` a sentence for
people, and field / column / row / limit say where, whenever the server knows.
"""
from __future__ import annotations

from typing import Any


class ApiError(Exception):
    """A request the server refuses: HTTP `status` with the JSON error body (no traceback)."""

    def __init__(self, status: int, error: str, message: str, *, field: str | None = None,
                 column: str | None = None, row: int | None = None, limit: float | None = None,
                 details: list[dict[str, Any]] | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.error, self.message = status, error, message
        self.field, self.column, self.row, self.limit, self.details = field, column, row, limit, details
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": self.error, "message": self.message, "field": self.field, "column": self.column,
                "row": self.row, "limit": self.limit, "details": self.details}


def error_body(error: str, message: str, **where: Any) -> dict[str, Any]:
    """The error body for `error` without raising (middleware answers)."""
    return ApiError(0, error, message, **where).body()


def too_large(field: str, what: str, n: int, limit: int, flag: str, column: str | None = None) -> ApiError:
    """413 for a table over one of the server's limits, naming the flag that sets it."""
    where = f" column {column!r}:" if column is not None else ""
    return ApiError(413, f"too_many_{what.replace(' ', '_')}",
                    f"{field}:{where} {n} {what}, over this server's limit of {limit} (tabfm serve {flag})",
                    field=field, column=column, limit=limit)


def invalid(message: str, *, field: str | None = None, column: str | None = None, row: int | None = None,
            error: str = "invalid_table", limit: float | None = None) -> ApiError:
    """422 for a well-formed request whose content the model cannot take."""
    return ApiError(422, error, message, field=field, column=column, row=row, limit=limit)
