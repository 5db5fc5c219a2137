"""A voice upload is bounded before it is decoded: a tiny file of a long, many-channel or oddly sampled signal is
refused fast with a 400, in little memory (engine.voices.cloning.decode_prompt_audio, the Encoder's register_voice).
The same uploads through a real Serve app: tests/serve/test_voice_registry.py."""

from __future__ import annotations

import io
import re
from collections.abc import Callable

import numpy as np
import pytest
import soundfile as sf

from deployments.encoder import Encoder
from engine.errors import CosyVoiceError, InvalidInputError
from engine.families import COSYVOICE1, COSYVOICE2
from engine.loading.loader import PRESET_VOICE_MODELS
from engine.voices.cloning import PROMPT_SAMPLE_RATES, PromptAudioLimits, VoiceCloner, decode_prompt_audio
from engine.voices.registry import EVERYONE, Caller, VoiceForbiddenError, VoiceRegistryFullError
from serve_app.args import AppArgs
from serve_app.ingress import voice_cloning_config
from tests.serve.conftest import bounded_in_time_and_memory, constant_flac

MAX_GROWTH_BYTES = 200 << 20  # the refused uploads below would take 300 MB to gigabytes if decoded whole
MAX_REFUSAL_S = 5.0  # generous: the bounded refusals take milliseconds
BOUNDS = (MAX_REFUSAL_S, MAX_GROWTH_BYTES)


def without_length(flac: bytes) -> bytes:
    """The FLAC file with its header's sample count zeroed: 'unknown', so only decoding can tell the length."""
    data = bytearray(flac)
    assert data[:4] == b"fLaC" and data[4] & 0x7F == 0  # the STREAMINFO block comes first
    # STREAMINFO bytes 10-17 (file bytes 18-25): rate (20 bits), channels - 1 (3), bits - 1 (5), samples (36)
    fields = int.from_bytes(data[18:26], "big") & ~((1 << 36) - 1)
    data[18:26] = fields.to_bytes(8, "big")
    return bytes(data)


def tone_wav(seconds: float, sample_rate: int, channels: int = 1) -> bytes:
    t = np.arange(int(seconds * sample_rate)) / sample_rate
    wave = 0.3 * np.sin(2 * np.pi * 220 * t) * (1 + 0.5 * np.sin(2 * np.pi * 3 * t))
    channel_waves = np.stack([wave * (1 + k) / channels for k in range(channels)], axis=1)
    buffer = io.BytesIO()
    sf.write(buffer, channel_waves, sample_rate, format="WAV", subtype="PCM_16")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def long_8_channel_flac() -> bytes:
    flac = constant_flac(600.0, channels=8)  # 307 MB as float32 samples
    assert len(flac) < 200_000
    return flac


EIGHT_CHANNELS = PromptAudioLimits(max_channels=8)  # so that an 8-channel bomb reaches the length checks
BOMBS: dict[str, tuple[Callable[[bytes], bytes], PromptAudioLimits, str]] = {  # name: (file, limits, message)
    "too many channels": (lambda flac: flac, PromptAudioLimits(), "has 8 channels; it may have at most 2"),
    "too long, by its header": (lambda flac: flac, EIGHT_CHANNELS, "lasts 600.00 s; it must last 1 to 30 s"),
    "too long, length not in the header": (without_length, EIGHT_CHANNELS, "lasts more than 30 s"),
}


@pytest.mark.parametrize(("make", "limits", "message"), BOMBS.values(), ids=BOMBS.keys())
def test_a_flac_bomb_is_refused_in_little_time_and_memory(
    long_8_channel_flac: bytes, make: Callable[[bytes], bytes], limits: PromptAudioLimits, message: str
) -> None:
    upload = make(long_8_channel_flac)
    with bounded_in_time_and_memory(*BOUNDS), pytest.raises(InvalidInputError, match=re.escape(message)):
        decode_prompt_audio(upload, limits)


@pytest.mark.parametrize("rate", [8000, 16001, 20011, 96000])
def test_a_rate_outside_the_list_is_refused_before_decoding(rate: int) -> None:
    message = f"sample rate is {rate} Hz; it must be one of 16000, 22050, 24000, 32000, 44100, 48000 Hz"
    with bounded_in_time_and_memory(*BOUNDS), pytest.raises(InvalidInputError, match=re.escape(message)):
        decode_prompt_audio(tone_wav(2.0, rate))


def test_the_configured_limits_apply() -> None:
    limits = PromptAudioLimits(min_seconds=2.5, max_seconds=4.0, max_channels=1, sample_rates=(16000,))
    with pytest.raises(InvalidInputError, match=re.escape("lasts 2.00 s; it must last 2.5 to 4 s")):
        decode_prompt_audio(tone_wav(2.0, 16000), limits)
    with pytest.raises(InvalidInputError, match=re.escape("it must be one of 16000 Hz")):
        decode_prompt_audio(tone_wav(3.0, 22050), limits)
    with pytest.raises(InvalidInputError, match=re.escape("has 2 channels; it may have at most 1")):
        decode_prompt_audio(tone_wav(3.0, 16000, channels=2), limits)
    assert decode_prompt_audio(tone_wav(3.0, 16000), limits)[0].shape == (48000,)


# --- cloning: the resampling itself is bounded --------------------------------------------------------------


