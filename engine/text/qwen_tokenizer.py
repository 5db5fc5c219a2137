"""CosyVoice2 / CosyVoice3 text tokenizer: the Qwen2 byte-level BPE of `<model_dir>/CosyVoice-BlankEN`, plus the
special tokens the family's official tokenizer class adds (`CosyVoice2Tokenizer`, `CosyVoice3Tokenizer`).

It gives the ids of `AutoTokenizer.from_pretrained(dir)` (transformers' `Qwen2TokenizerFast`) after the official
front end's `add_special_tokens`, built with the `tokenizers` library alone (no transformers dependency):
  1. `tokenizer.json` when the directory has one, else `vocab.json` + `merges.txt` assembled as transformers
     converts them: NFC normaliser, the Qwen2 split regex (isolated) then byte-level mapping, byte-level BPE;
  2. the added tokens of `tokenizer_config.json` (`added_tokens_decoder`, in id order) and its special tokens
     (Qwen2's defaults: `<|endoftext|>` as eos, pad and unk), each one the tokenizer does not have yet;
  3. the family's special tokens (`COSYVOICE2_SPECIAL_TOKENS` or `COSYVOICE3_SPECIAL_TOKENS`), in their official
     order; new ones take the next free ids.
Added tokens in the text are matched as single tokens; no BOS/EOS is added.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from engine.errors import CheckpointError, InvalidInputError
from engine.text.frontend import ENDOFPROMPT

TOKENIZER_DIR_NAME = "CosyVoice-BlankEN"  # inside an official CosyVoice2 model directory
QWEN2_PRETOKENIZE_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
ENDOFTEXT = "<|endoftext|>"
QWEN2_ENDOFTEXT_ID = 151643  # the released Qwen2 vocabulary's first added token; `<|im_start|>`, `<|im_end|>` follow
QWEN2_DEFAULT_SPECIAL_TOKENS = {"unk_token": ENDOFTEXT, "eos_token": ENDOFTEXT, "pad_token": ENDOFTEXT}
# The official CosyVoice2 front end adds these (eos/pad first, then the additional ones) in this order.
COSYVOICE2_SPECIAL_TOKENS = (
    ENDOFTEXT, "<|im_start|>", "<|im_end|>", ENDOFPROMPT, "[breath]", "<strong>", "</strong>",
    "[noise]", "[laughter]", "[cough]", "[clucking]", "[accent]", "[quick_breath]", "<laughter>", "</laughter>",
    "[hissing]", "[sigh]", "[vocalized-noise]", "[lipsmack]", "[mn]",
)  # fmt: skip
# CosyVoice3 adds, after those, `<|endofsystem|>` and phoneme tags in brackets for pronunciation fixes: ARPAbet
# (every vowel bare and with stress 0-2, and the consonants) and pinyin initials and finals with tone marks, each
# list in code point order as the official class writes them.
_ARPABET_VOWELS = ("AA", "AE", "AH", "AO", "AW", "AY", "EH", "ER", "EY", "IH", "IY", "OW", "OY", "UH", "UW")
_ARPABET_CONSONANTS = (
    "B", "CH", "D", "DH", "F", "G", "HH", "JH", "K", "L", "M", "N", "NG", "P", "R", "S", "SH", "T", "TH", "V", "W",
    "Y", "Z", "ZH",
)  # fmt: skip
_PINYIN = (
    "a", "ai", "an", "ang", "ao", "b", "c", "ch", "d", "e", "ei", "en", "eng", "f", "g", "h", "i", "ian", "in",
    "ing", "iu", "ià", "iàn", "iàng", "iào", "iá", "ián", "iáng", "iáo", "iè", "ié", "iòng", "ióng", "iù", "iú",
    "iā", "iān", "iāng", "iāo", "iē", "iě", "iōng", "iū", "iǎ", "iǎn", "iǎng", "iǎo", "iǒng", "iǔ", "j", "k", "l",
    "m", "n", "o", "ong", "ou", "p", "q", "r", "s", "sh", "t", "u", "uang", "ue", "un", "uo", "uà", "uài", "uàn",
    "uàng", "uá", "uái", "uán", "uáng", "uè", "ué", "uì", "uí", "uò", "uó", "uā", "uāi", "uān", "uāng", "uē", "uě",
    "uī", "uō", "uǎ", "uǎi", "uǎn", "uǎng", "uǐ", "uǒ", "vè", "w", "x", "y", "z", "zh", "à", "ài", "àn", "àng",
    "ào", "á", "ái", "án", "áng", "áo", "è", "èi", "èn", "èng", "èr", "é", "éi", "én", "éng", "ér", "ì", "ìn",
    "ìng", "í", "ín", "íng", "ò", "òng", "òu", "ó", "óng", "óu", "ù", "ùn", "ú", "ún", "ā", "āi", "ān", "āng", "āo",
    "ē", "ēi", "ēn", "ēng", "ě", "ěi", "ěn", "ěng", "ěr", "ī", "īn", "īng", "ō", "ōng", "ōu", "ū", "ūn", "ǎ", "ǎi",
    "ǎn", "ǎng", "ǎo", "ǐ", "ǐn", "ǐng", "ǒ", "ǒng", "ǒu", "ǔ", "ǔn", "ǘ", "ǚ", "ǜ",
)  # fmt: skip
_ARPABET = sorted(
    (*(vowel + stress for vowel in _ARPABET_VOWELS for stress in ("", "0", "1", "2")), *_ARPABET_CONSONANTS)
)
COSYVOICE3_SPECIAL_TOKENS = (
    *COSYVOICE2_SPECIAL_TOKENS,
    "<|endofsystem|>",
    *(f"[{phoneme}]" for phoneme in _ARPABET),
    *(f"[{phoneme}]" for phoneme in _PINYIN),
)
TOKENIZER_JSON, TOKENIZER_CONFIG = "tokenizer.json", "tokenizer_config.json"
VOCAB_JSON, MERGES_TXT = "vocab.json", "merges.txt"
_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


def byte_level_alphabet() -> list[str]:
    """The 256 characters byte-level BPE writes bytes 0..255 as, in byte order (printable Latin-1 bytes stand for
    themselves, the others for the characters from U+0100 on, in byte order)."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    alphabet, shifted = [], 0
    for byte in range(256):
        if byte in printable:
            alphabet.append(chr(byte))
        else:
            alphabet.append(chr(256 + shifted))
            shifted += 1
    return alphabet


