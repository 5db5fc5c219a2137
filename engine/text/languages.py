"""The language of a text: a request's `language` checked, or each sentence's detected.

CosyVoice3 speaks zh, en, de, es, fr, it, ru, ja and ko. The official front end normalises only Chinese and English
(`engine.text.frontend`); the others are spelled out by `engine.text.spelled_numbers`, so the front end needs to know
which sentence is in which language.

Detection, per sentence: by script first, which is certain (kana Japanese, Hangul Korean, Han without kana Chinese as
in the official `contains_chinese`, mostly Cyrillic Russian); Latin text by `py3langid` restricted to en, de, es, fr,
it, trusted at `LATIN_MIN_CONFIDENCE` or more (why this detector among those on PyPI: docs/text.md, "Which
language"). A sentence it cannot tell (digits only, one short word) is `None`: the caller gives it its neighbours'.
"""

from __future__ import annotations

import functools
import re
import unicodedata
from typing import TYPE_CHECKING

from engine.errors import InvalidInputError

if TYPE_CHECKING:
    from py3langid.langid import LanguageIdentifier

# The languages whose text the official front end normalises (wetext, inflect; Cantonese, yue, is written in Chinese
# characters), then the ones `engine.text.spelled_numbers` spells out.
OFFICIAL_LANGUAGES = ("zh", "en", "yue")
SPELLED_OUT_LANGUAGES = ("de", "es", "fr", "it", "ru", "ja", "ko")
LANGUAGES = OFFICIAL_LANGUAGES + SPELLED_OUT_LANGUAGES
LATIN_LANGUAGES = ("en", "de", "es", "fr", "it")
# py3langid's probability (normalised over the five) below which a Latin sentence is not trusted: one-word greetings
# scored 0.2-0.4 (and were wrong as often as right), sentences of three words or more 0.7 and above.
LATIN_MIN_CONFIDENCE = 0.5

KANA = re.compile(r"[\u3040-\u30ff\u31f0-\u31ff\uff66-\uff9f]")
HANGUL = re.compile(r"[\u1100-\u11ff\u3130-\u318f\uac00-\ud7af]")
HAN = re.compile(r"[\u4e00-\u9fff]")  # the official contains_chinese range
CYRILLIC = re.compile(r"[\u0400-\u04ff]")
# A sentence ends after a CJK mark, or an ASCII one before whitespace; a period after a digit does not end one, as
# German ordinals and dates ("am 3. Mai") write one there.
SENTENCE_END = re.compile(r"(?<=[。！？；\n])|(?:(?<=[!?;])|(?<=\D\.))(?=\s)")


def language_code(language: str) -> str:
    """`language` as one of LANGUAGES: a code such as "de" in any case, also with a region ("de-DE", "de_AT");
    InvalidInputError, naming them, for any other."""
    code = re.split(r"[-_]", language.strip(), maxsplit=1)[0].lower()
    if code not in LANGUAGES:
        raise InvalidInputError(
            f"language must be one of {', '.join(LANGUAGES)} (or such a code with a region, de-DE), got {language!r}"
        )
    return code


def sentences(text: str) -> list[str]:
    """`text` cut after each sentence end, whitespace kept: the pieces join back into `text`."""
    return [piece for piece in SENTENCE_END.split(text) if piece]


def detect_language(sentence: str, classify_latin: bool = True) -> str | None:
    """The language of one sentence, one of LANGUAGES, or None where it cannot be told (see the module docstring).
    Without `classify_latin`, Latin text is English (py3langid is not asked)."""
    if KANA.search(sentence):
        return "ja"
    if HANGUL.search(sentence):
        return "ko"
    if HAN.search(sentence):
        return "zh"
    latin = sum(1 for char in sentence if char.isalpha() and unicodedata.name(char, "").startswith("LATIN"))
    if len(CYRILLIC.findall(sentence)) > latin:
        return "ru"
    if latin == 0:
        return None
    if not classify_latin:
        return "en"
    language, confidence = latin_identifier().classify(sentence)
    return language if confidence >= LATIN_MIN_CONFIDENCE else None


@functools.cache
def latin_identifier() -> LanguageIdentifier:
    """py3langid's model restricted to LATIN_LANGUAGES, loaded once per process (~0.8 s: it decompresses the model)."""
    from py3langid.langid import MODEL_FILE, LanguageIdentifier

    identifier = LanguageIdentifier.from_model_file(MODEL_FILE, norm_probs=True)
    identifier.set_languages(list(LATIN_LANGUAGES))
    return identifier
