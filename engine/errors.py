"""The one exception family the engine raises; the HTTP layer maps `http_status` to a response."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")


class CosyVoiceError(Exception):
    """Base of every error the engine raises on purpose. `http_status` tells the server what to answer."""

    http_status = 500

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidInputError(CosyVoiceError):
    """The request itself is wrong: empty or over-long text, bad option values."""

    http_status = 400


class UnknownVoiceError(CosyVoiceError):
    """The requested voice (speaker id) does not exist in this model."""

    http_status = 404


class CheckpointError(CosyVoiceError):
    """A model directory or checkpoint file is missing, malformed or does not match its config."""

    http_status = 500


class NonFiniteOutputError(CosyVoiceError):
    """A stage produced NaN or inf; returned as an error, never as audio."""

    http_status = 500


class TextTooLongError(CosyVoiceError):
    """The text has more tokens than its bound, in all or in one sentence: refused before the encoder works on it
    (its memory grows with the square of a sentence's tokens)."""

    http_status = 413


class RequestTooLargeError(CosyVoiceError):
    """The request needs more decoder memory than the replica's whole budget: it could never be admitted."""

    http_status = 413


class DecodeLimitError(CosyVoiceError):
    """The request passed a decoding ceiling: its audio length or its wall-clock time (the decoder's settings)."""

    http_status = 413


class RequestFailedError(CosyVoiceError):
    """An unexpected fault while decoding this request alone (a bug its input hit): it ends, the others go on."""

    http_status = 500


class UnavailableError(CosyVoiceError):
    """The decoder cannot take requests now (its loop failed and the replica is being replaced): retry."""

    http_status = 503


def as_request_error(exc: Exception) -> CosyVoiceError:
    """The error that ends one request for `exc`: an engine error as it is, anything else a RequestFailedError whose
    cause is `exc` (for the log; the client learns only that decoding failed)."""
    if isinstance(exc, CosyVoiceError):
        return exc
    error = RequestFailedError(f"decoding this request failed ({type(exc).__name__})")
    error.__cause__ = exc
    return error


def isolate_failures(
    items: list[T],
    run: Callable[[list[T]], list[R]],
    fail: Callable[[T, CosyVoiceError], list[R]],
    undo: Callable[[T], None] = lambda _: None,
) -> list[R]:
    """`run(items)` (a batch); if it raises, `undo` each item (put back what the failed run changed) and run each item
    alone: an item that fails alone gives `fail(item, its error)`, so one request's fault fails that request only.
    When every item succeeds alone (the batch as a whole was at fault, e.g. its size), the single runs stand."""
    try:
        return run(items)
    except Exception as exc:
        for item in items:
            undo(item)
        if len(items) == 1:
            return fail(items[0], as_request_error(exc))
    results: list[R] = []
    for item in items:
        try:
            results += run([item])
        except Exception as exc:
            undo(item)
            results += fail(item, as_request_error(exc))
    return results
