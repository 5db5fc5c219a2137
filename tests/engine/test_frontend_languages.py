"""Numbers read in the text's own language: engine.text.spelled_numbers, engine.text.languages and
the front end that uses them, with Chinese and English left exactly as the official front end does."""

from __future__ import annotations

import unicodedata
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.errors import InvalidInputError
from engine.loading.loader import load_frontend, load_model
from engine.runtime.encoder_stage import TextEncoderStage
from engine.runtime.synthesis_request import SynthesisRequest
from engine.text.frontend import TextFrontend
from engine.text.languages import SPELLED_OUT_LANGUAGES, detect_language, language_code, sentences
from engine.text.spelled_numbers import NumberSpeller
from tests.conftest import kit_group
from tests.parity.test_parity_frontend import require_wetext

# (language, as written, as the speller writes it to be read): cardinals, decimals with the language's mark, ordinals
# where the text marks them, dates and years, percentages, the six currencies, units.
SPELLED = [
    ("de", "21 Bäume und 1.234 Äpfel", "einundzwanzig Bäume und eintausendzweihundertvierunddreißig Äpfel"),
    ("de", "Pi ist 3,14.", "Pi ist drei Komma eins vier."),
    ("de", "der 2. Platz, beim 1. Versuch", "der zweite Platz, beim ersten Versuch"),
    ("de", "Am 3. Mai 1990", "Am dritten Mai neunzehnhundertneunzig"),
    ("de", "am 03.10.2024", "am dritten Oktober zweitausendvierundzwanzig"),
    ("de", "der 1.5.2024", "der erste Mai zweitausendvierundzwanzig"),
    ("de", "2024-03-05, im Jahr 1990", "fünfter März zweitausendvierundzwanzig, im Jahr neunzehnhundertneunzig"),
    ("de", "25 % Rabatt", "fünfundzwanzig Prozent Rabatt"),
    ("de", "12,50 €, $1, £3,01", "zwölf Euro und fünfzig Cent, ein Dollar, drei Pfund und ein Penny"),
    ("de", "100 ₽, ¥500, ₩1.000", "einhundert Rubel, fünfhundert Yen, eintausend Won"),
    ("de", "5 km, 1 kg, -5 °C", "fünf Kilometer, ein Kilogramm, minus fünf Grad Celsius"),
    ("de", "Tel. 0301234567", "Tel. null drei null eins zwei drei vier fünf sechs sieben"),
    ("es", "21 km y 1 km", "veintiún kilómetros y un kilómetro"),
    ("es", "£1, £21, £200", "una libra, veintiuna libras, doscientas libras"),
    ("es", "3,14 y 0,05", "tres coma catorce y cero coma cero cinco"),
    ("es", "el 1.º, la 2.ª, el 1.er piso", "el primero, la segunda, el primer piso"),
    ("es", "Nací el 12/10/1990.", "Nací el doce de octubre de mil novecientos noventa."),
    ("es", "50 % más", "cincuenta por ciento más"),
    ("es", "3,50 € y $1.000.000", "tres euros con cincuenta céntimos y un millón de dólares"),
    ("es", "100 ₽, ¥500, ₩1.000", "cien rublos, quinientos yenes, mil wones"),
    ("es", "1 kg, 30 °C, -3 °C", "un kilogramo, treinta grados Celsius, menos tres grados Celsius"),
    ("fr", "21 €, £1, £21", "vingt et un euros, une livre, vingt et une livres"),
    ("fr", "3,14 et 1 000 habitants", "trois virgule quatorze et mille habitants"),
    ("fr", "1 000 000 €, 2 000 000 000 £", "un million d'euros, deux milliards de livres"),
    ("fr", "le 1er mai, la 1re, le 2e", "le premier mai, la première, le deuxième"),
    ("fr", "le 14/07/1989, le 1 mai", "le quatorze juillet mille neuf cent quatre-vingt-neuf, le premier mai"),
    ("fr", "10 %, 20 °C", "dix pour cent, vingt degrés Celsius"),
    ("fr", "1,5 km, 2,5 km", "un virgule cinq kilomètre, deux virgule cinq kilomètres"),
    ("fr", "$5, 100 ₽, ¥500, ₩1 000", "cinq dollars, cent roubles, cinq cents yens, mille wons"),
    ("it", "£1, 1 km, 2 km", "una sterlina, un chilometro, due chilometri"),
    ("it", "3,14", "tre virgola quattordici"),
    ("it", "il 1º maggio, la 2ª volta", "il primo maggio, la seconda volta"),
    ("it", "il 12/10/1990", "il dodici ottobre millenovecentonovanta"),
    ("it", "40 %", "quaranta per cento"),
    ("it", "3,50 €, 1.000.000 €, $5", "tre euro e cinquanta centesimi, un milione di euro, cinque dollari"),
    ("it", "100 ₽, ¥500, ₩1.000, 30 °C", "cento rubli, cinquecento yen, mille won, trenta gradi Celsius"),
    ("ru", "21 ₽, 22 ₽, 5 ₽", "двадцать один рубль, двадцать два рубля, пять рублей"),
    ("ru", "1,50 ₽ и 0,01 ₽", "один рубль пятьдесят копеек и одна копейка"),
    ("ru", "2,5 км", "две целых пять десятых километра"),
    ("ru", "3-й и 5-го", "третий и пятого"),
    ("ru", "5 марта 2024 года", "пятого марта две тысячи двадцать четвёртого года"),
    ("ru", "12.10.1990", "двенадцатого октября тысяча девятьсот девяностого года"),
    ("ru", "в 1990 году, к 2000 году", "в тысяча девятьсот девяностом году, к двухтысячному году"),
    ("ru", "45 %", "сорок пять процентов"),
    ("ru", "$2, €5, £3, ¥2, ₩1 000", "два доллара, пять евро, три фунта, две иены, одна тысяча вон"),
    ("ru", "-5 °C, 1 км, 3 кг", "минус пять градусов Цельсия, один километр, три килограмма"),
    ("ja", "2024年3月5日と2024/3/5", "二千二十四年三月五日と二千二十四年三月五日"),
    ("ja", "3.5km、25%、-5℃", "三点五キロメートル、二十五パーセント、摂氏マイナス五度"),
    ("ja", "¥1,000、1,000円、$5.50", "千円、千円、五ドル五十セント"),
    ("ja", "€3、£2、₽100、₩1,000", "三ユーロ、二ポンド、百ルーブル、千ウォン"),
    ("ja", "第1回、3kg", "第一回、三キログラム"),
    ("ko", "2024년 3월 5일, 2024-06-05", "이천이십사년 삼월 오일, 이천이십사년 유월 오일"),
    ("ko", "사과 3개, 20명, 21살, 3개월", "사과 세 개, 스무 명, 스물한 살, 삼개월"),
    ("ko", "1번째, 3번째", "첫 번째, 세 번째"),
    ("ko", "3.5km, 25%, -5°C", "삼 점 오 킬로미터, 이십오 퍼센트, 섭씨 마이너스 오 도"),
    ("ko", "₩5,000, 5,000원, $3", "오천 원, 오천원, 삼 달러"),
    ("ko", "€2, ¥100, £1, ₽10", "이 유로, 백 엔, 일 파운드, 십 루블"),
]  # fmt: skip


