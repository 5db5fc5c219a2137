"""The app args as a person reads them: how many knobs they have, each documented, and what an old config that
sets a removed or moved field is told.

Counting rule (`serve_app.full_config.leaf_knobs`): walk `AppArgs` from the top; a field whose type holds a pydantic
model (itself, optional, or a tuple of them, such as `voices` and a schedule's `windows`) is a section, walked into;
every other field is a leaf knob, counted once per place a config can set it (`decoder.autoscaling.rules.max_replicas`
and `decoder_cpu.max_replicas` are two knobs). Serve's own options of the deployments are not app args: a Serve
config's `deployments:` section sets them (`serve_app.deployment_options`).
"""

from __future__ import annotations

import logging
import types
from typing import Any

import pytest
from pydantic import ValidationError
from ray.serve._private.build_app import build_app as build_deployments

from serve_app.args import AppArgs
from serve_app.full_config import knob_table, leaf_knobs, main
from serve_app.ingress import build_app_with_overrides
from serve_app.request_args import LimitsArgs

# The most leaf knobs the app args may have. Only lower it: a new knob must replace one (or be derived instead).
MAX_LEAF_KNOBS = 60


def test_the_count_follows_the_rule() -> None:
    """The walk finds nested sections (optional ones and tuples of them too) and counts none of them as a knob."""
    knobs = dict(leaf_knobs())
    assert "decoder.autoscaling.rules.schedule.windows.start" in knobs  # a tuple of models, walked into
    assert "decoder.autoscaling.rules.max_replicas" in knobs  # inside an optional section
    assert "decoder_cpu.max_replicas" in knobs  # a field of the same name, counted where each is set
    assert not {"decoder", "decoder.autoscaling", "voices", "decoder.autoscaling.rules.schedule"} & knobs.keys()
    assert not {"ingress.num_cpus", "encoder.num_replicas", "decoder.max_ongoing_requests"} & knobs.keys()  # Serve's
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
        ("wyoming", "num_cpus", "`ray_actor_options: {num_cpus: ...}` of deployment `WyomingServer`"),
        ("wyoming", "resources", "`ray_actor_options: .*` of deployment `WyomingServer`"),
        (
            "encoder",
            "num_cpus",
            "`ray_actor_options: {num_cpus: ...}` of deployment `Encoder` in the Serve config's `deployments:`",
        ),
        ("encoder", "autoscaling", "`autoscaling_config: .*` of deployment `Encoder`"),
        ("decoder", "max_ongoing_requests", "of deployment `Decoder`.*2 x max_batch_size x 2 admission batches"),
        ("decoder", "max_concurrent_batches", "fixed at 2 .*MAX_CONCURRENT_BATCHES"),
        ("openai", "model_aliases", "fixed at tts-1, tts-1-hd, gpt-4o-mini-tts"),
        ("decoder", "num_replicas", "`num_replicas` of deployment `Decoder`"),
        ("decoder", "resources", "decoder.num_cpus and decoder.num_gpus"),
        ("decoder_cpu", "num_cpus", "of deployment `DecoderCPU`"),
        ("decoder_cpu", "num_replicas", "`num_replicas` of deployment `DecoderCPU`.*autoscaling_config: null"),
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


@pytest.mark.parametrize(
    ("config", "named"),
    [
        ({"ingress": {"num_replicas": 2}}, "ingress was removed: .*of deployment `TTSIngress`"),
        ({"cpu_resources": {"cpu_node": 1}}, "cpu_resources was removed: .*resources: {cpu_node: 1}.*`TTSIngress, "),
        ({"decoder": {"autoscaling": {"look_back_period_s": 5}}}, "look_back_period_s was removed: .*30 s"),
        ({"decoder": {"autoscaling": {"metrics_interval_s": 5}}}, "metrics_interval_s was removed: .*10 s"),
    ],
)
def test_a_removed_section_or_setting_is_refused_with_what_replaced_it(config: dict, named: str) -> None:
    with pytest.raises(ValidationError, match=named):
        AppArgs.model_validate(config)


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


