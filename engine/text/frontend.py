"""CosyVoice text front end: normalisation, splitting of long texts, and the model's text tokenizer.

It reproduces the official `CosyVoiceFrontEnd.text_normalize` with its wetext backend (the backend the official code
falls back to without `ttsfrd`) and the whisper tokenizer's `encode(text, allowed_special="all")`, without depending
on `openai-whisper` (the BPE ranks ship in `engine/text/assets/`). The tokenizer is pluggable (`TextTokenizer`):
CosyVoice2 and 3 run the same normalisation and splitting with their Qwen2 tokenizer.

`TextFrontend.split`: validate and clean, pass special-token markup through verbatim, normalise and split Chinese
(lengths in characters) or English (lengths in tokens), drop segments with nothing speakable. A front end made with
`spelled_out_languages` (CosyVoice3's de, es, fr, it, ru, ja, ko; v1's and v2's ja, ko) normalises sentences in those
languages on their own, spelling out their numbers (`engine.text.spelled_numbers`); text all in Chinese and English
takes the official path whole, exactly. Without wetext the FST step is skipped (logged once). The steps and the
deviations from the official code (all on inputs where it crashes or produces unspeakable segments): docs/text.md,
"The official path, step by step".
"""

from __future__ import annotations

import base64
import functools
import itertools
import logging
import re
import unicodedata
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import tiktoken

from engine.errors import CheckpointError, InvalidInputError
from engine.loading.yaml_config import ObjectSpec
from engine.text.languages import (
    LATIN_LANGUAGES,
    SPELLED_OUT_LANGUAGES,
    detect_language,
    language_code,
    latin_identifier,
    sentences,
)

if TYPE_CHECKING:
    import inflect

    from engine.text.spelled_numbers import NumberSpeller

logger = logging.getLogger(__name__)

BPE_RANKS_PATH = Path(__file__).parent / "assets" / "multilingual.tiktoken"

# Whisper's language codes in token order; v1 uses the first 100 (n_vocab 51866).
WHISPER_LANGUAGE_CODES = (
    "en", "zh", "de", "es", "ru", "ko", "fr", "ja", "pt", "tr", "pl", "ca", "nl", "ar", "sv", "it", "id", "hi",
    "fi", "vi", "he", "uk", "el", "ms", "cs", "ro", "da", "hu", "ta", "no", "th", "ur", "hr", "bg", "lt", "la",
    "mi", "ml", "cy", "sk", "te", "fa", "lv", "bn", "sr", "az", "sl", "kn", "et", "mk", "br", "eu", "is", "hy",
    "ne", "mn", "bs", "kk", "sq", "sw", "gl", "mr", "pa", "si", "km", "sn", "yo", "so", "af", "oc", "ka", "be",
    "tg", "sd", "gu", "am", "yi", "lo", "uz", "fo", "ht", "ps", "tk", "nn", "mt", "sa", "lb", "my", "bo", "tl",
    "mg", "as", "tt", "haw", "ln", "ha", "ba", "jw", "su", "yue",
)  # fmt: skip
WHISPER_GET_TOKENIZER = "whisper.tokenizer.get_tokenizer"
WHISPER_DEFAULT_NUM_LANGUAGES = 99  # the default of whisper's get_tokenizer; CosyVoice-300M's yaml says 100
NUM_TIMESTAMP_TOKENS = 1501  # <|0.00|> ... <|30.00|>, every 20 ms
WHISPER_PRETOKENIZE_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

