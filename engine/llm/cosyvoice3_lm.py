"""The CosyVoice3 speech-token LM (`CosyVoice3LM`): the CosyVoice2 Qwen2 decoder with its own speech vocabulary.

Same backbone, text embedding and continuous-batching decoder as v2 (qwen2_lm, generation); what
differs is the speech side:
- one table, `speech_embedding` [V + 200, D], holds the speech tokens and the special rows: sos = V, eos = V + 1,
  task id = V + 2, fill = V + 3 (there is no `llm_embedding`);
- `llm_decoder` is a Linear without bias to V + 200 classes, and every id from V up stops decoding;
- the text (prompt text + text) must contain `<|endofprompt|>` (id 151646): the official prompt convention is a
  system/instruct text ending in that token before the text to speak.

min_len: the official code masks only id V (its sos, never a likely pick) before min_len, so its eos can end an
utterance early; the shared decoder does the same by default (`model.eos` is V), and
`SamplingOptions.mask_all_stop_ids_before_min_len` masks every stop id instead, as it does for v2.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor, nn

from engine.errors import CheckpointError, InvalidInputError
from engine.llm.qwen2_lm import Qwen2Encoder, Qwen2LM, Qwen2LMConfig, Qwen2TextEmbedding, embed_text
from engine.loading.yaml_config import ObjectSpec
from engine.nn.layers import Linear, length_mask

NUM_SPECIAL_SPEECH_TOKENS = 200  # ids V .. V+199 of speech_embedding / llm_decoder, all stop decoding
SOS_OFFSET, EOS_OFFSET, TASK_ID_OFFSET, FILL_OFFSET = 0, 1, 2, 3
ENDOFPROMPT_TOKEN = 151646  # `<|endofprompt|>` in the CosyVoice3 Qwen tokenizer; the official code hard-codes it
DUMMY_SPEECH_LOGIT_GAIN = 10.0  # the initial speech rows' gain over the stop rows (see CosyVoice3LM.__init__)


class CosyVoice3LMConfig(Qwen2LMConfig):
    """The v2 LM config fields; speech_token_size is V, the first of the 200 special rows."""

    @classmethod
    def from_yaml(cls, spec: ObjectSpec, model_dir: str | Path, class_name: str = "CosyVoice3LM") -> CosyVoice3LMConfig:
        """The yaml `llm` node (class `CosyVoice3LM`); the Qwen2 config is
        `<model_dir>/CosyVoice-BlankEN/config.json`."""
        config = super().from_yaml(spec, model_dir, class_name)
        if config.qwen.vocab_size <= ENDOFPROMPT_TOKEN:
            raise CheckpointError(
                f"the Qwen2 vocabulary ({config.qwen.vocab_size}) has no <|endofprompt|> id {ENDOFPROMPT_TOKEN}"
            )
        return config


def embed_prompted_text(embed_tokens: nn.Embedding, tokens: Tensor, lengths: Tensor) -> Tensor:
    """`embed_text` of ids whose every row holds `<|endofprompt|>` within its length; InvalidInputError otherwise."""
    embedded = embed_text(embed_tokens, tokens, lengths)
    valid = length_mask(lengths.to(tokens.device), tokens.shape[1])
    lacking = (~((tokens == ENDOFPROMPT_TOKEN) & valid).any(dim=1)).nonzero().flatten().tolist()
    if lacking:
        raise InvalidInputError(
            f"CosyVoice3 text must contain <|endofprompt|> (id {ENDOFPROMPT_TOKEN}) after the system or instruct "
            f"prompt; row(s) {lacking} have none"
        )
    return embedded


class CosyVoice3TextEmbedding(Qwen2TextEmbedding):
    """What an encoder-only replica keeps of a loaded `CosyVoice3LM`: its Qwen2 token embedding."""

    def encode_text(self, tokens: Tensor, lengths: Tensor) -> Tensor:
        """tokens [B, T], lengths [B] -> [B, T, D], as `CosyVoice3LM.encode_text` (the marker is required)."""
        return embed_prompted_text(self.embed_tokens, tokens, lengths)


class CosyVoice3LM(Qwen2LM):
    """Module and parameter names follow the official class, so `llm.pt` loads strictly. The v2 `Qwen2LM`'s
    decoding (`eos`, `speaker_embed_dim`, `lm_input`, `generate`) is shared; the layers and the special rows differ."""

    def __init__(self, cfg: CosyVoice3LMConfig) -> None:
        nn.Module.__init__(self)  # no llm_embedding, and an llm_decoder without bias
        self.cfg = cfg
        classes = cfg.speech_token_size + NUM_SPECIAL_SPEECH_TOKENS
        self.llm = Qwen2Encoder(cfg.qwen)
        self.llm_decoder = Linear(cfg.llm_output_size, classes, bias=False)
        self.speech_embedding = nn.Embedding(classes, cfg.llm_input_size)
        with torch.no_grad():  # dummy weights only: a checkpoint overwrites these
            # A fresh decoder's logits are flat, so its 200 stop rows (2/3 of the tiny preset's rows) take enough
            # of the mass to end almost every dummy utterance at once; a trained one keeps them for the end.
            self.llm_decoder.weight[: cfg.speech_token_size] *= DUMMY_SPEECH_LOGIT_GAIN
            self.llm_decoder.weight[cfg.speech_token_size :] *= 1 / DUMMY_SPEECH_LOGIT_GAIN

    def encode_text(self, tokens: Tensor, lengths: Tensor) -> Tensor:
        """tokens [B, T] (right-padded ids of prompt text + text), lengths [B] -> [B, T, llm_input_size].

        Every row must contain `<|endofprompt|>` within its length (the official code asserts it).
        """
        return embed_prompted_text(self.llm.model.model.embed_tokens, tokens, lengths)

    @property
    def fill_token(self) -> int:
        return self.eos + FILL_OFFSET

    @property
    def end_token(self) -> int:
        """Bi-streaming ends on the official eos, V + 1 (plain decoding stops on any id from V)."""
        return self.eos + EOS_OFFSET

    def bistream_prompt_split(self, prompt_text: Tensor) -> int:
        """Bi-streaming: the prompt text through `<|endofprompt|>` goes first, before the mixed groups (official)."""
        marks = (prompt_text.reshape(-1) == ENDOFPROMPT_TOKEN).nonzero()
        if not len(marks):
            raise InvalidInputError(
                f"CosyVoice3 bi-streaming needs <|endofprompt|> (id {ENDOFPROMPT_TOKEN}) in the prompt text"
            )
        return int(marks[0, 0]) + 1

    def special_embeddings(self) -> tuple[Tensor, Tensor]:
        """The sos and task-id embeddings: rows V and V + 2 of speech_embedding."""
        weight = self.speech_embedding.weight
        sos, task_id = self.eos + SOS_OFFSET, self.eos + TASK_ID_OFFSET
        return weight[sos : sos + 1], weight[task_id : task_id + 1]