def test_the_token_bound_follows_the_character_bound() -> None:
    assert LimitsArgs(max_input_chars=200).max_input_tokens == 300


def built(args: dict[str, Any], deployments: list[dict[str, Any]]) -> dict[str, Any]:
    """The deployments `build_app_with_overrides` makes of `args` and `deployments`, by name (no Ray needed)."""
    app = build_app_with_overrides(args, deployments)
    return {deployment.name: deployment for deployment in build_deployments(app, name="app").deployments}


def test_a_deployment_override_reaches_the_deployment_as_serve_applies_it() -> None:
    deployments = built(
        {"decoder_cpu": {"enabled": True}},
        [
            {"name": "TTSIngress", "num_replicas": 3, "max_ongoing_requests": 100},
            {"name": "Encoder", "ray_actor_options": {"num_cpus": 2, "resources": {"cpu_node": 1}}},
            {"name": "DecoderCPU", "autoscaling_config": None, "num_replicas": 2, "max_queued_requests": 5},
        ],
    )
    ingress = deployments["TTSIngress"]
    assert (ingress.num_replicas, ingress.max_ongoing_requests) == (3, 100)
    assert ingress._deployment_config.max_queued_requests == 256  # the code's, where the override says nothing
    # ray_actor_options replaced whole, as Serve replaces them (num_gpus: Ray's default)
    assert deployments["Encoder"].ray_actor_options == {"num_cpus": 2.0, "resources": {"cpu_node": 1}}
    fallback = deployments["DecoderCPU"]._deployment_config
    assert fallback.autoscaling_config is None and fallback.num_replicas == 2 and fallback.max_queued_requests == 5
    decoder = deployments["Decoder"]
    assert decoder.max_ongoing_requests == 2 * 8 * 2  # the derived default: 2 x max_batch_size x max_concurrent
    assert decoder.ray_actor_options == {"num_cpus": 0.5, "num_gpus": 0.0}


def test_a_replica_count_beside_the_codes_autoscaling_leaves_the_autoscaling_in_force() -> None:
    """As Serve's override does (it keeps the code's autoscaling_config): an autoscaling_config set by either wins."""
    scaled = {"decoder": {"autoscaling": {"rules": {"max_replicas": 3}}}}
    decoder = built(scaled, [{"name": "Decoder", "num_replicas": 2}])["Decoder"]._deployment_config
    assert decoder.autoscaling_config is not None and decoder.autoscaling_config.max_replicas == 3
    encoder = built({}, [{"name": "Encoder", "autoscaling_config": {"min_replicas": 1, "max_replicas": 4}}])
    assert encoder["Encoder"]._deployment_config.autoscaling_config.max_replicas == 4


@pytest.mark.parametrize(
    ("deployments", "named"),
    [
        ([{"name": "Ingress"}], r"no deployment 'Ingress' in this app; its deployments: \['Decoder', 'Encoder', "),
        ([{"name": "DecoderCPU"}], "no deployment 'DecoderCPU'"),  # not deployed: decoder_cpu.enabled is off
        ([{"name": "Encoder", "num_cpus": 2}], r"Encoder has no option num_cpus; Serve's options: \[.*'ray_actor_"),
        ([{"name": "Encoder", "max_ongoing_requests": "many"}], "Encoder: .*max_ongoing_requests"),
        ([{"name": "Encoder"}, {"name": "Encoder"}], "Encoder is listed twice"),
        ([{"name": "Decoder", "ray_actor_options": {"num_cpus": 4}}], "decoder.num_cpus and decoder.num_gpus"),
        ([{"name": "Decoder", "max_ongoing_requests": 4}], r"max_batch_size x 2 admission batches at once \(16\)"),
        ([{"name": "TTSIngress", "max_ongoing_requests": 32}], r"max_text_streams \(32\) must be below TTSIngress"),
    ],
)
def test_a_bad_deployment_override_is_a_clear_error(deployments: list[dict[str, Any]], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        build_app_with_overrides({}, deployments)