@pytest.fixture(scope="module")
def cloners() -> dict[str, VoiceCloner]:
    return {
        "v1": VoiceCloner.from_model_dir(PRESET_VOICE_MODELS["tiny"], COSYVOICE1, 22050),
        "v2": VoiceCloner.from_model_dir(PRESET_VOICE_MODELS["cosyvoice2-tiny"], COSYVOICE2, 24000),
    }


@pytest.mark.parametrize("rate", [16001, 20011, 48001])
def test_cloning_refuses_a_rate_whose_resampling_kernel_is_huge(cloners: dict[str, VoiceCloner], rate: int) -> None:
    waveform = np.random.default_rng(0).uniform(-0.3, 0.3, 2 * rate).astype(np.float32)
    with bounded_in_time_and_memory(*BOUNDS), pytest.raises(InvalidInputError, match=f"from {rate} Hz to 16000 Hz"):
        cloners["v1"].clone(waveform, rate, "Hello there.")


@pytest.mark.parametrize("rate", PROMPT_SAMPLE_RATES)
@pytest.mark.parametrize("family", ["v1", "v2"])
def test_every_listed_rate_clones_in_bounded_memory(cloners: dict[str, VoiceCloner], family: str, rate: int) -> None:
    waveform, decoded_rate = decode_prompt_audio(tone_wav(2.0, rate, channels=2))
    assert decoded_rate == rate and waveform.shape == (2 * rate,)
    with bounded_in_time_and_memory(*BOUNDS):
        prompt = cloners[family].clone(waveform, rate, "Hello there.")
    assert prompt.sample_rate == cloners[family].sample_rate and prompt.speech_tokens.size > 0


# --- the Encoder deployment's register_voice, with the app's limits ------------------------------


@pytest.fixture(scope="module")
def encoder(tmp_path_factory: pytest.TempPathFactory) -> Encoder:
    args = AppArgs(model="tiny", voices_dir=str(tmp_path_factory.mktemp("voices")))
    return Encoder.func_or_class("tiny", False, args.limits.max_input_chars, voice_cloning_config(args))


UPLOADS = {  # name: (file, message)
    "a FLAC bomb": (lambda: constant_flac(600.0, channels=2), "lasts 600.00 s; it must last 1 to 30 s"),
    "an 8-channel FLAC": (lambda: constant_flac(2.0, channels=8), "has 8 channels"),
    "an odd-rate WAV": (lambda: tone_wav(2.0, 16001), "sample rate is 16001 Hz"),
}


@pytest.mark.parametrize(("make", "message"), UPLOADS.values(), ids=UPLOADS.keys())
def test_the_encoder_refuses_bad_uploads_fast(encoder: Encoder, make: Callable[[], bytes], message: str) -> None:
    upload = make()
    with bounded_in_time_and_memory(*BOUNDS), pytest.raises(InvalidInputError, match=re.escape(message)) as refused:
        encoder.register_voice(upload, "Hello there.", None, EVERYONE)
    assert refused.value.http_status == 400
    assert encoder.list_voices(EVERYONE) == []


ALICE = Caller(owner="a" * 32, admin=False)
NOT_AUDIO = b"RIFF, but no recording at all"  # decoding would refuse it: a refusal that names it came later
REFUSED_CHOICES = {  # name: (form fields, caller, error, message)
    "an invalid openai_name": ({"openai_name": "Not A Name"}, EVERYONE, InvalidInputError, "invalid openai_name"),
    "a control character in the name": ({"name": "a\x07b"}, EVERYONE, InvalidInputError, "invalid voice name"),
    "shared by a key that is no admin's": ({"shared": True}, ALICE, VoiceForbiddenError, "only an admin key"),
}


@pytest.mark.parametrize(("fields", "caller", "error", "message"), REFUSED_CHOICES.values(), ids=REFUSED_CHOICES.keys())
def test_the_forms_choices_are_refused_before_the_recording_is_decoded(
    encoder: Encoder, fields: dict[str, object], caller: Caller, error: type[CosyVoiceError], message: str
) -> None:
    with pytest.raises(error, match=message):
        encoder.register_voice(NOT_AUDIO, "Hello there.", **{"name": None, "caller": caller, **fields})


def test_a_key_at_its_voice_cap_is_refused_before_its_recording_is_decoded(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    args = AppArgs(model="tiny", voices_dir=str(tmp_path_factory.mktemp("capped")), limits={"max_voices_per_key": 1})
    capped = Encoder.func_or_class("tiny", False, args.limits.max_input_chars, voice_cloning_config(args))
    capped.register_voice(tone_wav(2.0, 16000), "Hello there.", None, ALICE)
    with pytest.raises(VoiceRegistryFullError, match="has registered 1 voices, the limit"):
        capped.register_voice(NOT_AUDIO, "Hello there.", None, ALICE)


def test_the_encoder_registers_a_stereo_44100_hz_upload(encoder: Encoder) -> None:
    record = encoder.register_voice(tone_wav(3.0, 44100, channels=2), "Hello there.", "stereo", EVERYONE)
    assert record["name"] == "stereo" and record["duration_s"] == pytest.approx(3.0)
    assert encoder.registered_prompt(record["id"], EVERYONE) is not None
    assert encoder.delete_voice(record["id"], EVERYONE)
