"""`/v1/voices`: the model's speakers and the registered (cloned) voices; registering and deleting one."""

from functools import partial
from typing import Annotated, Any

from fastapi import APIRouter, File, Form, Request, UploadFile

from deployments.encoder import VoiceCloningNotConfiguredError
from engine.errors import UnknownVoiceError
from engine.voices.cloning import MAX_PROMPT_AUDIO_BYTES
from engine.voices.registry import check_choices
from serve_app.audio import FORMATS
from serve_app.errors import UploadTooLargeError
from serve_app.schemas import Text
from serve_app.synthesis import Synthesis, call
from serve_app.tenancy import caller_of
from serve_app.voice_names import openai_voice_table

VOICES_PATH = "/v1/voices"


class VoiceRoutes:
    """`/v1/voices`, on the replica's `Synthesis`."""

    def __init__(self, synthesis: Synthesis) -> None:
        self.synthesis = synthesis

    def router(self) -> APIRouter:
        router = APIRouter()
        router.add_api_route(VOICES_PATH, self.voices, methods=["GET"])
        router.add_api_route(VOICES_PATH, self.register_voice, methods=["POST"], status_code=201)
        router.add_api_route(VOICES_PATH + "/{voice_id}", self.delete_voice, methods=["DELETE"])
        return router

    async def voices(self, http: Request) -> dict[str, Any]:
        """Built-in speakers (`voices`), registered voices (`registered_voices`: records with their ids; with API
        keys, the key's own and the shared ones), the voice each OpenAI voice name stands for (`openai_voices`), and
        what the model and server can do."""
        synthesis = self.synthesis
        info = await synthesis.model_info()
        registered = await call(partial(synthesis.encoder.list_voices.remote, caller_of(http.scope)))
        return {
            "model": synthesis.model_name,  # the name a text stream's `start` gives (the page's "speak as I type")
            "voices": info.voices,
            "sample_rate": info.sample_rate,
            "formats": sorted(FORMATS),
            "stream_formats": [name for name, fmt in FORMATS.items() if fmt.streamable],
            "registered_voices": registered,
            "openai_voices": openai_voice_table(synthesis.openai.voices, info.voices, info.default_voice),
            "voice_cloning": info.voice_cloning,
            "instructions": info.instructions,
        }

    async def register_voice(
        self,
        file: Annotated[
            UploadFile,
            File(
                description="a 1-30 s mono or stereo recording of the voice at 16, 22.05, 24, 32, 44.1 or 48 kHz "
                "(wav, flac, ogg, mp3)"
            ),
        ],
        transcript: Annotated[Text, Form(description="what the recording says")],
        http: Request,
        name: Annotated[Text | None, Form(description="a display name")] = None,
        shared: Annotated[bool, Form(description="usable by every API key (admin keys only)")] = False,
        openai_name: Annotated[
            Text | None, Form(description="a name OpenAI clients may send as `voice` for it, e.g. narrator")
        ] = None,
    ) -> dict[str, Any]:
        """Clone a voice from a short recording and its transcript; the returned `id` is usable as `voice` (with API
        keys, by this key only, unless an admin key makes it `shared`)."""
        if not (await self.synthesis.model_info()).voice_cloning:
            raise VoiceCloningNotConfiguredError()
        caller = caller_of(http.scope)
        check_choices(name, caller, shared, openai_name)  # the cheap refusals first (the encoder's per-key cap too)
        audio = await file.read(MAX_PROMPT_AUDIO_BYTES + 1)  # the size is checked before anything decodes the file
        if len(audio) > MAX_PROMPT_AUDIO_BYTES:
            raise UploadTooLargeError(f"the audio file is larger than the limit of {MAX_PROMPT_AUDIO_BYTES} bytes")
        register = partial(
            self.synthesis.encoder.register_voice.remote, audio, transcript, name, caller, shared, openai_name
        )
        return await call(register)

    async def delete_voice(self, voice_id: str, http: Request) -> dict[str, Any]:
        if not await call(partial(self.synthesis.encoder.delete_voice.remote, voice_id, caller_of(http.scope))):
            raise UnknownVoiceError(f"no registered voice has the id {voice_id!r}")
        return {"id": voice_id, "object": "voice", "deleted": True}
