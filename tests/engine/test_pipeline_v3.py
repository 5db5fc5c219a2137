"""CosyVoice3 end to end in the engine: the official prompt convention in each request mode (the LLM's text ids
against the kit's recorded official ids), the tokenizer checks, voice cloning on the `cosyvoice3-tiny` preset,
`python -m engine`, and the decoder memory estimate of the v3 presets."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import soundfile as sf

from engine.__main__ import main as engine_cli
from engine.errors import CheckpointError, InvalidInputError, RequestTooLargeError
from engine.families import COSYVOICE3
from engine.families.base import ModelConfig
from engine.llm.cosyvoice3_lm import ENDOFPROMPT_TOKEN
from engine.llm.qwen2_lm import QWEN_DIR
from engine.llm.sampling import SamplingOptions
from engine.loading.loader import PRESET_VOICE_MODELS, PRESETS, PRESETS_DIR, load_model
from engine.runtime.encoder_stage import TextEncoderStage
from engine.runtime.memory import estimate_request_memory
from engine.runtime.pipeline import CosyVoice
from engine.runtime.scheduler import Output, Scheduler
from engine.runtime.synthesis_request import SegmentText, SynthesisRequest
from engine.text.frontend import ENDOFPROMPT
from engine.voices.cloning import VoiceCloner, VoicePrompt
from tests.conftest import v3_kit_cases, v3_kit_dir
from tests.engine.conftest import write_tiny_qwen_tokenizer

SYSTEM_TEXT = "You are a helpful assistant.<|endofprompt|>"
SHORT = SamplingOptions(seed=5, min_token_text_ratio=2, max_token_text_ratio=3)


@pytest.fixture(scope="module")
def kit() -> Path:
    return v3_kit_dir()


@pytest.fixture(scope="module")
def official_texts(kit: Path) -> dict[str, dict[str, Any]]:
    """The kit's frontend cases by their text: what the official tokenizer made of the official examples."""
    cases = v3_kit_cases(kit).get("frontend")
    if not cases:
        pytest.skip("the kit has no frontend group")
    return {case["text"]: case for case in cases}


@pytest.fixture(scope="module")
def encoder(kit: Path) -> TextEncoderStage:
    """The kit's model dir as an encoder replica loads it: its tokenizer files give the official ids."""
    return TextEncoderStage(load_model(kit / "model", components=("encoder",)))


def kit_prompt(transcript: str) -> VoicePrompt:
    rng = np.random.default_rng(0)
    return VoicePrompt(
        transcript=transcript,
        embedding=rng.standard_normal(192).astype(np.float32),
        speech_tokens=rng.integers(0, 96, 10).astype(np.int64),
        speech_feat=rng.standard_normal((20, 80)).astype(np.float32),
        sample_rate=24000,
        family=COSYVOICE3.name,
    )


def official_ids(official_texts: dict[str, dict[str, Any]], text: str) -> list[int]:
    assert text in official_texts, f"the kit has no frontend case {text[:40]!r}"
    return official_texts[text]["raw_tokens"].tolist()


def only(texts: list[SegmentText]) -> SegmentText:
    assert len(texts) == 1, texts
    return texts[0]


# --- the prompt convention ----------------------------------------------------------------------------------


def test_a_built_in_speaker_gets_the_system_prompt_as_its_prompt_text(encoder: TextEncoderStage) -> None:
    text = only(encoder.segment_texts(SynthesisRequest("Hello world.", "spk3_a")))
    assert text.prompt == encoder.model.frontend.tokenize(SYSTEM_TEXT)
    assert text.prompt[-1] == ENDOFPROMPT_TOKEN and ENDOFPROMPT_TOKEN not in text.text


def test_zero_shot_prompt_text_is_the_official_one(
    encoder: TextEncoderStage, official_texts: dict[str, dict[str, Any]]
) -> None:
    """official example.py: prompt_text 'You are a helpful assistant.<|endofprompt|>' + the transcript."""
    transcript = "希望你以后能够做的比我还好呦。"
    text = only(encoder.segment_texts(SynthesisRequest("Hello world.", "voice"), kit_prompt(transcript)))
    assert text.prompt == official_ids(official_texts, SYSTEM_TEXT + transcript)
    assert text.prompt.count(ENDOFPROMPT_TOKEN) == 1 and ENDOFPROMPT_TOKEN not in text.text


