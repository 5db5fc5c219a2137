"""How benchmark figures are taken (`serve_app.bench.timing`: warm-up, repeats, median and spread, physical bounds),
then the engine benchmarks on every family (tiny presets): fixed speech lengths at the model's own token rate, the
per-stage run of `engine_bench`, the batch and streaming measures of `batching_bench`, and
the ~20 s text `compare` sends to the OpenAI endpoint."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from benchmarks import hold_cycle
from benchmarks.batching_bench import (
    cloned_voice_segment,
    measure_batches,
    measure_first_chunk,
    measure_prompt_cache_ttfa,
    report_rows,
    throughput_ratios,
)
from benchmarks.bistream_bench import measure_bistream
from benchmarks.compare import batching_figures, text_for_audio_seconds
from benchmarks.engine_bench import fixed_length_segments, run
from benchmarks.streams import (
    Listener,
    RateResult,
    StreamResult,
    held_rate_figures,
    held_rate_target,
    held_rate_title,
    poisson_arrivals,
    stream_request,
    summarize_rate,
)
from engine.loading.loader import load_model
from engine.runtime.decoder_stage import SpeechDecoderStage
from engine.runtime.encoder_stage import TextEncoderStage
from engine.runtime.memory import SAFETY_FACTOR
from engine.runtime.pipeline import CosyVoice
from serve_app.bench.http_load import LevelResult, LevelRun, Sample, level_dict, summarize
from serve_app.bench.timing import FailedMeasurements, Timing, add_repeat_options, measure, paired, ratio

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


def test_batching_bench_times_the_first_chunk_of_a_cloned_voice_with_and_without_the_prompt_cache() -> None:
    model = load_model("cosyvoice3-tiny")
    encoder, decoder = TextEncoderStage(model), SpeechDecoderStage(model)
    segment = cloned_voice_segment(encoder, prompt_seconds=2.0, audio_seconds=1.0)
    assert len(segment.llm_prompt_speech_tokens) == 50  # 2 s at v3's 25 Hz

    timing = measure_prompt_cache_ttfa(decoder, segment, REPEATS, warmup=1)

    json.dumps(timing, allow_nan=False)
    assert (timing["cache_misses"], timing["cache_hits"]) == (1, REPEATS)  # the warm-up cached run fills it
    assert timing["cached_prefix_rows"] > 1 and timing["prefill_rows"] > timing["cached_prefix_rows"]
    for name in ("ttfa_cached_s", "ttfa_uncached_s", "ratio"):
        assert timing[name] > 0 and timing[f"{name}_spread"]["n"] == REPEATS
    assert decoder.prompt_cache is None  # the stage is left as it was


def test_bistream_bench_times_first_audio_of_text_as_it_arrives_against_the_text_whole() -> None:
    model = load_model("cosyvoice3-tiny")
    encoder, decoder = TextEncoderStage(model), SpeechDecoderStage(model)

    timing = measure_bistream(encoder, decoder, None, tokens_per_second=50.0, repeats=REPEATS, warmup=0)

    json.dumps(timing, allow_nan=False)
    for name in ("bistream_first_audio_s", "whole_first_audio_s", "ratio"):
        assert timing[name] > 0 and timing[f"{name}_spread"]["n"] == REPEATS
    # the audio began while the text was still arriving (all of it takes 3.6 s at 50 tokens/s)
    assert timing["text_tokens"] > 100
    assert all(0 < arrived < timing["text_tokens"] for arrived in timing["text_tokens_arrived_at_first_audio"])


def test_hold_cycle_times_rows_leaving_and_rejoining_one_by_one_and_together_beside_a_step() -> None:
    report = hold_cycle.run("tiny", tokens=20, threads=1, repeats=REPEATS, warmup=0)

    json.dumps(report, allow_nan=False)
    assert report["failed_measurements"] == [] and report["rows"] > report["held_rows"] > 1
    for name in ("llm_step_s", "hold_cycle_s_one_by_one", "hold_cycle_s_together", "hold_cycle_ratio"):
        assert report[name] > 0 and report[f"{name}_spread"]["n"] == REPEATS, name


@pytest.mark.parametrize("preset", TINY_PRESETS)
def test_compare_sizes_the_openai_text_at_the_models_own_token_rate(preset: str) -> None:
    tts = CosyVoice.load(preset)
    frontend, ratio = tts.encoder.model.frontend, 4.0
    text = text_for_audio_seconds(tts, 20.0, ratio)

    wanted = tts.encoder.model.config.speech_tokens_for(20.0)
    spoken = ratio * len(frontend.tokenize(frontend.normalize(text)))
    assert wanted <= spoken < wanted + ratio * 8  # reached with the last word (a few text tokens at most)


def test_a_listener_underruns_only_when_a_piece_comes_after_it_ran_out() -> None:
    listener = Listener(jitter_buffer_s=0.3)

    listener.receive(1.0, 0.5)  # first audio at 1.0: it plays from 1.3 to 1.8
    listener.receive(1.8, 0.5)  # just in time: it plays on to 2.3
    listener.receive(2.5, 1.0)  # 0.2 s late: an underrun, and it plays again from 2.5 to 3.5
    listener.receive(3.4, 0.1)  # within the buffer again

    assert (listener.first_at, listener.underruns) == (1.0, 1)
    assert listener.runs_out_at == pytest.approx(3.6) and listener.audio_s == pytest.approx(2.1)
    on_time = Listener(jitter_buffer_s=0.3)
    for at in (0.0, 0.35, 0.7):  # 0.3 s of buffer covers chunks a little later than their playback
        on_time.receive(at, 0.1 if at == 0.0 else 0.5)
    assert on_time.underruns == 0


def _rate(rate: float, holds: bool) -> RateResult:
    ttfa = 0.2 if holds else 5.0
    return summarize_rate(rate, [StreamResult("short", ok=True, ttfa_s=ttfa)], {"short": 0.2, "long": 0.6}, 1.0)


def test_a_rate_holds_with_every_stream_ok_no_underrun_and_its_p95_ttfa_within_3x_idle() -> None:
    idle = {"short": 0.2, "long": 0.6}
    results = [StreamResult("short", ok=True, ttfa_s=0.3), StreamResult("long", ok=True, ttfa_s=1.5)]

    fine = summarize_rate(0.1, results, idle, 10.0)
    underrun = summarize_rate(0.1, [*results, StreamResult("short", ok=True, ttfa_s=0.2, underruns=1)], idle, 10.0)
    failed = summarize_rate(0.1, [*results, StreamResult("long", ok=False, ttfa_s=0.6, error="500")], idle, 10.0)
    slow = summarize_rate(0.1, [*results, StreamResult("short", ok=True, ttfa_s=0.7)], idle, 10.0)

    assert fine.holds and fine.ttfa_ratio_p95 == pytest.approx(2.45)  # each stream against its kind's idle TTFA
    assert (fine.served, fine.errors, fine.ttfa_p50_s) == (2, 0, pytest.approx(0.9))
    assert not underrun.holds and underrun.underruns_per_stream == pytest.approx(1 / 3)
    assert not failed.holds and (failed.served, failed.errors) == (2, 1)
    assert not slow.holds and slow.ttfa_ratio_p95 > 3.0


def test_the_held_rate_is_the_top_of_the_rates_that_all_hold_and_its_ratio_says_when_it_is_null() -> None:
    measured = held_rate_figures(
        {
            "fcfs": [_rate(0.1, True), _rate(0.2, False), _rate(0.4, True)],
            "deadline": [_rate(r, r < 0.8) for r in (0.1, 0.2, 0.4, 0.8)],
        }
    )
    fcfs_fails_all = held_rate_figures({"fcfs": [_rate(0.1, False)], "deadline": [_rate(0.1, True)]})
    fcfs_holds_all = held_rate_figures({"fcfs": [_rate(0.1, True)], "deadline": [_rate(0.1, True)]})
    deadline_holds_all = held_rate_figures(
        {"fcfs": [_rate(0.1, True), _rate(0.2, False)], "deadline": [_rate(0.1, True), _rate(0.2, True)]}
    )

    # 0.4 holds for fcfs only after 0.2 failed: not counted
    assert (measured["held_rate_fcfs"], measured["held_rate_deadline"]) == (0.1, 0.4)
    assert measured["held_rate_ratio"] == pytest.approx(4.0) and measured["held_rate_ratio_reason"] is None
    assert not measured["held_rate_ratio_is_lower_bound"]
    assert fcfs_fails_all["held_rate_fcfs"] is None and fcfs_fails_all["held_rate_fcfs_below"] == 0.1
    assert fcfs_fails_all["held_rate_ratio"] is None and "fails the lowest" in fcfs_fails_all["held_rate_ratio_reason"]
    assert fcfs_fails_all["held_rate_ratio_above"] == 1.0  # fcfs holds less than 0.1, deadline at least 0.1
    assert measured["held_rate_ratio_above"] is None and fcfs_holds_all["held_rate_ratio_above"] is None
    cut = held_rate_figures({"fcfs": [_rate(0.1, False)], "deadline": []})  # the time budget left deadline out
    assert cut["held_rate_deadline"] is None and "held_rate_deadline_below" not in cut
    assert cut["held_rate_ratio"] is None and cut["held_rate_ratio_above"] is None
    assert cut["held_rate_ratio_reason"].startswith("no rate was measured for deadline")
    assert "deadline not measured" in held_rate_title({**cut, "held_rate_fcfs_below": 0.1})
    assert (held_rate_target(4.0, None), held_rate_target(1.2, None), held_rate_target(None, 8.0)) == (
        True,
        False,
        True,
    )
    assert held_rate_target(None, 1.0) is None and held_rate_target(None, None) is None  # a bound of 1 tells nothing
    assert fcfs_holds_all["held_rate_ratio"] is None and "every rate" in fcfs_holds_all["held_rate_ratio_reason"]
    deadline_fails_all = held_rate_figures(
        {"fcfs": [_rate(0.1, True), _rate(0.2, False)], "deadline": [_rate(0.1, False)]}
    )
    assert deadline_fails_all["held_rate_ratio"] is None and "below 1" in deadline_fails_all["held_rate_ratio_reason"]
    assert deadline_holds_all["held_rate_ratio"] == 2.0 and deadline_holds_all["held_rate_ratio_is_lower_bound"]


def test_poisson_arrivals_are_seeded_and_have_the_asked_rate_and_mix() -> None:
    arrivals = poisson_arrivals(0.5, 2000, 0.25, seed=26)

    assert arrivals == poisson_arrivals(0.5, 2000, 0.25, seed=26)  # both policies get the same load
    assert arrivals != poisson_arrivals(0.5, 2000, 0.25, seed=27)
    offsets = [offset for offset, _ in arrivals]
    assert offsets[0] == 0.0 and offsets == sorted(offsets)
    assert 1800 / 0.5 < offsets[-1] < 2200 / 0.5  # 2000 gaps of 2 s on average
    assert 0.2 < sum(kind == "long" for _, kind in arrivals) / 2000 < 0.3


def test_a_stream_request_measures_its_first_audio_and_underruns_through_http() -> None:
    sample_rate, gaps = 1000, (0.05, 0.0, 0.5)  # 0.1 s of audio per piece: the third comes 0.4 s late

    async def pieces() -> AsyncIterator[bytes]:
        for gap in gaps:
            await asyncio.sleep(gap)
            yield b"\0" * 200

    def handler(request: httpx.Request) -> httpx.Response:
        if json.loads(request.content)["text"] == "bad":
            return httpx.Response(422, json={"error": {"message": "no"}})
        return httpx.Response(200, content=pieces())

    async def run() -> tuple[StreamResult, StreamResult]:
        transport = httpx.MockTransport(handler)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            good = await stream_request(client, "Hi there.", "short", sample_rate, 0.1, 5.0, seed=1)
            bad = await stream_request(client, "bad", "short", sample_rate, 0.1, 5.0, seed=2)
        return good, bad

    good, bad = asyncio.run(run())

    assert good.ok and good.underruns == 1 and good.audio_s == pytest.approx(0.3)
    assert 0.04 < good.ttfa_s < good.total_s and good.total_s >= 0.55
    assert not bad.ok and bad.error.startswith("422") and bad.ttfa_s is None


def test_memory_check_measures_a_decode_in_a_fresh_process(tmp_path: Path) -> None:
    """`benchmarks.memory_check` on the tiny model, end to end: one case measured in its child process, the estimate
    with the scheduler's safety factor beside it."""
    out = tmp_path / "memory_check.json"
    command = [sys.executable, "-m", "benchmarks.memory_check", "--models", "tiny", "--seconds", "1", "--batches", "2"]
    subprocess.run([*command, "--threads", "1", "--out", str(out)], check=True, capture_output=True, timeout=300)
    [case] = json.loads(out.read_text())["cases"]
    assert case["batch"] == 2 and case["audio_seconds"] == pytest.approx(1.0, abs=0.05)
    # A second decode at the same shapes grows the resident set by little (0-10 MB here), and the kernel's lazy peak
    # tracking and reclaim move the figure by a few hundred KB either way (-245 KB once): a growth, not the resident
    # set itself (hundreds of MB for the tiny model) nor KiB taken for bytes.
    assert -(1 << 20) < case["measured_peak_bytes"] < 64 << 20
    assert case["estimate_bytes"] == pytest.approx(sum(case["estimate_terms_bytes"].values()) * SAFETY_FACTOR, rel=1e-6)
