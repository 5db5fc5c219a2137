"""The `Encoder` deployment: frontend, text encoder and voice features, on CPU only (optionally INT8)."""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ray import serve

from engine.errors import CosyVoiceError, InvalidInputError
from engine.families.base import InstructionSupport
from engine.loading.loader import load_model
from engine.loading.model_source import LLM_CHECKPOINT_AUTO, model_directory
from engine.runtime.bistream import BistreamStart
from engine.runtime.encoder_stage import TextEncoderStage
from engine.runtime.segment import EncodedSegment
from engine.runtime.synthesis_request import SegmentText, SynthesisRequest
from engine.voices.cloning import VoiceCloner, VoicePrompt, decode_prompt_audio
from engine.voices.default_voice import (
    DEFAULT_VOICE_FILE,
    DEFAULT_VOICE_ID,
    DEFAULT_VOICE_NAME,
    DEFAULT_VOICE_TRANSCRIPT,
)
from engine.voices.registry import Caller, VoiceRegistry
from engine.voices.store import is_store_url
from observability import STRUCTURED_LOGGING

logger = logging.getLogger("ray.serve")

VOICE_CLONING_NOT_CONFIGURED = (
    "voice cloning is not configured on this server: start it with voices_dir (--voices-dir: where registered "
    "voices are kept) and either an official model dir holding campplus.onnx and the speech tokenizer ONNX file, "
    "or voice_models_dir (--voice-models-dir)"
)


class VoiceCloningNotConfiguredError(CosyVoiceError):
    """Registering a voice on a server started without voice cloning."""

    http_status = 501

    def __init__(self, message: str = VOICE_CLONING_NOT_CONFIGURED) -> None:  # one argument: Ray re-raises it
        super().__init__(message)


@dataclass(frozen=True)
class ProvisionedVoice:
    """A voice the operator provisions at deploy (app args `voices`): a recording (a path every encoder node reads,
    or an object-store URL), its transcript, and the registry id and display name it gets."""

    file: str
    transcript: str
    voice_id: str
    name: str


@dataclass(frozen=True)
class VoiceCloningConfig:
    """Where the cloning models and the registered voices are (what an uploaded prompt recording may be:
    `engine.voices.cloning.PromptAudioLimits`)."""

    voices_dir: str  # a local directory or an object-store URL (s3://bucket/prefix)
    models_dir: str  # a directory, or the hub id of the model whose directory holds them
    max_voices: int
    max_voices_per_key: int | None
    voices: tuple[ProvisionedVoice, ...] = ()  # registered at start-up, idempotently
    default_voice: bool = True  # a model without built-in speakers is provisioned DEFAULT_VOICE too


@dataclass(frozen=True)
class ModelInfo:
    """What the ingress knows of the served model, asked once from an encoder replica (`Encoder.info`)."""

    model: str  # the loaded model's name
    family: str  # its family's name (CosyVoice2, ...)
    version: int
    instructions: InstructionSupport  # how it takes instructions (the family's answer for this model)
    streaming: bool  # its family streams
    streaming_speed: bool  # ... at any speed, not only 1.0
    bistream: bool  # its family bi-streams a text that comes piece by piece (CosyVoice2/3)
    voices: tuple[str, ...]  # the built-in speakers
    sample_rate: int
    speech_tokens_per_s: int
    voice_cloning: bool  # voices can be registered
    llm_checkpoint: str | None  # the LLM checkpoint it runs (None: dummy weights)
    default_voice: str | None  # the id OpenAI's voice names fall back to on a model without speakers, if any
    languages: tuple[str, ...]

    def streams_at(self, speed: float) -> bool:
        """Whether a request at `speed` streams (CosyVoice3, as the official code, at 1.0 only)."""
        return self.streaming and (speed == 1.0 or self.streaming_speed)


@dataclass(frozen=True)
class SentencePlan:
    """A request's sentences as `Encoder.encode_first` split them, held by the ingress while the first is decoded and
    given back to `Encoder.encode_planned` (any replica) for the others: their texts and whose voice they are spoken
    in, not the voice's arrays (embeddings, prompt speech and features), which the encoder looks up again rather than
    send them to the ingress and back."""

    request: SynthesisRequest  # validated: its seed is drawn
    caller: Caller  # who asked: a registered voice is one this caller sees (encode_first checked)
    texts: tuple[SegmentText, ...]

    @property
    def num_segments(self) -> int:
        return len(self.texts)


