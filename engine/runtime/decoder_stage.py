"""The decoder side of serving (GPU or CPU): speech-token generation, flow matching and the vocoder over a batch of
`EncodedSegment`s, each checked first: a decoder takes only what its encoder side makes."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch
import torch.nn.functional as F

from engine.errors import InvalidInputError, NonFiniteOutputError
from engine.flow.masked_diff import FlowRequest
from engine.llm.generation import GenerationRequest, SilentRunFilter, prefill_prompt_prefix
from engine.llm.sampling import SamplingOptions
from engine.loading.loader import LoadedModel
from engine.runtime.bistream import BistreamStart, BistreamSynthesis
from engine.runtime.prompt_cache import PreparedPrompt, PromptCache, PromptKey
from engine.runtime.segment import EncodedSegment
from engine.runtime.streaming import DecodeStream
from engine.runtime.synthesis_request import MAX_SPEED, MIN_SPEED

# Sizes a decoder takes in one segment, checked before any of it is computed. The encoder's own inputs stay far below:
# a sentence of `limits.max_input_chars` text, a voice prompt of at most 30 s
# (`engine.voices.cloning.MAX_PROMPT_SECONDS`: 1500 speech tokens at 50 per second, 2600 mel frames).
MAX_SEGMENT_TEXT_TOKENS = 8192
MAX_PROMPT_SPEECH_TOKENS = 4096
MAX_PROMPT_MEL_FRAMES = 8192
MAX_VOICE_KEY_CHARS = 256  # a voice name or prompt key, as a segment carries it


def _tensor(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """Arrays arrive read-only from Ray's object store: copy into a writable tensor on `device`."""
    return torch.from_numpy(np.array(array)).to(device)


def _checked_array(name: str, value: object, shape: tuple[int | None, ...], integer: bool = False) -> np.ndarray:
    """`value` as an array of `shape` (None: any size), of integers or of finite floats; else InvalidInputError."""
    if not isinstance(value, np.ndarray) or value.ndim != len(shape):
        raise InvalidInputError(f"{name} must be a {len(shape)}-d array")
    if any(want is not None and have != want for have, want in zip(value.shape, shape, strict=True)):
        raise InvalidInputError(f"{name} must have shape {shape}, got {value.shape}")
    if integer and not np.issubdtype(value.dtype, np.integer):
        raise InvalidInputError(f"{name} must hold integers, got {value.dtype}")
    if not integer and not (np.issubdtype(value.dtype, np.floating) and np.isfinite(value).all()):
        raise InvalidInputError(f"{name} must hold finite floats")
    return value


HEALTH_CHECK_MEL_FRAMES = 4  # enough for every conv of the vocoder, negligible time