# The official tag that ends a system or instruct prompt before the text to speak (one special token for the Qwen
# tokenizers of CosyVoice2 and later; CosyVoice3's LLM requires it in every input).
ENDOFPROMPT = "<|endofprompt|>"
CHINESE_CHAR = re.compile(r"[\u4e00-\u9fff]")
# replace_blank: a space survives only between two non-space ASCII characters.
SPACE_NOT_BETWEEN_ASCII = re.compile(r"(?<![\x00-\x1f\x21-\x7f]) | (?![\x00-\x1f\x21-\x7f])")
# Applied in order after wetext on the Chinese path.
CHINESE_REPLACEMENTS = (
    ("²", "平方"),
    ("³", "立方"),
    (".", "。"),
    (" - ", "，"),
    ("（", ""),
    ("）", ""),
    ("【", ""),
    ("】", ""),
    ("`", ""),
    ("——", " "),
)
TRAILING_COMMAS = re.compile(r"[，,、]+$")
WHITESPACE_RUN = re.compile(r"\s+")  # a line break or a run of spaces in spelled-out text is one space, as read
CLOSING_QUOTES = frozenset('"”')
KEPT_CONTROL_CHARACTERS = frozenset("\n\t")  # the Chinese path removes "\n" itself; others are noise
SEGMENT_MAX_LEN = 80
SEGMENT_MIN_LEN = 60
SEGMENT_MERGE_LEN = 20


@dataclass(frozen=True)
class SplitRule:
    """How a language cuts a paragraph into sentences."""

    sentence_ends: frozenset[str]
    final_mark: str  # appended when the text does not end a sentence


CHINESE_SPLIT = SplitRule(frozenset("。？！；：、.?!;"), "。")
ENGLISH_SPLIT = SplitRule(frozenset(".?!;:"), ".")
JAPANESE_SPLIT = SplitRule(frozenset("。？！?!"), "。")  # counted in characters, as Chinese


def whisper_special_tokens(num_languages: int = 100) -> list[str]:
    """Whisper's special tokens in id order; they follow the BPE ranks."""
    if not 1 <= num_languages <= len(WHISPER_LANGUAGE_CODES):
        raise ValueError(f"num_languages must be in 1..{len(WHISPER_LANGUAGE_CODES)}, got {num_languages}")
    return [
        "<|endoftext|>",
        "<|startoftranscript|>",
        *(f"<|{code}|>" for code in WHISPER_LANGUAGE_CODES[:num_languages]),
        "<|translate|>",
        "<|transcribe|>",
        "<|startoflm|>",
        "<|startofprev|>",
        "<|nospeech|>",
        "<|notimestamps|>",
        # Formatted from i * 0.02 exactly as whisper does, so that the strings (hence ids) agree.
        *(f"<|{i * 0.02:.2f}|>" for i in range(NUM_TIMESTAMP_TOKENS)),
    ]


@functools.cache
def load_whisper_encoding(num_languages: int = 100) -> tiktoken.Encoding:
    """Whisper's multilingual tiktoken encoding, built from the packaged rank file (never touches the network)."""
    ranks: dict[bytes, int] = {}
    for line in BPE_RANKS_PATH.read_text(encoding="ascii").splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    first_special_id = len(ranks)
    special_ids = {token: first_special_id + i for i, token in enumerate(whisper_special_tokens(num_languages))}
    return tiktoken.Encoding(
        name=f"whisper-multilingual-{num_languages}",
        pat_str=WHISPER_PRETOKENIZE_PATTERN,
        mergeable_ranks=ranks,
        special_tokens=special_ids,
        explicit_n_vocab=first_special_id + len(special_ids),
    )


