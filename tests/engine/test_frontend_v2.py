"""CosyVoice2 text front end: engine.text.qwen_tokenizer against transformers' Qwen2TokenizerFast, and TextFrontend
with it.

The expected ids were recorded with transformers 4.51.3 (tokenizers 0.21.4), the versions of the v2 kit: on the
tiny tokenizer directory of tests/engine/conftest.py, `AutoTokenizer.from_pretrained(dir)` followed by the
official CosyVoice2 `add_special_tokens` call, then `tokenizer([text])["input_ids"][0]`.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from tokenizers import pre_tokenizers

from engine.errors import CheckpointError, InvalidInputError
from engine.text.frontend import ENGLISH_SPLIT, TextFrontend, WhisperTokenizer, split_paragraph
from engine.text.qwen_tokenizer import COSYVOICE2_SPECIAL_TOKENS, TOKENIZER_DIR_NAME, QwenTokenizer, byte_level_alphabet
from tests.engine.conftest import TINY_VOCAB_SIZE, write_tiny_qwen_tokenizer

# sha256 of the files the recorded ids belong to; a new `tokenizers` trainer could write other files
TINY_FILE_SHA256 = {
    "vocab.json": "bd09edd57dbdafb873cbd9eda707b8ba25c01a2154d49cc7f6b2f5b1443eae52",
    "merges.txt": "6624d6819819744eb1670cbe68ad241d3c52b976479be1a226c6d826a0cbc76a",
}
TRANSFORMERS_IDS = {
    "Hello world, this is a test.": [337, 295, 78, 326, 11, 256, 278, 82, 312, 258, 256, 277, 83, 13],
    "We'll see: 2024 and 3.14; isn't it HE'LL?": [
        344, 334, 317, 68, 25, 220, 17, 15, 17, 19, 286, 220, 18, 13, 16, 19, 26, 312, 77, 288, 220, 264, 220, 39,
        36, 6, 43, 43, 30,
    ],
    "收到好友从远方寄来的生日礼物，那份意外的惊喜。": [
        162, 242, 114, 161, 230, 108, 325, 161, 237, 233, 271, 236, 311, 314, 244, 117, 161, 107, 226, 162, 251, 98,
        263, 310, 253, 162, 245, 98, 163, 97, 120, 163, 231, 102, 285, 165, 224, 96, 271, 121, 162, 226, 237, 283,
        244, 320, 225, 232, 307, 250, 275,
    ],
    "用开心的语气说<|endofprompt|>你好，world!": [
        310, 101, 161, 120, 222, 305, 225, 263, 164, 107, 255, 162, 108, 242, 164, 107, 112, 383, 304, 325, 285, 86,
        265, 293, 0,
    ],
    "[breath]Hello<strong>there</strong>[laughter] ok[mn]": [
        384, 337, 295, 78, 385, 376, 281, 386, 388, 220, 78, 74, 399,
    ],
    "<|im_start|>user\nhi<|im_end|>\n": [381, 84, 82, 276, 198, 278, 382, 198],
    "a<|endoftext|>b": [64, 380, 65],
    "  leading and trailing   \n\n\ttabs\r\n": [
        220, 274, 68, 64, 67, 291, 70, 286, 256, 81, 347, 75, 291, 70, 220, 220, 220, 198, 198, 197, 378, 82, 201, 198,
    ],
    "😀 emoji ◆ symbols": [
        172, 253, 246, 222, 220, 68, 76, 78, 73, 72, 220, 158, 245, 228, 260, 88, 76, 65, 78, 75, 82,
    ],
}  # fmt: skip
# The same call on a directory holding the 256 byte tokens of `byte_level_alphabet()` and no merges.
TRANSFORMERS_BYTE_LEVEL_IDS = {
    "[breath]Hello<strong>there</strong>[laughter] ok[mn]": [
        260, 72, 101, 108, 108, 111, 261, 116, 104, 101, 114, 101, 262, 264, 32, 111, 107, 275,
    ],
    "今天天气挺不错的<|endofprompt|>": [
        228, 187, 138, 229, 164, 169, 229, 164, 169, 230, 176, 148, 230, 140, 186, 228, 184, 141, 233, 148, 153, 231,
        154, 132, 259,
    ],
}  # fmt: skip
KIT_QWEN_VOCAB_SIZE = 400  # CosyVoice-BlankEN/config.json of the v2 kit
LONG_ENGLISH = " ".join(
    f"Sentence number {word} tells about the quick brown fox and the lazy dog near the river."
    for word in ("one", "two", "three", "four", "five", "six", "seven", "eight")
)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_qwen_tokenizer(tmp_path_factory.mktemp("qwen") / TOKENIZER_DIR_NAME)


@pytest.fixture(scope="module")
def tiny(tiny_dir: Path) -> QwenTokenizer:
    return QwenTokenizer.from_dir(tiny_dir)


def test_tiny_tokenizer_files_are_the_recorded_ones(tiny_dir: Path, tmp_path: Path) -> None:
    for name, digest in TINY_FILE_SHA256.items():
        assert hashlib.sha256((tiny_dir / name).read_bytes()).hexdigest() == digest, f"{name} changed: re-record ids"
    again = write_tiny_qwen_tokenizer(tmp_path / "again")
    for name in ("vocab.json", "merges.txt", "tokenizer_config.json"):
        assert (again / name).read_bytes() == (tiny_dir / name).read_bytes(), name
    assert len(json.loads((tiny_dir / "vocab.json").read_text(encoding="utf-8"))) == TINY_VOCAB_SIZE


@pytest.mark.parametrize("text", list(TRANSFORMERS_IDS))
def test_ids_match_transformers(tiny: QwenTokenizer, text: str) -> None:
    assert tiny.encode(text) == TRANSFORMERS_IDS[text]
    assert tiny.decode(tiny.encode(text)) == text


def test_special_tokens_take_the_next_free_ids_in_official_order(tiny: QwenTokenizer) -> None:
    # <|endoftext|>, <|im_start|>, <|im_end|> come from tokenizer_config.json; the other 17 are new
    expected = list(range(TINY_VOCAB_SIZE, TINY_VOCAB_SIZE + len(COSYVOICE2_SPECIAL_TOKENS)))
    assert [tiny.encode(token) for token in COSYVOICE2_SPECIAL_TOKENS] == [[i] for i in expected]
    assert tiny.vocab_size == KIT_QWEN_VOCAB_SIZE


def test_tokenizer_json_and_files_without_config_give_the_same_ids(tiny: QwenTokenizer, tmp_path: Path) -> None:
    with_json = QwenTokenizer.from_dir(write_tiny_qwen_tokenizer(tmp_path / "json", with_tokenizer_json=True))
    bare_dir = write_tiny_qwen_tokenizer(tmp_path / "bare")
    (bare_dir / "tokenizer_config.json").unlink()  # Qwen2's default specials: <|endoftext|> first
    bare = QwenTokenizer.from_dir(bare_dir)
    for text, ids in TRANSFORMERS_IDS.items():
        assert with_json.encode(text) == ids, text
        assert bare.encode(text) == ids, text
    assert with_json.vocab_size == bare.vocab_size == tiny.vocab_size


def test_text_is_nfc_normalised(tiny: QwenTokenizer) -> None:
    assert tiny.encode("cafe\u0301 \u212b") == tiny.encode("caf\u00e9 \u00c5") == [66, 64, 69, 127, 102, 220, 127, 227]


def test_from_dir_errors_name_the_missing_files(v2_kit: Path, tmp_path: Path) -> None:
    config_only = tmp_path / "config_only"
    config_only.mkdir()
    (config_only / "config.json").symlink_to(v2_kit / "model" / TOKENIZER_DIR_NAME / "config.json")
    with pytest.raises(CheckpointError, match=r"no tokenizer files: missing vocab\.json and merges\.txt"):
        QwenTokenizer.from_dir(config_only)
    with pytest.raises(CheckpointError, match="does not exist"):
        QwenTokenizer.from_dir(tmp_path / "nowhere")
    broken = write_tiny_qwen_tokenizer(tmp_path / "broken")
    (broken / "merges.txt").unlink()
    with pytest.raises(CheckpointError, match=r"missing merges\.txt"):
        QwenTokenizer.from_dir(broken)
    (broken / "merges.txt").write_text("#version: 0.2\nĠ\n", encoding="utf-8")
    with pytest.raises(CheckpointError, match="cannot read"):
        QwenTokenizer.from_dir(broken)


def test_encode_rejects_non_strings(tiny: QwenTokenizer) -> None:
    with pytest.raises(InvalidInputError, match="text must be a string"):
        tiny.encode(b"bytes")  # type: ignore[arg-type]


def test_byte_level_alphabet_is_byte_ordered() -> None:
    alphabet = byte_level_alphabet()
    assert set(alphabet) == set(pre_tokenizers.ByteLevel.alphabet()) and len(alphabet) == 256
    assert (alphabet[ord("a")], alphabet[ord(" ")], alphabet[ord("\n")], alphabet[0], alphabet[255]) == (
        "a", "Ġ", "Ċ", "Ā", "ÿ",
    )  # fmt: skip


def test_byte_level_stand_in() -> None:
    tokenizer = QwenTokenizer.byte_level()
    assert tokenizer.vocab_size == 256 + len(COSYVOICE2_SPECIAL_TOKENS)
    text = "Grüße, 你好!"
    assert tokenizer.encode(text) == list(text.encode("utf-8"))
    assert tokenizer.decode(tokenizer.encode(text)) == text
    for text, ids in TRANSFORMERS_BYTE_LEVEL_IDS.items():
        assert tokenizer.encode(text) == ids, text
    assert max(tokenizer.encode("".join(COSYVOICE2_SPECIAL_TOKENS))) < KIT_QWEN_VOCAB_SIZE


def test_frontend_uses_the_given_tokenizer(tiny: QwenTokenizer) -> None:
    frontend = TextFrontend(use_wetext=False, tokenizer=tiny)
    text = "用开心的语气说<|endofprompt|>你好，world!"
    assert frontend.tokenize(text) == TRANSFORMERS_IDS[text]
    segments = frontend.split("Hello world, this is a test.")
    assert frontend.segment_tokens("Hello world, this is a test.") == [tiny.encode(s) for s in segments]


def test_english_split_lengths_are_counted_with_the_models_tokenizer(tiny: QwenTokenizer) -> None:
    qwen_frontend = TextFrontend(use_wetext=False, tokenizer=tiny)
    whisper_frontend = TextFrontend(use_wetext=False)
    normalized = qwen_frontend.normalize(LONG_ENGLISH)
    qwen_segments = qwen_frontend.split(LONG_ENGLISH)
    assert qwen_segments == split_paragraph(normalized, ENGLISH_SPLIT, lambda segment: len(tiny.encode(segment)))
    # the tiny vocabulary needs more tokens per sentence than whisper's, so it cuts the text differently
    assert qwen_segments != whisper_frontend.split(LONG_ENGLISH)


def test_the_instruction_end_marker_per_version(tiny: QwenTokenizer) -> None:
    v1, v2 = TextFrontend(use_wetext=False), TextFrontend(use_wetext=False, tokenizer=tiny)
    assert isinstance(v1.tokenizer, WhisperTokenizer) and v1.tokenizer.vocab_size == 51866
    # the callers' instructions end with <|endofprompt|> (official example.py): one special id in v2 ...
    assert v2.tokenize("<|endofprompt|>") == [TINY_VOCAB_SIZE + COSYVOICE2_SPECIAL_TOKENS.index("<|endofprompt|>")]
    assert len(v1.tokenize("<|endofprompt|>")) > 1  # ... plain text for whisper, which has no such special token
    assert v1.encoding.n_vocab == 51866
    with pytest.raises(AttributeError, match="whisper"):
        _ = v2.encoding


def test_lone_surrogates_are_dropped_before_the_tokenizer_which_would_raise(tiny: QwenTokenizer) -> None:
    """A JSON "\\ud800" escape makes a lone surrogate, which the Qwen tokenizer refuses with a TypeError (a 500 for
    any client that sent one in an instruction or a text stream's piece)."""
    with pytest.raises(TypeError):
        tiny.encode("Hi\ud800 there.")
    frontend = TextFrontend(use_wetext=False, tokenizer=tiny)
    assert frontend.tokenize("Hi\ud800 there\udfff.") == frontend.tokenize("Hi there.")
    assert frontend.split("Hi\ud800 there.") == frontend.split("Hi there.")