@pytest.mark.parametrize(("language", "written", "spoken"), SPELLED)
def test_numbers_dates_units_and_currencies_are_spelled_in_the_texts_language(
    language: str, written: str, spoken: str
) -> None:
    assert NumberSpeller(language).spell_out(written) == spoken


def test_letters_are_kept_and_composed() -> None:
    speller = NumberSpeller("de")
    assert speller.spell_out("Straße, Öl, über, naïve") == "Straße, Öl, über, naïve"
    decomposed = unicodedata.normalize("NFD", "Bäume ändern sich")
    assert decomposed != "Bäume ändern sich" and speller.spell_out(decomposed) == "Bäume ändern sich"
    assert NumberSpeller("es").spell_out("El niño, mañana") == "El niño, mañana"


@pytest.fixture(scope="module")
def v3_frontend() -> TextFrontend:
    """The CosyVoice3 tiny preset's front end as the encoder loads it: every spelled-out language on."""
    frontend = load_frontend("cosyvoice3-tiny")
    assert sorted(frontend.spellers) == sorted(SPELLED_OUT_LANGUAGES)
    return frontend


def test_the_language_of_each_sentence_is_detected(v3_frontend: TextFrontend) -> None:
    text = "Ich habe 3 Äpfel. I have 3 apples. Tengo 3 manzanas. J'ai 3 pommes. Ho 3 mele e una pera. У меня 3 яблока. "
    text += "りんごが3個あります。사과가 3개 있어요. 我有3个苹果。"
    assert v3_frontend.split_by_language(text) == [
        ("de", "Ich habe drei Äpfel."),
        ("en", "I have three apples."),
        ("es", "Tengo tres manzanas."),
        ("fr", "J'ai trois pommes."),
        ("it", "Ho tre mele e una pera."),
        ("ru", "У меня три яблока."),
        ("ja", "りんごが三個あります。"),
        ("ko", "사과가 세 개 있어요."),
        ("zh", "我有三个苹果。"),
    ]


