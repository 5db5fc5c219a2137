"""The engine benchmarks on every family (tiny presets): fixed speech lengths at the model's own token rate, the
per-stage run of `engine_bench`, the batch and streaming measures of `batching_bench`, and
the ~20 s text `compare` sends to the OpenAI endpoint."""

from __future__ import annotations

import pytest

from benchmarks.batching_bench import measure_batches, measure_first_chunk
from benchmarks.compare import text_for_audio_seconds
from benchmarks.engine_bench import fixed_length_segments, run
from engine.loader import load_model
from engine.pipeline import CosyVoice, SpeechDecoderStage, TextEncoderStage

TINY_PRESETS = ("tiny", "cosyvoice2-tiny", "cosyvoice3-tiny")


@pytest.mark.parametrize("preset", TINY_PRESETS)
def test_fixed_length_segments_speak_the_asked_seconds(preset: str) -> None:
    model = load_model(preset)
    seconds = 0.6
    segments = fixed_length_segments(TextEncoderStage(model), seconds, count=2)
    decoder = SpeechDecoderStage(model)

    tokens = decoder.generate_tokens(segments)
    waves = decoder.decode_batch(segments)

    expected_tokens = model.config.speech_tokens_for(seconds)
    assert [len(t) for t in tokens] == [expected_tokens] * 2  # no stop id ends either before max_len
    sample_rate, token_rate = model.config.sample_rate, model.config.family.cloning.token_rate
    for wave in waves:
        # at least the asked audio, and less than one speech token more (50 tokens/s for v1, 25 for v2 and v3)
        assert seconds * sample_rate <= len(wave) < (seconds + 1 / token_rate) * sample_rate


@pytest.mark.parametrize("preset", ["tiny", "cosyvoice3-tiny"])
def test_engine_bench_times_each_stage_and_measures_int8_and_weights(preset: str) -> None:
    result = run(preset, 0.4, threads=1)

    model = load_model(preset, components=("decoder",))
    assert result["speech_tokens"] == model.config.speech_tokens_for(0.4)
    assert result["audio_seconds"] >= 0.4
    assert all(seconds > 0 for seconds in result["seconds"].values())
    int8 = result["int8_vs_fp32"]
    assert 0.0 <= int8["greedy_token_agreement"] <= 1.0
    assert int8["greedy_tokens_compared"] == result["speech_tokens"]
    if preset == "tiny":  # the v1 text encoder is a Conformer: its Linear layers are quantized
        assert int8["text_encoder_int8_linear_layers"] > 0 and int8["text_encoder_cosine"] > 0.9
    else:  # the v3 text module is the Qwen2 embedding lookup: nothing to quantize, so no cosine is given
        assert int8["text_encoder_int8_linear_layers"] == 0 and int8["text_encoder_cosine"] is None
    for name in ("llm", "flow", "hift"):
        weights = result["parameter_bytes"][name]
        assert weights["fp16"] * 2 == weights["fp32"]  # every weight and buffer is a float
    assert result["parameter_bytes"]["llm"]["int8_linear"] < result["parameter_bytes"]["llm"]["fp32"]


def test_batching_bench_measures_cosyvoice3_batches_and_its_first_streamed_chunk() -> None:
    model = load_model("cosyvoice3-tiny")
    encoder, decoder = TextEncoderStage(model), SpeechDecoderStage(model)

    rows = measure_batches(decoder, lambda n: fixed_length_segments(encoder, 0.4, n), [1, 2], 0.4)["rows"]
    [segment] = fixed_length_segments(encoder, 2.0)
    streaming = measure_first_chunk(decoder, segment)

    assert [row["batch"] for row in rows] == [1, 2]
    assert all(row["llm_ms_per_token_step"] > 0 and row["decoder_throughput"] > 0 for row in rows)
    # 2 s of v3 speech is 50 tokens: its first chunk comes after the first 25 (+ the flow's look-ahead)
    assert streaming["first_chunk_s"] is not None and streaming["first_chunk_s"] < streaming["stream_total_s"]


@pytest.mark.parametrize("preset", TINY_PRESETS)
def test_compare_sizes_the_openai_text_at_the_models_own_token_rate(preset: str) -> None:
    tts = CosyVoice.load(preset)
    frontend, ratio = tts.encoder.model.frontend, 4.0
    text = text_for_audio_seconds(tts, 20.0, ratio)

    wanted = tts.encoder.model.config.speech_tokens_for(20.0)
    spoken = ratio * len(frontend.tokenize(frontend.normalize(text)))
    assert wanted <= spoken < wanted + ratio * 8  # reached with the last word (a few text tokens at most)
