"""A baseline server built like the official CosyVoice FastAPI server: one model copy, one request at a time.

It serves the subset of `/v1/tts` (and `/v1/voices`) that `serve_app.bench.http_load` sends, on the same
engine: a whole request is one `CosyVoice.synthesize` call; a streaming one yields each sentence's audio
as it is decoded (as the official server yields per sentence). A lock keeps one request on the model.

    python -m benchmarks.baseline_server --model tiny --port 8100 [--threads 1] [--device cuda --dtype float16]
"""

from __future__ import annotations

import argparse
import threading
from collections.abc import Iterator
from typing import Any

import torch
import uvicorn
from fastapi import FastAPI
from fastapi.responses import Response, StreamingResponse

from engine.llm.sampling import SamplingOptions
from engine.runtime.pipeline import CosyVoice
from engine.runtime.synthesis_request import SynthesisRequest
from serve_app.audio import to_pcm16


def build_baseline(tts: CosyVoice) -> FastAPI:
    app = FastAPI(title="cosyvoice baseline")
    model_lock = threading.Lock()

    @app.get("/v1/voices")
    def voices() -> dict[str, Any]:
        return {"voices": tts.voices, "sample_rate": tts.sample_rate}

    # Plain `def` endpoints run in the server's thread pool, as in the official server; the lock serializes them.
    @app.post("/v1/tts")
    def synthesize(body: dict[str, Any]) -> Response:
        voice = body.get("voice") or tts.voices[0]
        options = {**body.get("sampling", {}), "seed": body.get("seed")}
        if not body.get("stream"):
            with model_lock:
                audio, _ = tts.synthesize(body["text"], voice, **options)
            return Response(to_pcm16(audio), media_type="audio/pcm")

        def sentences() -> Iterator[bytes]:
            request = SynthesisRequest(text=body["text"], voice=voice, sampling=SamplingOptions(**options))
            with model_lock:
                for segment in tts.encoder.encode(request.validated()):
                    [audio] = tts.decoder.decode_batch([segment])
                    if isinstance(audio, Exception):
                        raise audio
                    yield to_pcm16(audio)

        return StreamingResponse(sentences(), media_type="audio/pcm")

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (Ray gives a replica 1)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    options = parser.parse_args()
    torch.set_num_threads(options.threads)
    tts = CosyVoice.load(options.model, device=options.device, dtype=options.dtype)
    uvicorn.run(build_baseline(tts), host="127.0.0.1", port=options.port, log_level="warning")


if __name__ == "__main__":
    main()
