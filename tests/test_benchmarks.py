"""How benchmark figures are taken (`benchmarks.timing`: warm-up, repeats, median and spread, physical bounds),
then the engine benchmarks on every family (tiny presets): fixed speech lengths at the model's own token rate, the
per-stage run of `engine_bench`, the batch and streaming measures of `batching_bench`, and
the ~20 s text `compare` sends to the OpenAI endpoint."""

from __future__ import annotations

import argparse
import json
import math

import pytest

from benchmarks.batching_bench import measure_batches, measure_first_chunk, report_rows, throughput_ratios
from benchmarks.compare import batching_figures, text_for_audio_seconds
from benchmarks.engine_bench import fixed_length_segments, run
from benchmarks.http_bench import LevelResult, LevelRun, Sample, level_dict, summarize
from benchmarks.timing import FailedMeasurements, Timing, add_repeat_options, measure, paired, ratio
from engine.loader import load_model
from engine.pipeline import CosyVoice, SpeechDecoderStage, TextEncoderStage

TINY_PRESETS = ("tiny", "cosyvoice2-tiny", "cosyvoice3-tiny")
REPEATS = 2  # the tiny-model runs below: enough to have a spread, quick


class FakeClock:
    """A clock that only the fake workload advances: each call of `work` takes the next of `durations`."""

    def __init__(self, durations: list[float]) -> None:
        self.now, self.durations, self.calls = 0.0, list(durations), 0

    def __call__(self) -> float:
        return self.now

    def work(self) -> int:
        self.now += self.durations[self.calls]
        self.calls += 1
        return self.calls


def test_measure_leaves_the_warmup_calls_out_and_reports_median_and_spread() -> None:
    clock = FakeClock([100.0, 50.0, 1.0, 5.0, 3.0])  # two cold calls, then the three timed ones

    result, timing = measure(clock.work, repeats=3, warmup=2, clock=clock)

    assert clock.calls == 5 and result == 5  # the last call's result
    assert timing.samples == (1.0, 5.0, 3.0)
    assert (timing.median, timing.min, timing.max, timing.n) == (3.0, 1.0, 5.0, 3)
    assert timing.fields("llm_seconds") == {"llm_seconds": 3.0, "llm_seconds_spread": {"min": 1.0, "max": 5.0, "n": 3}}


def test_timing_derives_figures_repeat_by_repeat() -> None:
    seconds = Timing((2.0, 4.0, 1.0, 8.0))
    throughput = seconds.map(lambda s: 8.0 / s)  # audio seconds per wall second

    assert seconds.median == 3.0  # an even count: the mean of the middle two
    assert (throughput.min, throughput.max) == (1.0, 8.0)  # the slowest run gives the lowest throughput
    assert paired(ratio, Timing((8.0, 6.0)), Timing((2.0, 3.0))).samples == (4.0, 2.0)
    assert math.isnan(ratio(1.0, 0.0))
    with pytest.raises(ValueError):
        paired(ratio, Timing((1.0, 2.0)), Timing((1.0,)))  # repeats of different figures must pair up
    with pytest.raises(ValueError):
        Timing(())


def test_measure_and_the_command_line_refuse_fewer_than_one_repeat() -> None:
    with pytest.raises(ValueError, match="repeats"):
        measure(lambda: None, repeats=0)
    parser = argparse.ArgumentParser()
    add_repeat_options(parser)
    assert (parser.parse_args([]).repeats, parser.parse_args([]).warmup) == (3, 1)
    for bad in (["--repeats", "0"], ["--warmup", "-1"], ["--repeats", "x"]):
        with pytest.raises(SystemExit):
            parser.parse_args(bad)


