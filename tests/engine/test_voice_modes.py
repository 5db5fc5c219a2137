"""How a cloned voice (a `VoicePrompt`) conditions synthesis in each official mode, on the tiny dummy models."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from engine.errors import InvalidInputError
from engine.families import families
from engine.llm.sampling import SamplingOptions
from engine.runtime.pipeline import CosyVoice
from engine.runtime.synthesis_request import SynthesisRequest
from engine.voices.cloning import VoicePrompt

SHORT = SamplingOptions(seed=3, min_token_text_ratio=2, max_token_text_ratio=4)
TEXT = "Cloned voices speak this."
TRANSCRIPT = "This is what the prompt says."


@pytest.fixture(scope="module", params=["tiny", "cosyvoice2-tiny"])
def tts(request: pytest.FixtureRequest) -> CosyVoice:
    return CosyVoice.load(request.param)


def make_prompt(tts: CosyVoice, tokens: int = 10) -> VoicePrompt:
    rng = np.random.default_rng(0)
    frames = 2 * tokens  # the v2 alignment; v1 interpolates any prompt length
    return VoicePrompt(
        transcript=TRANSCRIPT,
        embedding=rng.standard_normal(192).astype(np.float32),
        speech_tokens=rng.integers(0, 96, tokens).astype(np.int64),
        speech_feat=rng.standard_normal((frames, 80)).astype(np.float32),
        sample_rate=tts.sample_rate,
        family=tts.encoder.model.config.family.name,
    )


def text_tokens(tts: CosyVoice, text: str) -> int:
    frontend = tts.encoder.model.frontend
    return len(frontend.tokenize(frontend.normalize(text)))


def encode(tts: CosyVoice, prompt: VoicePrompt | None, **options):
    [segment] = tts.encoder.encode(SynthesisRequest(TEXT, tts.voices[0], sampling=SHORT, **options), prompt=prompt)
    return segment


def test_zero_shot_puts_the_transcript_and_the_prompt_speech_before_the_text(tts: CosyVoice) -> None:
    prompt = make_prompt(tts)
    segment = encode(tts, prompt)
    assert len(segment.text_encoded) == text_tokens(tts, TRANSCRIPT) + text_tokens(tts, TEXT)
    assert segment.text_len == text_tokens(tts, TEXT)  # min/max speech length count the target text only
    np.testing.assert_array_equal(segment.llm_prompt_speech_tokens, prompt.speech_tokens)
    np.testing.assert_array_equal(segment.flow_prompt_speech_tokens, prompt.speech_tokens)
    np.testing.assert_array_equal(segment.prompt_feat, prompt.speech_feat)
    np.testing.assert_array_equal(segment.flow_embedding, prompt.embedding)
    np.testing.assert_array_equal(segment.llm_embedding, prompt.embedding)


def test_cross_lingual_keeps_the_voice_but_not_the_prompt_text_or_speech_in_the_llm(tts: CosyVoice) -> None:
    prompt = make_prompt(tts)
    segment = encode(tts, prompt, cross_lingual=True)
    assert len(segment.text_encoded) == text_tokens(tts, TEXT)
    assert len(segment.llm_prompt_speech_tokens) == 0
    np.testing.assert_array_equal(segment.flow_prompt_speech_tokens, prompt.speech_tokens)
    np.testing.assert_array_equal(segment.prompt_feat, prompt.speech_feat)


@pytest.mark.parametrize(
    ("instruction", "official_form"),
    [
        ("Speak slowly.<|endofprompt|>", "Speak slowly.<|endofprompt|>"),
        (" Read 25 words. ", "Read 25 words.<|endofprompt|>"),
    ],
)
def test_instruct_with_a_cloned_voice(tts: CosyVoice, instruction: str, official_form: str) -> None:
    prompt = make_prompt(tts)
    segment = encode(tts, prompt, instruct_text=instruction)
    version = tts.encoder.model.config.version
    frontend = tts.encoder.model.frontend
    # the official form ends in <|endofprompt|>, which the engine appends to a plain instruction, once; its
    # markup turns v1's normalisation off ("25" stays digits)
    [text] = tts.encoder.segment_texts(SynthesisRequest(TEXT, tts.voices[0], instruct_text=instruction), prompt)
    assert text.prompt == frontend.tokenize(official_form)
    assert len(segment.text_encoded) == len(text.prompt) + text_tokens(tts, TEXT)  # the instruction, not the transcript
    assert len(segment.llm_prompt_speech_tokens) == 0
    if version == 1:  # v1 Instruct: the speaker only through the flow embedding, no prompt speech
        assert segment.llm_embedding is None and len(segment.flow_prompt_speech_tokens) == 0
        assert segment.prompt_feat.shape == (0, 80)
    else:  # v2 instruct2: the prompt speech still guides the flow
        np.testing.assert_array_equal(segment.flow_prompt_speech_tokens, prompt.speech_tokens)
        np.testing.assert_array_equal(segment.prompt_feat, prompt.speech_feat)


def test_a_cloned_voice_synthesises_audio_of_its_token_length(tts: CosyVoice) -> None:
    segment = encode(tts, make_prompt(tts))
    [audio] = tts.decoder.decode_batch([segment])
    assert audio.dtype == np.float32 and np.isfinite(audio).all() and len(audio) > 0
    assert len(audio) % tts.encoder.model.config.hift.hop == 0


@pytest.mark.parametrize(
    ("options", "with_prompt", "needle"),
    [
        ({"cross_lingual": True}, False, "needs a cloned voice"),
        ({"cross_lingual": True, "instruct_text": "Loud."}, True, "cannot be combined"),
    ],
)
def test_mode_errors(tts: CosyVoice, options: dict, with_prompt: bool, needle: str) -> None:
    with pytest.raises(InvalidInputError, match=needle):
        encode(tts, make_prompt(tts) if with_prompt else None, **options)


def test_a_prompt_made_for_another_family_is_refused(tts: CosyVoice) -> None:
    prompt = make_prompt(tts)
    for family in families():
        if family is tts.encoder.model.config.family:
            continue
        rate = family.cloning_models().prompt_mel.sample_rate
        foreign = replace(prompt, family=family.name, sample_rate=rate)
        with pytest.raises(InvalidInputError, match=f"prepared for {family.name} models; .* register the voice again"):
            encode(tts, foreign)