def special_token(content: str) -> AddedToken:
    """A special token as transformers' `add_special_tokens` adds a string: matched in the raw text."""
    return AddedToken(content, normalized=False, special=True)


def qwen2_pipeline(model: models.BPE) -> Tokenizer:
    """The tokenizer transformers builds for Qwen2 from a vocab and merges."""
    tokenizer = Tokenizer(model)
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _bpe(vocab: dict[str, int], merges: list[tuple[str, str]]) -> models.BPE:
    return models.BPE(
        vocab=vocab,
        merges=merges,
        unk_token=None,
        continuing_subword_prefix="",
        end_of_word_suffix="",
        fuse_unk=False,
        byte_fallback=False,
    )


def _token_content(value: Any, where: str) -> str:
    """A token of tokenizer_config.json: a string or a serialised AddedToken ({"content": ...})."""
    content = value.get("content") if isinstance(value, dict) else value
    if not isinstance(content, str) or not content:
        raise CheckpointError(f"{where}: expected a token string, got {value!r}")
    return content


def _config_added_tokens(config: dict[str, Any], path: Path) -> list[AddedToken]:
    """The added tokens of a tokenizer_config.json, in id order, then its special tokens (transformers' order)."""
    decoder = config.get("added_tokens_decoder", {})
    if not isinstance(decoder, dict):
        raise CheckpointError(f"{path}: added_tokens_decoder must be a mapping of id -> token")
    added = []
    for token_id, entry in sorted(decoder.items(), key=lambda item: int(item[0])):
        if not isinstance(entry, dict):
            raise CheckpointError(f"{path}: added token {token_id} must be a mapping, got {entry!r}")
        special = bool(entry.get("special", False))
        added.append(
            AddedToken(
                _token_content(entry, f"{path} added token {token_id}"),
                single_word=bool(entry.get("single_word", False)),
                lstrip=bool(entry.get("lstrip", False)),
                rstrip=bool(entry.get("rstrip", False)),
                normalized=bool(entry.get("normalized", not special)),
                special=special,
            )
        )
    specials = [config.get(key, QWEN2_DEFAULT_SPECIAL_TOKENS.get(key)) for key in _SPECIAL_TOKEN_KEYS]
    specials += config.get("additional_special_tokens") or []
    for value in specials:
        if value is not None:
            added.append(special_token(_token_content(value, str(path))))
    return added


