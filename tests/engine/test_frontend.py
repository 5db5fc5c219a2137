"""engine.text.frontend: the rebuilt whisper vocabulary, input validation, robustness, and segment length limits."""

from __future__ import annotations

import logging
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.errors import InvalidInputError
from engine.text import frontend as frontend_module
from engine.text.frontend import (
    SEGMENT_MAX_LEN,
    SEGMENT_MERGE_LEN,
    SEGMENT_MIN_LEN,
    TextFrontend,
    complete_sentences,
    is_speakable,
    load_whisper_encoding,
)

# Ids of whisper's multilingual tokenizer with 100 languages (large-v3 vocabulary).
KNOWN_SPECIAL_IDS = {
    "<|endoftext|>": 50257,
    "<|startoftranscript|>": 50258,
    "<|en|>": 50259,
    "<|zh|>": 50260,
    "<|yue|>": 50358,
    "<|translate|>": 50359,
    "<|transcribe|>": 50360,
    "<|nospeech|>": 50363,
    "<|notimestamps|>": 50364,
    "<|0.00|>": 50365,
    "<|0.02|>": 50366,
    "<|30.00|>": 51865,
}
CHINESE_CHARS = (
    "的一是不了人我在有他这中大来上国个到说们为子和你地出道也时年得就那要下以生会自着去之过家学对可她里后"
    "小么心多天而能好都然没日于起还发成事只作当想看文无开手十用主行方又如前所本见经头面公同三已老从动两长"
    "知民样现分将外但身些与高意进把法此实回二理美点月明其种声全工己话"
)
CHINESE_SENTENCE_ENDS = "。！？；"
ENGLISH_WORDS = (
    "the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while",
    "seven", "bright", "stars", "quietly", "watch", "from", "far", "above", "every", "river",
    "and", "mountain", "under", "an", "autumn", "sky", "full", "of", "promise",
)  # fmt: skip


@pytest.fixture(scope="module")
def frontend() -> TextFrontend:
    return TextFrontend()


@pytest.fixture(scope="module")
def minimal_frontend() -> TextFrontend:
    return TextFrontend(use_wetext=False)


def test_vocabulary_is_whispers_multilingual_100_languages() -> None:
    encoding = load_whisper_encoding()
    assert encoding.n_vocab == 51866
    for token, token_id in KNOWN_SPECIAL_IDS.items():
        assert encoding.encode(token, allowed_special="all") == [token_id], token
    text = "Hello 世界, ça va? 😀 <|en|>"
    assert encoding.decode(encoding.encode(text, allowed_special="all")) == text


@pytest.mark.parametrize("method", ["normalize", "split", "segment_tokens"])
@pytest.mark.parametrize("text", ["", "   ", " \n\t ", "\x00\x07\u200b", "\ufeff \r\n"])
def test_empty_text_is_rejected(frontend: TextFrontend, method: str, text: str) -> None:
    with pytest.raises(InvalidInputError, match="empty"):
        getattr(frontend, method)(text)


@pytest.mark.parametrize("method", ["normalize", "split", "segment_tokens", "tokenize"])
def test_length_limit(method: str) -> None:
    limited = TextFrontend(max_text_chars=20)
    assert getattr(limited, method)("Twenty chars of text") is not None  # exactly at the limit
    with pytest.raises(InvalidInputError, match="more than the limit of 20"):
        getattr(limited, method)("Twenty-one characters")


@pytest.mark.parametrize("text", [None, b"bytes", 3])
def test_non_string_is_rejected(frontend: TextFrontend, text: object) -> None:
    with pytest.raises(InvalidInputError, match="must be a string"):
        frontend.split(text)  # type: ignore[arg-type]


@pytest.mark.parametrize("text", ["!!! ???", "😀🎉", "。。。", "<||>", "— … —", "«»"])
def test_nothing_speakable_is_rejected(frontend: TextFrontend, text: str) -> None:
    with pytest.raises(InvalidInputError, match="nothing speakable"):
        frontend.split(text)


def test_control_characters_are_removed(frontend: TextFrontend) -> None:
    assert frontend.split("Hello\x00 wor\u200bld\x07.") == ["Hello world."]
    assert frontend.split("\ufeff你好\x1b，世界") == ["你好，世界。"]


def test_special_token_markup_passes_through_verbatim(frontend: TextFrontend) -> None:
    text = "<|en|> 3 apples, (no) normalisation "
    assert frontend.normalize(text) == text
    assert frontend.split(text) == [text]
    assert frontend.segment_tokens(text)[0][0] == KNOWN_SPECIAL_IDS["<|en|>"]


def test_chinese_cleanup_rules(frontend: TextFrontend) -> None:
    assert frontend.normalize("你好，世界，") == "你好，世界。"  # trailing commas end the sentence
    assert frontend.split("（你好）【世界】") == ["你好世界。"]  # brackets removed, final mark appended
    assert frontend.normalize("中文 English words 中文") == "中文English words中文"  # spaces kept only inside ASCII
    # " - " becomes a comma; between CJK characters its spaces are already gone, as in the official order.
    assert frontend.normalize("苹果 apple - banana 一 - 二") == "苹果apple，banana一-二"
    # A closing quote stays with the sentence its mark ends.
    long_quote = "他说：“" + "好" * 70 + "。”" + "然后" * 20 + "。"
    segments = frontend.split(long_quote)
    assert len(segments) == 2 and segments[0].endswith("。”") and "".join(segments) == long_quote