def test_a_sentence_that_cannot_be_told_takes_its_neighbours_language(v3_frontend: TextFrontend) -> None:
    assert detect_language("Hallo.") is None and detect_language("42.") is None
    assert v3_frontend.split("Hallo. Der Zug hat 15 Minuten Verspätung.") == [
        "Hallo. Der Zug hat fünfzehn Minuten Verspätung."
    ]
    assert v3_frontend.split("Der Zug hat 15 Minuten Verspätung. 42.") == [
        "Der Zug hat fünfzehn Minuten Verspätung. zweiundvierzig."
    ]
    # kanji alone are Chinese, but Japanese beside Japanese
    assert detect_language("東京大学。") == "zh"
    assert v3_frontend.split_by_language("東京大学。3時に会いましょう。") == [("ja", "東京大学。三時に会いましょう。")]
    assert v3_frontend.split_by_language("사과 3개. 苹果3个。") == [("ko", "사과 세 개."), ("zh", "苹果三个。")]


def test_the_sentences_of_a_text_join_back_into_it() -> None:
    text = "Am 3. Mai war es kalt. Wirklich?  Ja! 今日は。次"
    assert sentences(text) == ["Am 3. Mai war es kalt.", " Wirklich?", "  Ja!", " 今日は。", "次"]
    assert "".join(sentences(text)) == text


def test_a_requests_language_is_taken_without_detection(v3_frontend: TextFrontend) -> None:
    assert v3_frontend.split("I have 3 apples.", language="de") == ["I have drei apples."]
    assert v3_frontend.split("Ich habe 3 Äpfel.", language="en") == ["Ich habe three Äpfel."]  # the official reading
    assert v3_frontend.split("Ich habe 3 Äpfel.", language="DE-de") == ["Ich habe drei Äpfel."]
    assert language_code("de_DE") == "de" and language_code(" JA ") == "ja"
    with pytest.raises(InvalidInputError, match=r"language must be one of zh, en, yue, de, .*got 'pt-BR'"):
        v3_frontend.split("Olá.", language="pt-BR")


def test_chinese_and_english_stay_as_the_official_front_end_reads_them(
    each_kit: Path, each_kit_cases: dict[str, list[dict[str, Any]]]
) -> None:
    """With every language of the kit's family spelled out, as served: the kit's official normalisation and segments."""
    require_wetext()
    frontend = load_frontend(each_kit / "model", load_format="official")
    assert frontend.spellers
    for case in kit_group(each_kit_cases, "frontend"):
        assert frontend.normalize(case["text"]) == case["normalized_text"], case["text"]
        assert "\n".join(frontend.split(case["text"])) == case["segments_joined"], case["text"]


def test_v1_and_v2_spell_out_japanese_and_korean_only() -> None:
    """The languages beyond Chinese and English their model cards name; a German text takes the official path."""
    for preset in ("tiny", "cosyvoice2-tiny"):
        frontend = load_frontend(preset)
        assert sorted(frontend.spellers) == ["ja", "ko"]
        assert frontend.split_by_language("사과 3개.") == [("ko", "사과 세 개.")]
        assert frontend.split_by_language("Ich habe 3 Äpfel.", "de")[0][0] == "en"


def test_spelling_turned_off_leaves_every_text_to_the_official_path() -> None:
    frontend = load_frontend("cosyvoice3-tiny", spell_out_languages=False)
    assert not frontend.spellers
    assert frontend.split_by_language("Ich habe 3 Äpfel und 2 Birnen.") == [
        ("en", "Ich habe three Äpfel und two Birnen.")
    ]


def test_a_synthesis_request_carries_its_language_to_the_front_end() -> None:
    stage = TextEncoderStage(load_model("cosyvoice3-tiny", components=("encoder",)))
    frontend = stage.model.frontend
    voice = stage.voices[0]
    request = SynthesisRequest(text="Es kostet 3 €.", voice=voice, language="fr-FR")
    assert request.validated().language == "fr"
    [segment] = stage.segment_texts(request)
    assert segment.text == frontend.tokenize("Es kostet trois euros.")
    with pytest.raises(InvalidInputError, match="language must be one of"):
        SynthesisRequest(text="Olá.", voice=voice, language="pt").validated()


@pytest.mark.parametrize("language", SPELLED_OUT_LANGUAGES)
@settings(max_examples=150, deadline=None)
@given(text=st.text(alphabet="0123456789 .,-−/:%°C€$£₽¥₩kmgl年월개째ºªer-йEUR", max_size=40))
def test_any_digits_and_marks_are_spelled_without_a_digit_left_or_an_error(language: str, text: str) -> None:
    spoken = NumberSpeller(language).spell_out(text)
    assert not any(char.isdigit() for char in spoken), (text, spoken)
