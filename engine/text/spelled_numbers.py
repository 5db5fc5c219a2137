"""Numbers, dates, units and currencies spelled out in German, Spanish, French, Italian, Russian, Japanese and Korean.

CosyVoice3 speaks these languages, but the official front end normalises Chinese and English only: a German "10" is
read "ten" (FunAudioLLM/CosyVoice#1949). `NumberSpeller(language).spell_out(text)` writes them as the language says
them, with `num2words` for the number words and the tables below for what stands around them. Every other character
(umlauts, accents, ß, ñ) is kept; the text is NFC-composed, as the tokenizer's merges are for composed letters.

The passes, in order (a later one sees the words an earlier one wrote, never its digits): dates (and years beside a
word for year), ordinals where the text marks them (and Korean's native numbers before counters), amounts of money,
quantities of a unit, then every other number in the language's digit grouping and decimal mark. A number agrees
with the noun it counts where the language wants it ("ein Euro", "два рубля"). Each pass's forms, and what is not
done (times, ranges, Roman numerals, German ordinals without an article): docs/text.md, "What is spelled out".
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal

MINUS = "-−"  # hyphen-minus and the minus sign
MAX_UNGROUPED_DIGITS = 9  # longer runs without grouping are codes and phone numbers: read digit by digit
MAX_SPELLED_DIGITS = 15  # longer whole numbers (num2words' words end at 10**27 in some languages) too
CURRENCY_SYMBOLS = {"€": "EUR", "$": "USD", "£": "GBP", "₽": "RUB", "¥": "JPY", "￥": "JPY", "₩": "KRW"}
CURRENCY_CODES = ("EUR", "USD", "GBP", "RUB", "JPY", "KRW")
UNIT_ALIASES = {"℃": "°C", "％": "%", "L": "l", "mL": "ml"}
# German words after which an ordinal ends in -en ("am dritten Mai") or -e ("der dritte Platz"); else -er
GERMAN_DATIVE_WORDS = frozenset({"am", "im", "vom", "zum", "zur", "beim", "dem", "den", "des", "seit", "ab", "bis"})
GERMAN_NOMINATIVE_WORDS = frozenset({"der", "die", "das"})
# Russian endings of a written ordinal ("3-й", "5-го") -> num2words' case and gender
RUSSIAN_ORDINAL_ENDINGS = {
    "й": ("n", "m"),
    "я": ("n", "f"),
    "е": ("n", "n"),
    "го": ("g", "m"),
    "му": ("d", "m"),
    "м": ("p", "m"),
    "ю": ("a", "f"),
}
RUSSIAN_YEAR_WORDS = {"год": "n", "года": "g", "году": "p", "годом": "i"}  # -> the year's case ("в 1990 году")
KOREAN_NATIVE_TENS = ("", "열", "스물", "서른", "마흔", "쉰", "예순", "일흔", "여든", "아흔")
KOREAN_NATIVE_ONES = ("", "한", "두", "세", "네", "다섯", "여섯", "일곱", "여덟", "아홉")
# counters read with native numbers up to 99 (not 개월, months, nor 달러, dollars: both take Sino-Korean ones)
KOREAN_NATIVE_COUNTERS = r"시간|시|개(?!월)|명|살|마리|권|잔|병|달(?!러)"
KOREAN_MONTHS = {6: "유월", 10: "시월"}  # the two months whose Sino-Korean numbers drop a consonant
# what a count ending in millions or milliards needs before its noun: "un millón de euros", "un million d'euros"
MILLIONS_LINK = {
    "es": (" de", ("millón", "millones", "billón", "billones")),
    "fr": (" de", ("million", "millions", "milliard", "milliards")),
    "it": (" di", ("milione", "milioni", "miliardo", "miliardi")),
}
FRENCH_ELISION = re.compile(r"\bde (?=[aeiouyéèêh])")


@dataclass(frozen=True)
class Noun:
    """A thing counted: `forms` are templates with {} for the number, (one, other) or Russian's (one, few, many), one
    alone where the word never changes; `gender` (m, f, n) makes the number agree ("una libra")."""

    forms: tuple[str, ...]
    gender: str = "m"


@dataclass(frozen=True)
class LanguageTable:
    """How one language writes and says numbers and what stands around them."""

    group_marks: str  # between groups of three digits
    decimal_mark: str
    decimal_word: str  # "Komma"; Russian's fractions are num2words' own ("две целых пять десятых")
    fraction_as_number: bool  # "tres coma catorce" (es, fr, it), else digit by digit ("drei Komma eins vier")
    minus: str
    months: tuple[str, ...]  # as a date says them (Russian: in the genitive); none in ja and ko (3月, 3월)
    units: dict[str, Noun]  # symbol -> name
    currencies: dict[str, tuple[Noun, Noun | None]]  # ISO code -> (unit, hundredth); None: no hundredths in use
    cents_joiner: str  # between the units and the cents of an amount
    word_joiner: str = " "  # between number words (Japanese writes none)


def _nouns(**forms: tuple[str, ...] | str) -> dict[str, Noun]:
    """Nouns of the masculine gender by symbol; a str is a word that never changes."""
    return {symbol: Noun((form,) if isinstance(form, str) else form) for symbol, form in forms.items()}


def _symbols(nouns: dict[str, Noun]) -> dict[str, Noun]:
    """The units by their written symbols: the keyword names stand for km/h, °C and %."""
    names = {"kmh": "km/h", "celsius": "°C", "percent": "%"}
    return {names.get(name, name): noun for name, noun in nouns.items()}


RUSSIAN_UNITS = _symbols(_nouns(
    km=("{} километр", "{} километра", "{} километров"), m=("{} метр", "{} метра", "{} метров"),
    cm=("{} сантиметр", "{} сантиметра", "{} сантиметров"),
    mm=("{} миллиметр", "{} миллиметра", "{} миллиметров"),
    kmh=("{} километр в час", "{} километра в час", "{} километров в час"),
    kg=("{} килограмм", "{} килограмма", "{} килограммов"), g=("{} грамм", "{} грамма", "{} граммов"),
    mg=("{} миллиграмм", "{} миллиграмма", "{} миллиграммов"), l=("{} литр", "{} литра", "{} литров"),
    ml=("{} миллилитр", "{} миллилитра", "{} миллилитров"),
    celsius=("{} градус Цельсия", "{} градуса Цельсия", "{} градусов Цельсия"),
    percent=("{} процент", "{} процента", "{} процентов"),
))  # fmt: skip
# Russian writes its unit symbols in Cyrillic too (not "г", which is also "год": "1990 г.")
RUSSIAN_SYMBOLS = {"км": "km", "м": "m", "см": "cm", "мм": "mm", "км/ч": "km/h", "кг": "kg", "мг": "mg", "л": "l",
                   "мл": "ml"}  # fmt: skip

TABLES: dict[str, LanguageTable] = {
    "de": LanguageTable(
        group_marks=".\u00a0\u202f",
        decimal_mark=",",
        decimal_word="Komma",
        fraction_as_number=False,
        minus="minus",
        months=("Januar", "Februar", "März", "April", "Mai", "Juni", "Juli", "August", "September", "Oktober",
                "November", "Dezember"),
        units=_symbols(_nouns(
            km="{} Kilometer", m="{} Meter", cm="{} Zentimeter", mm="{} Millimeter", kmh="{} Kilometer pro Stunde",
            kg="{} Kilogramm", g="{} Gramm", mg="{} Milligramm", l="{} Liter", ml="{} Milliliter",
            celsius="{} Grad Celsius", percent="{} Prozent",
        )),
        currencies={
            "EUR": (Noun(("{} Euro",)), Noun(("{} Cent",))),
            "USD": (Noun(("{} Dollar",)), Noun(("{} Cent",))),
            "GBP": (Noun(("{} Pfund",), "n"), Noun(("{} Penny", "{} Pence"))),
            "RUB": (Noun(("{} Rubel",)), Noun(("{} Kopeke", "{} Kopeken"), "f")),
            "JPY": (Noun(("{} Yen",)), None),
            "KRW": (Noun(("{} Won",)), None),
        },
        cents_joiner=" und ",
    ),
    "es": LanguageTable(
        group_marks=".\u00a0\u202f",
        decimal_mark=",",
        decimal_word="coma",
        fraction_as_number=True,
        minus="menos",
        months=("enero", "febrero", "marzo", "abril", "mayo", "junio", "julio", "agosto", "septiembre", "octubre",
                "noviembre", "diciembre"),
        units=_symbols(_nouns(
            km=("{} kilómetro", "{} kilómetros"), m=("{} metro", "{} metros"), cm=("{} centímetro", "{} centímetros"),
            mm=("{} milímetro", "{} milímetros"), kmh=("{} kilómetro por hora", "{} kilómetros por hora"),
            kg=("{} kilogramo", "{} kilogramos"), g=("{} gramo", "{} gramos"), mg=("{} miligramo", "{} miligramos"),
            l=("{} litro", "{} litros"), ml=("{} mililitro", "{} mililitros"),
            celsius=("{} grado Celsius", "{} grados Celsius"), percent="{} por ciento",
        )),
        currencies={
            "EUR": (Noun(("{} euro", "{} euros")), Noun(("{} céntimo", "{} céntimos"))),
            "USD": (Noun(("{} dólar", "{} dólares")), Noun(("{} centavo", "{} centavos"))),
            "GBP": (Noun(("{} libra", "{} libras"), "f"), Noun(("{} penique", "{} peniques"))),
            "RUB": (Noun(("{} rublo", "{} rublos")), Noun(("{} kopek", "{} kopeks"))),
            "JPY": (Noun(("{} yen", "{} yenes")), None),
            "KRW": (Noun(("{} won", "{} wones")), None),
        },
        cents_joiner=" con ",
    ),
    "fr": LanguageTable(
        group_marks=" \u00a0\u202f.",
        decimal_mark=",",
        decimal_word="virgule",
        fraction_as_number=True,
        minus="moins",
        months=("janvier", "février", "mars", "avril", "mai", "juin", "juillet", "août", "septembre", "octobre",
                "novembre", "décembre"),
        units=_symbols(_nouns(
            km=("{} kilomètre", "{} kilomètres"), m=("{} mètre", "{} mètres"), cm=("{} centimètre", "{} centimètres"),
            mm=("{} millimètre", "{} millimètres"), kmh=("{} kilomètre par heure", "{} kilomètres par heure"),
            kg=("{} kilogramme", "{} kilogrammes"), g=("{} gramme", "{} grammes"),
            mg=("{} milligramme", "{} milligrammes"), l=("{} litre", "{} litres"),
            ml=("{} millilitre", "{} millilitres"),
            celsius=("{} degré Celsius", "{} degrés Celsius"), percent="{} pour cent",
        )),
        currencies={
            "EUR": (Noun(("{} euro", "{} euros")), Noun(("{} centime", "{} centimes"))),
            "USD": (Noun(("{} dollar", "{} dollars")), Noun(("{} cent", "{} cents"))),
            "GBP": (Noun(("{} livre", "{} livres"), "f"), Noun(("{} penny", "{} pence"))),
            "RUB": (Noun(("{} rouble", "{} roubles")), Noun(("{} kopeck", "{} kopecks"))),
            "JPY": (Noun(("{} yen", "{} yens")), None),
            "KRW": (Noun(("{} won", "{} wons")), None),
        },
        cents_joiner=" et ",
    ),
    "it": LanguageTable(
        group_marks=".\u00a0\u202f",
        decimal_mark=",",
        decimal_word="virgola",
        fraction_as_number=True,
        minus="meno",
        months=("gennaio", "febbraio", "marzo", "aprile", "maggio", "giugno", "luglio", "agosto", "settembre",
                "ottobre", "novembre", "dicembre"),
        units=_symbols(_nouns(
            km=("{} chilometro", "{} chilometri"), m=("{} metro", "{} metri"), cm=("{} centimetro", "{} centimetri"),
            mm=("{} millimetro", "{} millimetri"), kmh=("{} chilometro all'ora", "{} chilometri all'ora"),
            kg=("{} chilogrammo", "{} chilogrammi"), g=("{} grammo", "{} grammi"),
            mg=("{} milligrammo", "{} milligrammi"), l=("{} litro", "{} litri"), ml=("{} millilitro", "{} millilitri"),
            celsius=("{} grado Celsius", "{} gradi Celsius"), percent="{} per cento",
        )),
        currencies={
            "EUR": (Noun(("{} euro",)), Noun(("{} centesimo", "{} centesimi"))),
            "USD": (Noun(("{} dollaro", "{} dollari")), Noun(("{} centesimo", "{} centesimi"))),
            "GBP": (Noun(("{} sterlina", "{} sterline"), "f"), Noun(("{} penny",))),
            "RUB": (Noun(("{} rublo", "{} rubli")), Noun(("{} copeco", "{} copechi"))),
            "JPY": (Noun(("{} yen",)), None),
            "KRW": (Noun(("{} won",)), None),
        },
        cents_joiner=" e ",
    ),
    "ru": LanguageTable(
        group_marks=" \u00a0\u202f",
        decimal_mark=",",
        decimal_word="",
        fraction_as_number=True,
        minus="минус",
        months=("января", "февраля", "марта", "апреля", "мая", "июня", "июля", "августа", "сентября", "октября",
                "ноября", "декабря"),
        units={**RUSSIAN_UNITS, **{cyrillic: RUSSIAN_UNITS[latin] for cyrillic, latin in RUSSIAN_SYMBOLS.items()}},
        currencies={
            "EUR": (Noun(("{} евро",), "n"), Noun(("{} цент", "{} цента", "{} центов"))),
            "USD": (Noun(("{} доллар", "{} доллара", "{} долларов")), Noun(("{} цент", "{} цента", "{} центов"))),
            "GBP": (Noun(("{} фунт", "{} фунта", "{} фунтов")), Noun(("{} пенни",), "n")),
            "RUB": (Noun(("{} рубль", "{} рубля", "{} рублей")), Noun(("{} копейка", "{} копейки", "{} копеек"), "f")),
            "JPY": (Noun(("{} иена", "{} иены", "{} иен"), "f"), None),
            "KRW": (Noun(("{} вона", "{} воны", "{} вон"), "f"), None),
        },
        cents_joiner=" ",
    ),
    "ja": LanguageTable(
        group_marks=",",
        decimal_mark=".",
        decimal_word="点",
        fraction_as_number=False,
        minus="マイナス",
        months=(),
        units=_symbols(_nouns(
            km="{}キロメートル", m="{}メートル", cm="{}センチメートル", mm="{}ミリメートル", kmh="時速{}キロメートル",
            kg="{}キログラム", g="{}グラム", mg="{}ミリグラム", l="{}リットル", ml="{}ミリリットル",
            celsius="摂氏{}度", percent="{}パーセント",
        )),
        currencies={
            "EUR": (Noun(("{}ユーロ",)), Noun(("{}セント",))),
            "USD": (Noun(("{}ドル",)), Noun(("{}セント",))),
            "GBP": (Noun(("{}ポンド",)), Noun(("{}ペンス",))),
            "RUB": (Noun(("{}ルーブル",)), Noun(("{}コペイカ",))),
            "JPY": (Noun(("{}円",)), None),
            "KRW": (Noun(("{}ウォン",)), None),
        },
        cents_joiner="",
        word_joiner="",
    ),
    "ko": LanguageTable(
        group_marks=",",
        decimal_mark=".",
        decimal_word="점",
        fraction_as_number=False,
        minus="마이너스",
        months=(),
        units=_symbols(_nouns(
            km="{} 킬로미터", m="{} 미터", cm="{} 센티미터", mm="{} 밀리미터", kmh="시속 {} 킬로미터",
            kg="{} 킬로그램", g="{} 그램", mg="{} 밀리그램", l="{} 리터", ml="{} 밀리리터",
            celsius="섭씨 {} 도", percent="{} 퍼센트",
        )),
        currencies={
            "EUR": (Noun(("{} 유로",)), Noun(("{} 센트",))),
            "USD": (Noun(("{} 달러",)), Noun(("{} 센트",))),
            "GBP": (Noun(("{} 파운드",)), Noun(("{} 펜스",))),
            "RUB": (Noun(("{} 루블",)), Noun(("{} 코페이카",))),
            "JPY": (Noun(("{} 엔",)), None),
            "KRW": (Noun(("{} 원",)), None),
        },
        cents_joiner=" ",
    ),
}  # fmt: skip


@dataclass(frozen=True)
class Number:
    """A number as written: its sign, the digits before the decimal mark (without grouping) and after it."""

    negative: bool
    integer: str
    fraction: str = ""
    grouped: bool = False

    @property
    def magnitude(self) -> Decimal:
        return Decimal(f"{int(self.integer)}.{self.fraction or '0'}")


Replacement = tuple[re.Pattern[str], Callable[[re.Match[str]], str]]


class NumberSpeller:
    """Spells out the numbers of text in one of `TABLES`' languages (see the module docstring)."""

    def __init__(self, language: str) -> None:
        if language not in TABLES:
            raise ValueError(f"no number spelling for {language!r}; there is for {', '.join(TABLES)}")
        # Imported here: an optional dependency (the `text` extra) of front ends that spell out other languages.
        from num2words import num2words

        self._num2words: Callable[..., str] = num2words
        self.language = language
        self.table = table = TABLES[language]
        groups, decimal, minus = (re.escape(marks) for marks in (table.group_marks, table.decimal_mark + ".", MINUS))
        number = (
            f"(?:(?<![\\w{minus}])(?P<sign>[{minus}]))?(?<!\\d)"
            f"(?P<integer>\\d{{1,3}}(?:[{groups}]\\d{{3}})+(?![{groups}]?\\d)|\\d+)(?:[{decimal}](?P<fraction>\\d+))?"
            "(?!\\d)"
        )
        units = "|".join(map(re.escape, sorted({*table.units, *UNIT_ALIASES}, key=len, reverse=True)))
        currency = f"(?:(?P<symbol>{'|'.join(map(re.escape, CURRENCY_SYMBOLS))})|(?P<code>{'|'.join(CURRENCY_CODES)}))"
        self.passes: list[Replacement] = [
            *self._date_passes(),
            *self._ordinal_passes(),
            # the sign after the amount first: "1 ₽ 2 ₽" is two amounts, not "1" and "₽ 2"
            (re.compile(f"{number}\\s?{currency}(?!\\w)"), self._amount),
            (re.compile(f"(?<![^\\W\\d_]){currency}\\s?{number}"), self._amount),
            (re.compile(f"{number}\\s?(?P<unit>{units})(?!\\w)"), self._quantity),
            (re.compile(number), lambda match: self.number_words(self._parsed(match))),
        ]

    def spell_out(self, text: str) -> str:
        """`text` with its numbers, dates, amounts and quantities in words, NFC-composed."""
        text = unicodedata.normalize("NFC", text)
        for pattern, words in self.passes:
            text = pattern.sub(words, text)
        return text

    # --- numbers

    def cardinal(self, n: int, gender: str | None = None) -> str:
        """The words of a whole number `n` >= 0, agreeing with the `gender` (m, f, n) of a noun it counts; None where
        it counts none (German "eins", Spanish "uno")."""
        if self.language == "ru":
            return self._num2words(n, lang="ru", gender=gender or "m")
        words = self._num2words(n, lang=self.language)
        if gender is None:
            return words
        if self.language == "de" and words.endswith("eins"):
            return words[:-4] + ("eine" if gender == "f" else "ein")
        if self.language == "es" and gender == "f":  # "veintiuna libras", "doscientas libras" (hundreds agree too)
            return re.sub(r"uno$", "una", words.replace("ientos", "ientas") if n < 10**6 else words)
        if self.language == "es":
            return re.sub(r"(?:veinti)?uno$", lambda m: "veintiún" if m[0] == "veintiuno" else "un", words)
        if self.language == "fr" and gender == "f" and words.endswith("un"):
            return words + "e"
        if self.language == "it" and n == 1:
            return "una" if gender == "f" else "un"
        return words

    def ordinal(self, n: int, feminine: bool = False) -> str:
        """num2words' ordinal of `n` (Spanish and Italian: masculine, or feminine)."""
        words = self._num2words(n, lang=self.language, to="ordinal")
        return re.sub(r"o\b", "a", words) if feminine else words

    def russian_ordinal(self, n: int, case: str, gender: str = "m") -> str:
        return self._num2words(n, lang="ru", to="ordinal", case=case, gender=gender)

    def digits(self, digits: str) -> str:
        """`digits` read one by one ("007", a phone number)."""
        return self.table.word_joiner.join(self._num2words(int(digit), lang=self.language) for digit in digits)

    def number_words(self, number: Number, gender: str | None = None) -> str:
        """The words of a number as written: its sign, whole part and fraction (`gender` as in `cardinal`)."""
        table = self.table
        digit_count = len(number.integer)
        if (
            (number.integer.startswith("0") and digit_count > 1)
            or digit_count > MAX_SPELLED_DIGITS
            or (not number.grouped and digit_count > MAX_UNGROUPED_DIGITS)
        ):
            words = [self.digits(number.integer)]
        elif number.fraction and self.language == "ru":
            words = [self._num2words(number.magnitude, lang="ru")]
        else:
            words = [self.cardinal(int(number.integer), None if number.fraction else gender)]
        if number.fraction and self.language != "ru":
            significant = number.fraction.lstrip("0")
            if table.fraction_as_number and significant:
                zeros = len(number.fraction) - len(significant)
                words += [table.decimal_word, *[self.cardinal(0)] * zeros, self.cardinal(int(significant))]
            else:
                words += [table.decimal_word, self.digits(number.fraction)]
        return table.word_joiner.join([table.minus, *words] if number.negative else words)

    def counted(self, number: Number, noun: Noun) -> str:
        """`number` with the noun it counts, in the form that number takes ("1 km": "ein Kilometer", "5 рублей")."""
        words = self.number_words(number, noun.gender)
        link, millions = MILLIONS_LINK.get(self.language, ("", ()))
        linked = bool(millions) and not number.fraction and words.endswith(millions)
        phrase = noun.forms[min(self._form(number), len(noun.forms) - 1)].format(words + link if linked else words)
        return FRENCH_ELISION.sub("d'", phrase) if linked and self.language == "fr" else phrase

    def _form(self, number: Number) -> int:
        """Which of a noun's forms a number takes: 0 one, 1 other (Russian: 1 few, 2 many)."""
        whole = int(number.integer)
        if self.language == "ru":
            if number.fraction:
                return 1  # "две целых пять десятых километра"
            if whole % 10 == 1 and whole % 100 != 11:
                return 0
            return 1 if 2 <= whole % 10 <= 4 and not 12 <= whole % 100 <= 14 else 2
        if self.language == "fr":
            return 0 if number.magnitude < 2 else 1  # "1,5 kilomètre"
        return 0 if whole == 1 and not number.fraction else 1

    @staticmethod
    def _parsed(match: re.Match[str]) -> Number:
        integer = match["integer"]
        return Number(
            match["sign"] is not None, re.sub(r"\D", "", integer), match["fraction"] or "", not integer.isdigit()
        )

    # --- money and quantities

    def _amount(self, match: re.Match[str]) -> str:
        unit, hundredth = self.table.currencies[match["code"] or CURRENCY_SYMBOLS[match["symbol"]]]
        number = self._parsed(match)
        if hundredth is None or not number.fraction or len(number.fraction) > 2:
            return self.counted(number, unit)  # "3,5 ¥", "1,005 €": a decimal number of units
        whole, cents = int(number.integer), int(number.fraction.ljust(2, "0"))
        parts = []
        if whole or not cents:
            parts.append(self.counted(Number(number.negative, number.integer, grouped=number.grouped), unit))
        if cents:
            parts.append(self.counted(Number(number.negative and not whole, str(cents)), hundredth))
        return self.table.cents_joiner.join(parts)

    def _quantity(self, match: re.Match[str]) -> str:
        unit = UNIT_ALIASES.get(match["unit"], match["unit"])
        return self.counted(self._parsed(match), self.table.units[unit])

    # --- dates and ordinals

    def _date_passes(self) -> list[Replacement]:
        day, month, year = r"(?P<day>\d{1,2})", r"(?P<month>\d{1,2})", r"(?P<year>\d{4})"
        passes = [(re.compile(f"(?<![\\d.]){year}-{month}-{day}(?![\\d-])"), self._numeric_date)]
        if self.language in ("ja", "ko"):
            numeric = f"(?<![\\d.]){year}(?P<sep>[/.]){month}(?P=sep){day}(?!\\d)\\.?"
        else:
            numeric = f"(?<![\\d.]){day}(?P<sep>[./]){month}(?P=sep){year}(?!\\d)"
        passes.append((re.compile(numeric), self._numeric_date))
        months = "|".join(self.table.months)
        if self.language == "de":
            written = f"(?<![\\d.]){day}\\.\\s*(?P<name>{months})(?:\\s+{year}(?!\\d))?"
            passes += [
                (re.compile(written), self._written_date),
                (re.compile(f"\\b(?P<word>Jahr|Jahre|Jahres)\\s+{year}(?!\\d)"), self._german_year),
            ]
        elif self.language == "ru":
            written = f"(?<![\\d.]){day}\\s+(?P<name>{months})(?:\\s+{year}(?:\\s*(?:года|г\\.))?)?(?!\\w)"
            words = "|".join(sorted(RUSSIAN_YEAR_WORDS, key=len, reverse=True))
            passes += [
                (re.compile(written), self._written_date),
                (re.compile(f"(?<![\\d.]){year}\\s*(?P<word>{words}|г\\.)(?!\\w)"), self._russian_year),
            ]
        elif self.language in ("fr", "it"):
            first = "premier" if self.language == "fr" else "primo"
            passes.append((re.compile(f"(?<![\\d.,])1\\s+(?P<name>{months})\\b"), lambda m: f"{first} {m['name']}"))
        elif self.language == "ko":
            passes.append((re.compile(r"(?<![\d.])(?P<month>6|10)월"), lambda m: KOREAN_MONTHS[int(m["month"])]))
        return passes

    def _numeric_date(self, match: re.Match[str]) -> str:
        day, month, year = int(match["day"]), int(match["month"]), int(match["year"])
        if not (1 <= month <= 12 and 1 <= day <= 31):
            return match[0]
        if self.language in ("ja", "ko"):  # the written form, whose numbers the last pass spells
            return f"{year}年{month}月{day}日" if self.language == "ja" else f"{year}년 {month}월 {day}일"
        return self._date_words(day, self.table.months[month - 1], year, _word_before(match))

    def _written_date(self, match: re.Match[str]) -> str:
        year = int(match["year"]) if match["year"] else None
        return self._date_words(int(match["day"]), match["name"], year, _word_before(match))

    def _date_words(self, day: int, month: str, year: int | None, word_before: str) -> str:
        if self.language == "de":
            words = f"{self.german_ordinal(day, word_before)} {month}"
            return f"{words} {self._num2words(year, lang='de', to='year')}" if year else words
        if self.language == "ru":  # the date of an event: "пятого марта две тысячи двадцать четвёртого года"
            words = f"{self.russian_ordinal(day, 'g', 'n')} {month}"
            return f"{words} {self.russian_ordinal(year, 'g')} года" if year else words
        if self.language == "es":
            return f"{self.cardinal(day)} de {month} de {self.cardinal(year)}"
        first = {"fr": "premier", "it": "primo"}[self.language]
        return f"{first if day == 1 else self.cardinal(day)} {month} {self.cardinal(year)}"

    def german_ordinal(self, n: int, word_before: str) -> str:
        """A German ordinal in the form the word before it asks: "am dritten", "der dritte", else "dritter"."""
        base = self.ordinal(n)  # "dritte"
        if word_before.lower() in GERMAN_DATIVE_WORDS:
            return base + "n"
        return base if word_before.lower() in GERMAN_NOMINATIVE_WORDS else base + "r"

    def _german_year(self, match: re.Match[str]) -> str:
        return f"{match['word']} {self._num2words(int(match['year']), lang='de', to='year')}"

    def _russian_year(self, match: re.Match[str]) -> str:
        word = match["word"]
        if word == "г.":  # the abbreviation: "в 1990 г." is "в ... году", else "... года"
            word = "году" if _word_before(match).lower() == "в" else "года"
        case = RUSSIAN_YEAR_WORDS[word]
        if case == "p" and _word_before(match).lower() == "к":
            case = "d"  # "к 1990 году"
        return f"{self.russian_ordinal(int(match['year']), case)} {word}"

    def _ordinal_passes(self) -> list[Replacement]:
        n = r"(?<![\d.,])(?P<n>\d{1,6})"  # an ordinal of more digits is no ordinal: read as a number
        if self.language == "de":
            articles = "|".join(sorted(GERMAN_DATIVE_WORDS | GERMAN_NOMINATIVE_WORDS))
            pattern = re.compile(f"\\b(?P<word>{articles})\\s+{n}\\.(?=\\s)", re.IGNORECASE)
            return [(pattern, lambda m: f"{m['word']} {self.german_ordinal(int(m['n']), m['word'])}")]
        if self.language in ("es", "it"):
            marked = (re.compile(f"{n}\\.?(?P<mark>[ºª])"), lambda m: self.ordinal(int(m["n"]), m["mark"] == "ª"))
            if self.language == "it":
                return [marked]
            return [(re.compile(f"{n}\\.?er\\b"), lambda m: self.ordinal(int(m["n"]))[:-1]), marked]  # primer
        if self.language == "fr":
            return [
                (
                    re.compile(r"(?<![\d.,])1(?P<end>er|re|ère)\b"),
                    lambda m: "premier" if m["end"] == "er" else "première",
                ),
                (re.compile(f"{n}(?:e|ème|eme)\\b"), lambda m: self.ordinal(int(m["n"]))),
            ]
        if self.language == "ru":
            endings = "|".join(sorted(RUSSIAN_ORDINAL_ENDINGS, key=len, reverse=True))
            pattern = re.compile(f"{n}-(?P<end>{endings})(?!\\w)")
            return [(pattern, lambda m: self.russian_ordinal(int(m["n"]), *RUSSIAN_ORDINAL_ENDINGS[m["end"]]))]
        if self.language == "ko":
            return [
                (re.compile(f"{n}\\s*번째"), lambda m: self.ordinal(int(m["n"]))),
                (re.compile(f"(?<!제){n}\\s*(?P<counter>{KOREAN_NATIVE_COUNTERS})"), self._korean_counted),
            ]
        return []  # Japanese: 第3 and 3番目 are the number's own kanji, spelled by the last pass

    def _korean_counted(self, match: re.Match[str]) -> str:
        n = int(match["n"])
        if not 1 <= n <= 99:
            return f"{self.cardinal(n)} {match['counter']}"
        native = "스무" if n == 20 else KOREAN_NATIVE_TENS[n // 10] + KOREAN_NATIVE_ONES[n % 10]
        return f"{native} {match['counter']}"


def _word_before(match: re.Match[str]) -> str:
    """The word before a match in its text ("" at its start)."""
    before = re.search(r"(\w+)\W*$", match.string[: match.start()])
    return before[1] if before else ""
