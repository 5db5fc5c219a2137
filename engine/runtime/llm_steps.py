"""The decoder loop's LLM step: one token for every generating sentence, each token taken to its sentence, and the
step's own ends: a sentence's error, its request past its audio ceiling, the step out of device memory."""

from __future__ import annotations

import torch

from engine.errors import DecodeLimitError, as_request_error
from engine.llm.bistream import step_together
from engine.llm.generation import TokenEvent
from engine.runtime.admission import Admission
from engine.runtime.live_limits import LiveLimits
from engine.runtime.loop_state import Sentence
from engine.runtime.request_set import RequestSet


class LlmSteps:
    """Runs the loop's LLM steps; `max_speech_tokens` (None: no ceiling) ends a request whose speech passes
    `max_audio_s`."""

    def __init__(
        self,
        requests: RequestSet,
        limits: LiveLimits,
        admission: Admission,
        max_audio_s: float | None,
        max_speech_tokens: int | None,
    ) -> None:
        self.requests, self.limits, self.admission = requests, limits, admission
        self.llm, self.lanes, self.stats = requests.llm, requests.lanes, requests.stats
        self.max_audio_s, self.max_speech_tokens = max_audio_s, max_speech_tokens

    def step(self) -> None:
        """One step of the batch (if a sentence generates in it), then one of the bi-streams that can decode, their
        LM forwards batched together."""
        if self.llm.active:
            self._batch_step()
        decoding = []
        for sentence in [s for s in self.requests.live if s.bistream is not None and not s.tokens_done]:
            try:
                self._feed_text(sentence)
            except Exception as exc:  # this utterance's input: it ends, the others go on
                self.requests.fail(sentence.request, as_request_error(exc))
                continue
            if sentence.bistream.decoding:
                decoding.append(sentence)
        if not decoding:
            return
        with self.llm.on_loop_stream():
            outcomes = step_together([s.bistream for s in decoding])
        self.stats.bistream_batch_size_counts[len(decoding)] += 1
        for sentence, outcome in zip(decoding, outcomes, strict=True):
            if isinstance(outcome, Exception):  # this utterance's state: it ends, the others go on
                self.requests.fail(sentence.request, as_request_error(outcome))
                continue
            event = self._bistream_event(sentence, outcome)
            if event is not None:
                self._take_token(sentence, event)

    @staticmethod
    def _feed_text(sentence: Sentence) -> None:
        """Give the bi-stream's LM its next text pieces while it waits for them (None: the text's end)."""
        decoder = sentence.bistream
        while not decoder.decoding and not decoder.finished and sentence.text_pieces:
            piece = sentence.text_pieces.popleft()
            if piece is None:
                decoder.end_text()
            else:
                decoder.add_text(torch.tensor(piece, dtype=torch.long))

    @staticmethod
    def _bistream_event(sentence: Sentence, token: int | None) -> TokenEvent | None:
        """The event of a bi-stream's step that returned `token`: a speech token, its stream's end, or None (a fill
        token asked for more text)."""
        decoder, stream = sentence.bistream, sentence.stream
        if decoder.finished and not decoder.decoding:  # the end token or the length limit: vocoding comes next
            sentence.tokens_done = True
            sentence.bistream = None
            return TokenEvent(stream.llm_id, token, "eos", None)
        return None if token is None else TokenEvent(stream.llm_id, token, None, None)

    def _batch_step(self) -> None:
        requests = self.requests
        generating = [s for s in requests.live if not (s.tokens_done or s.paused or s.held)]
        batch_size = self.llm.active
        while_vocoding = self.lanes.running
        try:
            events = self.llm.step()
        except torch.cuda.OutOfMemoryError:  # the generator is as it was before the step
            retried = self._out_of_memory(generating)
            if retried is None:
                return
            events = retried
        self.stats.llm_steps += 1
        self.stats.llm_batch_size_counts[batch_size] += 1
        if len({s.request.streaming for s in generating}) == 2:
            self.stats.mixed_steps += 1
        if while_vocoding:
            self.stats.llm_steps_while_vocoding += 1
        for event in events:
            sentence = requests.by_llm_id.get(event.request_id)
            if sentence is None:  # its request ended earlier in this loop (an error of another of its sentences)
                continue
            if event.finish_reason is not None:  # its generator row is gone: vocoding comes next
                sentence.tokens_done = True
                del requests.by_llm_id[event.request_id]
                sentence.llm_id = None
            if event.error is not None:
                requests.fail(sentence.request, as_request_error(event.error))
                continue
            self._take_token(sentence, event)

    def _take_token(self, sentence: Sentence, event: TokenEvent) -> None:
        ticket = sentence.request
        if sentence.stream is not None:
            sentence.events.append(event)  # recorded by the next streams job
        elif event.token is not None:
            sentence.tokens.append(event.token)
        ticket.speech_tokens += event.token is not None
        if self.max_speech_tokens is not None and ticket.speech_tokens > self.max_speech_tokens:
            self.stats.over_limit += 1
            self.requests.fail(
                ticket,
                DecodeLimitError(
                    f"the request's speech passed the limit of {self.max_audio_s:g} s of audio; send a shorter "
                    "text or a lower max_token_text_ratio"
                ),
            )

    def _out_of_memory(self, generating: list[Sentence]) -> list[TokenEvent] | None:
        """An LLM step ran out of memory and was undone: lower the live limit and pause the newest generating
        sentences past it (their KV caches dropped, so memory frees); the step runs again at the next loop step. A
        sentence alone in the step is retried at once, alone -> that step's events (None: not retried or it ended)."""
        if len(generating) == 1:
            return self.limits.run_alone(generating[0], "an LLM step", self.llm.step)
        self.limits.lower("an LLM step")
        for victim in reversed(generating[1:]):  # the oldest keeps generating
            if self.requests.generating_slots <= self.limits.live_limit:
                break
            self.admission.pause(victim, keep_cache=False)
            self.stats.oom_paused += 1
        return None
