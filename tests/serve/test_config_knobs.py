"""The app args as a person reads them: how many knobs they have, each documented, and what an old config that
sets a removed or moved field is told.

Counting rule (`serve_app.full_config.leaf_knobs`): walk `AppArgs` from the top; a field whose type holds a pydantic
model (itself, optional, or a tuple of them, such as `voices` and a schedule's `windows`) is a section, walked into;
every other field is a leaf knob, counted once per place a config can set it (`ingress.num_cpus` and
`encoder.num_cpus` are two knobs, though the replica base documents them once).
"""

from __future__ import annotations

import logging
import types

import pytest
from pydantic import ValidationError

from serve_app.args import AppArgs
from serve_app.full_config import knob_table, leaf_knobs, main
from serve_app.request_args import LimitsArgs

# The most leaf knobs the app args may have. Only lower it: a new knob must replace one (or be derived instead).
MAX_LEAF_KNOBS = 84


def test_the_count_follows_the_rule() -> None:
    """The walk finds nested sections (optional ones and tuples of them too) and counts none of them as a knob."""
    knobs = dict(leaf_knobs())
    assert "decoder.autoscaling.rules.schedule.windows.start" in knobs  # a tuple of models, walked into
    assert "encoder.autoscaling.max_replicas" in knobs  # an optional section
    assert "ingress.num_cpus" in knobs and "encoder.num_cpus" in knobs  # one base, counted where each is set
    assert not {"decoder", "decoder.autoscaling", "voices", "decoder.autoscaling.rules.schedule"} & knobs.keys()
    assert isinstance(AppArgs.model_fields["voices"].annotation, types.GenericAlias)


def test_the_app_args_have_at_most_the_allowed_knobs() -> None:
    knobs = [name for name, _ in leaf_knobs()]
    assert len(knobs) == len(set(knobs))
    assert len(knobs) <= MAX_LEAF_KNOBS, f"{len(knobs)} leaf knobs, at most {MAX_LEAF_KNOBS}: {knobs}"


