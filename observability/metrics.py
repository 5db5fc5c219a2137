"""The service's Prometheus metrics, recorded through `ray.serve.metrics` (Ray exports them as `ray_<name>`).

Each deployment builds its own set inside its replica (so Serve adds the deployment, replica and
application tags); the autoscaling policy builds its counter on the controller. The Grafana dashboard
`observability/grafana_dashboard.json` charts every name defined here.
"""

from __future__ import annotations

import math

from ray.serve.metrics import Counter, Gauge, Histogram

SECONDS_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 60.0, 120.0)
RTF_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 5.0, 10.0)
BATCH_SIZE_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)

REQUESTS = "cosyvoice_requests_total"
REQUEST_LATENCY = "cosyvoice_request_latency_seconds"
FIRST_CHUNK = "cosyvoice_time_to_first_chunk_seconds"
REAL_TIME_FACTOR = "cosyvoice_real_time_factor"
AUDIO_SECONDS = "cosyvoice_audio_seconds_total"
DECODER_QUEUE_DEPTH = "cosyvoice_decoder_queue_depth"
DECODER_ONGOING = "cosyvoice_decoder_ongoing_requests"
BATCH_SIZE = "cosyvoice_decoder_batch_size"
GPU_MEMORY_ALLOCATED = "cosyvoice_decoder_gpu_memory_allocated_bytes"
GPU_MEMORY_RESERVED = "cosyvoice_decoder_gpu_memory_reserved_bytes"
AUTOSCALING_DECISIONS = "cosyvoice_autoscaling_decisions_total"
UTILIZATION_FROM_BUSY_TIME = "cosyvoice_decoder_utilization_from_busy_time"
PRECISION_FALLBACKS = "cosyvoice_decoder_precision_fallbacks_total"
DECODER_LOOP_FAILURES = "cosyvoice_decoder_loop_failures_total"
DECODER_OUT_OF_MEMORY = "cosyvoice_decoder_out_of_memory_total"
DECODER_LIVE_LIMIT = "cosyvoice_decoder_live_limit"
DECODER_BISTREAM_SLOTS_FREE = "cosyvoice_decoder_bistream_slots_free"
DECODER_FIRST_AUDIO = "cosyvoice_decoder_time_to_first_audio_seconds"
STREAM_UNDERRUNS = "cosyvoice_decoder_stream_underruns_total"
STREAM_MIN_SLACK = "cosyvoice_decoder_stream_min_slack_seconds"
PROMPT_CACHE_LOOKUPS = "cosyvoice_decoder_prompt_cache_lookups_total"
PROMPT_CACHE_BYTES = "cosyvoice_decoder_prompt_cache_bytes"
# The least slack of a stream (Ray's buckets are positive: a stream that stalled counts as 0, in the first bucket;
# the underruns counter counts its stalls)
SLACK_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)


class IngressMetrics:
    """Per request: count by endpoint and status code; for synthesis also latency, first chunk, RTF, audio."""

    def __init__(self) -> None:
        self.requests = Counter(
            REQUESTS,
            "HTTP requests by endpoint, the status code the client got, and outcome (complete, or aborted: the body "
            "was cut after the status line)",
            ("endpoint", "status_code", "outcome"),
        )
        synthesis_tags = ("endpoint", "mode")
        self.latency = Histogram(REQUEST_LATENCY, "Request start to last audio byte", SECONDS_BUCKETS, synthesis_tags)
        self.first_chunk = Histogram(
            FIRST_CHUNK,
            "Request start to the first audio chunk (whole mode: to the whole body)",
            SECONDS_BUCKETS,
            synthesis_tags,
        )
        self.real_time_factor = Histogram(
            REAL_TIME_FACTOR,
            "Request latency / audio duration (below 1: faster than real time)",
            RTF_BUCKETS,
            synthesis_tags,
        )
        self.audio_seconds = Counter(AUDIO_SECONDS, "Seconds of audio produced", synthesis_tags)

    def record_synthesis(
        self, endpoint: str, mode: str, first_chunk_s: float, latency_s: float, audio_s: float
    ) -> None:
        tags = {"endpoint": endpoint, "mode": mode}
        self.first_chunk.observe(first_chunk_s, tags)
        self.latency.observe(latency_s, tags)
        if audio_s > 0:  # a Ray Counter refuses 0 (an LLM that stops before its first token gives no audio)
            self.audio_seconds.inc(audio_s, tags)
            self.real_time_factor.observe(latency_s / audio_s, tags)


