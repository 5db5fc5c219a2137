"""What a decoder loop reports of itself: its counters, its limits and load now, its cache of voice prompts (a
replica's `batch_stats` adds its own admission figures to this)."""

from __future__ import annotations

from typing import Any

from engine.runtime.scheduler import Scheduler


def loop_report(scheduler: Scheduler) -> dict[str, Any]:
    """The loop's counters since start ({size: count} for the batch sizes), its limits and its load now."""
    stats, cache = scheduler.stats, scheduler.prompt_cache
    return {
        "max_vocode_batch": scheduler.max_vocode_batch,
        "llm_batch_size_counts": dict(stats.llm_batch_size_counts),
        "joined_running_batch": stats.joined_running_batch,
        "mixed_steps": stats.mixed_steps,
        "pipelined_sentences": stats.pipelined_sentences,
        "vocode_batch_size_counts": dict(stats.vocode_batch_size_counts),
        "bistream_batch_size_counts": dict(stats.bistream_batch_size_counts),
        "llm_steps_while_vocoding": stats.llm_steps_while_vocoding,
        "first_lane_chunks": stats.first_lane_chunks,
        "admitted": stats.admitted,
        "cancelled": stats.cancelled,
        "request_faults": stats.request_faults,
        "policy": scheduler.policy.name,
        "preempted": stats.preempted,
        "resumed": stats.resumed,
        "held_for_first_audio": stats.held_for_first_audio,
        "over_limit": stats.over_limit,
        "out_of_memory": stats.out_of_memory,
        "oom_paused": stats.oom_paused,
        "oom_ended": stats.oom_ended,
        "live_limit": scheduler.live_limit,
        "loop_failed": scheduler.failure is not None,
        "live": scheduler.live,
        "queued": scheduler.queued,
        "awaiting_sentences": scheduler.awaiting_sentences,
        "live_bytes": scheduler.live_bytes,
        "memory_budget_bytes": scheduler.limits.memory_budget_bytes,
        "prompt_cache": {
            "hits": cache.stats.hits,
            "misses": cache.stats.misses,
            "evictions": cache.stats.evictions,
            "entries": len(cache),
            "bytes": cache.nbytes,
            "max_bytes": cache.max_bytes,
        },
    }