def test_a_ratio_outside_its_bound_is_a_failed_measurement_not_a_result() -> None:
    failed = FailedMeasurements()

    assert failed.bounded("decoder_ratio", 1.8, 0.0, 8.0, "why") == 1.8
    assert failed.bounded("llm_ratio", 38.9, 0.0, 8.0, "batch 8 cannot beat 8x batch 1") is None
    assert failed.bounded("zero_division", math.nan, 0.0, math.inf, "no audio") is None
    fields = failed.bounded_fields("efficiency", Timing((1.3, 1.1, 1.2)), 0.0, 1.0, "above the floor", key="eff")

    assert fields == {"eff": None, "eff_spread": None}
    assert [e["name"] for e in failed.entries] == ["llm_ratio", "zero_division", "efficiency"]
    why = "batch 8 cannot beat 8x batch 1"
    assert failed.entries[0] == {"name": "llm_ratio", "value": 38.9, "bound": [0.0, 8.0], "why": why}
    assert failed.entries[2]["samples"] == [1.3, 1.1, 1.2]
    json.dumps(failed.entries, allow_nan=False)  # NaN and inf are written as text: the report stays valid JSON


def _batch_rows(b1_seconds: tuple[float, ...], b8_seconds: tuple[float, ...], audio: float = 2.0) -> list[dict]:
    rows = []
    for batch, seconds in ((1, Timing(b1_seconds)), (8, Timing(b8_seconds))):
        throughput = seconds.map(lambda s, a=batch * audio: a / s)
        rows.append({"batch": batch, "timings": {"llm_throughput": throughput, "decoder_throughput": throughput}})
    return rows


def test_batching_ratios_are_bound_checked() -> None:
    failed = FailedMeasurements()
    # the measured bug: a cold batch-1 row (here 20x slow) made batch 8 look 38.9x faster than batch 1
    cold = throughput_ratios(_batch_rows((20.0, 21.0, 19.0), (4.0, 4.0, 4.0)), 8, failed)
    honest = throughput_ratios(_batch_rows((1.0, 1.1, 0.9), (4.0, 4.0, 4.0)), 8, failed, suffix="_int8")

    assert cold["llm_throughput_ratio_b8_vs_b1"] is None and cold["decoder_throughput_ratio_b8_vs_b1_spread"] is None
    assert {e["name"] for e in failed.entries} == {
        "llm_throughput_ratio_b8_vs_b1",
        "decoder_throughput_ratio_b8_vs_b1",
    }
    assert failed.entries[0]["value"] == pytest.approx(40.0)
    assert honest["llm_throughput_ratio_b8_vs_b1_int8"] == pytest.approx(2.0)
    assert honest["llm_throughput_ratio_b8_vs_b1_int8_spread"] == {
        "min": pytest.approx(1.8),
        "max": pytest.approx(2.2),
        "n": 3,
    }


def _level(concurrency: int, audio_s_per_s: list[float]) -> LevelResult:
    runs = [LevelRun([Sample(ok=True, latency_s=1.0, audio_s=rate)], 1.0) for rate in audio_s_per_s]
    return summarize("whole", concurrency, runs)


def test_http_levels_report_the_median_throughput_of_their_repeats() -> None:
    runs = [
        LevelRun([Sample(ok=True, first_chunk_s=0.1, latency_s=0.5, audio_s=1.0)] * 4, 2.0),
        LevelRun([Sample(ok=True, first_chunk_s=0.2, latency_s=0.5, audio_s=1.0)] * 3 + [Sample(ok=False)], 1.0),
        LevelRun([Sample(ok=True, first_chunk_s=0.3, latency_s=0.5, audio_s=1.0)] * 4, 4.0),
    ]

    result = summarize("stream", 4, runs)
    report = level_dict(result)

    assert (result.requests, result.errors, result.repeats) == (4, 1, 3)  # requests per repeat, errors over all
    assert result.audio_s_per_s == 2.0 and result.audio_s_per_s_spread == {"min": 1.0, "max": 3.0, "n": 3}
    assert result.wall_s == 2.0 and result.requests_per_s == 2.0
    assert result.first_chunk_s["p50"] == pytest.approx(0.2)  # the percentiles pool every repeat's requests
    assert "throughput" not in report and report["audio_s_per_s_spread"]["n"] == 3
    json.dumps(report)