class DecoderMetrics:
    """Queue depth, ongoing requests and GPU memory of a decoder replica; its batch sizes by path; its requests
    recomputed in float32 (engine.nn.precision's NaN guard)."""

    def __init__(self) -> None:
        self.queue_depth = Gauge(DECODER_QUEUE_DEPTH, "Requests waiting in the replica for a batch")
        self.ongoing = Gauge(DECODER_ONGOING, "Requests in the replica: waiting plus decoding")
        self.batch_size = Histogram(BATCH_SIZE, "Requests per decoder batch", BATCH_SIZE_BUCKETS, ("path",))
        self.gpu_allocated = Gauge(GPU_MEMORY_ALLOCATED, "torch-allocated GPU memory of the replica (0 on CPU)")
        self.gpu_reserved = Gauge(GPU_MEMORY_RESERVED, "torch-reserved (cached) GPU memory of the replica (0 on CPU)")
        self.utilization_from_busy_time = Gauge(
            UTILIZATION_FROM_BUSY_TIME,
            "1: the replica reports its busy-time fraction as autoscaling utilization (no GPU, or NVML unavailable); "
            "0: NVML GPU utilization",
        )
        self.first_audio = Histogram(
            DECODER_FIRST_AUDIO,
            "A request's arrival in the decoder loop to its first audio handed on (whole: to its audio), by path",
            SECONDS_BUCKETS,
            ("path",),
        )
        self.underruns = Counter(
            STREAM_UNDERRUNS,
            "Stream chunks handed on after the stream's listener (playing at 1x from its first chunk) had run out",
        )
        self.min_slack = Histogram(
            STREAM_MIN_SLACK,
            "Per stream, the least audio its listener had left when a chunk was handed on (0 if it stalled)",
            SLACK_BUCKETS,
        )
        self.loop_failures = Counter(
            DECODER_LOOP_FAILURES,
            "Decoder loops ended by a fault no single request explains (their requests got 503; the replica is "
            "replaced); a request's own fault ends that request alone and is not counted here",
        )
        self.out_of_memory = Counter(
            DECODER_OUT_OF_MEMORY,
            "Decoder work (an LLM step, a flow + vocoder run) that ran out of GPU memory and was put back and retried "
            "under a lowered live limit; a request that cannot fit even alone ends with 503",
        )
        self.live_limit = Gauge(
            DECODER_LIVE_LIMIT,
            "Live sentences the replica's loop admits now: its max batch size, lower for a while after running out of "
            "GPU memory",
        )
        self.bistream_slots_free = Gauge(
            DECODER_BISTREAM_SLOTS_FREE,
            "Bi-streamed utterances (text streams on CosyVoice2/3) the replica can still take: its max batch size less "
            "those it decodes; every session that ends, however, gives its slot back",
        )
        self.precision_fallbacks = Counter(
            PRECISION_FALLBACKS,
            "Requests whose reduced-precision flow mel or audio was not finite and were recomputed in float32; "
            "recovered: whether float32 was finite",
            ("stage", "recovered"),
        )

        self.prompt_cache_lookups = Counter(
            PROMPT_CACHE_LOOKUPS,
            "Sentences in a cloned voice by whether the voice's prepared prompt was in the replica's cache (result: "
            "hit or miss)",
            ("result",),
        )
        self.prompt_cache_bytes = Gauge(
            PROMPT_CACHE_BYTES, "Bytes the replica's cache of prepared voice prompts holds (within its memory budget)"
        )
        self._prompt_cache_counted = {"hit": 0, "miss": 0}

    def record_prompt_cache(self, hits: int, misses: int, nbytes: int) -> None:
        """The cache's running totals: the lookups since the last call are counted."""
        for result, total in (("hit", hits), ("miss", misses)):
            new = total - self._prompt_cache_counted[result]
            if new > 0:  # a Ray Counter refuses 0
                self.prompt_cache_lookups.inc(new, {"result": result})
                self._prompt_cache_counted[result] = total
        self.prompt_cache_bytes.set(nbytes)

    def record_playback(self, streaming: bool, first_audio_s: float | None, underruns: int, min_slack_s: float) -> None:
        """What a request's listener felt, once it ended (engine.runtime.playback.PlaybackClock's figures)."""
        if first_audio_s is not None:
            self.first_audio.observe(first_audio_s, {"path": "stream" if streaming else "whole"})
        if streaming and underruns:
            self.underruns.inc(underruns)
        if streaming and math.isfinite(min_slack_s):
            self.min_slack.observe(max(0.0, min_slack_s))

    def record_precision_fallback(self, stage: str, recovered: bool) -> None:
        """A listener for engine.nn.precision.FALLBACKS."""
        self.precision_fallbacks.inc(tags={"stage": stage, "recovered": str(recovered).lower()})


class AutoscalingMetrics:
    """Replica-count decisions of the autoscaling policies, by deployment, direction and reason."""

    def __init__(self) -> None:
        self.decisions = Counter(
            AUTOSCALING_DECISIONS,
            "Target replica changes asked by the policy",
            ("deployment", "direction", "reason"),
        )
