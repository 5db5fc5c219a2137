"""What the Wyoming listener (`serve_app.wyoming_listener`) asks of the ingress, through the ingress's deployment handle
(no HTTP route): the voices a client without a key may use, and a text spoken as 16-bit PCM chunks on the streaming
path of every HTTP request (`Synthesis.stream_audio`), so that Wyoming has the same limits, decoder routing and
synthesis metrics as HTTP."""

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from functools import partial

from engine.runtime.synthesis_request import SynthesisRequest
from engine.voices.registry import Caller
from observability.http import SynthesisTimer
from serve_app.audio import to_pcm16
from serve_app.guard import check_voice_name
from serve_app.native_routes import default_voice
from serve_app.synthesis import Synthesis, call, delivery
from serve_app.voice_names import CatalogVoice

logger = logging.getLogger("ray.serve")

WYOMING_ENDPOINT = "wyoming"  # the `endpoint` tag of its metrics


@dataclass(frozen=True)
class WyomingCatalog:
    """What Wyoming's `describe` answers: the model and the voices a caller may use."""

    model: str
    family: str
    sample_rate: int
    languages: tuple[str, ...]
    voices: tuple[CatalogVoice, ...]


class WyomingSpeech:
    """What the Wyoming listener asks of the ingress, on the replica's `Synthesis`."""

    def __init__(self, synthesis: Synthesis) -> None:
        self.synthesis = synthesis

    async def catalog(self, caller: Caller) -> WyomingCatalog:
        """The served model and the voices `caller` may use (`Synthesis.voice_catalog`)."""
        info = await self.synthesis.model_info()
        return WyomingCatalog(
            model=self.synthesis.model_name,
            family=info.family,
            sample_rate=info.sample_rate,
            languages=info.languages,
            voices=await self.synthesis.voice_catalog(caller, info),
        )

    async def speech(
        self, text: str, voice: str | None, caller: Caller, request_id: str
    ) -> AsyncIterator[tuple[int, bytes]]:
        """`text` spoken in `voice` (a name the catalog lists; None: the model's default voice): (the model's sample
        rate, 16-bit mono PCM) for each chunk, as the decoder makes it."""
        synthesis = self.synthesis
        synthesis.check_text(text)
        info = await synthesis.model_info()
        if voice is None:
            voice = default_voice(info)
        else:
            check_voice_name(voice)  # before the name reaches the registry
            voice = await synthesis.resolve_voice(voice, caller, info)
        request = SynthesisRequest(text=text, voice=voice)
        delivery("stream", "pcm", info, request.speed)  # only its checks: PCM streams where the family streams
        request = synthesis.checked(request, info)
        first, plan = await call(partial(synthesis.encoder.encode_first.remote, request, request_id, caller))
        timer = SynthesisTimer(WYOMING_ENDPOINT, "stream", info.sample_rate)
        logger.info("Wyoming synthesis of %d segment(s)", plan.num_segments, extra={"request_id": request_id})
        async for chunk in timer.measure(synthesis.stream_audio(first, plan, request_id)):
            yield info.sample_rate, to_pcm16(chunk)