class SpeechDecoderStage:
    """Speech-token generation, flow matching and vocoder over a batch of encoded segments."""

    def __init__(self, model: LoadedModel, prompt_cache: PromptCache | None = None) -> None:
        self.model = model
        self.prompt_cache = prompt_cache  # None: every request's prompt is prepared anew

    @property
    def sample_rate(self) -> int:
        return self.model.config.sample_rate

    def check_segment(self, segment: EncodedSegment) -> None:
        """InvalidInputError unless `segment` is what this decoder can take: the encoder's output for this model,
        every number finite and in bounds, every size within the decoder's. A decoder checks every segment it is
        given (callers may skip the HTTP layer; an unpickled object skipped its constructors' checks)."""
        config = self.model.config
        if not isinstance(segment, EncodedSegment):
            raise InvalidInputError(f"a segment must be an EncodedSegment, got {type(segment).__name__}")
        if not isinstance(segment.sampling, SamplingOptions):
            raise InvalidInputError("segment.sampling must be SamplingOptions")
        segment.sampling.check()
        if segment.sampling.seed is None:
            raise InvalidInputError("segment.sampling.seed must be set (the encoder draws one)")
        speed = segment.speed
        if isinstance(speed, bool) or not isinstance(speed, (int, float)) or not MIN_SPEED <= speed <= MAX_SPEED:
            raise InvalidInputError(f"speed must be a number between {MIN_SPEED} and {MAX_SPEED}, got {speed!r}")
        text_rows = _checked_array("text_encoded", segment.text_encoded, (None, self.model.llm.cfg.llm_input_size))
        if not 1 <= len(text_rows) <= MAX_SEGMENT_TEXT_TOKENS:
            raise InvalidInputError(f"text_encoded must have 1 to {MAX_SEGMENT_TEXT_TOKENS} rows, got {len(text_rows)}")
        text_len = segment.text_len
        if isinstance(text_len, bool) or not isinstance(text_len, int) or not 1 <= text_len <= len(text_rows):
            raise InvalidInputError(f"text_len must be an integer in [1, {len(text_rows)}], got {text_len!r}")
        if segment.llm_embedding is not None and segment.llm_embedding.size:
            _checked_array("llm_embedding", segment.llm_embedding, (config.spk_embed_dim,))
        _checked_array("flow_embedding", segment.flow_embedding, (config.spk_embed_dim,))
        for name in ("llm_prompt_speech_tokens", "flow_prompt_speech_tokens"):
            tokens = _checked_array(name, getattr(segment, name), (None,), integer=True)
            if len(tokens) > MAX_PROMPT_SPEECH_TOKENS:
                raise InvalidInputError(f"{name} has {len(tokens)} tokens; at most {MAX_PROMPT_SPEECH_TOKENS}")
            if tokens.size and not 0 <= int(tokens.min()) <= int(tokens.max()) < self.model.llm.eos:
                raise InvalidInputError(f"{name} must be in [0, {self.model.llm.eos})")
        frames = _checked_array("prompt_feat", segment.prompt_feat, (None, config.mel_bins))
        if len(frames) > MAX_PROMPT_MEL_FRAMES:
            raise InvalidInputError(f"prompt_feat must have at most {MAX_PROMPT_MEL_FRAMES} frames, got {len(frames)}")
        for name in ("voice", "prompt_key"):
            value = getattr(segment, name)
            if value is not None and not (isinstance(value, str) and 0 < len(value) <= MAX_VOICE_KEY_CHARS):
                raise InvalidInputError(f"{name} must be None or a string of 1 to {MAX_VOICE_KEY_CHARS} characters")

    @torch.inference_mode()
    def decode_batch(self, segments: list[EncodedSegment]) -> list[np.ndarray | NonFiniteOutputError]:
        """Whole-utterance synthesis of a batch: one waveform [N] float32 per segment, or its error."""
        tokens = self.generate_tokens(segments)
        mels = self.tokens_to_mel(segments, tokens)
        return self.vocode(segments, mels)

    def generation_requests(self, segments: list[EncodedSegment]) -> list[GenerationRequest]:
        """The LLM requests of `segments`; a segment in a voice whose prepared prompt is cached (or is prepared and
        cached now) starts from its prompt prefix."""
        return [self._generation_request(segment) for segment in segments]

    def _generation_request(self, segment: EncodedSegment) -> GenerationRequest:
        device = self.model.decoder_device
        key = self._prompt_key(segment)
        prepared = None if key is None else self.prompt_cache.get(key)
        request = GenerationRequest(
            text_encoded=_tensor(segment.text_encoded, device),
            text_len=segment.text_len,
            embedding=None if segment.llm_embedding is None else _tensor(segment.llm_embedding, device),
            prompt_speech_tokens=_tensor(segment.llm_prompt_speech_tokens, device),
            options=segment.sampling,
        )
        if prepared is not None:
            return replace(
                request,
                embedding=prepared.llm_embedding,
                prompt_speech_tokens=prepared.llm_prompt_speech_tokens,
                prefix=prepared.prefix,
            )
        if key is None:
            return request
        # A miss prepares the prompt and starts from its prefix too, so that a hit computes exactly what a miss did.
        prepared = PreparedPrompt(
            prefix=prefill_prompt_prefix(self.model.llm, request),
            llm_prompt_speech_tokens=request.prompt_speech_tokens,
            llm_embedding=request.embedding,
            flow_prompt_speech_tokens=_tensor(segment.flow_prompt_speech_tokens, device),
            prompt_feat=_tensor(segment.prompt_feat, device),
            flow_embedding=_tensor(segment.flow_embedding, device),
        )
        self.prompt_cache.put(key, prepared)
        return replace(request, prefix=prepared.prefix)

    def _prompt_key(self, segment: EncodedSegment) -> PromptKey | None:
        if self.prompt_cache is None or not self.prompt_cache.max_bytes:
            return None
        if segment.voice is None or segment.prompt_key is None:
            return None
        return segment.voice, segment.prompt_key

    def flow_request(self, segment: EncodedSegment, tokens: torch.Tensor) -> FlowRequest:
        """The flow's request for `tokens` of `segment`: the prompt tensors already on the device when its voice's
        prepared prompt is cached (not counted as a hit or a miss: the LLM's lookup was)."""
        device = self.model.decoder_device
        key = self._prompt_key(segment)
        prepared = None if key is None else self.prompt_cache.get(key, count=False)
        if prepared is not None:
            return FlowRequest(
                tokens=tokens.to(device),
                prompt_tokens=prepared.flow_prompt_speech_tokens,
                prompt_feat=prepared.prompt_feat,
                embedding=prepared.flow_embedding,
                seed=segment.sampling.seed,
            )
        return FlowRequest(
            tokens=tokens.to(device),
            prompt_tokens=_tensor(segment.flow_prompt_speech_tokens, device),
            prompt_feat=_tensor(segment.prompt_feat, device),
            embedding=_tensor(segment.flow_embedding, device),
            seed=segment.sampling.seed,
        )

    def generate_tokens(self, segments: list[EncodedSegment]) -> list[torch.Tensor]:
        return self.model.llm.generate(self.generation_requests(segments))

    def tokens_to_mel(self, segments: list[EncodedSegment], tokens: list[torch.Tensor]) -> list[torch.Tensor]:
        """The mel of each segment's LLM tokens (the family's long silent runs dropped first, as officially).

        The LLM may stop before its first token: such a segment gets an empty mel [mel_bins, 0] (no flow call), and
        so no audio, as its stream would.
        """
        flow_tokens = [self.flow_tokens(t) for t in tokens]
        spoken = [i for i, t in enumerate(flow_tokens) if len(t)]
        requests = [self.flow_request(segments[i], flow_tokens[i]) for i in spoken]
        mels = [torch.zeros(self.model.config.mel_bins, 0, dtype=self.model.dtype) for _ in segments]
        for i, mel in zip(spoken, self.model.flow.inference(requests) if requests else [], strict=True):
            mels[i] = self.apply_speed(mel, segments[i].speed)
        return mels

    def flow_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """The LLM's tokens [N] as the flow gets them: the official `llm_job` drops the family's silent tokens
        past a run of 5 (streaming drops the same ones, token by token)."""
        silent = self.model.config.family.silent_tokens
        if not silent:
            return tokens
        return torch.tensor(SilentRunFilter(silent).filter(tokens.tolist()), dtype=torch.long)

    @staticmethod
    def apply_speed(mel: torch.Tensor, speed: float) -> torch.Tensor:
        """Official v1 speed control: stretch the mel [80, T] in time by 1/speed (linear interpolation)."""
        if speed == 1.0 or mel.shape[-1] == 0:
            return mel
        frames = max(1, int(mel.shape[-1] / speed))
        return F.interpolate(mel[None].float(), size=frames, mode="linear")[0].to(mel.dtype)

    @torch.inference_mode()
    def check_health(self) -> None:
        """A tiny vocoder pass on the decoder's device, waited for, so a device fault (a CUDA error) raises here.

        Its output is not judged: weights that give NaN fail each request with a message (500), not the replica.
        """
        hift = self.model.hift
        mel = torch.zeros(hift.config.in_channels, HEALTH_CHECK_MEL_FRAMES, dtype=self.model.dtype)
        hift.inference([mel.to(self.model.decoder_device)], seeds=[0])
        if self.model.decoder_device.type == "cuda":
            torch.cuda.synchronize(self.model.decoder_device)

    def open_bistream(self, start: BistreamStart) -> BistreamSynthesis:
        """One bi-streamed utterance (CosyVoice2/3): push text ids piece by piece, then finish (runtime.bistream)."""
        return BistreamSynthesis(self, start)

    def open_stream(self, segments: list[EncodedSegment]) -> DecodeStream:
        """Streaming synthesis of a batch: iterate the returned `DecodeStream` (see engine.runtime.streaming)."""
        return DecodeStream(self, segments)

    def vocode(
        self, segments: list[EncodedSegment], mels: list[torch.Tensor]
    ) -> list[np.ndarray | NonFiniteOutputError]:
        """One waveform [N] float32 per mel, or its error; an empty mel gives empty audio (no vocoder call)."""
        voiced = [i for i, mel in enumerate(mels) if mel.shape[-1]]
        waves = [torch.zeros(0) for _ in mels]
        if voiced:
            made = self.model.hift.inference(
                [mels[i] for i in voiced], seeds=[segments[i].sampling.seed for i in voiced]
            )
            for i, wave in zip(voiced, made, strict=True):
                waves[i] = wave
        results: list[np.ndarray | NonFiniteOutputError] = []
        for wave in waves:
            audio = wave.float().cpu().numpy()
            if not np.isfinite(audio).all():
                results.append(NonFiniteOutputError("the vocoder produced NaN or inf samples; no audio returned"))
            else:
                results.append(audio)
        return results
