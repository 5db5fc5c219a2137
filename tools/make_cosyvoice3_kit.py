"""Make the CosyVoice3 conformance kit by running the official code on tiny random weights, or extend one.

Run it in a throwaway virtual environment that has the official repository's requirements, never in
this project's environment (docs/parity.md, "The kit tools")::

    python tools/make_cosyvoice3_kit.py --official /path/to/CosyVoice --out tests/fixtures/cosyvoice3-tiny \
        --qwen-tokenizer /path/to/tokenizer-files

``--official`` is a checkout of FunAudioLLM/CosyVoice with its Matcha-TTS submodule; its modules are imported from
there at run time, nothing copied. ``--qwen-tokenizer`` names Qwen2 tokenizer files to copy into
``model/CosyVoice-BlankEN``. Without ``--out/cases.pt`` the script writes ``model/`` and ``cases.pt`` with every
group; with it, the groups of MADE_GROUPS (``stream``, ``frontend``, ``llm_sampled``) are added or replaced, the
longer hift cases (HIFT_LONG_FRAMES) added where missing, and every hift case given its hidden tensors and spreads.
``--bistream-only``, ``--respread`` and ``--references`` work as the v1/v2 tool's (tools/make_conformance_kit.py).
The kit's README is written by hand from what this prints; the sections of those three flags the tool writes.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import re
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from make_conformance_kit import (  # the sibling tool, on sys.path when this runs as a script
    HIFT_LONG_FRAMES,
    add_existing_kit_modes,
    bistream_case,
    copy_qwen_tokenizer,
    measure_spreads,
    official_commit,
    official_e2e,
    official_text_frontend,
    recorded_cpu,
    sampled_llm_case,
    serve_spread_child,
    sha256,
    spread_readme,
    text_path_case,
    write_bistream_group,
    write_references,
    write_respread,
)
from torch import Tensor, nn

SEED = 2003
SPEECH_TOKENS = 96  # speech vocabulary of the tiny kit (6561 in the released model)
ENDOFPROMPT = 151646  # the official LLM asserts this id is in the text, so the Qwen vocab cannot shrink below it
QWEN_VOCAB = ENDOFPROMPT + 1
EOS_SCALE = 0.9  # eos row scale: two LLM cases stop on eos, one runs to max_len
QWEN_DIR = "CosyVoice-BlankEN"
# what extending a kit adds or replaces; the other groups are kept as they are
MADE_GROUPS = ("stream", "frontend", "llm_sampled")
# Inputs of the prompted stream case. With this seed its greedy LLM runs to max_len (8 text tokens x 12 = 96, found
# by trying seeds); its 12 prompt tokens pad the first hop to 25 + 13, so hops of 38 and 50 (each + 3 look-ahead
# tokens) and a short final chunk.
STREAM_SEED = 2019
# Seed of the longer hift cases' random mels (HIFT_LONG_FRAMES: divergences that show only on long mels).
HIFT_LONG_SEED = 2033
# Inputs and RNG seed of the sampled LLM case (`llm_sampled`): a zero-shot prompt, the yaml's ras_sampling.
SAMPLED_SEED = 2023
FRONTEND_TEXTS = (
    "You are a helpful assistant.<|endofprompt|>希望你以后能够做的比我还好呦。",
    "You are a helpful assistant. 请用广东话表达。<|endofprompt|>",
    "You are a helpful assistant.<|endofprompt|>[breath]因为他们那一辈人[breath]在乡里面住的要习惯一点，"
    "[breath]邻居都很活络，[breath]嗯，都很熟悉。[breath]",
    "He paused [breath] and then, after a quick breath [quick_breath], went on.",
    "八百标兵奔北坡，北坡炮兵并排跑，炮兵怕把标兵碰，标兵怕碰炮兵炮。",
    "Hello world, this is a streaming test of the third CosyVoice.",
    "今天是2024年3月5日，气温25.5度，我买了3个苹果。",
    "I have 3 apples and 25 pears, 28 in all, for 4.50 dollars.",
    "高管也通过电话、短信、微信等方式对报道[j][ǐ]予好评。",
    " ".join(
        f"Sentence number {word} tells about the quick brown fox and the lazy dog near the river."
        for word in ("one", "two", "three", "four", "five", "six")
    ),
)

# yaml key path -> (official value as written in the yaml, tiny value)
TINY_YAML = {
    "llm_input_size": ("896", "16"),
    "llm_output_size": ("896", "16"),
    "llm.speech_token_size": ("6561", str(SPEECH_TOKENS)),
    "flow.vocab_size": ("6561", str(SPEECH_TOKENS)),
    "flow.pre_lookahead_layer.channels": ("1024", "32"),
    "flow.decoder.estimator.dim": ("1024", "32"),
    "flow.decoder.estimator.depth": ("22", "2"),
    "flow.decoder.estimator.heads": ("16", "2"),
    "flow.decoder.estimator.dim_head": ("64", "16"),
    "hift.base_channels": ("512", "64"),
    "hift.f0_predictor.cond_channels": ("512", "32"),
}

TINY_QWEN = {
    "architectures": ["Qwen2ForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "hidden_act": "silu",
    "hidden_size": 16,
    "initializer_range": 0.02,
    "intermediate_size": 32,
    "max_position_embeddings": 32768,
    "max_window_layers": 2,
    "model_type": "qwen2",
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 32768,
    "tie_word_embeddings": True,
    "torch_dtype": "float32",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": QWEN_VOCAB,
}

# Sections of the training yaml that inference never builds; loading them would pull in the training
# dependencies (pyworld, librosa, lightning). Overridden to None, as the official flow.py and generator.py
# self-tests override whole sections. (get_tokenizer stays: the front end uses it.)
TRAINING_KEYS = (
    "mel_spec_transform1",
    "hifigan",
    "parquet_opener",
    "tokenize",
    "filter",
    "resample",
    "truncate",
    "feat_extractor",
    "compute_fbank",
    "compute_whisper_fbank",
    "compute_f0",
    "parse_embedding",
    "shuffle",
    "sort",
    "batch",
    "padding",
    "data_pipeline",
    "data_pipeline_gan",
)


def import_official(root: Path) -> None:
    """Put the official code on sys.path; stub Matcha's logger, which would import lightning."""
    sys.path[:0] = [str(root), str(root / "third_party" / "Matcha-TTS")]
    utils = types.ModuleType("matcha.utils")
    utils.__path__ = [str(root / "third_party" / "Matcha-TTS" / "matcha" / "utils")]
    pylogger = types.ModuleType("matcha.utils.pylogger")
    pylogger.get_pylogger = logging.getLogger
    sys.modules["matcha.utils"] = utils
    sys.modules["matcha.utils.pylogger"] = pylogger