def test_minimal_normalisation_still_spells_english_numbers(minimal_frontend: TextFrontend) -> None:
    assert minimal_frontend.backend == "minimal"
    assert minimal_frontend.split("I have 3 apples and 25 oranges") == ["I have three apples and twenty-five oranges."]
    # Beyond inflect's range the digits are read one by one instead of failing.
    assert minimal_frontend.normalize("1" * 40) == " ".join(["one"] * 40)


def test_missing_wetext_warns_once_and_falls_back(monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    monkeypatch.setitem(sys.modules, "wetext", None)  # makes `import wetext` raise ImportError
    frontend_module._warn_wetext_missing.cache_clear()
    with caplog.at_level(logging.WARNING, logger="engine.text.frontend"):
        frontends = [TextFrontend(), TextFrontend()]
    assert [frontend.backend for frontend in frontends] == ["minimal", "minimal"]
    assert sum("wetext is not installed" in record.getMessage() for record in caplog.records) == 1
    with pytest.raises(ImportError, match="wetext"):
        TextFrontend(use_wetext=True)
    frontend_module._warn_wetext_missing.cache_clear()


def assert_valid_split(frontend: TextFrontend, text: str) -> None:
    try:
        segments = frontend.split(text)
    except InvalidInputError:
        # Normalisation keeps letters, so only text without any may be rejected as unspeakable.
        assert not any(char.isascii() and char.isalpha() for char in text), text
        return
    assert segments and all(segment and is_speakable(segment) for segment in segments)
    for tokens in frontend.segment_tokens(text):
        assert tokens and all(0 <= token < frontend.encoding.n_vocab for token in tokens)
    assert isinstance(frontend.normalize(text), str)


MIXED_TEXT = st.lists(
    st.one_of(
        st.text(max_size=40),
        st.text(alphabet=CHINESE_CHARS + CHINESE_SENTENCE_ENDS + "，、“”（）【】0123456789.²³ -", max_size=40),
        st.sampled_from(["<|", "|>", "<|en|>", "—— ", " - ", '."', "。”", "$5.50", "3/4/2024", "10:30", "1" * 45]),
        st.text(alphabet=st.characters(categories=["Cc", "Cf", "Cs", "Co", "Zs", "So", "Sk", "Mn"]), max_size=10),
    ),
    max_size=6,
).map("".join)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=MIXED_TEXT)
def test_arbitrary_unicode_never_crashes(frontend: TextFrontend, minimal_frontend: TextFrontend, text: str) -> None:
    assert_valid_split(frontend, text)
    assert_valid_split(minimal_frontend, text)


def assert_within_limits(segments: list[str], length) -> None:
    """Flushed segments are in (min, max]; the last one is at least the merge length (or the only one)."""
    assert len(segments) > 1
    for segment in segments[:-1]:
        assert SEGMENT_MIN_LEN < length(segment) <= SEGMENT_MAX_LEN, segment
    assert SEGMENT_MERGE_LEN <= length(segments[-1]) < SEGMENT_MAX_LEN + SEGMENT_MERGE_LEN, segments[-1]


def test_long_chinese_text_splits_within_limits(frontend: TextFrontend) -> None:
    # Sentences of 5..20 characters (the limits are in characters for Chinese).
    sentences = [
        "".join(CHINESE_CHARS[(7 * i + 3 * j) % len(CHINESE_CHARS)] for j in range(4 + i % 16))
        + CHINESE_SENTENCE_ENDS[i % len(CHINESE_SENTENCE_ENDS)]
        for i in range(60)
    ]
    text = "".join(sentences)
    segments = frontend.split(text)
    assert "".join(segments) == frontend.normalize(text) == text
    assert all(segment[-1] in CHINESE_SENTENCE_ENDS for segment in segments)
    assert_within_limits(segments, len)


def test_long_english_text_splits_within_limits(frontend: TextFrontend) -> None:
    # Sentences of 3..12 words (the limits are in BPE tokens for English).
    sentences = [
        " ".join(ENGLISH_WORDS[(5 * i + j) % len(ENGLISH_WORDS)] for j in range(3 + i % 10)).capitalize()
        + ".?!;"[i % 4]
        for i in range(30)
    ]
    text = " ".join(sentences)
    segments = frontend.split(text)
    assert "".join(segments) == frontend.normalize(text) == text
    assert_within_limits(segments, lambda segment: len(frontend.tokenize(segment)))


@pytest.mark.parametrize(
    ("text", "whole"),
    [
        ("Hello there. How", "Hello there."),
        ("Hello there.", ""),  # the next piece may go on: "there.com"
        ("It costs 3.5 dollars. Then", "It costs 3.5 dollars."),
        ('He said "hi." Then', 'He said "hi."'),
        ("One! Two? Three; four", "One! Two? Three;"),
        ("你好。我们", "你好。"),  # a CJK mark ends its sentence at once
        ("no mark yet", ""),
    ],
)
def test_complete_sentences_of_text_that_arrives_in_pieces(text: str, whole: str) -> None:
    assert text[: complete_sentences(text)] == whole


@given(st.lists(st.sampled_from(["Hi", " there", ".", " ", "3.5", "。", "!", "x", '"']), max_size=12))
def test_whole_sentences_only_grow_as_text_arrives(pieces: list[str]) -> None:
    text = "".join(pieces)
    ends = [complete_sentences(text[:n]) for n in range(len(text) + 1)]
    assert ends == sorted(ends) and all(end <= n for n, end in enumerate(ends))