def test_instruct2_prompt_text_is_the_official_one(
    encoder: TextEncoderStage, official_texts: dict[str, dict[str, Any]]
) -> None:
    """official example.py: instruct_text 'You are a helpful assistant. <instruction><|endofprompt|>'."""
    request = SynthesisRequest("好少咯。", "voice", instruct_text="请用广东话表达。")
    text = only(encoder.segment_texts(request, kit_prompt("Hi.")))
    assert text.prompt == official_ids(official_texts, "You are a helpful assistant. 请用广东话表达。<|endofprompt|>")
    assert text.prompt[-1] == ENDOFPROMPT_TOKEN


def test_cross_lingual_puts_the_system_prompt_in_the_text(
    encoder: TextEncoderStage, official_texts: dict[str, dict[str, Any]]
) -> None:
    """official: the tts text starts with the system prompt, so it counts in the text's length; the engine
    normalises the caller's text first (the official front end leaves the whole tagged text as it is, which a
    caller gets by writing the system prompt into the text)."""
    official = next(text for text in official_texts if text.startswith(SYSTEM_TEXT + "[breath]"))
    spoken = official.removeprefix(SYSTEM_TEXT)
    frontend = encoder.model.frontend
    plain = only(encoder.segment_texts(SynthesisRequest(spoken, "voice", cross_lingual=True), kit_prompt("Hi.")))
    assert plain.prompt == []
    system = frontend.tokenize(SYSTEM_TEXT)
    [segment] = frontend.split(spoken)  # normalised, with the final mark the sentence splitter adds
    assert plain.text == system + frontend.tokenize(segment)
    assert plain.text.index(ENDOFPROMPT_TOKEN) == len(system) - 1
    as_written = encoder.segment_texts(SynthesisRequest(official, "voice", cross_lingual=True), kit_prompt("Hi."))
    assert only(as_written) == SegmentText(prompt=[], text=official_ids(official_texts, official))


def test_a_text_or_instruction_in_the_official_form_is_taken_as_written(encoder: TextEncoderStage) -> None:
    frontend = encoder.model.frontend
    written = "You are a helpful assistant. Read slowly.<|endofprompt|>Hello."
    text = only(encoder.segment_texts(SynthesisRequest(written, "spk3_a")))
    assert text == SegmentText(prompt=[], text=frontend.tokenize(written))  # as the kit's llm case with no prompt
    instruction = "You are a news reader.<|endofprompt|>"
    request = SynthesisRequest("Hello.", "voice", instruct_text=instruction)
    assert only(encoder.segment_texts(request, kit_prompt("Hi."))).prompt == frontend.tokenize(instruction)


def test_a_caller_may_replace_the_system_prompt(encoder: TextEncoderStage) -> None:
    frontend = encoder.model.frontend
    request = SynthesisRequest("Hello.", "voice", instruct_text="Slowly.", system_prompt="You read the news.")
    text = only(encoder.segment_texts(request, kit_prompt("Hi.")))
    assert text.prompt == frontend.tokenize("You read the news. Slowly.<|endofprompt|>")
    zero_shot = SynthesisRequest("Hello.", "voice", system_prompt="You read the news.")
    assert only(encoder.segment_texts(zero_shot, kit_prompt("Hi."))).prompt == frontend.tokenize(
        "You read the news.<|endofprompt|>Hi."
    )
    for bad in ("", "  ", f"Nested{ENDOFPROMPT}"):
        with pytest.raises(InvalidInputError, match="system_prompt must be non-empty text without"):
            encoder.segment_texts(SynthesisRequest("Hello.", "spk3_a", system_prompt=bad))


def test_a_system_prompt_for_a_family_without_one_is_a_400() -> None:
    encoder = CosyVoice.load("cosyvoice2-tiny").encoder
    with pytest.raises(InvalidInputError, match=r"^CosyVoice2 models take no system prompt$") as error:
        encoder.encode(SynthesisRequest("Hello.", encoder.voices[0], system_prompt="You read the news."))
    assert error.value.http_status == 400


# --- the tokenizer ------------------------------------------------------------------------------------------