class TextTokenizer(Protocol):
    """What the front end needs of a model's text tokenizer."""

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, special tokens written in it included."""
        ...


class WhisperTokenizer:
    """CosyVoice v1's tokenizer: whisper's multilingual BPE, with every special token allowed in the text."""

    def __init__(self, num_languages: int = 100) -> None:
        self.encoding = load_whisper_encoding(num_languages)

    @classmethod
    def from_yaml(cls, spec: ObjectSpec | None) -> WhisperTokenizer:
        """The tokenizer a v1 yaml's `get_tokenizer` names; 100 languages (CosyVoice-300M's) when it names none.

        Only whisper's multilingual tokenizer can be built here: its BPE ranks ship in engine/text/assets. Any other
        (gpt2, the CosyVoice-300M-25Hz `cosyvoice.tokenizer.tokenizer.get_tokenizer`) is refused by name.
        """
        if spec is None:
            return cls()
        if not isinstance(spec, ObjectSpec) or spec.target != WHISPER_GET_TOKENIZER:
            target = spec.target if isinstance(spec, ObjectSpec) else repr(spec)
            raise CheckpointError(
                f"get_tokenizer {target} is not supported; this engine builds {WHISPER_GET_TOKENIZER} (multilingual)"
            )
        if spec.get("multilingual") is not True:
            raise CheckpointError(f"get_tokenizer {WHISPER_GET_TOKENIZER} must be multilingual: True")
        num_languages = spec.get("num_languages", WHISPER_DEFAULT_NUM_LANGUAGES)
        if isinstance(num_languages, bool) or not isinstance(num_languages, int):
            raise CheckpointError(f"get_tokenizer num_languages must be an integer, got {num_languages!r}")
        try:
            return cls(num_languages)
        except ValueError as error:
            raise CheckpointError(f"get_tokenizer: {error}") from None

    @property
    def vocab_size(self) -> int:
        return self.encoding.n_vocab

    def encode(self, text: str) -> list[int]:
        return self.encoding.encode(text, allowed_special="all")


def contains_chinese(text: str) -> bool:
    return CHINESE_CHAR.search(text) is not None


def has_special_token_markup(text: str) -> bool:
    """The official front end leaves such text untouched (SSML-like markup, special tokens)."""
    return "<|" in text and "|>" in text


def lone_surrogate_at(text: str) -> int | None:
    """Where `text` holds its first lone surrogate (U+D800-U+DFFF: half of a UTF-16 pair, not a character; JSON's
    "\\ud800" escape makes one, and the Qwen tokenizers raise on it), None when it holds none."""
    try:
        text.encode("utf-8")  # only a lone surrogate cannot be encoded
    except UnicodeEncodeError as error:
        return error.start
    return None


def without_lone_surrogates(text: str) -> str:
    return text.encode("utf-8", "ignore").decode("utf-8")


def strip_control_characters(text: str) -> str:
    """Drop control, format and lone-surrogate characters (never speech; NUL crashes wetext); keep newline, tab."""
    return "".join(
        char for char in text if char in KEPT_CONTROL_CHARACTERS or unicodedata.category(char) not in ("Cc", "Cf", "Cs")
    )


def is_speakable(segment: str) -> bool:
    """Whether a segment holds anything besides punctuation, symbols and whitespace."""
    return any(not char.isspace() and unicodedata.category(char)[0] not in "PSZ" for char in segment)


def spell_out_numbers(text: str, inflect_engine: inflect.engine) -> str:
    """Replace each run of `str.isdigit` characters with its English words, as the official front end does."""
    pieces = []
    for is_digit_run, chars in itertools.groupby(text, key=str.isdigit):
        run = "".join(chars)
        pieces.append(_number_words(run, inflect_engine) if is_digit_run else run)
    return "".join(pieces)


def _number_words(digits: str, inflect_engine: inflect.engine) -> str:
    import inflect  # loaded by `TextFrontend` already

    try:
        return inflect_engine.number_to_words(digits)
    except inflect.NumOutOfRangeError:  # beyond decillions: read it digit by digit instead of failing
        return " ".join(inflect_engine.number_to_words(digit) for digit in digits)


def chinese_cleanup(text: str) -> str:
    """The official rules applied to Chinese text after wetext: spaces, marks, brackets, trailing commas."""
    text = text.replace("\n", "")
    text = SPACE_NOT_BETWEEN_ASCII.sub("", text)
    for old, new in CHINESE_REPLACEMENTS:
        text = text.replace(old, new)
    return TRAILING_COMMAS.sub("。", text)


# Where text that arrives in pieces (a text stream) has a whole sentence: the marks both split rules end one at,
# but the enumeration comma. A CJK mark ends it at once; an ASCII one only before whitespace, as "3.5", "e.g." and
# "a.m." keep theirs inside a word (so its sentence is complete once the next piece starts).
STREAM_SENTENCE_ENDS = (CHINESE_SPLIT.sentence_ends | ENGLISH_SPLIT.sentence_ends) - {"、"}


def complete_sentences(text: str) -> int:
    """How many characters at the start of `text` are whole sentences (0: none yet), a closing quote after the last
    mark included."""
    end = 0
    for i, char in enumerate(text):
        if char not in STREAM_SENTENCE_ENDS:
            continue
        after = i + 1
        if after < len(text) and text[after] in CLOSING_QUOTES:
            after += 1
        if not char.isascii() or (after < len(text) and text[after].isspace()):
            end = after
    return end


def split_paragraph(text: str, rule: SplitRule, length: Callable[[str], int]) -> list[str]:
    """Cut `text` into sentences at `rule.sentence_ends`, then greedily pack them into segments.

    A segment is closed before a sentence that would make it longer than SEGMENT_MAX_LEN, but only once it is
    longer than SEGMENT_MIN_LEN; a final remainder shorter than SEGMENT_MERGE_LEN joins the previous segment.
    `length` measures a string (characters for Chinese, the tokenizer's tokens for English). As in the official code, a
    sentence-end mark with no text since the previous one is dropped, and a closing quote right after a mark
    stays with its sentence.
    """
    if not text:
        return []
    if text[-1] not in rule.sentence_ends:
        text += rule.final_mark
    sentences: list[str] = []
    start = 0
    for i, char in enumerate(text):
        if char not in rule.sentence_ends:
            continue
        if i > start:
            sentences.append(text[start : i + 1])
        start = i + 1
        if start < len(text) and text[start] in CLOSING_QUOTES:
            if sentences:
                sentences[-1] += text[start]
            start += 1

    segments: list[str] = []
    current = ""
    for sentence in sentences:
        if length(current + sentence) > SEGMENT_MAX_LEN and length(current) > SEGMENT_MIN_LEN:
            segments.append(current)
            current = ""
        current += sentence
    if current:
        if segments and length(current) < SEGMENT_MERGE_LEN:
            segments[-1] += current
        else:
            segments.append(current)
    return segments


@functools.cache
def _warn_spelling_missing() -> None:
    logger.warning(
        "num2words or py3langid is not installed: numbers in languages beyond Chinese and English are read as the "
        "official front end reads them (in English). Install them with: pip install 'cosyvoice-serve[text]'"
    )


def _load_spellers(languages: Iterable[str]) -> dict[str, NumberSpeller]:
    """A number speller for each of `languages` (of SPELLED_OUT_LANGUAGES); none where its packages are missing."""
    languages = tuple(languages)
    unknown = sorted(set(languages) - set(SPELLED_OUT_LANGUAGES))
    if unknown:
        raise ValueError(f"no number spelling for {unknown}; there is for {', '.join(SPELLED_OUT_LANGUAGES)}")
    if not languages:
        return {}
    from engine.text.spelled_numbers import NumberSpeller

    try:
        spellers = {language: NumberSpeller(language) for language in languages}
        if set(languages) & set(LATIN_LANGUAGES):
            latin_identifier()  # loaded with the front end, not by its first request
    except ImportError:
        _warn_spelling_missing()
        return {}
    return spellers


@functools.cache
def _warn_wetext_missing() -> None:
    logger.warning(
        "wetext is not installed: text normalisation is minimal (no FST rewriting of dates, units, currencies; "
        "English digits are still spelled out). Install it with: pip install 'cosyvoice-serve[text]'"
    )


def _load_wetext(use_wetext: bool | None) -> tuple[Any, Any] | None:
    """The official (Chinese, English) wetext normalizers, or None for the minimal normalisation."""
    if use_wetext is False:
        return None
    try:
        from wetext import Normalizer
    except ImportError as error:
        if use_wetext:
            raise ImportError(
                "use_wetext=True but the 'wetext' package is not installed: pip install 'cosyvoice-serve[text]'"
            ) from error
        _warn_wetext_missing()
        return None
    # Both in language "auto", exactly as the official front end builds them: wetext itself picks its
    # Chinese grammar for text with Chinese characters or made of digits only.
    return Normalizer(remove_erhua=False), Normalizer()


class TextFrontend:
    """Text -> normalised segments -> token ids, as the official CosyVoice front ends."""

    def __init__(
        self,
        max_text_chars: int = 2000,
        use_wetext: bool | None = None,
        tokenizer: TextTokenizer | None = None,
        spelled_out_languages: Iterable[str] = (),
    ) -> None:
        """`use_wetext`: None uses wetext when installed, True requires it, False forces the minimal rules.
        `tokenizer`: the model's text tokenizer; v1's whisper tokenizer by default. `spelled_out_languages`: those of
        SPELLED_OUT_LANGUAGES whose numbers are spelled out in their own words (the module docstring); none by
        default, and none where num2words or py3langid is not installed (logged once)."""
        if max_text_chars < 1:
            raise ValueError(f"max_text_chars must be positive, got {max_text_chars}")
        self.max_text_chars = max_text_chars
        self.tokenizer = tokenizer if tokenizer is not None else WhisperTokenizer()
        # Imported here: it takes ~1.8 s (its API is type-checked at import), which the processes that import the
        # engine without a text front end (the ingress, the decoders) need not pay.
        import inflect

        self._inflect = inflect.engine()
        normalizers = _load_wetext(use_wetext)
        self._zh_wetext, self._en_wetext = normalizers or (None, None)
        self.backend = "wetext" if normalizers else "minimal"
        self.spellers = _load_spellers(spelled_out_languages)
        # Latin sentences are told apart only where one of de, es, fr, it is spelled out (else they are English).
        self._classify_latin = any(language in self.spellers for language in LATIN_LANGUAGES)

    @property
    def encoding(self) -> tiktoken.Encoding:
        """The whisper encoding of a v1 front end (the v1 API before tokenizers were pluggable)."""
        if not isinstance(self.tokenizer, WhisperTokenizer):
            raise AttributeError("only a front end with the v1 whisper tokenizer has a tiktoken encoding")
        return self.tokenizer.encoding

    def tokenize(self, text: str) -> list[int]:
        """Token ids of `text` as is (no normalisation, lone surrogates dropped); special tokens such as `<|en|>` are
        allowed."""
        self._check_length(text)
        return self._encode(without_lone_surrogates(text))

    def normalize(self, text: str, language: str | None = None) -> str:
        """The whole normalised text (official `text_normalize(text, split=False)`). `language`: the text's, one of
        `engine.text.languages.LANGUAGES` (InvalidInputError for another); None: each sentence's, detected."""
        return self._normalize(text, language)[0]

    def split(self, text: str, language: str | None = None) -> list[str]:
        """The normalised segments, synthesised one after another (official `text_normalize(text, split=True)`)."""
        return [segment for _, segment in self._normalize(text, language)[1]]

    def split_by_language(self, text: str, language: str | None = None) -> list[tuple[str | None, str]]:
        """(language, segment) for each segment of `split`: the language it was normalised as ("zh" and "en": the
        official front end's way), None for text with special-token markup, which is taken as written."""
        return self._normalize(text, language)[1]

    def segment_tokens(self, text: str, language: str | None = None) -> list[list[int]]:
        """Token ids of each segment of `split(text, language)`, tokenized separately."""
        return [self._encode(segment) for segment in self.split(text, language)]

    def _check_length(self, text: str) -> None:
        if not isinstance(text, str):
            raise InvalidInputError(f"text must be a string, got {type(text).__name__}")
        if len(text) > self.max_text_chars:
            raise InvalidInputError(f"text has {len(text)} characters, more than the limit of {self.max_text_chars}")

    def _normalize(self, text: str, language: str | None) -> tuple[str, list[tuple[str | None, str]]]:
        self._check_length(text)
        language = None if language is None else language_code(language)
        text = strip_control_characters(text)
        if not text.strip():
            raise InvalidInputError("text is empty or only whitespace")
        if has_special_token_markup(text):
            normalized, segments = text, [(None, text)]
        else:
            runs = [self._normalize_run(run, run_language) for run_language, run in self._language_runs(text, language)]
            normalized = " ".join(run_text for run_text, _ in runs)
            segments = [segment for _, run_segments in runs for segment in run_segments]
        segments = [(language, segment) for language, segment in segments if is_speakable(segment)]
        if not segments:
            raise InvalidInputError(f"text has nothing speakable after normalisation: {text[:50]!r}")
        return normalized, segments

    def _language_runs(self, text: str, language: str | None) -> list[tuple[str | None, str]]:
        """`text` (stripped) in runs of consecutive sentences of one language each: (a language of `spellers`, run),
        or (None, run) for the official path. Text without a sentence in a spelled-out language is one official run,
        so that Chinese and English text is normalised as a whole, as the official front end does."""
        text = text.strip()
        if language is not None or not self.spellers:
            return [(language if language in self.spellers else None, text)]
        pieces = sentences(text)
        detected = [detect_language(piece, self._classify_latin) for piece in pieces]
        for index, found in enumerate(detected):
            # Kanji alone may be Japanese: a Chinese sentence after a Japanese one (opening the text: before it) is.
            if found == "zh":
                before = next((told for told in reversed(detected[:index]) if told), None)
                after = next((told for told in detected[index + 1 :] if told), None)
                detected[index] = "ja" if (before or after) == "ja" else "zh"
        known = [found for found in detected if found is not None]
        if not any(found in self.spellers for found in known):
            return [(None, text)]
        runs: list[tuple[str | None, str]] = []
        current = known[0]  # what sentences before the first told apart take
        for piece, found in zip(pieces, detected, strict=True):
            current = found or current  # one it cannot tell takes the language before it
            run_language = current if current in self.spellers else None
            if runs and runs[-1][0] == run_language:
                runs[-1] = (run_language, runs[-1][1] + piece)
            else:
                runs.append((run_language, piece))
        return [(run_language, run.strip()) for run_language, run in runs if run.strip()]

    def _normalize_run(self, text: str, language: str | None) -> tuple[str, list[tuple[str | None, str]]]:
        """A run of one language, normalised and split: its own way for a spelled-out language, else the official."""
        if language is not None:
            normalized = self.spellers[language].spell_out(WHITESPACE_RUN.sub(" ", text))
            if language == "ja":
                segments = split_paragraph(normalized, JAPANESE_SPLIT, len)
            else:
                segments = split_paragraph(normalized, ENGLISH_SPLIT, self._token_count)
        elif contains_chinese(text):
            language, normalized = "zh", chinese_cleanup(self._apply_wetext(self._zh_wetext, text))
            segments = split_paragraph(normalized, CHINESE_SPLIT, len)
        else:
            language = "en"
            normalized = spell_out_numbers(self._apply_wetext(self._en_wetext, text), self._inflect)
            segments = split_paragraph(normalized, ENGLISH_SPLIT, self._token_count)
        return normalized, [(language, segment) for segment in segments]

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def _token_count(self, text: str) -> int:
        return len(self._encode(text))

    @staticmethod
    def _apply_wetext(normalizer: Any, text: str) -> str:
        if normalizer is None:
            return text
        try:
            return normalizer.normalize(text)
        except Exception as error:  # a third-party FST failure must not fail the request; raw text still works
            logger.warning(
                "wetext could not normalise %r (%s: %s); using it as is", text[:50], type(error).__name__, error
            )
            return text