DEFAULT_VOICE = ProvisionedVoice(
    file=str(DEFAULT_VOICE_FILE),
    transcript=DEFAULT_VOICE_TRANSCRIPT,
    voice_id=DEFAULT_VOICE_ID,
    name=DEFAULT_VOICE_NAME,
)


def read_voice_file(location: str) -> bytes:
    """The bytes of a provisioned voice's recording: a local path or an object-store URL."""
    if is_store_url(location):
        import fsspec

        with fsspec.open(location, "rb", skip_instance_cache=True) as file:
            return file.read()
    return Path(location.removeprefix("file://")).read_bytes()


@serve.deployment(name="Encoder", ray_actor_options={"num_gpus": 0}, logging_config=STRUCTURED_LOGGING)
class Encoder:
    def __init__(
        self,
        model: str,
        int8: bool,
        max_text_chars: int,
        voice_cloning: VoiceCloningConfig | None = None,
        llm_checkpoint: str = LLM_CHECKPOINT_AUTO,
        max_text_tokens: int | None = None,
        spell_out_languages: bool = True,
    ) -> None:
        """`model`: a preset, a model dir or a hub id; `llm_checkpoint`: the LLM checkpoint the text encoder's weights
        come from (the decoders load the same one); `max_text_tokens`: the most tokens a request's text may have
        (`TextEncoderStage`); `spell_out_languages`: numbers spelled out in the model's languages beyond Chinese and
        English (`engine.loading.loader.load_model`)."""
        loaded = load_model(
            model,
            components=("encoder",),
            int8=int8,
            max_text_chars=max_text_chars,
            llm_checkpoint=llm_checkpoint,
            spell_out_languages=spell_out_languages,
        )
        self.llm_checkpoint = loaded.llm_checkpoint
        self.model_name = loaded.name
        self.stage = TextEncoderStage(loaded, max_text_tokens)
        self.max_text_chars = max_text_chars
        self.voice_cloning = voice_cloning
        self.cloner: VoiceCloner | None = None
        self.registry: VoiceRegistry | None = None
        self.default_voice: str | None = None  # the id OpenAI's voice names fall back to (DEFAULT_VOICE), if any
        if voice_cloning is not None:
            config = loaded.config
            self.cloner = VoiceCloner.from_model_dir(
                model_directory(voice_cloning.models_dir), config.family, config.sample_rate, config.flow.vocab_size
            )
            self.registry = VoiceRegistry(
                voice_cloning.voices_dir, voice_cloning.max_voices, voice_cloning.max_voices_per_key
            )
            for voice in voice_cloning.voices:
                self.provision(voice)
            if voice_cloning.default_voice and not self.stage.voices:
                self.provision(DEFAULT_VOICE)
                self.default_voice = DEFAULT_VOICE.voice_id

    def encode(self, request: SynthesisRequest, request_id: str, caller: Caller) -> list[EncodedSegment]:
        """One encoded segment per sentence, in order (engine errors propagate to the caller); a registered voice
        must be one `caller` sees."""
        segments = self.stage.encode(request, prompt=self.registered_prompt(request.voice, caller))
        logger.info("encoded %d segment(s)", len(segments), extra={"request_id": request_id})
        return segments

    def encode_first(
        self, request: SynthesisRequest, request_id: str, caller: Caller
    ) -> tuple[list[EncodedSegment], SentencePlan]:
        """The first sentence's segment alone, and the plan whose other sentences `encode_planned` encodes: the first
        can reach the decoder while the others are encoded (each segment is as `encode` makes it); a registered voice
        must be one `caller` sees."""
        plan = self.stage.plan(request, prompt=self.registered_prompt(request.voice, caller))
        first = self.stage.encode_planned(plan, 0, 1)
        logger.info("encoded the first of %d segment(s)", plan.num_segments, extra={"request_id": request_id})
        return first, SentencePlan(plan.request, caller, plan.texts)

    def encode_planned(self, sentences: SentencePlan, start: int, request_id: str = "") -> list[EncodedSegment]:
        """The segments of the plan's sentences from `start` on, in order, their voice looked up again on this
        replica."""
        request = sentences.request
        plan = self.stage.replan(request, sentences.texts, self.registered_prompt(request.voice, sentences.caller))
        segments = self.stage.encode_planned(plan, start)
        logger.info("encoded segments %d to %d", start, plan.num_segments - 1, extra={"request_id": request_id})
        return segments

    def bistream_start(self, request: SynthesisRequest, request_id: str, caller: Caller) -> BistreamStart:
        """A bi-streamed utterance's prompt and voice (CosyVoice2/3; its text comes piece by piece, each through
        `text_piece_tokens`); a registered voice must be one `caller` sees."""
        start = self.stage.bistream_start(request, prompt=self.registered_prompt(request.voice, caller))
        logger.info("prepared a bi-streamed utterance", extra={"request_id": request_id})
        return start

    def text_piece_tokens(self, text: str) -> list[int]:
        """A bi-streamed text piece's ids, tokenized as it comes (engine.runtime.bistream)."""
        return self.stage.text_piece_tokens(text)

    def registered_prompt(self, voice: str, caller: Caller) -> VoicePrompt | None:
        """The prompt of a registered voice; None for a built-in speaker (or a name the stage will refuse)."""
        if self.registry is None or voice in self.stage.voices:
            return None
        return self.registry.get(voice, caller)

    def register_voice(
        self,
        audio: bytes,
        transcript: str,
        name: str | None,
        caller: Caller,
        shared: bool = False,
        openai_name: str | None = None,
    ) -> dict[str, Any]:
        """Clone the voice of `audio` (a recording of `transcript`) and register it for `caller` (for every key:
        `shared`, admin keys only), with the `openai_name` clients may send for it; its record as the API shows it."""
        if self.cloner is None or self.registry is None or self.voice_cloning is None:
            raise VoiceCloningNotConfiguredError()
        transcript = transcript.strip()
        if not transcript or len(transcript) > self.max_text_chars:
            raise InvalidInputError(f"the transcript must have 1 to {self.max_text_chars} characters")
        self.registry.check_admission(name, caller, shared, openai_name)  # before the costly decoding and cloning
        waveform, sample_rate = decode_prompt_audio(audio)
        duration_s = len(waveform) / sample_rate
        prompt = self.cloner.clone(waveform, sample_rate, transcript)
        return self.registry.add(prompt, name, duration_s, caller, shared, openai_name).shown()

    def named_voice(self, openai_name: str, caller: Caller) -> str | None:
        """The id of the voice `caller` hears for `openai_name` (`VoiceRegistry.named`: its own, then a shared one);
        None without one."""
        return None if self.registry is None else self.registry.named(openai_name, caller)

    def provision(self, voice: ProvisionedVoice) -> None:
        """Register a provisioned voice unless the registry has it already from the same recording, transcript and
        model family (replicas that start together clone it at most once each, and store it once)."""
        assert self.cloner is not None and self.registry is not None
        if len(voice.transcript) > self.max_text_chars:
            raise InvalidInputError(
                f"provisioned voice {voice.name!r}: the transcript must have at most {self.max_text_chars} characters"
            )
        try:
            audio = read_voice_file(voice.file)
        except (OSError, ValueError) as error:
            raise CosyVoiceError(f"provisioned voice {voice.name!r}: cannot read {voice.file}: {error}") from error
        family = self.cloner.family.name
        source = hashlib.sha256(b"\0".join((audio, voice.transcript.encode(), family.encode()))).hexdigest()

        def clone() -> tuple[VoicePrompt, float]:
            try:
                waveform, sample_rate = decode_prompt_audio(audio)
            except InvalidInputError as error:
                raise InvalidInputError(f"provisioned voice {voice.name!r} ({voice.file}): {error.message}") from None
            assert self.cloner is not None
            return self.cloner.clone(waveform, sample_rate, voice.transcript), len(waveform) / sample_rate

        record = self.registry.provision(voice.voice_id, voice.name, source, clone)
        logger.info("provisioned voice %s is %s", voice.name, record.id)

    def list_voices(self, caller: Caller) -> list[dict[str, Any]]:
        return [] if self.registry is None else [record.shown() for record in self.registry.records(caller)]

    def delete_voice(self, voice_id: str, caller: Caller) -> bool:
        return self.registry is not None and self.registry.delete(voice_id, caller)

    def info(self) -> ModelInfo:
        family = self.stage.model.config.family
        return ModelInfo(
            model=self.model_name,
            family=family.name,
            version=family.version,
            instructions=family.instruction_support(self.model_name),
            streaming=family.streaming is not None,
            streaming_speed=family.streaming is not None and family.streaming.streams_speed,
            bistream=family.bistream,
            voices=tuple(self.stage.voices),
            sample_rate=self.stage.sample_rate,
            speech_tokens_per_s=self.stage.model.config.speech_token_rate,
            voice_cloning=self.cloner is not None,
            llm_checkpoint=self.llm_checkpoint,
            default_voice=self.default_voice,
            languages=tuple(family.languages),
        )

    def ping(self) -> bool:
        return True