def tiny_yaml(official_yaml: str) -> str:
    """The official yaml with the TINY_YAML values replaced, each exactly once under its key path."""
    lines = official_yaml.splitlines(keepends=True)
    for path, (old, new) in TINY_YAML.items():
        *parents, key = path.split(".")
        depth, start = 0, 0
        for parent in parents:  # walk down the nested mapping by indentation
            pattern = re.compile(rf"^{' ' * (4 * depth)}{parent}:")
            start = next(i for i in range(start, len(lines)) if pattern.match(lines[i]))
            depth += 1
        pattern = re.compile(rf"^({' ' * (4 * depth)}{key}: ){re.escape(old)}(\s*(#.*)?)$")
        index = next(i for i in range(start, len(lines)) if pattern.match(lines[i].rstrip("\n")))
        lines[index] = pattern.sub(rf"\g<1>{new}\g<2>", lines[index].rstrip("\n")) + "\n"
    return "".join(lines)


def randomise(module: nn.Module, generator: torch.Generator) -> None:
    """Re-initialise every parameter so that no layer is the identity or zero (official inits zero some)."""
    names = dict(module.named_parameters())
    with torch.no_grad():
        for name, p in names.items():
            leaf = name.rsplit(".", 1)[-1]
            if name.endswith("parametrizations.weight.original0"):
                continue  # the weight-norm gain is set from its direction below
            if leaf == "alpha":
                p.copy_(torch.rand(p.shape, generator=generator) + 0.5)
            elif leaf == "bias":
                p.copy_(torch.randn(p.shape, generator=generator) * 0.05)
            elif p.dim() == 1 or leaf in ("gamma", "beta"):  # norm weights and GRN
                base = 0.0 if leaf == "beta" else 1.0
                p.copy_(base + torch.randn(p.shape, generator=generator) * 0.1)
            elif isinstance(_owner(module, name), nn.Embedding):
                p.copy_(torch.randn(p.shape, generator=generator))
            else:
                p.copy_(torch.randn(p.shape, generator=generator) / p[0].numel() ** 0.5)
        for name, g in names.items():
            if name.endswith("parametrizations.weight.original0"):
                v = names[name[: -len("original0")] + "original1"]
                norm = v.flatten(1).norm(dim=1).reshape(g.shape)
                g.copy_(norm * (0.7 + 0.6 * torch.rand(g.shape, generator=generator)))


def _owner(root: nn.Module, name: str) -> nn.Module:
    parts = name.split(".")[:-1]
    parts = [p for p in parts if p not in ("parametrizations", "weight")]
    return root.get_submodule(".".join(parts)) if parts else root