def test_the_knob_table_lists_each_knob_once_with_its_default(capsys: pytest.CaptureFixture[str]) -> None:
    main(["--knobs"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| `")]
    assert [row.split("`")[1] for row in rows] == [name for name, _ in leaf_knobs()]
    assert "| `decoder.prompt_cache_share` | `0.1` | share of a decoder replica's memory budget" in knob_table()
    assert "| `voices.file` | required |" in knob_table()


def test_every_knob_is_documented() -> None:
    """Every leaf knob has its description in args.py (or the autoscaling rules' models): the one place a person
    reads it, and what `python -m serve_app.full_config` and the docs point to."""
    undocumented = [name for name, info in leaf_knobs() if not (info.description or "").strip()]
    assert not undocumented


@pytest.mark.parametrize(
    ("section", "field", "named"),
    [
        ("scheduler", "first_audio_hold_s", "measured best, 1 s"),
        ("scheduler", "min_preempt_slack_s", "fixed at 1 s"),
        ("scheduler", "first_audio_passover_s", "no difference beyond noise"),
        ("limits", "health_timeout_s", "HEALTH_PROBE_TIMEOUT_S"),
        ("decoder_cpu", "autoscaling_config", "decoder_cpu.max_replicas"),
        ("decoder_cpu", "batch_wait_timeout_s", "decoder.batch_wait_timeout_s"),
        ("limits", "max_input_tokens", "1.5 x max_input_chars"),
        ("limits", "max_prompt_audio_channels", "MAX_PROMPT_CHANNELS"),
        ("wyoming", "num_cpus", "WYOMING_NUM_CPUS"),
        ("decoder", "resources", "cpu_resources"),
        ("security", "api_keys_env", "fixed at COSYVOICE_API_KEYS"),
        ("security", "admin_keys_env", "fixed at COSYVOICE_ADMIN_KEYS"),
        ("limits", "max_prompt_audio_s", "fixed at 30 s .*speech tokenizer's limit"),
        ("limits", "prompt_audio_sample_rates", "fixed at 16000, .* 48000 Hz"),
        ("wyoming", "max_connections", "fixed at 16"),
        ("wyoming", "zeroconf", "where the zeroconf package is installed"),
        ("scheduler", "whole_deadline_factor", "fixed at 2 .*WHOLE_DEADLINE_FACTOR"),
        ("decoder", "max_vocode_batch", "fixed at 8 on a GPU, 1 on CPU"),
        ("limits", "max_text_streams_per_key", "derived: half of max_concurrent_requests_per_key"),
        ("limits", "body_read_timeout_s", "fixed at 10 s .*BODY_READ_IDLE_S"),
        ("limits", "body_read_deadline_s", "fixed at 120 s"),
        ("limits", "retry_after_s", "fixed at 1 s .*RETRY_AFTER_S"),
        ("decoder_cpu", "poll_interval_s", "fixed at 2 s .*ROUTING_POLL_S"),
        ("decoder_cpu", "wake_hold_s", "fixed at 900 s .*WAKE_HOLD_S"),
        ("limits", "text_stream_idle_s", "fixed at 60 s .*TEXT_STREAM_IDLE_S"),
        ("limits", "reroute_s", "fixed at 30 s .*REROUTE_S"),
    ],
)
def test_a_removed_field_is_refused_with_what_replaced_it(section: str, field: str, named: str) -> None:
    with pytest.raises(ValidationError, match=f"{field} was removed: .*{named}"):
        AppArgs.model_validate({section: {field: 1.0}})


def test_the_removed_audio_section_is_refused_with_its_fixed_bit_rates() -> None:
    with pytest.raises(ValidationError, match=r"audio was removed: .*mp3 160, aac 96 and opus 64 kbit/s"):
        AppArgs.model_validate({"audio": {"mp3_kbps": 128}})


@pytest.mark.parametrize(
    ("rule", "named"),
    [
        ("queue_scale_up_factor", "fixed at 2 .*max_replicas"),
        ("scale_up_cooldown_s", ".*the windows restart.*never held a step back"),
        ("scale_down_cooldown_s", ".*a -1 waits a whole scale_down_window_s"),
    ],
)
def test_a_removed_scaling_rule_is_refused_with_why(rule: str, named: str) -> None:
    with pytest.raises(ValidationError, match=f"{rule} was removed: {named}"):
        AppArgs.model_validate({"decoder": {"autoscaling": {"rules": {rule: 3.0}}}})


def test_the_encoders_fixed_timing_names_the_serve_config_override() -> None:
    with pytest.raises(ValidationError, match=r"upscale_delay_s was removed: fixed at 5 s.*deployments:"):
        AppArgs.model_validate({"encoder": {"autoscaling": {"upscale_delay_s": 1}}})
    scaling = AppArgs.model_validate({"encoder": {"autoscaling": {"max_replicas": 3}}}).encoder.autoscaling
    assert scaling is not None and scaling.serve_config()["upscale_delay_s"] == 5.0


def test_the_prompt_cache_share_moved_to_the_decoder(caplog: pytest.LogCaptureFixture) -> None:
    serve_logger = logging.getLogger("ray.serve")  # Ray's, which does not propagate to the root logger
    serve_logger.addHandler(caplog.handler)
    try:
        args = AppArgs.model_validate({"scheduler": {"prompt_cache_share": 0.25, "policy": "fcfs"}})
    finally:
        serve_logger.removeHandler(caplog.handler)
    assert args.decoder.prompt_cache_share == 0.25 and args.scheduler.policy == "fcfs"
    assert "decoder.prompt_cache_share" in caplog.text
    with pytest.raises(ValidationError, match="set twice"):
        AppArgs.model_validate({"scheduler": {"prompt_cache_share": 0.2}, "decoder": {"prompt_cache_share": 0.3}})


def test_the_cpu_replicas_resources_moved_to_one_field(caplog: pytest.LogCaptureFixture) -> None:
    """An old config's equal `resources` on every deployed CPU section are read as `cpu_resources`; one that leaves a
    deployed section out, or gives two, is refused (moving it would pin that section too, or pick one)."""
    pinned = {"resources": {"cpu_node": 1}}
    serve_logger = logging.getLogger("ray.serve")
    serve_logger.addHandler(caplog.handler)
    try:
        args = AppArgs.model_validate({"ingress": pinned, "encoder": {**pinned, "int8": True}})
    finally:
        serve_logger.removeHandler(caplog.handler)
    assert args.cpu_resources == {"cpu_node": 1} and args.encoder.int8
    assert "read as cpu_resources" in caplog.text
    for refused in (
        {"ingress": pinned},
        {"ingress": pinned, "encoder": pinned, "decoder_cpu": {"enabled": True}},
        {"ingress": pinned, "encoder": {"resources": {"other": 1}}},
        {"ingress": pinned, "encoder": pinned, "cpu_resources": {"cpu_node": 1}},
    ):
        with pytest.raises(ValidationError, match="places every CPU replica"):
            AppArgs.model_validate(refused)


def test_the_token_bound_follows_the_character_bound() -> None:
    assert LimitsArgs(max_input_chars=200).max_input_tokens == 300
