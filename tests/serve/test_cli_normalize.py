"""`cosyvoice-serve normalize`: what the model reads of a text, from the embedded tiny models, without Ray."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

from serve_app.cli import main as cli_main


def test_normalize_prints_each_segment_with_the_language_it_is_read_in(capsys: pytest.CaptureFixture[str]) -> None:
    text = "Am 3. Mai kostet es 12,50 €. I have 3 apples. 今日は2024年です。"
    assert cli_main(["normalize", text, "--model", "cosyvoice3-tiny"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "[de] Am dritten Mai kostet es zwölf Euro und fünfzig Cent.",
        "[en] I have three apples.",
        "[ja] 今日は二千二十四年です。",
    ]
    assert "ray" not in sys.modules or not sys.modules["ray"].is_initialized()


def test_normalize_takes_the_language_and_the_app_args_of_a_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli_main(["normalize", "I have 3 apples.", "--model", "cosyvoice3-tiny", "--language", "fr"]) == 0
    assert capsys.readouterr().out == "[fr] I have trois apples.\n"
    config = tmp_path / "serve.yaml"
    application = {"name": "app", "args": {"model": "cosyvoice3-tiny", "text": {"spell_out_languages": False}}}
    config.write_text(yaml.safe_dump({"applications": [application]}))
    assert cli_main(["normalize", "Ich habe 3 Äpfel.", "--config", str(config)]) == 0
    assert capsys.readouterr().out == "[en] Ich habe three Äpfel.\n"  # the official front end's reading


def test_normalize_refuses_an_unknown_language_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["normalize", "Olá.", "--model", "cosyvoice3-tiny", "--language", "pt"]) == 2
    assert capsys.readouterr().err.startswith("error: language must be one of zh, en, yue, de, es, fr, it, ru, ja, ko")
