"""Which sentences generate tokens: admission in the policy's order within the live limits, preemption of a
sentence with slack to spare for an earlier deadline, and the rows held out while a stream's first audio is made
(docs/scheduler.md, "Order: playback deadlines" and "Memory")."""

from __future__ import annotations

from functools import partial

import torch

from engine.errors import as_request_error
from engine.runtime.bistream import open_bistream_decoder
from engine.runtime.decoder_stage import SpeechDecoderStage
from engine.runtime.live_limits import LiveLimits
from engine.runtime.loop_state import Sentence, awaits_first_audio
from engine.runtime.playback import SchedulingPolicy
from engine.runtime.prompt_cache import PromptCache
from engine.runtime.request_set import RequestSet


class Admission:
    """Admits, pauses, resumes and holds the loop's sentences; used on the loop thread."""

    def __init__(
        self,
        stage: SpeechDecoderStage,
        requests: RequestSet,
        limits: LiveLimits,
        policy: SchedulingPolicy,
        prompt_cache: PromptCache,
        hold_rows: bool,
    ) -> None:
        self.stage, self.requests, self.limits, self.policy, self.prompt_cache = (
            stage,
            requests,
            limits,
            policy,
            prompt_cache,
        )
        self.llm, self.streams, self.lanes = requests.llm, requests.streams, requests.lanes
        self.stats, self.clock = requests.stats, requests.clock
        self.hold_rows = hold_rows

    def candidates(self) -> list[Sentence]:
        """The sentences that may join the LLM batch, in the policy's order: each queued request's next one (a
        running request's once the sentences before it have all their tokens) and the paused ones."""
        keyed = [
            (self.policy.admission_key(t, continues=bool(t.admitted)), t.sentences[t.admitted])
            for t in self.requests.queue
            if all(s.tokens_done for s in t.sentences[: t.admitted])
        ]
        keyed += [(self.policy.admission_key(s.request, continues=True), s) for s in self.requests.live if s.paused]
        return [sentence for _, sentence in sorted(keyed, key=lambda item: item[0])]

    def fits(self, sentence: Sentence) -> bool:
        """Whether `sentence` may join the batch now: a free slot, and room in the memory budget (an empty loop
        takes any sentence: submissions larger than the whole budget were refused)."""
        if self.requests.generating_slots >= self.limits.live_limit:
            return False
        budget, held = self.limits.memory_budget_bytes, self.requests.live_bytes
        needed = 0 if sentence.cache_kept else sentence.memory_bytes
        if budget is None:
            return True
        self.trim_prompt_cache(held + needed)
        return not held or held + needed + self.prompt_cache.nbytes <= budget

    def trim_prompt_cache(self, live_bytes: int) -> None:
        """Live sentences come first: the prompt cache gives up what they need of the memory budget."""
        budget = self.limits.memory_budget_bytes
        if budget is not None and live_bytes + self.prompt_cache.nbytes > budget:
            self.prompt_cache.evict_to(max(0, budget - live_bytes))

    def admissible(self) -> bool:
        candidates = self.candidates()
        return bool(candidates) and self.fits(candidates[0])

    def admit(self) -> None:
        """Admit (or resume) sentences in the policy's order while they fit; the first that does not fit may take the
        slot of a generating sentence the policy lets it pause, and otherwise waits, with every one after it."""
        now = self.clock()
        for sentence in self.candidates():
            if not self.fits(sentence) and not self._preempt_for(sentence, now):
                return
            if sentence.paused:
                self.llm.resume([sentence.llm_id])
                sentence.paused = sentence.cache_kept = False
                self.stats.resumed += 1
            elif not self._start_generating(sentence):
                return

    def _preempt_for(self, waiting: Sentence, now: float) -> bool:
        """Pause generating sentences, the latest deadline first, while the policy allows it and `waiting` does not
        fit; -> whether it fits now. A paused sentence keeps its KV cache unless memory is what `waiting` lacks."""
        while not self.fits(waiting):
            victims = [
                s
                for s in self.requests.live
                if not (s.paused or s.tokens_done or s.llm_id is None)
                and s.request is not waiting.request
                and self.policy.may_preempt(s.request, waiting.request, now)
            ]
            if not victims:
                return False
            victim = max(victims, key=lambda s: self.policy.deadline(s.request))
            if victim.held:  # back into the batch first: it is paused the way its slot's new owner needs
                self.llm.resume([victim.llm_id])
                victim.held = False
            budget = self.limits.memory_budget_bytes
            self.pause(victim, keep_cache=budget is None or self.requests.live_bytes + waiting.memory_bytes <= budget)
            self.stats.preempted += 1
        return True

    def pause(self, sentence: Sentence, keep_cache: bool) -> None:
        """Take a generating sentence out of the LLM batch until it is admitted again; its KV cache is set aside if
        `keep_cache` and there is device memory for the copy, else recomputed on resume."""
        try:
            self.llm.pause([sentence.llm_id], keep_cache=keep_cache)
        except torch.cuda.OutOfMemoryError:  # the copy of its rows did not fit; nothing changed
            keep_cache = False
            self.llm.pause([sentence.llm_id], keep_cache=False)
        sentence.paused, sentence.cache_kept = True, keep_cache

    def _add_to_generator(self, sentence: Sentence) -> bool:
        """Its generator row (and stream, when streaming), made from its segment -> True. On the LLM's CUDA stream:
        a voice's prompt prefix may be prefilled here."""
        with self.llm.on_loop_stream():
            if sentence.bistream_start is not None:  # its own LM state, stepped beside the batch (`LlmSteps`)
                sentence.bistream = open_bistream_decoder(self.stage.model, sentence.bistream_start)
                sentence.stream = self.streams.add_fed(sentence.segment)
            elif sentence.request.streaming:
                sentence.stream = self.streams.add(sentence.segment)
                sentence.llm_id = sentence.stream.llm_id
            else:
                [request] = self.stage.generation_requests([sentence.segment])
                sentence.llm_id = self.llm.add(request)
        return True

    def _start_generating(self, sentence: Sentence) -> bool:
        """Admit a request's next sentence: its generator row (its stream, when streaming) starts in the next step.
        -> whether admission goes on (not after running out of device memory: the sentence waits, still queued)."""
        ticket, requests = sentence.request, self.requests
        try:
            self._add_to_generator(sentence)
        except torch.cuda.OutOfMemoryError:  # its inputs' copy to the device: nothing was added
            if requests.live or self.lanes.jobs:  # others hold memory: it waits, still queued, until some is freed
                self.limits.lower("an admission")
                return False
            # nothing else holds any: it is tried once more, alone, and if it cannot fit its request ends
            if self.limits.run_alone(sentence, "an admission", partial(self._add_to_generator, sentence)) is None:
                return True
        except Exception as exc:  # this request's input: it ends, the admission goes on
            requests.fail(ticket, as_request_error(exc))
            return True
        if self.llm.batch_size:
            self.stats.joined_running_batch += 1
        if ticket.admitted and not ticket.sentences[ticket.admitted - 1].done:
            self.stats.pipelined_sentences += 1
        if sentence.llm_id is not None:
            requests.by_llm_id[sentence.llm_id] = sentence
        ticket.admitted += 1
        self.stats.admitted += 1
        requests.live.append(sentence)
        self.trim_prompt_cache(requests.live_bytes)  # its admission may have cached its voice's prompt
        if ticket.admitted == len(ticket.sentences):
            requests.queue.remove(ticket)
        return True

    def hold_rows_for_first_audio(self) -> None:
        """While a stream that has no audio yet generates, the generating sentences the policy may hold sit out of the
        LLM batch (`hold_rows`), their KV caches set aside; they rejoin once no such stream generates, or once their
        deadline comes near. Those that leave or rejoin at a step do so together: the batch's cache is copied once."""
        if not self.hold_rows:
            return
        generating = [s for s in self.requests.live if not (s.tokens_done or s.paused or s.llm_id is None)]
        first_audio_due = awaits_first_audio(generating)
        now = self.clock()
        hold = [s for s in generating if first_audio_due and self.policy.may_hold(s.request, now)]
        to_hold = [s for s in hold if not s.held]
        to_release = [s for s in generating if s.held and s not in hold]
        if to_hold:
            self.llm.pause([s.llm_id for s in to_hold], keep_cache=True)
            self.stats.held_for_first_audio += len(to_hold)
        if to_release:
            self.llm.resume([s.llm_id for s in to_release])
        for sentence in generating:
            sentence.held = sentence in hold
