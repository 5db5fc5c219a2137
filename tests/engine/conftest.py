"""Shared helpers of the engine tests: a sink for the decoder loop (engine.runtime.scheduler) and stepping it
until a condition holds; a tiny Qwen2-style tokenizer directory (the conformance kit's CosyVoice-BlankEN has no
tokenizer files); a Hugging Face cache laid out on disk."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
from tokenizers import models, pre_tokenizers, trainers

from engine.runtime.scheduler import Output, Scheduler
from engine.runtime.segment import EncodedSegment
from engine.text.qwen_tokenizer import QWEN2_ENDOFTEXT_ID, qwen2_pipeline, special_token


class Collected:
    """A sink that keeps what a request handed on: audio arrays, then an error if one ended it, then None."""

    def __init__(self) -> None:
        self.outputs: list[Output] = []

    def __call__(self, item: Output) -> None:
        self.outputs.append(item)

    @property
    def ended(self) -> bool:
        return bool(self.outputs) and self.outputs[-1] is None

    @property
    def chunks(self) -> list[np.ndarray]:
        """The audio handed on, as it came, of a request that ended without an error."""
        assert self.ended and all(isinstance(o, np.ndarray) for o in self.outputs[:-1]), self.outputs
        return self.outputs[:-1]

    @property
    def audio(self) -> np.ndarray:
        """All its audio in one array."""
        return np.concatenate([chunk for chunk in self.chunks if chunk.size])

    @property
    def error(self) -> Exception | None:
        """The error that ended the request, if one did."""
        return self.outputs[-2] if len(self.outputs) >= 2 and isinstance(self.outputs[-2], Exception) else None


def step_until(scheduler: Scheduler, condition: Callable[[], bool], limit: int = 2000) -> None:
    """Step the loop until `condition()` holds; fail (never hang) after `limit` steps."""
    for _ in range(limit):
        if condition():
            return
        scheduler.step()
    raise AssertionError(f"not reached in {limit} steps")


def decode_to_end(scheduler: Scheduler, requests: list[tuple[EncodedSegment, bool]]) -> list[Collected]:
    """Submit every (segment, streaming) at once and step the loop until it has no work -> each request's sink; the
    loop must not have failed."""
    sinks = [Collected() for _ in requests]
    for (segment, streaming), sink in zip(requests, sinks, strict=True):
        scheduler.submit([segment], streaming=streaming, sink=sink)
    step_until(scheduler, lambda: not scheduler.has_work, limit=5000)
    assert scheduler.failure is None
    return sinks


# 380 trained ids + the 3 config tokens + CosyVoice2's 17 new special tokens = 400, the kit's Qwen2 vocab_size.
TINY_VOCAB_SIZE = 380
CONFIG_ADDED_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CORPUS = (
    "The quick brown fox jumps over the lazy dog while seven bright stars watch from far above.",
    "Hello world, this is a tiny tokenizer for the CosyVoice test suite; it isn't meant to be good.",
    "We'll see whether numbers like 2024 and 3.14 are split digit by digit, as Qwen does.",
    "She said: \"Don't worry, we're almost there!\" and then they'd laughed for a while.",
    "收到好友从远方寄来的生日礼物，那份意外的惊喜与深深的祝福让我心中充满了甜蜜的快乐。",
    "今天天气挺不错的，我们一起去公园散步吧。希望你喜欢这个小小的测试。",
    "八百标兵奔北坡，炮兵并排北边跑。",
    "Mixed text: 你好 world, 再见 friends!\nNew line\ttab and   spaces.",
)


def write_tiny_qwen_tokenizer(directory: Path, *, with_tokenizer_json: bool = False, qwen2_ids: bool = False) -> Path:
    """Write the tiny tokenizer files into `directory` (created if needed) and return it."""
    if with_tokenizer_json and qwen2_ids:
        raise ValueError("qwen2_ids is written as vocab.json entries; a tokenizer.json would number them anew")
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = qwen2_pipeline(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB_SIZE,
        min_frequency=1,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tokenizer.train_from_iterator(CORPUS * 4, trainer=trainer)
    tokenizer.model.save(str(directory))  # vocab.json + merges.txt
    first_added_id = QWEN2_ENDOFTEXT_ID if qwen2_ids else tokenizer.get_vocab_size()
    if qwen2_ids:
        vocab_path = directory / "vocab.json"
        vocab = json.loads(vocab_path.read_text(encoding="utf-8"))
        vocab.update({token: first_added_id + i for i, token in enumerate(CONFIG_ADDED_TOKENS)})
        vocab_path.write_text(json.dumps(vocab, ensure_ascii=False, separators=(",", ":")), encoding="utf-8")
    added = {
        str(first_added_id + i): {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, token in enumerate(CONFIG_ADDED_TOKENS)
    }
    config = {
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": list(CONFIG_ADDED_TOKENS[1:]),
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|endoftext|>",
        "errors": "replace",
        "model_max_length": 32768,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False), encoding="utf-8")
    if with_tokenizer_json:
        tokenizer.add_special_tokens([special_token(token) for token in CONFIG_ADDED_TOKENS])
        tokenizer.save(str(directory / "tokenizer.json"))
    return directory


V3_KIT_MODEL = Path(__file__).resolve().parents[1] / "fixtures" / "cosyvoice3-tiny" / "model"
REPO_ID = "FunAudioLLM/Fun-CosyVoice3-0.5B-2512"
CACHED_COMMIT = "0123456789abcdef0123456789abcdef01234567"


def hugging_face_cache(home: Path, repo_id: str, model_dir: Path) -> Path:
    """An HF_HOME whose hub cache holds `model_dir` as the `main` snapshot of `repo_id`, laid out as huggingface_hub
    writes it (refs/main naming the commit, snapshots/<commit>/ the files) -> the snapshot's directory."""
    repo = home / "hub" / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(CACHED_COMMIT)
    snapshot = repo / "snapshots" / CACHED_COMMIT
    shutil.copytree(model_dir, snapshot)
    return snapshot
