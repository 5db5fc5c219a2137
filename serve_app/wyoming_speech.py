"""What the Wyoming listener (`serve_app.wyoming_server`) asks of the ingress, through the ingress's deployment handle
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
from serve_app.native_routes import NativeRoutes
from serve_app.synthesis import CatalogVoice

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


class WyomingSpeech(NativeRoutes):
    async def wyoming_catalog(self, caller: Caller) -> WyomingCatalog:
        """The served model and the voices `caller` may use (`Synthesis.voice_catalog`)."""
        info = await self.model_info()
        return WyomingCatalog(
            model=self.model_name,
            family=info["family"],
            sample_rate=info["sample_rate"],
            languages=tuple(info["languages"]),
            voices=await self.voice_catalog(caller),
        )

    async def wyoming_speech(
        self, text: str, voice: str | None, caller: Caller, request_id: str
    ) -> AsyncIterator[tuple[int, bytes]]:
        """`text` spoken in `voice` (a name the catalog lists; None: the model's default voice): (the model's sample
        rate, 16-bit mono PCM) for each chunk, as the decoder makes it."""
        self.check_text(text)
        if voice is None:
            voice = await self.default_voice()
        else:
            check_voice_name(voice)  # before the name reaches the registry
            voice = await self.resolve_voice(voice, caller)
        request, _, info = await self.checked(SynthesisRequest(text=text, voice=voice), "pcm", "stream")
        first, plan = await self.call(partial(self.encoder.encode_first.remote, request, request_id, caller))
        timer = SynthesisTimer(WYOMING_ENDPOINT, "stream", info["sample_rate"])
        logger.info("Wyoming synthesis of %d segment(s)", plan.num_segments, extra={"request_id": request_id})
        async for chunk in timer.measure(self.stream_audio(first, plan, request_id)):
            yield info["sample_rate"], to_pcm16(chunk)