def test_the_stand_in_tokenizer_gives_the_released_ids() -> None:
    tokenizer = load_model("cosyvoice3-tiny", components=("encoder",)).frontend.tokenizer
    assert tokenizer.encode(f"{ENDOFPROMPT}[breath]<|endofsystem|>[ǜ]") == [151646, 151647, 151663, 151923]
    assert tokenizer.encode("Hi") == [ord("H"), ord("i")]  # the byte-level stand-in: one id per byte


def test_an_official_dir_whose_tokenizer_misplaces_endofprompt_is_refused(kit: Path, tmp_path: Path) -> None:
    model_dir = tmp_path / "model"
    shutil.copytree(kit / "model", model_dir)
    shutil.rmtree(model_dir / QWEN_DIR)
    write_tiny_qwen_tokenizer(model_dir / QWEN_DIR)  # Qwen2's added tokens right after 380 trained ids
    shutil.copy(kit / "model" / QWEN_DIR / "config.json", model_dir / QWEN_DIR / "config.json")
    with pytest.raises(CheckpointError, match=r"gives <\|endofprompt\|> the id\(s\) \[383\]; .* id 151646"):
        load_model(model_dir, components=("encoder",))


def test_a_tag_beyond_a_models_vocabulary_is_a_400(encoder: TextEncoderStage) -> None:
    """The kit's LLM embeds ids below 151647 (as the official one, it loads): a later tag is refused per request."""
    with pytest.raises(InvalidInputError, match=r"text token ids must be in \[0, 151647\); the text holds id 151923"):
        encoder.encode(SynthesisRequest("Hello [ǜ].", "spk3_a"))


# --- cloning and synthesis on the tiny preset ----------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny() -> CosyVoice:
    return CosyVoice.load("cosyvoice3-tiny")


@pytest.fixture(scope="module")
def cloned(tiny: CosyVoice) -> VoicePrompt:
    """A voice registered with the cloning models the preset ships."""
    config = tiny.encoder.model.config
    cloner = VoiceCloner.from_model_dir(
        PRESET_VOICE_MODELS["cosyvoice3-tiny"], config.family, config.sample_rate, config.flow.vocab_size
    )
    t = np.arange(int(2.5 * 16000)) / 16000
    recording = (0.3 * np.sin(2 * np.pi * 170 * t) * (1 + 0.4 * np.sin(2 * np.pi * 3 * t))).astype(np.float32)
    return cloner.clone(recording, 16000, "Hello there.")


def test_a_cloned_voice_has_25_hz_tokens_and_two_24_khz_mel_frames_each(cloned: VoicePrompt) -> None:
    assert cloned.family == "CosyVoice3" and cloned.sample_rate == 24000
    assert len(cloned.speech_tokens) == int(2.5 * 25) and cloned.speech_feat.shape == (2 * 62, 80)


@pytest.mark.parametrize(
    "mode", [{}, {"cross_lingual": True}, {"instruct_text": "Speak happily."}], ids=["zero_shot", "cross", "instruct2"]
)
def test_a_cloned_voice_speaks_in_every_mode(tiny: CosyVoice, cloned: VoicePrompt, mode: dict[str, Any]) -> None:
    request = SynthesisRequest("Spoken in a cloned voice.", "voice", sampling=SHORT, **mode)
    segments = tiny.encoder.encode(request, cloned)
    llm_speech = {"zero_shot": len(cloned.speech_tokens)}.get(next(iter(mode), "zero_shot"), 0)
    assert all(len(segment.llm_prompt_speech_tokens) == llm_speech for segment in segments)
    assert all(len(segment.flow_prompt_speech_tokens) == len(cloned.speech_tokens) for segment in segments)
    for audio in tiny.decoder.decode_batch(segments):
        assert isinstance(audio, np.ndarray) and audio.dtype == np.float32 and np.isfinite(audio).all()
        assert len(audio) > 0 and len(audio) % 480 == 0  # 24 kHz, 480 samples per mel frame
    assert tiny.sample_rate == 24000


