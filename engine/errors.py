"""The one exception family the engine raises; the HTTP layer maps `http_status` to a response."""

from __future__ import annotations


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


class RequestTooLargeError(CosyVoiceError):
    """The request needs more decoder memory than the replica's whole budget: it could never be admitted."""

    http_status = 413