def test_compare_efficiency_is_null_when_a_ratio_it_divides_is_impossible() -> None:
    failed = FailedMeasurements()
    baseline, engine_ratio = _level(8, [1.0, 1.0, 1.0]), Timing((2.0, 2.0, 2.0))

    fine = batching_figures(_level(8, [3.0, 3.3, 2.7]), _level(1, [1.0, 1.1, 0.9]), baseline, engine_ratio, 8, failed)
    impossible = batching_figures(_level(8, [30.0] * 3), _level(1, [1.0] * 3), baseline, engine_ratio, 8, failed)
    no_engine = batching_figures(_level(8, [3.0] * 3), _level(1, [1.0] * 3), baseline, None, 8, failed)

    assert fine["serving_throughput_ratio_c8_vs_c1"] == pytest.approx(3.0)
    assert fine["batching_efficiency_c8"] == pytest.approx(1.5)
    assert fine["batching_efficiency_c8_spread"]["n"] == 3
    assert fine["throughput_ratio_c8"] == pytest.approx(3.0)
    assert impossible["serving_throughput_ratio_c8_vs_c1"] is None and impossible["batching_efficiency_c8"] is None
    assert impossible["throughput_ratio_c8"] == pytest.approx(30.0)  # no bound above: ours against another server
    assert no_engine["batching_efficiency_c8"] is None and no_engine["serving_throughput_ratio_c8_vs_c1"] == 3.0
    assert [e["name"] for e in failed.entries] == ["serving_throughput_ratio_c8_vs_c1"]


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
    result = run(preset, 0.4, threads=1, repeats=REPEATS, warmup=1)

    model = load_model(preset, components=("decoder",))
    assert result["speech_tokens"] == model.config.speech_tokens_for(0.4)
    assert result["audio_seconds"] >= 0.4
    for group in ("seconds", "rtf"):
        for name in ("llm", "flow", "hift") + (("text_encode",) if group == "seconds" else ("total", "decoder")):
            spread = result[group][f"{name}_spread"]
            assert 0 < spread["min"] <= result[group][name] <= spread["max"] and spread["n"] == REPEATS
    assert result["llm_ms_per_token_spread"]["n"] == REPEATS
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

    batching = measure_batches(decoder, lambda n: fixed_length_segments(encoder, 0.4, n), [1, 2], 0.4, REPEATS)
    [segment] = fixed_length_segments(encoder, 2.0)
    streaming = measure_first_chunk(decoder, segment, REPEATS, warmup=1)

    rows = report_rows(batching)["rows"]
    json.dumps(rows, allow_nan=False)
    assert [row["batch"] for row in rows] == [1, 2]
    assert all(row["llm_ms_per_token_step"] > 0 and row["decoder_throughput"] > 0 for row in rows)
    for row in rows:
        for name in ("llm_seconds", "decoder_seconds", "llm_throughput", "decoder_throughput", "latency_s"):
            spread = row[f"{name}_spread"]
            assert spread["min"] <= row[name] <= spread["max"] and spread["n"] == REPEATS
    # 2 s of v3 speech is 50 tokens: its first chunk comes after the first 25 (+ the flow's look-ahead)
    assert streaming["first_chunk_s"] is not None and streaming["first_chunk_s"] < streaming["stream_total_s"]
    assert streaming["first_chunk_s_spread"]["n"] == streaming["full_synthesis_s_spread"]["n"] == REPEATS
    assert streaming["fraction"] > 0 and streaming["fraction_spread"]["n"] == REPEATS


@pytest.mark.parametrize("preset", TINY_PRESETS)
def test_compare_sizes_the_openai_text_at_the_models_own_token_rate(preset: str) -> None:
    tts = CosyVoice.load(preset)
    frontend, ratio = tts.encoder.model.frontend, 4.0
    text = text_for_audio_seconds(tts, 20.0, ratio)

    wanted = tts.encoder.model.config.speech_tokens_for(20.0)
    spoken = ratio * len(frontend.tokenize(frontend.normalize(text)))
    assert wanted <= spoken < wanted + ratio * 8  # reached with the last word (a few text tokens at most)