def test_a_cosyvoice2_prompt_is_refused_by_a_cosyvoice3_model(tiny: CosyVoice, cloned: VoicePrompt) -> None:
    foreign = VoicePrompt(
        cloned.transcript, cloned.embedding, cloned.speech_tokens, cloned.speech_feat, 24000, family="CosyVoice2"
    )
    with pytest.raises(InvalidInputError, match="prepared for CosyVoice2 models; this model is CosyVoice3") as error:
        tiny.encoder.encode(SynthesisRequest("Hi.", "voice_0123456789ab"), foreign)
    assert error.value.http_status == 400


def test_python_m_engine_speaks_with_the_tiny_preset(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out.wav"
    assert engine_cli(["Hello.", "--model", "cosyvoice3-tiny", "-o", str(out)]) == 0
    audio, rate = sf.read(out, dtype="float32")
    assert rate == 24000 and len(audio) > 0 and np.isfinite(audio).all()
    assert "at 24000 Hz" in capsys.readouterr().out
    quantized = tmp_path / "int4.wav"  # the CPU server's dtypes are the command's too
    assert engine_cli(["Hello.", "--model", "cosyvoice3-tiny", "--dtype", "auto-int4", "-o", str(quantized)]) == 0
    assert np.isfinite(sf.read(quantized, dtype="float32")[0]).all()


# --- memory -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("preset", ["cosyvoice3-tiny", "cosyvoice3-0.5b"])
def test_the_memory_estimate_of_the_v3_presets(preset: str) -> None:
    config = ModelConfig.from_yaml_file(PRESETS_DIR / PRESETS[preset])
    small, large = estimate_request_memory(config, 10), estimate_request_memory(config, 20)
    qwen = config.llm.qwen
    per_position = 2 * qwen.num_hidden_layers * qwen.num_key_value_heads * qwen.head_dim * 2
    assert large.kv_cache_bytes - small.kv_cache_bytes == per_position * (10 + 10 * 20)  # text + max speech
    # the DiT's attention grows with the square of the frames: twice the speech, more than twice the bytes
    assert large.flow_bytes > 2 * small.flow_bytes > 0 and large.vocoder_bytes == 2 * small.vocoder_bytes


def test_a_v3_request_is_admitted_by_its_memory_estimate_and_decoded_in_the_loop(tiny: CosyVoice) -> None:
    segments = tiny.encoder.encode(SynthesisRequest("Through the decoder loop.", tiny.voices[0], sampling=SHORT))
    scheduler = Scheduler(tiny.decoder, max_live=2, memory_budget_bytes=None)
    [estimate] = scheduler.limits.check_fits(segments)
    outputs: list[Output] = []
    with pytest.raises(RequestTooLargeError, match="decoder memory"):
        Scheduler(tiny.decoder, max_live=2, memory_budget_bytes=estimate - 1).submit(segments, False, outputs.append)
    loop = Scheduler(tiny.decoder, max_live=2, memory_budget_bytes=estimate)
    loop.submit(segments, False, outputs.append)
    while loop.has_work:
        loop.step()
    [audio, end] = outputs
    assert end is None and isinstance(audio, np.ndarray) and np.isfinite(audio).all() and len(audio) > 0


LONG_TEXT = " ".join(f"Sentence number {n} of a long text keeps the voice it started with." for n in range(1, 7))


@pytest.mark.parametrize("mode", [{}, {"cross_lingual": True}, {"instruct_text": "Speak calmly."}], ids=str)
def test_every_sentence_of_a_long_text_gets_the_same_voice_and_one_seed_stream(
    tiny: CosyVoice, cloned: VoicePrompt, mode: dict[str, Any]
) -> None:
    request = SynthesisRequest(LONG_TEXT, "voice", sampling=SamplingOptions(seed=41), **mode)
    segments = tiny.encoder.encode(request, cloned)
    assert len(segments) > 1  # the text is long enough to be split
    first = segments[0]
    for index, segment in enumerate(segments):
        for field in ("flow_embedding", "llm_prompt_speech_tokens", "flow_prompt_speech_tokens", "prompt_feat"):
            np.testing.assert_array_equal(getattr(segment, field), getattr(first, field), err_msg=field)
        if first.llm_embedding is None:
            assert segment.llm_embedding is None
        else:
            np.testing.assert_array_equal(segment.llm_embedding, first.llm_embedding)
        assert segment.sampling.seed == 41 + index  # one stream: the request's seed, then one per sentence
        assert (segment.segment_index, segment.num_segments) == (index, len(segments))