def _copied(value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.detach().clone()
    if isinstance(value, tuple | list):
        return type(value)(_copied(v) for v in value)
    if isinstance(value, dict):
        return {k: _copied(v) for k, v in value.items()}
    return value


class Recorder:
    """Collects the first call's inputs and outputs of a module via forward hooks."""

    def __init__(self, module: nn.Module) -> None:
        self.calls: list[tuple[tuple, dict, Any]] = []
        module.register_forward_hook(self._hook, with_kwargs=True)

    def _hook(self, _module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        # copies: the official solver refills the same input buffers before every estimator call
        self.calls.append(tuple(map(_copied, (args, kwargs, output))))

    def reset(self) -> None:
        self.calls.clear()


def greedy_sampler(record: list[Tensor]) -> Callable:
    def sample(weighted_scores: Tensor, decoded_tokens: list, sampling: int) -> int:
        record.append(weighted_scores.detach().clone())
        return int(weighted_scores.argmax())

    return sample


def llm_case(
    llm: nn.Module,
    name: str,
    text: Tensor,
    prompt_text: Tensor,
    prompt_speech: Tensor,
    max_ratio: float,
    min_ratio: float,
) -> dict[str, Any]:
    scores: list[Tensor] = []
    llm.sampling = greedy_sampler(scores)
    decoder = Recorder(llm.llm_decoder)
    backbone_inputs: list[Tensor] = []
    original_step = llm.llm.forward_one_step

    def step(xs: Tensor, masks: Tensor, cache: Any = None) -> Any:
        backbone_inputs.append(xs.detach().clone())
        return original_step(xs, masks, cache=cache)

    llm.llm.forward_one_step = step
    text_len = torch.tensor([text.shape[1]], dtype=torch.int32)
    tokens = list(
        llm.inference(
            text=text,
            text_len=text_len.clone(),
            prompt_text=prompt_text,
            prompt_text_len=torch.tensor([prompt_text.shape[1]], dtype=torch.int32),
            prompt_speech_token=prompt_speech,
            prompt_speech_token_len=torch.tensor([prompt_speech.shape[1]], dtype=torch.int32),
            embedding=torch.zeros(0, 192),
            sampling=25,
            max_token_text_ratio=max_ratio,
            min_token_text_ratio=min_ratio,
        )
    )
    llm.llm.forward_one_step = original_step
    raw = torch.stack([out[0].log_softmax(dim=-1) for _, _, out in decoder.calls])
    sampled = torch.stack(scores)
    top2 = sampled.topk(2, dim=-1).values
    max_len, min_len = int(text.shape[1] * max_ratio), int(text.shape[1] * min_ratio)
    stopped = len(tokens) < max_len
    return {
        "name": name,
        "function": "cosyvoice.llm.llm.CosyVoice3LM.inference",
        "text": text,
        "text_len": text_len,
        "prompt_text": prompt_text,
        "prompt_text_len": torch.tensor([prompt_text.shape[1]], dtype=torch.int32),
        "prompt_speech_token": prompt_speech,
        "prompt_speech_token_len": torch.tensor([prompt_speech.shape[1]], dtype=torch.int32),
        "max_token_text_ratio": float(max_ratio),
        "min_token_text_ratio": float(min_ratio),
        "min_len": min_len,
        "max_len": max_len,
        "sos_token": llm.sos,
        "eos_token": llm.eos_token,
        "task_id_token": llm.task_id,
        "stop_token_ids": torch.tensor(llm.stop_token_ids),
        "masked_before_min_len": llm.speech_token_size,
        "out_tokens": torch.tensor(tokens, dtype=torch.int64),
        "num_steps": len(scores),
        "step_raw_logp": raw,
        "step_top1_margin": top2[:, 0] - top2[:, 1],
        "lm_input_prefill": backbone_inputs[0],
        "stop_reason": "stop_token" if stopped else "max_len",
        "stop_token": int(sampled[-1].argmax()) if stopped else -1,
    }


def flow_case(
    flow: nn.Module,
    name: str,
    token: Tensor,
    prompt_token: Tensor,
    prompt_feat: Tensor,
    embedding: Tensor,
    streaming: bool,
    finalize: bool,
) -> dict[str, Any]:
    estimator = Recorder(flow.decoder.estimator)
    lookahead = Recorder(flow.pre_lookahead_layer)
    feat, _ = flow.inference(
        token=token,
        token_len=torch.tensor([token.shape[1]], dtype=torch.int32),
        prompt_token=prompt_token,
        prompt_token_len=torch.tensor([prompt_token.shape[1]], dtype=torch.int32),
        prompt_feat=prompt_feat,
        prompt_feat_len=torch.tensor([prompt_feat.shape[1]], dtype=torch.int32),
        embedding=embedding,
        streaming=streaming,
        finalize=finalize,
    )
    args, _kwargs, out = estimator.calls[0]
    x, mask, mu, t, spks, cond = args[:6]
    return {
        "name": name,
        "function": "cosyvoice.flow.flow.CausalMaskedDiffWithDiT.inference",
        "token": token,
        "prompt_token": prompt_token,
        "prompt_feat": prompt_feat,
        "embedding": embedding,
        "streaming": int(streaming),
        "finalize": int(finalize),
        "lookahead_out": lookahead.calls[0][2],
        "est_in_x": x,
        "est_in_mask": mask,
        "est_in_mu": mu,
        "est_in_t": t,
        "est_in_spks": spks,
        "est_in_cond": cond,
        "est_out_step0": out,
        "num_estimator_calls": len(estimator.calls),
        "feat": feat,
        "mel_len1": prompt_feat.shape[1],
        "mel_len2": feat.shape[2],
    }


def hift_case(hift: nn.Module, name: str, mel: Tensor, finalize: bool) -> dict[str, Any]:
    f0_rec, pre_rec, post_rec = Recorder(hift.f0_predictor), Recorder(hift.conv_pre), Recorder(hift.conv_post)
    speech, source = hift.inference(speech_feat=mel, finalize=finalize)
    f0 = f0_rec.calls[0][2]
    sine = hift.m_source.l_sin_gen
    return {
        "name": name,
        "function": "cosyvoice.hifigan.generator.CausalHiFTGenerator.inference",
        "mel": mel,
        "finalize": int(finalize),
        "f0": f0,
        "source_initial_phase": sine.rand_ini.clone(),
        "source_noise": sine.sine_waves[:, : source.shape[-1]].clone(),
        "source": source,
        "conv_pre_out": pre_rec.calls[0][2],
        "conv_post_out": post_rec.calls[0][2],
        "speech": speech,
        "voiced_fraction": float((f0 > sine.voiced_threshold).float().mean()),
        "clamped_fraction": float((speech.abs() >= hift.audio_limit).float().mean()),
        **recorded_cpu(),
    }


def hift_long_cases(hift: nn.Module) -> list[dict[str, Any]]:
    """`hift_case` on random mels of HIFT_LONG_FRAMES frames, finalize=True, without conv_post_out. Their noise is
    a prefix of the one fixed buffer: stored as views of the longest case's, so `torch.save` writes it once."""
    g = torch.Generator().manual_seed(HIFT_LONG_SEED)
    mels = {frames: torch.randn(1, 80, frames, generator=g) * 2 - 4 for frames in HIFT_LONG_FRAMES}
    cases = {frames: hift_case(hift, f"mel{frames}_long", mel, finalize=True) for frames, mel in mels.items()}
    longest = cases[max(cases)]["source_noise"]
    for case in cases.values():
        del case["conv_post_out"]  # size: the recorded magnitude and phase hold it
        noise = case["source_noise"]
        assert torch.equal(noise, longest[:, : noise.shape[1]])
        case["source_noise"] = longest[:, : noise.shape[1]]
    return list(cases.values())


def official_hift_hidden(hift: nn.Module, case: dict[str, Any]) -> dict[str, Tensor]:
    """One official run over a recorded hift case: `m_source` on the recorded f0 (cast to float32, as inference()
    does; its draws are the fixed buffers), `source_sine` and `source_linear` the input and output of its
    l_linear; then `decode` of the recorded mel (without the f0 look-ahead when finalize=0) and source, with
    `conv_pre_out`, `conv_post_out`, `magnitude` and `phase` (as `_istft` gets them) and `speech`."""
    out: dict[str, Tensor] = {}
    finalize = bool(case["finalize"])
    mel = case["mel"] if finalize else case["mel"][:, :, : -hift.f0_predictor.condnet[0].causal_padding]
    hooks = [
        hift.m_source.l_linear.register_forward_hook(
            lambda _m, i, o: out.update(source_sine=i[0].clone(), source_linear=o.clone())
        ),
        hift.conv_pre.register_forward_hook(lambda _m, _i, o: out.update(conv_pre_out=o.clone())),
        hift.conv_post.register_forward_hook(lambda _m, _i, o: out.update(conv_post_out=o.clone())),
    ]
    istft = hift._istft

    def recording_istft(magnitude: Tensor, phase: Tensor) -> Tensor:
        out.update(magnitude=magnitude.clone(), phase=phase.clone())
        return istft(magnitude, phase)

    hift._istft = recording_istft
    try:
        with torch.inference_mode():
            f0 = case["f0"].to(case["mel"].dtype)
            out["source"] = hift.m_source(hift.f0_upsamp(f0[:, None]).transpose(1, 2))[0].transpose(1, 2)
            out["speech"] = hift.decode(x=mel, s=case["source"], finalize=finalize)
    finally:
        del hift._istft
        for hook in hooks:
            hook.remove()
    return out


def official_hift_run(model: Any, case: dict[str, Any]) -> dict[str, Tensor]:
    """What `measure_spreads` compares of a hift case: its hidden tensors (`official_hift_hidden`) and the official
    inference from its mel, f0 predicted (`official_e2e`); the source's draws are the model's fixed buffers, checked
    against the case's first (a process whose kernels differ must draw them the same)."""
    check_fixed_draws(model, [case])
    e2e = official_e2e(model.hift, speech_feat=case["mel"], finalize=bool(case["finalize"]))
    return official_hift_hidden(model.hift, case) | e2e


def calibrate_hift(hift: nn.Module, generator: torch.Generator) -> None:
    """Scale the f0 head and conv_post: f0 partly voiced, log-magnitudes about N(-2, 0.5^2), phases of std 2."""
    mel = torch.randn(1, 80, 40, generator=generator) * 2 - 4
    with torch.no_grad():
        hidden = hift.f0_predictor.condnet(mel).transpose(1, 2)
        raw = hift.f0_predictor.classifier(hidden)
        cls = hift.f0_predictor.classifier
        cls.weight.mul_(40.0 / raw.std())
        cls.bias.fill_(15.0)
        post = Recorder(hift.conv_post)
        hift.inference(speech_feat=mel)
        hift.f0_predictor.float()
        out = post.calls[0][2][0]
        half = out.shape[0] // 2 + 1
        g = hift.conv_post.parametrizations.weight.original0
        scale = torch.ones(out.shape[0])
        scale[:half] = 0.5 / out[:half].std(dim=1)
        scale[half:] = 2.0 / out[half:].std(dim=1)
        g.mul_(scale.reshape(g.shape))
        hift.conv_post.bias.copy_(
            torch.cat([-2.0 - out[:half].mean(dim=1) * scale[:half], torch.zeros(out.shape[0] - half)])
        )


def write_model_files(official: Path, model_dir: Path) -> None:
    """Write `model/` with tiny random weights (a new kit only: an existing kit's files are never rewritten)."""
    from safetensors.torch import save_file
    from transformers import Qwen2Config, Qwen2ForCausalLM

    blank = model_dir / QWEN_DIR
    blank.mkdir(parents=True, exist_ok=True)
    official_yaml = (official / "examples/libritts/cosyvoice3/conf/cosyvoice3.yaml").read_text()
    (model_dir / "cosyvoice3.yaml").write_text(tiny_yaml(official_yaml))
    (blank / "config.json").write_text(json.dumps(TINY_QWEN, indent=2) + "\n")
    # The official Qwen2Encoder calls from_pretrained, which needs a weights file; llm.pt overwrites every
    # tensor, so the file holds all but the (large) tied embedding, which from_pretrained then initialises.
    torch.manual_seed(SEED)
    qwen = Qwen2ForCausalLM(Qwen2Config(**TINY_QWEN))
    save_file(
        {k: v.contiguous() for k, v in qwen.state_dict().items() if "embed_tokens" not in k and "lm_head" not in k},
        str(blank / "model.safetensors"),
        metadata={"format": "pt"},
    )

    configs = official_configs(model_dir)
    llm, flow, hift = configs["llm"], configs["flow"], configs["hift"]
    randomise(llm, torch.Generator().manual_seed(SEED + 1))
    randomise(flow, torch.Generator().manual_seed(SEED + 2))
    randomise(hift, torch.Generator().manual_seed(SEED + 3))
    with torch.no_grad():
        # Residual branches scaled up so the tiny Qwen is not nearly the identity; the speech head sharpened.
        for layer in llm.llm.model.model.layers:
            layer.self_attn.o_proj.weight.mul_(2.0)
            layer.mlp.down_proj.weight.mul_(2.0)
        llm.llm_decoder.weight.mul_(8.0)
        # llm_decoder has no bias. The 200 ids from V up all stop decoding: shrink them so that only eos (V+1)
        # can win, along a fixed random direction whose scale decides how often it does.
        llm.llm_decoder.weight[SPEECH_TOKENS:].mul_(0.1 / 8.0)
        llm.llm_decoder.weight[SPEECH_TOKENS + 1].mul_(EOS_SCALE * 80.0)
    hift.eval()
    calibrate_hift(hift, torch.Generator().manual_seed(SEED + 4))
    for name, module in (("llm", llm), ("flow", flow), ("hift", hift)):
        torch.save(module.state_dict(), model_dir / f"{name}.pt")
    speakers = torch.Generator().manual_seed(SEED + 5)
    torch.save(
        {sid: {"embedding": torch.randn(1, 192, generator=speakers)} for sid in ("spk3_a", "spk3_b")},
        model_dir / "spk2info.pt",
    )


def official_configs(model_dir: Path) -> dict[str, Any]:
    """The official objects `load_hyperpyyaml` builds from the kit's yaml, training-only sections set to None."""
    from hyperpyyaml import load_hyperpyyaml

    overrides = {"qwen_pretrain_path": str((model_dir / QWEN_DIR).resolve()), **{key: None for key in TRAINING_KEYS}}
    with open(model_dir / "cosyvoice3.yaml") as f:
        return load_hyperpyyaml(f, overrides=overrides)


def load_official_model(model_dir: Path) -> tuple[Any, dict[str, Any]]:
    """The official `CosyVoice3Model` over the kit's files (its loader is strict), and the yaml's objects."""
    from cosyvoice.cli.model import CosyVoice3Model

    configs = official_configs(model_dir)
    model = CosyVoice3Model(configs["llm"], configs["flow"], configs["hift"], fp16=False)
    model.load(*(str(model_dir / f"{name}.pt") for name in ("llm", "flow", "hift")))
    return model, configs


def reference_cases(model: Any, official: Path) -> dict[str, list[dict[str, Any]]]:
    """The groups of a new kit: meta, llm, flow and hift (single official calls)."""
    llm, flow, hift = model.llm, model.flow, model.hift
    g = torch.Generator().manual_seed(SEED + 6)

    def ids(n: int, high: int) -> Tensor:
        return torch.randint(0, high, (1, n), generator=g, dtype=torch.int32)

    def with_endofprompt(n: int) -> Tensor:
        return torch.cat([ids(n - 1, 1000), torch.tensor([[ENDOFPROMPT]], dtype=torch.int32)], dim=1)

    empty = torch.zeros(1, 0, dtype=torch.int32)
    llm_cases = [
        llm_case(llm, "sft_like_system_prompt", ids(5, 1000), with_endofprompt(3), empty, 20, 2),
        llm_case(
            llm,
            "zero_shot_with_prompt",
            ids(6, 1000),
            torch.cat([with_endofprompt(4), ids(5, 1000)], 1),
            ids(12, SPEECH_TOKENS),
            10,
            2,
        ),
        llm_case(
            llm, "instruct_endofprompt_in_text", torch.cat([with_endofprompt(3), ids(4, 1000)], 1), empty, empty, 12, 3
        ),
    ]
    e2e_llm = llm_cases[1]
    prompt_feat = torch.randn(1, 24, 80, generator=g) * 2 - 4
    embedding = torch.randn(1, 192, generator=g)
    flow_cases = [
        flow_case(
            flow,
            "prompt_nonstream_finalize",
            ids(20, SPEECH_TOKENS),
            ids(12, SPEECH_TOKENS),
            prompt_feat,
            embedding,
            streaming=False,
            finalize=True,
        ),
        flow_case(
            flow,
            "prompt_stream_chunk_not_final",
            ids(31, SPEECH_TOKENS),
            ids(12, SPEECH_TOKENS),
            prompt_feat,
            embedding,
            streaming=True,
            finalize=False,
        ),
        flow_case(
            flow,
            "e2e_zero_shot_from_llm",
            e2e_llm["out_tokens"][None].int(),
            e2e_llm["prompt_speech_token"],
            prompt_feat,
            embedding,
            streaming=False,
            finalize=True,
        ),
    ]
    flow_cases[2]["e2e_source"] = "token = out_tokens of llm case zero_shot_with_prompt; prompt_token = its prompt"
    hift_cases = [
        hift_case(hift, "mel16_finalize", torch.randn(1, 80, 16, generator=g) * 2 - 4, finalize=True),
        hift_case(hift, "mel24_chunk_not_final", torch.randn(1, 80, 24, generator=g) * 2 - 4, finalize=False),
        hift_case(hift, "e2e_zero_shot_from_flow", flow_cases[2]["feat"], finalize=True),
    ]
    hift_cases[2]["e2e_source"] = "mel = feat of flow case e2e_zero_shot_from_llm"
    import transformers

    commit = official_commit(official)
    meta = {
        "kit": "cosyvoice3-tiny",
        "model_version": "CosyVoice3 (Fun-CosyVoice3-0.5B style)",
        "official_commit": commit,
        "seed": SEED,
        "torch_version": str(torch.__version__),
        "transformers_version": str(transformers.__version__),
        "device": "cpu",
        "dtype": "float32",
        "num_threads": 1,
        "yaml": "model/cosyvoice3.yaml",
        "sample_rate": 24000,
        "hop": 480,
        "endofprompt_token": ENDOFPROMPT,
    }
    return {"meta": [meta], "llm": llm_cases, "flow": flow_cases, "hift": hift_cases}


class InlineThread:
    """Stands in for `threading.Thread` in the official model module: start() runs the LLM job to its end, so the
    streaming loop then finds every token and cuts the chunks it cuts in any thread timing (a chunk waits for
    hop + look-ahead tokens, the last one for the LLM's end), with no thread."""

    def __init__(self, target: Callable, args: tuple = ()) -> None:
        self.target, self.args = target, args

    def start(self) -> None:
        self.target(*self.args)

    def join(self) -> None:
        pass


def run_tts(model: Any, inputs: dict[str, Tensor], stream: bool) -> tuple[list[Tensor], list[dict[str, Any]]]:
    """The official `CosyVoice3Model.tts` on `inputs`, with its LLM thread run inline and no sleeps: the speech it
    yields and, per token2wav call, its arguments, the flow mel and the HiFT call's mel, source and speech."""
    import cosyvoice.cli.model as official_model

    calls: list[dict[str, Any]] = []
    token2wav, flow_inference, hift_inference = model.token2wav, model.flow.inference, model.hift.inference

    def recording_token2wav(**kwargs: Any) -> Tensor:
        cache = model.hift_cache_dict[kwargs["uuid"]]
        calls.append(
            {
                "tokens": kwargs["token"][0].to(torch.int64).clone(),
                "token_offset": int(kwargs["token_offset"]),
                "streaming": int(kwargs.get("stream", False)),
                "finalize": int(kwargs["finalize"]),
                "speech_offset": 0 if cache is None else int(cache["speech_offset"]),
            }
        )
        return token2wav(**kwargs)

    def recording_flow(**kwargs: Any) -> tuple[Tensor, Any]:
        feat, rest = flow_inference(**kwargs)
        calls[-1]["flow_mel"] = feat.clone()
        return feat, rest

    def recording_hift(speech_feat: Tensor, finalize: bool = True) -> tuple[Tensor, Tensor]:
        speech, source = hift_inference(speech_feat=speech_feat, finalize=finalize)
        calls[-1].update(hift_mel=speech_feat.clone(), hift_source=source.clone(), hift_speech=speech.clone())
        return speech, source

    model.token2wav, model.flow.inference, model.hift.inference = recording_token2wav, recording_flow, recording_hift
    model.token_hop_len = 25  # the official tts grows it on the model for good; each case starts as a new model
    thread, clock = official_model.threading.Thread, official_model.time
    official_model.threading.Thread = InlineThread
    official_model.time = types.SimpleNamespace(sleep=lambda _seconds: None)
    try:
        speech = [out["tts_speech"].clone() for out in model.tts(**inputs, stream=stream)]
    finally:
        official_model.threading.Thread, official_model.time = thread, clock
        del model.token2wav, model.flow.inference, model.hift.inference
    return speech, calls


def stream_case(
    model: Any,
    name: str,
    inputs: dict[str, Tensor],
    ratio: tuple[float, float],
    llm_tokens: list[int] | None = None,
) -> dict[str, Any]:
    """`CosyVoice3Model.tts(stream=True)` and `tts(stream=False)` on the same input, the LLM greedy (or, with
    `llm_tokens`, replaced by that list), both length ratios fixed; see the kit README for the fields."""
    llm = model.llm
    llm_inference = llm.inference
    yielded: list[int] = []

    def recording_inference(*args: Any, **kwargs: Any) -> Any:
        kwargs.update(min_token_text_ratio=ratio[0], max_token_text_ratio=ratio[1])
        for token in llm_inference(*args, **kwargs) if llm_tokens is None else iter(llm_tokens):
            yielded.append(int(token))
            yield token

    llm.sampling = greedy_sampler([])
    llm.inference = recording_inference
    try:
        speech, chunks = run_tts(model, inputs, stream=True)
        stream_tokens = list(yielded)
        yielded.clear()
        whole_speech, (whole,) = run_tts(model, inputs, stream=False)
    finally:
        del llm.inference
    assert yielded == stream_tokens, "the LLM is greedy: both runs must generate the same tokens"
    last = chunks[-1]
    case: dict[str, Any] = {
        "name": name,
        "function": "cosyvoice.cli.model.CosyVoice3Model.tts(stream=True), then tts(stream=False)",
        "sampler": "greedy argmax over the scores passed to llm.sampling"
        if llm_tokens is None
        else "none: llm.inference replaced by a fixed token list (llm_tokens)",
        **{key: value.clone() for key, value in inputs.items()},
        "min_token_text_ratio": float(ratio[0]),
        "max_token_text_ratio": float(ratio[1]),
        "token_hop_len": 25,
        "token_max_hop_len": int(model.token_max_hop_len),
        "stream_scale_factor": int(model.stream_scale_factor),
        "pre_lookahead_len": int(model.flow.pre_lookahead_len),
        "token_mel_ratio": int(model.flow.token_mel_ratio),
        "silent_tokens": torch.tensor(model.silent_tokens, dtype=torch.int64),
        "max_silent_token_run": 5,
        "llm_tokens": torch.tensor(stream_tokens, dtype=torch.int64),
        "out_tokens": last["tokens"],
        "num_chunks": len(chunks),
    }
    # Each chunk's audio is stored as a view of the concatenation (torch.save keeps one copy of a shared storage).
    concatenated = torch.cat(speech, dim=1)
    start = 0
    for k, (chunk, audio) in enumerate(zip(chunks, speech, strict=True)):
        frames = chunk["hift_mel"].shape[2]
        # Each HiFT call re-runs the whole accumulated mel: its mel and source are prefixes of the last call's.
        assert torch.equal(chunk["hift_mel"], last["hift_mel"][:, :, :frames]), f"{name} chunk {k} mel"
        assert torch.equal(chunk["hift_source"], last["hift_source"][:, :, : chunk["hift_source"].shape[2]]), k
        assert torch.equal(audio, chunk["hift_speech"][:, chunk["speech_offset"] :]), f"{name} chunk {k} speech"
        case[f"chunk_{k}_tokens"] = chunk["tokens"]
        case[f"chunk_{k}_token_offset"] = chunk["token_offset"]
        case[f"chunk_{k}_streaming"] = chunk["streaming"]
        case[f"chunk_{k}_finalize"] = chunk["finalize"]
        case[f"chunk_{k}_flow_mel"] = chunk["flow_mel"]
        case[f"chunk_{k}_hift_frames"] = frames
        case[f"chunk_{k}_speech_offset"] = chunk["speech_offset"]
        case[f"chunk_{k}_speech"] = concatenated[:, start : start + audio.shape[1]]
        start += audio.shape[1]
    # The last chunk is the whole call's flow call (all tokens, full attention, finalize): one mel, stored once.
    assert torch.equal(whole["tokens"], last["tokens"]) and torch.equal(whole["flow_mel"], last["flow_mel"]), name
    case.update(
        hift_mel=last["hift_mel"],
        hift_source=last["hift_source"],
        speech=concatenated,
        whole_mel=last["flow_mel"],
        whole_source=whole["hift_source"],
        whole_speech=whole_speech[0],
    )
    return case


def stream_inputs(llm_case: dict[str, Any], prompt_feat: Tensor, embedding: Tensor) -> dict[str, Tensor]:
    """The `tts` arguments of a zero-shot call with an llm case's text and prompt (the flow gets the same prompt)."""
    return {
        "text": llm_case["text"],
        "prompt_text": llm_case["prompt_text"],
        "llm_prompt_speech_token": llm_case["prompt_speech_token"],
        "flow_prompt_speech_token": llm_case["prompt_speech_token"],
        "prompt_speech_feat": prompt_feat,
        "flow_embedding": embedding,
        "llm_embedding": embedding,
    }


def stream_cases(model: Any, llm_cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    g = torch.Generator().manual_seed(STREAM_SEED)
    embedding = torch.randn(1, 192, generator=g)
    system = torch.randint(0, 1000, (1, 4), generator=g, dtype=torch.int32)
    prompted = {
        "prompt_speech_token": torch.randint(0, SPEECH_TOKENS, (1, 12), generator=g, dtype=torch.int32),
        "prompt_text": torch.cat([system, torch.tensor([[ENDOFPROMPT]], dtype=torch.int32), system[:, :2]], dim=1),
        "text": torch.randint(0, 1000, (1, 8), generator=g, dtype=torch.int32),
    }
    prompt_feat = torch.randn(1, 24, 80, generator=g) * 2 - 4
    no_prompt = next(case for case in llm_cases if case["name"] == "instruct_endofprompt_in_text")
    no_prompt_inputs = stream_inputs(no_prompt, torch.zeros(1, 0, 80), embedding)
    no_prompt_ratio = (no_prompt["min_token_text_ratio"], no_prompt["max_token_text_ratio"])
    # a run of 8 silent tokens (the official llm_job keeps 5) after 20 of no_prompt's tokens, then 6 more
    tokens = no_prompt["out_tokens"].tolist()
    with_silence = [*tokens[:20], 1, 2, 28, 29, 55, 1, 2, 28, *tokens[20:26]]
    return [
        stream_case(model, "no_prompt_three_chunks", no_prompt_inputs, no_prompt_ratio),
        stream_case(model, "zero_shot_padded_first_hop", stream_inputs(prompted, prompt_feat, embedding), (2.0, 12.0)),
        stream_case(model, "silent_run_dropped", no_prompt_inputs, no_prompt_ratio, llm_tokens=with_silence),
    ]


def llm_sampled_cases(model: Any) -> list[dict[str, Any]]:
    """The official LLM with the yaml's own sampler (`ras_sampling`) on a zero-shot prompt, as the v1/v2 kits
    record it (`sampled_llm_case`); the prompt text holds the <|endofprompt|> id the official LLM asserts."""
    g = torch.Generator().manual_seed(SAMPLED_SEED)
    system = torch.randint(0, 1000, (1, 3), generator=g, dtype=torch.int32)
    prompt_text = torch.cat([system, torch.tensor([[ENDOFPROMPT]], dtype=torch.int32)], dim=1)
    prompt_speech = torch.randint(0, SPEECH_TOKENS, (1, 6), generator=g, dtype=torch.int32)
    text = torch.randint(0, 1000, (1, 6), generator=g, dtype=torch.int32)
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=g))
    sampler = model.llm.sampling
    case = sampled_llm_case(
        model.llm,
        sampler,
        seed,
        text=text,
        prompt_text=prompt_text,
        prompt_speech_token=prompt_speech,
        embedding=None,
        ratio=(2.0, 10.0),
    )
    return [case]


BISTREAM_SEED = SEED + 32


def llm_bistream_cases(model: Any) -> list[dict[str, Any]]:
    """The official `inference_bistream` with greedy tokens (`bistream_case`), the text in pieces of 1-7 tokens: a
    system prompt only (no prompt speech: decoding starts at once, before any text joins) and a zero-shot prompt of
    20 speech tokens, greedy, and the latter again with the yaml's sampler. The prompt text holds the <|endofprompt|>
    id the official loop asserts."""
    g = torch.Generator().manual_seed(BISTREAM_SEED)
    llm = model.llm
    llm.mix_ratio = [int(v) for v in llm.mix_ratio]

    def draw(prompt_speech: int, prompt_extra: int, text: int) -> Callable:
        def make() -> tuple[list[Tensor], Tensor, Tensor]:
            ids = torch.randint(0, 1000, (1, text), generator=g, dtype=torch.int32)
            pieces, start = [], 0
            while start < text:
                size = 1 + int(torch.randint(0, 7, (1,), generator=g))
                pieces.append(ids[:, start : start + size].contiguous())
                start += size
            system = torch.randint(0, 1000, (1, 3), generator=g, dtype=torch.int32)
            extra = torch.randint(0, 1000, (1, prompt_extra), generator=g, dtype=torch.int32)
            prompt_text = torch.cat([system, torch.tensor([[ENDOFPROMPT]], dtype=torch.int32), extra], dim=1)
            speech = torch.randint(0, SPEECH_TOKENS, (1, prompt_speech), generator=g, dtype=torch.int32)
            return pieces, prompt_text, speech

        return make

    return [
        bistream_case(llm, "system_prompt_only", draw(0, 0, 23)),
        bistream_case(llm, "zero_shot_prompt", draw(20, 6, 26)),
        bistream_case(llm, "ras_sampled_zero_shot", draw(20, 6, 26), sampled=True),
    ]


def frontend_cases(configs: dict[str, Any]) -> list[dict[str, Any]]:
    """The official text path of CosyVoice3 for FRONTEND_TEXTS, recorded as the v1/v2 tool records it (the
    tokenizer's `encode` is what `_extract_text_token` calls), plus whether markup skipped the normalisation."""
    frontend = official_text_frontend(configs)
    return [
        {
            **text_path_case(frontend, text),
            "tokenizer": "cosyvoice.tokenizer.tokenizer.CosyVoice3Tokenizer (get_qwen_tokenizer, cosyvoice3)",
            "normalization_skipped": int("<|" in text and "|>" in text),
        }
        for text in FRONTEND_TEXTS
    ]


def check_fixed_draws(model: Any, hift_cases: list[dict[str, Any]]) -> None:
    """The HiFT source buffers are drawn from the global RNG while the modules are built; the flow's CFM seeds it
    (0) first, so every build draws the same ones. Check it against the kit's recorded buffers."""
    sine = model.hift.m_source.l_sin_gen
    for case in hift_cases:
        assert torch.equal(sine.rand_ini, case["source_initial_phase"]), case["name"]
        assert torch.equal(sine.sine_waves[:, : case["source_noise"].shape[1]], case["source_noise"]), case["name"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--official", type=Path, required=True, help="checkout of FunAudioLLM/CosyVoice")
    parser.add_argument("--out", type=Path, required=True, help="kit directory to write or extend")
    parser.add_argument("--qwen-tokenizer", type=Path, help="tokenizer files to copy into model/CosyVoice-BlankEN")
    add_existing_kit_modes(parser, bistream_help="")
    args = parser.parse_args()
    torch.set_num_threads(1)
    import_official(args.official)
    # the tool again, on the kit's model, for the spread variants that need a fresh process
    tool = Path(__file__).resolve()
    child_command = [sys.executable, str(tool), "--official", str(args.official), "--out", str(args.out.resolve())]
    if args.spread_child:
        model, _ = load_official_model(args.out / "model")
        serve_spread_child(args.spread_child, lambda case: official_hift_run(model, case))
        return
    mode = next((mode for mode in ("respread", "bistream_only", "references") if getattr(args, mode)), None)
    if mode:  # a mode that works on an existing kit, with its own model
        option = "--" + mode.replace("_", "-")
        cases_path = args.out / "cases.pt"
        if not cases_path.is_file():
            sys.exit(f"{option} works on an existing kit")
        model, _ = load_official_model(args.out / "model")
        cases = torch.load(cases_path, weights_only=True)
        command = f"python tools/make_cosyvoice3_kit.py --official {args.official} --out {args.out} {option}"
        commit = official_commit(args.official)
        run = functools.partial(official_hift_run, model)
        if args.respread:
            measure_spreads(run, cases, child_command)
            write_respread(args.out, cases, command, commit)
            print("\n".join(spread_readme(cases)))
        elif args.bistream_only:
            write_bistream_group(args.out, cases, llm_bistream_cases(model), command, commit)
            for case in cases["llm_bistream"]:
                print(f"llm_bistream {case['name']}: {len(case['out_tokens'])} tokens, {case['num_steps']} steps")
        else:  # the hift cases a new kit gets, made afresh
            made = reference_cases(model, args.official)["hift"] + hift_long_cases(model.hift)
            write_references(args.out, cases, made, run, child_command, command, commit)
        return

    model_dir = args.out / "model"
    cases_path = args.out / "cases.pt"
    extending = cases_path.is_file()
    if not extending:
        write_model_files(args.official, model_dir)
    if args.qwen_tokenizer:
        copy_qwen_tokenizer(args.qwen_tokenizer, model_dir)
    model, configs = load_official_model(model_dir)
    cases = torch.load(cases_path, weights_only=True) if extending else reference_cases(model, args.official)
    # the longer hift cases (divergences that show only on long mels), added to a kit that lacks them; the kit's
    # other cases stay as they are
    names = {case["name"] for case in cases["hift"]}
    cases["hift"] += [case for case in hift_long_cases(model.hift) if case["name"] not in names]
    # the HiFT hidden tensors and their spreads, on each case's own inputs
    measure_spreads(lambda case: official_hift_run(model, case), cases, child_command)
    cases = {group: value for group, value in cases.items() if group not in MADE_GROUPS}
    sampled = llm_sampled_cases(model)  # first: the stream cases leave a greedy sampler on the model
    cases["stream"] = stream_cases(model, cases["llm"])
    cases["frontend"] = frontend_cases(configs)
    cases["llm_sampled"] = sampled
    torch.save(cases, cases_path)
    print_summary(cases, args.out)


def print_summary(cases: dict[str, list[dict[str, Any]]], out: Path) -> None:
    for case in cases["llm"]:
        print(
            f"llm {case['name']}: {len(case['out_tokens'])} tokens, stop {case['stop_reason']} "
            f"(min {case['min_len']}, max {case['max_len']}), smallest margin {case['step_top1_margin'].min():.3f}"
        )
    for case in cases["llm_sampled"]:
        print(
            f"llm_sampled {case['name']}: seed {case['seed']}, {len(case['out_tokens'])} tokens in "
            f"{case['num_steps']} steps, {int(case['step_fallback'].sum())} fallback draws"
        )
    for case in cases["flow"]:
        print(
            f"flow {case['name']}: feat {list(case['feat'].shape)}, mu {list(case['est_in_mu'].shape)}, "
            f"|feat| max {case['feat'].abs().max():.2f}"
        )
    for case in cases["hift"]:
        print(
            f"hift {case['name']}: speech {list(case['speech'].shape)}, voiced {case['voiced_fraction']:.2f}, "
            f"clamped {case['clamped_fraction']:.4f}, |speech| max {case['speech'].abs().max():.3f}"
        )
    print("\n".join(spread_readme(cases)))
    for case in cases["stream"]:
        chunks = [
            f"{len(case[f'chunk_{k}_tokens'])} tokens from {case[f'chunk_{k}_token_offset']}"
            f"{' final' if case[f'chunk_{k}_finalize'] else ''} -> {case[f'chunk_{k}_speech'].shape[1]} samples"
            for k in range(case["num_chunks"])
        ]
        print(
            f"stream {case['name']}: llm {len(case['llm_tokens'])} tokens, flow {len(case['out_tokens'])}; "
            f"chunks: {'; '.join(chunks)}; whole {case['whole_speech'].shape[1]} samples, "
            f"|speech - whole| max {(case['speech'] - case['whole_speech']).abs().max():.3f}"
        )
    for case in cases["frontend"]:
        print(
            f"frontend {case['text'][:40]!r}: skipped {case['normalization_skipped']}, "
            f"{case['num_segments']} segments, {len(case['segment_tokens'])} tokens, "
            f"max id {int(case['raw_tokens'].max())}"
        )
    for path in sorted(p for p in out.rglob("*") if p.is_file() and p.name != "README.md"):
        print(f"| `{path.relative_to(out)}` | {path.stat().st_size} | `{sha256(path)}` |")


if __name__ == "__main__":
    main()