class QwenTokenizer:
    """Text -> Qwen2 BPE ids with a CosyVoice family's special tokens (see the module docstring)."""

    def __init__(self, tokenizer: Tokenizer, special_tokens: tuple[str, ...] = COSYVOICE2_SPECIAL_TOKENS) -> None:
        """`tokenizer`: the Qwen2 tokenizer before CosyVoice's `special_tokens`, which are added here."""
        tokenizer.add_special_tokens([special_token(token) for token in special_tokens])
        self._tokenizer = tokenizer

    @classmethod
    def from_dir(cls, path: str | Path, special_tokens: tuple[str, ...] = COSYVOICE2_SPECIAL_TOKENS) -> QwenTokenizer:
        """From a Hugging Face tokenizer directory such as `<model_dir>/CosyVoice-BlankEN`."""
        path = Path(path)
        if not path.is_dir():
            raise CheckpointError(f"Qwen tokenizer directory {path} does not exist")
        if (path / TOKENIZER_JSON).is_file():
            tokenizer = Tokenizer.from_file(str(path / TOKENIZER_JSON))
        else:
            missing = [name for name in (VOCAB_JSON, MERGES_TXT) if not (path / name).is_file()]
            if missing:
                raise CheckpointError(
                    f"Qwen tokenizer directory {path} has no tokenizer files: missing {' and '.join(missing)} "
                    f"(or a {TOKENIZER_JSON})"
                )
            try:
                vocab, merges = models.BPE.read_file(str(path / VOCAB_JSON), str(path / MERGES_TXT))
            except Exception as error:  # tokenizers reports malformed files as a bare Exception
                raise CheckpointError(f"cannot read the Qwen tokenizer files in {path}: {error}") from error
            tokenizer = qwen2_pipeline(_bpe(vocab, merges))
        config: dict[str, Any] = {}
        if (path / TOKENIZER_CONFIG).is_file():
            config = json.loads((path / TOKENIZER_CONFIG).read_text(encoding="utf-8"))
        # adding a token the tokenizer already has keeps its id, as transformers' loading does
        tokenizer.add_tokens(_config_added_tokens(config, path / TOKENIZER_CONFIG))
        return cls(tokenizer, special_tokens)

    @classmethod
    def byte_level(
        cls, special_tokens: tuple[str, ...] = COSYVOICE2_SPECIAL_TOKENS, endoftext_id: int = 256
    ) -> QwenTokenizer:
        """A file-less stand-in for dummy-weight models: the 256 byte tokens (ids = byte values), no merges, then
        `<|endoftext|>` at `endoftext_id` and the rest of `special_tokens` (which start with it) after it. The
        default packs them after the bytes (276 ids with CosyVoice2's); `QWEN2_ENDOFTEXT_ID` gives each special
        token its id in the released vocabulary, as a CosyVoice3 LLM needs (`<|endofprompt|>` = 151646)."""
        vocab = {char: byte for byte, char in enumerate(byte_level_alphabet())}
        vocab[ENDOFTEXT] = endoftext_id
        tokenizer = qwen2_pipeline(_bpe(vocab, []))
        # added on its own first: the tokenizers library numbers new added tokens after the largest added id
        tokenizer.add_special_tokens([special_token(ENDOFTEXT)])
        return cls(tokenizer, special_tokens)

    @property
    def vocab_size(self) -> int:
        """One past the largest id, added tokens included (transformers' `len(tokenizer)` for a dense vocabulary):
        the embedding rows a model needs for every id."""
        return max(self._tokenizer.get_vocab(with_added_tokens=True).values()) + 1

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; special tokens written in it (e.g. `<|endofprompt|>`, `[breath]`) are single ids."""
        if not isinstance(text, str):
            raise InvalidInputError(f"text must be a string, got {type(text).__name__}")
        return self._tokenizer.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        """The text of `ids`, special tokens included."""
        return self._tokenizer.decode(ids, skip_special_tokens=False)
