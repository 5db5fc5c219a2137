"""What the app args (`serve_app.args`) allow of a request and its caller: limits, API keys, the OpenAI names,
provisioned voices."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import ClassVar

from pydantic import Field, SecretStr, model_validator

from engine.voices.cloning import (
    MAX_PROMPT_AUDIO_BYTES,
    MAX_PROMPT_CHANNELS,
    MAX_PROMPT_SECONDS,
    MIN_PROMPT_SECONDS,
    PROMPT_SAMPLE_RATES,
)
from engine.voices.registry import provisioned_voice_id
from engine.voices.store import is_store_url
from serve_app.args_base import StrictArgs

# Tokens an input may have per character of `max_input_chars` (the model's tokenizer on the text as sent): Chinese
# takes ~1.1 a character, English ~0.25, emoji 2 and rare scripts up to 4, so a text of emoji or rare script is
# refused before its length in characters would be.
TOKENS_PER_INPUT_CHAR = 1.5


class LimitsArgs(StrictArgs):
    REMOVED_FIELDS: ClassVar[Mapping[str, str]] = {
        "health_timeout_s": "the health probes wait a fixed 2 s for a stage to answer "
        "(serve_app.health_routes.HEALTH_PROBE_TIMEOUT_S): a live one answers in milliseconds",
        "max_input_tokens": f"derived: {TOKENS_PER_INPUT_CHAR:g} x max_input_chars (LimitsArgs.max_input_tokens)",
        "max_prompt_audio_channels": f"the speech tokenizer's bound, {MAX_PROMPT_CHANNELS} "
        "(engine.voices.cloning.MAX_PROMPT_CHANNELS)",
        "body_read_timeout_s": "fixed at 10 s (serve_app.guard.BODY_READ_IDLE_S): a client that stalls mid-body "
        "longer gets 408 and frees its ingress slot",
        "body_read_deadline_s": "fixed at 120 s (serve_app.guard.BODY_READ_DEADLINE_S): the largest body, a 10 MiB "
        "voice upload, arrives in it at 0.7 Mbit/s",
        "retry_after_s": "fixed at 1 s (serve_app.errors.RETRY_AFTER_S): Retry-After is in whole seconds, and a "
        "slot frees as soon as any request ends",
        "text_stream_idle_s": "fixed at 60 s (serve_app.text_stream.TEXT_STREAM_IDLE_S): a client between sentences "
        "sends text well within it, and a forgotten socket gives its ingress slot back within a minute",
        "reroute_s": "fixed at 30 s (serve_app.synthesis.REROUTE_S): it covers Ray declaring a lost node dead and a "
        "replacement's start (10-24 s measured, docs/reliability.md)",
        "max_text_streams_per_key": "derived: half of max_concurrent_requests_per_key, at least 1, or no bound of "
        "its own where that is None (LimitsArgs.max_text_streams_per_key)",
        "max_prompt_audio_bytes": f"fixed at {MAX_PROMPT_AUDIO_BYTES >> 20} MiB "
        "(engine.voices.cloning.MAX_PROMPT_AUDIO_BYTES): the longest recording allowed, as uncompressed WAV",
        "max_prompt_audio_s": f"fixed at {MAX_PROMPT_SECONDS:g} s (engine.voices.cloning.MAX_PROMPT_SECONDS): the "
        "speech tokenizer's limit",
        "min_prompt_audio_s": f"fixed at {MIN_PROMPT_SECONDS:g} s (engine.voices.cloning.MIN_PROMPT_SECONDS): "
        "a shorter recording holds barely a word of the voice",
        "prompt_audio_sample_rates": f"fixed at {', '.join(map(str, PROMPT_SAMPLE_RATES))} Hz "
        "(engine.voices.cloning.PROMPT_SAMPLE_RATES): each resamples to the models' rates in bounded memory",
    }

    max_input_chars: int = Field(4096, ge=1, description="longer inputs are rejected with 400")
    long_text_chars: int = Field(300, ge=1, description="inputs longer than this take the streaming path")
    max_body_bytes: int = Field(1 << 20, ge=1, description="larger request bodies are rejected with 413")
    max_stream_s: float = Field(
        300.0,
        gt=0,
        description="wall-clock seconds one decoder call (a stream, or a sentence of a whole request) may take from "
        "its arrival at the decoder; past it, it ends with 413 and frees its slot",
    )
    max_audio_s: float = Field(
        600.0,
        gt=0,
        description="seconds of speech one decoder call (a stream, or a sentence of a whole request) may make; past "
        "it, it ends with 413 and frees its slot (sampling.max_token_text_ratio also bounds it per text length)",
    )
    # Voice registration (POST /v1/voices): the registry.
    max_voices: int = Field(100, ge=1, description="registered voices at most; past it, registering answers 409")
    max_voices_per_key: int | None = Field(
        20,
        ge=1,
        description="with API keys on, registered voices one key may own (shared ones count for none); past it, "
        "registering answers 409; None: only max_voices",
    )
    max_text_streams: int = Field(
        32,
        ge=1,
        description="text streams one ingress replica holds at once; one more is refused at its handshake with 503 "
        "(1013 where the handshake cannot be answered). Below deployment TTSIngress's max_ongoing_requests (64 by "
        "default), so that sockets never take the slots plain requests need",
    )
    max_concurrent_requests_per_key: int | None = Field(
        8,
        ge=1,
        description="with API keys on, requests one key may have in flight in one ingress replica (a stream until "
        "its end); more: 429 + Retry-After; None: no limit",
    )

    @property
    def max_text_streams_per_key(self) -> int | None:
        """With API keys on, the text streams one key may hold at once in one ingress replica (one more: 503): half
        its requests in flight (at least 1), which count them too, so its streams leave it room for plain requests;
        None (no bound of its own) where those have none."""
        per_key = self.max_concurrent_requests_per_key
        return None if per_key is None else max(1, per_key // 2)

    @property
    def max_input_tokens(self) -> int:
        """Inputs with more tokens (a CosyVoice2/3 text stream's pieces in all, a v1 one's each sentence) are refused
        with 413 before anything else is done with them."""
        return int(TOKENS_PER_INPUT_CHAR * self.max_input_chars)


# The environment variables the ingress replicas read more keys from (comma-separated): the one every cluster profile,
# the launcher (ray_cluster.yaml) and the KubeRay manifest set, and its admin twin. Keys stay out of config files.
API_KEYS_ENV = "COSYVOICE_API_KEYS"
ADMIN_KEYS_ENV = "COSYVOICE_ADMIN_KEYS"


class SecurityArgs(StrictArgs):
    REMOVED_FIELDS: ClassVar[Mapping[str, str]] = {
        "api_keys_env": f"fixed at {API_KEYS_ENV} (serve_app.request_args.API_KEYS_ENV): the variable every cluster "
        "profile, the launcher and the KubeRay manifest set; keys stay out of config files",
        "admin_keys_env": f"fixed at {ADMIN_KEYS_ENV} (serve_app.request_args.ADMIN_KEYS_ENV), beside {API_KEYS_ENV}",
    }

    api_keys: tuple[SecretStr, ...] = Field(
        (),
        description=f"bearer tokens accepted on every endpoint but /healthz (and those, comma-separated, of the "
        f"ingress replicas' {API_KEYS_ENV} environment variable)",
    )
    admin_keys: tuple[SecretStr, ...] = Field(
        (),
        description="bearer tokens accepted like api_keys that also see, use and delete every registered voice "
        f"(other keys: only their own and the shared ones); more, comma-separated, in {ADMIN_KEYS_ENV}",
    )
    allowed_model_roots: tuple[str, ...] | None = Field(
        None, description="directories a model dir must lie in (symlinks resolved); None: any path without '..'"
    )
    allowed_hosts: tuple[str, ...] | None = Field(
        None,
        description="Host header names (without port) the server answers, '*' for any; others get 421 (DNS "
        "rebinding). None: without API keys localhost, 127.0.0.1, [::1] and the HTTP host Serve binds; with keys any",
    )
    allowed_origins: tuple[str, ...] = Field(
        (),
        description="browser origins (scheme://host[:port]) besides the server's own that may POST or DELETE on a "
        "server without API keys, '*' for any; other cross-origin writes get 403 (cross-site request forgery)",
    )


# OpenAI's speech voices. The presets' built-in speakers are dummy_female and dummy_male: OpenAI's voices split
# between them by the register OpenAI describes (an official model dir names its own speakers in `openai.voices`).
OPENAI_VOICE_NAMES = (
    "alloy",
    "ash",
    "ballad",
    "coral",
    "echo",
    "fable",
    "onyx",
    "nova",
    "sage",
    "shimmer",
    "verse",
    "marin",
    "cedar",
)

DEFAULT_OPENAI_VOICES = {
    "alloy": "dummy_female",
    "ash": "dummy_male",
    "ballad": "dummy_male",
    "coral": "dummy_female",
    "echo": "dummy_male",
    "fable": "dummy_male",
    "onyx": "dummy_male",
    "nova": "dummy_female",
    "sage": "dummy_female",
    "shimmer": "dummy_female",
    "verse": "dummy_male",
    "marin": "dummy_female",
    "cedar": "dummy_male",
}

# OpenAI's speech models: the `model` names its clients send, accepted (and listed) besides the served model's own.
OPENAI_TTS_MODELS = ("tts-1", "tts-1-hd", "gpt-4o-mini-tts")


class OpenAIArgs(StrictArgs):
    """What lets code written for OpenAI's speech endpoint run unchanged: its model and voice names, and instructions
    that a voice cannot follow."""

    REMOVED_FIELDS: ClassVar[Mapping[str, str]] = {
        "model_aliases": f"fixed at {', '.join(OPENAI_TTS_MODELS)} (serve_app.request_args.OPENAI_TTS_MODELS): the "
        "names OpenAI's clients send; any other client names the served model (served_model_name)",
    }

    voices: dict[str, str] = Field(
        default_factory=lambda: dict(DEFAULT_OPENAI_VOICES),
        description="voice name -> a built-in speaker or registered voice id of the served model",
    )
    strict_instructions: bool = Field(
        False,
        description="answer 400 to `instructions` the voice cannot follow (/v1/audio/speech, the text stream's "
        "start); false: speak the input without them, as OpenAI's tts-1 does, and say so (X-Instructions: ignored)",
    )

    @model_validator(mode="after")
    def _names_are_not_empty(self) -> OpenAIArgs:
        if any(not name.strip() or not target.strip() for name, target in self.voices.items()):
            raise ValueError("openai.voices must map non-empty names to non-empty voices")
        return self


class ProvisionedVoiceArgs(StrictArgs):
    """A voice registered at start-up (idempotently: the same id on every start and every replica is one voice),
    shared by every API key, outside `limits.max_voices_per_key`; only an admin key deletes it (the next start
    registers it again)."""

    file: str = Field(
        min_length=1,
        description="the recording (1-30 s, wav/flac/ogg/mp3, 16-48 kHz): a path every encoder node can read (the "
        "model volume) or an object-store URL (s3://bucket/key)",
    )
    transcript: str = Field(min_length=1, description="what the recording says")
    id: str = Field(
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$",
        description="the operator's name for it; its registry id is this when it has the shape voice_<12 hex>, else "
        "one derived from it (GET /v1/voices shows it)",
    )
    name: str | None = Field(None, min_length=1, max_length=64, description="its display name (default: id)")
    openai_name: str | None = Field(
        None, min_length=1, description="the OpenAI voice name (alloy, ash, ...) that stands for it in openai.voices"
    )

    @property
    def voice_id(self) -> str:
        return provisioned_voice_id(self.id)

    @model_validator(mode="after")
    def _readable_path(self) -> ProvisionedVoiceArgs:
        if not is_store_url(self.file) and ".." in Path(self.file).parts:
            raise ValueError(f"voice file path {self.file!r} must not contain '..'")
        if not self.transcript.strip():
            raise ValueError("a provisioned voice needs a transcript")
        return self
