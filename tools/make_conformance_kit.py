"""Make (or extend) a CosyVoice v1/v2 conformance kit by running the official CosyVoice code.

The official code is imported at run time from a checkout given by path (never copied here), inside a throwaway venv
outside this repo that has the official dependencies (how to make it: docs/parity.md, "The kit tools"):

    /tmp/offvenv/bin/python tools/make_conformance_kit.py --official /tmp/cosyvoice-official \\
        --model tests/fixtures/cosyvoice1-tiny/model --out tests/fixtures/cosyvoice1-tiny

`--official` is a checkout of FunAudioLLM/CosyVoice with its `third_party/Matcha-TTS` submodule in place. The kit is
written to `--out`: `model/`, `cases.pt` and `README.md`; an existing kit's groups are kept and the groups made here
added (`--remake` replaces them). Groups: `llm_sampled`, `stream`, `hift` (with the official HiFT's hidden tensors
and `spread_<tensor>`, the official code's own variation on this machine, from which the parity tests take their
tolerances), `llm_bistream` (`--bistream-only`) and `frontend`. `--respread` measures the spreads again and
`--references` records `KIT/references/<CPU kind>.pt`, changing nothing else. Every group and field:
docs/parity.md, "The kit tools, group by group", and the README section the tool writes.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

V1_YAML, V2_YAML = "cosyvoice.yaml", "cosyvoice2.yaml"
QWEN_DIR = "CosyVoice-BlankEN"
MADE_GROUPS = ("llm_sampled", "stream")
BISTREAM_MARKER = "## The llm_bistream group (made with --bistream-only)"
HIFT_CACHE_CASE = "cache_source_from_stream"
# Longer hift cases (mel frames) of the v2 kit: a v2 divergence showed at 30 frames on another CPU, not on shorter
# cases.
HIFT_LONG_FRAMES = (30, 60, 120)
# Left out of the longer cases for size: `magnitude` and `phase` hold conv_post_out, the source holds s_stft.
LONG_CASE_OMITTED = ("s_stft", "conv_post_out")
# The official HiFT's hidden tensors recorded in every hift case, in pipeline order (see official_hift_hidden):
# l_linear's input and output in the source module, then the magnitude and phase `_istft` gets.
HIFT_INTERMEDIATES = ("source_sine", "source_linear", "magnitude", "phase")
# Runs of the official code other than the one-thread default, whose differences from it are each tensor's spread.
# These run in this process (`spread_variant`):
IN_PROCESS_VARIANTS = {
    "threads2": "two intra-op threads",
    "no_mkldnn": "the native convolution kernels instead of oneDNN's",
}
# These in a fresh process (`child_runs`), because ATen, oneDNN and MKL read their variable once, when they start.
# MKL has a variant of its own: the convolutions oneDNN leaves to ATen (conv_pre's among them) are MKL GEMMs, which
# ATen's and oneDNN's variables do not reach.
PROCESS_VARIANTS = {
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
    "mkl_avx2": {"MKL_ENABLE_INSTRUCTIONS": "AVX2"},
}
SPREAD_VARIANTS = (*IN_PROCESS_VARIANTS, *PROCESS_VARIANTS)
# The library each variable of PROCESS_VARIANTS sets, in the names `kernel_isas` gives what they report.
KERNEL_VARIABLES = {"ATEN_CPU_CAPABILITY": "ATen", "ONEDNN_MAX_CPU_ISA": "oneDNN", "MKL_ENABLE_INSTRUCTIONS": "MKL"}
# The hidden flag on which the tools run as the child of `child_runs`.
SPREAD_CHILD_FLAG = "--spread-child"
GROUPS_MARKER = "## Groups made by tools/make_conformance_kit.py"
RESPREAD_MARKER = "## HiFT spreads measured again (made with --respread)"
REFERENCES_MARKER = "## HiFT references per CPU kind (made with --references)"
# The inputs of a hift case (with its `rand_draw_*`): a reference file's case must hold the kit's case's to the bit.
CASE_INPUTS = ("mel", "cache_source", "finalize", "source_initial_phase", "source_noise")
SPREAD_VIEW = "the log of `magnitude`, the others as they are"
FRONTEND_TEXTS = (
    "Hello world, this is a streaming test.",
    "I have 3 apples and 25 pears.",
    "收到好友从远方寄来的生日礼物，那份意外的惊喜与深深的祝福让我心中充满了甜蜜的快乐。",
    "今天是2024年3月5日，气温25.5度",
    "You are a helpful assistant. 请用广东话表达。<|endofprompt|>",
    "在面对挑战时，他展现了非凡的<strong>勇气</strong>与<strong>智慧</strong>。",
    "He laughed [laughter] and then took a breath [breath] before going on.",
    "Mixed 中英文 text with [noise] tags.",
)


def official_commit(checkout: Path) -> str:
    """The checkout's short commit; for a tree without its git history, $OFFICIAL_COMMIT, else 'unknown'."""
    try:
        out = subprocess.run(["git", "-C", str(checkout), "rev-parse", "--short=7", "HEAD"], capture_output=True)
        commit = out.stdout.decode().strip()
    except OSError:
        commit = ""
    return commit or os.environ.get("OFFICIAL_COMMIT", "unknown")


def recorded_cpu() -> dict[str, str]:
    """What every hift case made here records of this machine: `recorded_cpu_kind`, the kind of CPU whose float32
    rounding its tensors carry (`CpuCapabilities.kernel_kind`: the parity tests hold a case of their own kind to the
    float32 floor), and `recorded_cpu`, the CPU in words."""
    from engine.nn.precision import cpu_capabilities  # this project's, installed in the venv

    cpu = cpu_capabilities()
    return {"recorded_cpu_kind": cpu.kernel_kind, "recorded_cpu": cpu.describe()}


def copy_qwen_tokenizer(files: Path, model_dir: Path) -> None:
    """Copy the Qwen2 tokenizer files in `files` (not its config.json: the kit's model has its own) into
    `model_dir/CosyVoice-BlankEN`."""
    for path in sorted(files.iterdir()):
        if path.is_file() and path.name != "config.json":
            shutil.copy2(path, model_dir / QWEN_DIR / path.name)


def import_official(checkout: Path) -> None:
    matcha = checkout / "third_party" / "Matcha-TTS"
    if not (checkout / "cosyvoice" / "cli" / "model.py").is_file() or not (matcha / "matcha").is_dir():
        sys.exit(f"{checkout} is not a CosyVoice checkout with its third_party/Matcha-TTS submodule")
    sys.path[:0] = [str(checkout), str(matcha)]


def greedy(weighted_scores: torch.Tensor, decoded_tokens: list, sampling: int) -> int:
    """Stands in for the yaml sampler where a case is greedy: argmax of the scores sampling_ids passes on."""
    return int(weighted_scores.argmax())


def int32(values: list[int] | torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(values, dtype=torch.int32).reshape(1, -1)


class Maker:
    def __init__(self, model_dir: Path, seed: int) -> None:
        from cosyvoice.cli.model import CosyVoice2Model, CosyVoiceModel
        from hyperpyyaml import load_hyperpyyaml

        self.version = 2 if (model_dir / V2_YAML).is_file() else 1
        yaml_path = model_dir / (V2_YAML if self.version == 2 else V1_YAML)
        if not yaml_path.is_file():
            sys.exit(f"{model_dir} holds neither {V1_YAML} nor {V2_YAML}")
        overrides = {"qwen_pretrain_path": str(model_dir / QWEN_DIR)} if self.version == 2 else None
        with open(yaml_path) as f:
            self.configs = load_hyperpyyaml(f, overrides=overrides)
        model_class = CosyVoice2Model if self.version == 2 else CosyVoiceModel
        self.model_class = model_class
        self.model_dir = model_dir
        self.model = self.new_model()
        self.sampler = self.model.llm.sampling
        self.generator = torch.Generator().manual_seed(seed)
        self.seed = seed
        llm = self.model.llm
        self.text_vocab = self.configs["llm"].text_embedding.num_embeddings if self.version == 1 else 200
        self.speech_vocab = llm.speech_token_size
        self.hop = 480 if self.version == 2 else 256

    def new_model(self) -> Any:
        model = self.model_class(self.configs["llm"], self.configs["flow"], self.configs["hift"], fp16=False)
        model.load(*(str(self.model_dir / name) for name in ("llm.pt", "flow.pt", "hift.pt")))
        return model

    def randint(self, high: int, n: int) -> list[int]:
        return torch.randint(0, high, (n,), generator=self.generator).tolist()

    def prompt(self, speech_tokens: int, text_tokens: int) -> dict[str, torch.Tensor]:
        frames = 2 * speech_tokens if self.version == 2 else int(speech_tokens * 22050 / 256 / 50)
        return {
            "prompt_text": int32(self.randint(self.text_vocab, text_tokens)),
            "prompt_speech_token": int32(self.randint(self.speech_vocab, speech_tokens)),
            "prompt_feat": torch.randn(1, frames, 80, generator=self.generator),
            "embedding": torch.randn(1, 192, generator=self.generator),
        }

    # ---- llm_sampled ------------------------------------------------------------------------------------------

    def llm_sampled(self, text_tokens: int, ratio: tuple[float, float]) -> dict[str, Any]:
        inputs = self.prompt(speech_tokens=6, text_tokens=4)
        text = int32(self.randint(self.text_vocab, text_tokens))
        seed = int(torch.randint(0, 2**31 - 1, (1,), generator=self.generator))
        return sampled_llm_case(
            self.model.llm,
            self.sampler,
            seed,
            text=text,
            prompt_text=inputs["prompt_text"],
            prompt_speech_token=inputs["prompt_speech_token"],
            embedding=inputs["embedding"],
            ratio=ratio,
        )

    # ---- llm_bistream -----------------------------------------------------------------------------------------

    def llm_bistream(self) -> list[dict[str, Any]]:
        """v2 only: the text in pieces of 1-7 tokens, without a prompt and with a zero-shot prompt of 20 speech
        tokens (two 5 + 15 groups from the prompt before decoding starts), greedy, and the latter again with the
        yaml's sampler."""
        llm = self.model.llm
        llm.mix_ratio = [int(v) for v in llm.mix_ratio]

        def draw(prompt_speech: int, prompt_text: int, text: int) -> Any:
            def make() -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
                ids = self.randint(self.text_vocab, text)
                cuts, start = [], 0
                while start < text:
                    size = 1 + int(torch.randint(0, 7, (1,), generator=self.generator))
                    cuts.append(int32(ids[start : start + size]))
                    start += size
                return (
                    cuts,
                    int32(self.randint(self.text_vocab, prompt_text)),
                    int32(self.randint(self.speech_vocab, prompt_speech)),
                )

            return make

        return [
            bistream_case(llm, "no_prompt", draw(0, 0, 23)),
            bistream_case(llm, "zero_shot_prompt", draw(20, 6, 26)),
            bistream_case(llm, "ras_sampled_zero_shot", draw(20, 6, 26), sampled=True),
        ]

    # ---- stream -----------------------------------------------------------------------------------------------

    def stream(self, name: str, text_tokens: int, ratio: float, prompt_tokens: int) -> dict[str, Any]:
        inputs = self.prompt(speech_tokens=prompt_tokens, text_tokens=5 if prompt_tokens else 0)
        text = int32(self.randint(self.text_vocab, text_tokens))
        model = self.new_model()  # v2's tts grows token_hop_len on the model itself: start fresh
        model.llm.sampling = greedy
        llm_inference = model.llm.inference

        generated: list[int] = []

        def fixed_ratio_inference(*args: Any, **kwargs: Any) -> Any:
            kwargs.update(max_token_text_ratio=ratio, min_token_text_ratio=ratio)
            for token in llm_inference(*args, **kwargs):
                generated.append(int(token))
                yield token

        model.llm.inference = fixed_ratio_inference
        chunks: list[dict[str, torch.Tensor]] = []
        lock = threading.Lock()

        def first_estimator_call(_module: Any, args: tuple) -> None:
            with lock:
                if "noise" not in chunks[-1]:
                    chunks[-1]["noise"] = args[0][0].clone()

        decode = model.hift.decode

        def recording_decode(x: torch.Tensor, s: torch.Tensor, **kwargs: Any) -> torch.Tensor:
            chunks[-1]["mel"], chunks[-1]["source"] = x.clone(), s.clone()
            return decode(x=x, s=s, **kwargs)

        model.hift.decode = recording_decode
        token2wav = model.token2wav

        def recording_token2wav(**kwargs: Any) -> torch.Tensor:
            chunks.append({"tokens": kwargs["token"][0].to(torch.int64).clone(), "finalize": int(kwargs["finalize"])})
            return token2wav(**kwargs)

        model.token2wav = recording_token2wav
        hook = model.flow.decoder.estimator.register_forward_pre_hook(first_estimator_call)
        speech_parts = []
        try:
            for out in model.tts(
                text=text,
                flow_embedding=inputs["embedding"],
                llm_embedding=inputs["embedding"],
                prompt_text=inputs["prompt_text"],
                llm_prompt_speech_token=inputs["prompt_speech_token"],
                flow_prompt_speech_token=inputs["prompt_speech_token"],
                prompt_speech_feat=inputs["prompt_feat"],
                stream=True,
            ):
                speech_parts.append(out["tts_speech"])
        finally:
            hook.remove()
        case: dict[str, Any] = {
            "name": name,
            "function": f"cosyvoice.cli.model.{type(model).__name__}.tts(stream=True)",
            "sampler": "greedy argmax over the scores passed to llm.sampling",
            "text": text,
            "text_len": torch.tensor([text.shape[1]], dtype=torch.int32),
            "prompt_text": inputs["prompt_text"],
            "prompt_speech_token": inputs["prompt_speech_token"],
            "prompt_feat": inputs["prompt_feat"],
            "embedding": inputs["embedding"],
            "min_token_text_ratio": float(ratio),
            "max_token_text_ratio": float(ratio),
            "num_chunks": len(chunks),
        }
        for k, (chunk, speech) in enumerate(zip(chunks, speech_parts, strict=True)):
            case[f"chunk_{k}_tokens"] = chunk["tokens"]
            case[f"chunk_{k}_finalize"] = chunk["finalize"]
            case[f"chunk_{k}_mel"] = chunk["mel"]
            case[f"chunk_{k}_source"] = chunk["source"]
            case[f"chunk_{k}_speech"] = speech.clone()
            if self.version == 1:
                case[f"chunk_{k}_noise"] = chunk["noise"]
        case["out_tokens"] = torch.tensor(generated, dtype=torch.int64)
        return case

    def sampled_and_stream(self) -> dict[str, list[dict[str, Any]]]:
        """The `llm_sampled` and `stream` groups, in the order a run makes them: each draws its inputs from `seed`
        after the one before, and the hift cases (`hift_cases`) draw on the global RNG after both."""
        made = {"llm_sampled": [self.llm_sampled(text_tokens=6, ratio=(8.0, 10.0))]}
        if self.version == 1:  # v1 hop 100 + 20 overlap: chunks at 120 and 220 tokens, then the rest
            made["stream"] = [self.stream("zero_shot_three_chunks", text_tokens=10, ratio=26.0, prompt_tokens=12)]
        else:  # 10 prompt tokens: a first hop of 25 + 15, then 50, then the final chunk
            made["stream"] = [self.stream("zero_shot_padded_first_hop", text_tokens=8, ratio=14.0, prompt_tokens=10)]
        return made

    # ---- hift cases with recorded draws -----------------------------------------------------------------------

    def hift_cases(self, stream_case: dict[str, Any]) -> list[dict[str, Any]]:
        """The hift cases made here: `hift_with_cache` on the stream case just made, and for v2 `hift_long`."""
        cases = [self.hift_with_cache(stream_case)]
        if self.version == 2:
            cases += [self.hift_long(frames) for frames in HIFT_LONG_FRAMES]
        return cases

    def hift_with_cache(self, stream_case: dict[str, Any]) -> dict[str, Any]:
        cache_frames = 8 if self.version == 2 else 20  # the official HiFT cache of each version
        mel = stream_case["chunk_1_mel"][:, :, : 2 * cache_frames].contiguous()  # short: the kit stays small
        cache = stream_case["chunk_0_source"][:, :, -cache_frames * self.hop :]
        return self.hift_recorded(
            HIFT_CACHE_CASE,
            mel,
            cache,
            e2e_source=f"mel = the head of chunk_1_mel of stream case {stream_case['name']}; "
            "cache_source = the tail of its chunk_0_source",
        )

    def hift_long(self, frames: int) -> dict[str, Any]:
        """A longer random-mel case (a divergence once showed only from 30 frames), its own draws from `seed`."""
        generator = torch.Generator().manual_seed(self.seed * 1000 + frames)
        mel = torch.randn(1, 80, frames, generator=generator) * 2 - 6  # as the kit's first hift cases
        torch.manual_seed(self.seed * 1000 + frames)
        case = self.hift_recorded(f"mel{frames}_long", mel, torch.zeros(1, 1, 0))
        for key in LONG_CASE_OMITTED:
            del case[key]
        return case

    def hift_recorded(
        self, name: str, mel: torch.Tensor, cache: torch.Tensor, e2e_source: str | None = None
    ) -> dict[str, Any]:
        """`HiFTGenerator.inference(mel, cache)` on the global RNG, its random draws and hidden tensors recorded."""
        from torch.distributions.uniform import Uniform

        hift = self.model.hift
        draws: list[tuple[str, torch.Tensor]] = []
        originals = {"rand": torch.rand, "randn_like": torch.randn_like, "sample": Uniform.sample}

        def rand(*args: Any, **kwargs: Any) -> torch.Tensor:
            out = originals["rand"](*args, **kwargs)
            draws.append(("torch.rand", out.clone()))
            return out

        def randn_like(*args: Any, **kwargs: Any) -> torch.Tensor:
            out = originals["randn_like"](*args, **kwargs)
            draws.append(("torch.randn_like", out.clone()))
            return out

        def sample(self_: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
            out = originals["sample"](self_, *args, **kwargs)
            draws.append(("Uniform.sample", out.clone()))
            return out

        captured: dict[str, torch.Tensor] = {}
        hooks = [
            hift.conv_pre.register_forward_hook(lambda _m, _i, out: captured.update(conv_pre_out=out.clone())),
            hift.source_downs[0].register_forward_pre_hook(lambda _m, i: captured.update(s_stft=i[0].clone())),
            hift.conv_post.register_forward_hook(lambda _m, _i, out: captured.update(conv_post_out=out.clone())),
        ]
        # v1's SineGen draws its phases with Uniform.sample (which calls torch.rand itself), v2's SineGen2 torch.rand
        if self.version == 2:
            torch.rand = rand
        else:
            Uniform.sample = sample
        torch.randn_like = randn_like
        try:
            with torch.inference_mode():
                speech, source = hift.inference(speech_feat=mel, cache_source=cache)
                f0 = hift.f0_predictor(mel)
        finally:
            torch.rand, torch.randn_like, Uniform.sample = (
                originals["rand"],
                originals["randn_like"],
                originals["sample"],
            )
            for hook in hooks:
                hook.remove()
        case: dict[str, Any] = {
            "name": name,
            "function": "cosyvoice.hifigan.generator.HiFTGenerator.inference",
            "mel": mel,
            "cache_source": cache.clone(memory_format=torch.contiguous_format),  # not a view of the stream's
            "f0": f0,
            "source": source.clone(),
            "speech": speech.clone(),
            **captured,
            "clamped_fraction": float((speech.abs() >= 0.99).float().mean()),
            "audio_limit": 0.99,
            "voiced_fraction": float((f0 > 10).float().mean()),
            "rand_draw_order": ",".join(kind for kind, _ in draws),
            **({} if e2e_source is None else {"e2e_source": e2e_source}),
            **recorded_cpu(),
        }
        for k, (_, value) in enumerate(draws):
            case[f"rand_draw_{k}"] = value
        return case

    def hift_run(self, case: dict[str, Any]) -> dict[str, torch.Tensor]:
        """`official_hift_run` on this model's HiFT (what `measure_spreads` compares). Recomputed from the case's
        own inputs, so that the hidden tensors fit its recorded tensors whichever machine recorded those."""
        return official_hift_run(self.model.hift, case)

    # ---- v2 frontend ------------------------------------------------------------------------------------------

    def frontend_cases(self) -> list[dict[str, Any]]:
        frontend = official_text_frontend(self.configs)
        return [text_path_case(frontend, text) for text in FRONTEND_TEXTS]


def sampled_llm_case(
    llm: Any,
    sampler: Any,
    seed: int,
    *,
    text: torch.Tensor,
    prompt_text: torch.Tensor,
    prompt_speech_token: torch.Tensor,
    embedding: torch.Tensor | None,
    ratio: tuple[float, float],
) -> dict[str, Any]:
    """An `llm_sampled` case: one official `llm.inference` with the yaml's own sampler (`sampler`, a partial of
    `ras_sampling`) after `torch.manual_seed(seed)`, recording per sampler call whether the fallback draw ran.
    `embedding` None (CosyVoice3, which ignores it) passes an empty one and records none."""
    import cosyvoice.utils.common as common

    fallbacks: list[int] = []
    fallback_draw = common.random_sampling

    def recording_fallback(*args: Any) -> int:
        fallbacks[-1] = 1
        return fallback_draw(*args)

    def counting_sampler(scores: torch.Tensor, decoded: list, sampling: int) -> int:
        fallbacks.append(0)
        return sampler(scores, decoded, sampling)

    lengths = {
        "text_len": torch.tensor([text.shape[1]], dtype=torch.int32),
        "prompt_text_len": torch.tensor([prompt_text.shape[1]], dtype=torch.int32),
        "prompt_speech_token_len": torch.tensor([prompt_speech_token.shape[1]], dtype=torch.int32),
    }
    llm.sampling = counting_sampler
    common.random_sampling = recording_fallback
    try:
        torch.manual_seed(seed)
        tokens = list(
            llm.inference(
                text=text,
                text_len=lengths["text_len"].clone(),
                prompt_text=prompt_text,
                prompt_text_len=lengths["prompt_text_len"],
                prompt_speech_token=prompt_speech_token,
                prompt_speech_token_len=lengths["prompt_speech_token_len"],
                embedding=torch.zeros(0, 192) if embedding is None else embedding,
                max_token_text_ratio=ratio[1],
                min_token_text_ratio=ratio[0],
            )
        )
    finally:
        llm.sampling = sampler
        common.random_sampling = fallback_draw
    keywords = sampler.keywords
    return {
        "name": "ras_sampled_zero_shot",
        "function": f"cosyvoice.llm.llm.{type(llm).__name__}.inference",
        "sampler": "the yaml's llm.sampling (ras_sampling) on the global torch RNG, seeded with `seed` first",
        "seed": seed,
        "text": text,
        "text_len": lengths["text_len"],
        "prompt_text": prompt_text,
        "prompt_text_len": lengths["prompt_text_len"],
        "prompt_speech_token": prompt_speech_token,
        "prompt_speech_token_len": lengths["prompt_speech_token_len"],
        **({} if embedding is None else {"embedding": embedding}),
        "min_token_text_ratio": float(ratio[0]),
        "max_token_text_ratio": float(ratio[1]),
        "top_p": float(keywords["top_p"]),
        "top_k": int(keywords["top_k"]),
        "win_size": int(keywords["win_size"]),
        "tau_r": float(keywords["tau_r"]),
        "out_tokens": torch.tensor(tokens, dtype=torch.int64),
        "num_steps": len(fallbacks),
        "step_fallback": torch.tensor(fallbacks, dtype=torch.int32),
    }


BISTREAM_MAX_TOKENS = 300  # a draw whose greedy run is longer (no end token yet) is replaced by the next draw
BISTREAM_TRIES = 40
BISTREAM_SAMPLED_SEED = 1234  # + the draw's number: the seed of a sampled llm_bistream case


def bistream_case(
    llm: Any,
    name: str,
    draw: Callable[[], tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]],
    sampled: bool = False,
) -> dict[str, Any]:
    """An `llm_bistream` case: the official `llm.inference_bistream`, its text a generator of pieces, with greedy
    tokens, or (`sampled`) with the yaml's own sampler (`ras_sampling`) on the global torch RNG after
    `torch.manual_seed(seed)`. `draw()` gives (text pieces [1, n_i], prompt_text [1, P], prompt_speech_token [1, S]);
    draws are made until the run ends on the end token within BISTREAM_MAX_TOKENS (random weights may loop or pick an
    id the official loop rejects)."""
    for attempt in range(BISTREAM_TRIES):
        pieces, prompt_text, prompt_speech = draw()
        seed = BISTREAM_SAMPLED_SEED + attempt if sampled else None
        run = official_bistream_run(llm, pieces, prompt_text, prompt_speech, seed)
        if run is None:
            continue
        if sampled:
            keywords = llm.sampling.keywords
            run |= {
                "seed": seed,
                "top_p": float(keywords["top_p"]),
                "top_k": int(keywords["top_k"]),
                "win_size": int(keywords["win_size"]),
                "tau_r": float(keywords["tau_r"]),
            }
        return {
            "name": name,
            "function": f"cosyvoice.llm.llm.{type(llm).__name__}.inference_bistream",
            "sampler": "the yaml's llm.sampling (ras_sampling) on the global torch RNG, seeded with `seed` first"
            if sampled
            else "greedy argmax over the scores passed to llm.sampling",
            "draw": attempt,
            "num_pieces": len(pieces),
            **{f"piece_{k}": piece for k, piece in enumerate(pieces)},
            "prompt_text": prompt_text,
            "prompt_speech_token": prompt_speech,
            "mix_ratio": torch.tensor(llm.mix_ratio),
            "fill_token": int(llm.fill_token),
            "end_token": int(llm.eos_token),
            **run,
        }
    sys.exit(f"{name}: no draw in {BISTREAM_TRIES} ended on the end token within {BISTREAM_MAX_TOKENS} tokens")


def official_bistream_run(
    llm: Any, pieces: list[torch.Tensor], prompt_text: torch.Tensor, prompt_speech: torch.Tensor, seed: int | None
) -> dict[str, Any] | None:
    """One `inference_bistream`, greedy (seed None) or with the yaml's sampler after `torch.manual_seed(seed)` -> the
    speech tokens yielded, how many before each piece was taken (and before the end of text), per LM step the raw
    log-softmax and (greedy) per sampled step the greedy margin; None when the official loop raised or ran past
    BISTREAM_MAX_TOKENS."""
    raw: list[torch.Tensor] = []
    margins: list[float] = []
    yielded: list[int] = []
    before_piece: list[int] = []
    yaml_sampler = llm.sampling

    def text() -> Any:
        for piece in pieces:
            before_piece.append(len(yielded))
            yield piece
        before_piece.append(len(yielded))

    def recording_sampler(scores: torch.Tensor, decoded: list, sampling: int) -> int:
        if len(yielded) >= BISTREAM_MAX_TOKENS:
            raise OverflowError("no end token")
        if seed is not None:
            return yaml_sampler(scores, decoded, sampling)
        top2 = scores.topk(2).values
        margins.append(float(top2[0] - top2[1]))
        return int(scores.argmax())

    hook = llm.llm_decoder.register_forward_hook(
        lambda _m, _a, out: raw.append(out[0].float().log_softmax(dim=-1).detach().clone())
    )
    llm.sampling = recording_sampler
    if seed is not None:
        torch.manual_seed(seed)
    try:
        for token in llm.inference_bistream(
            text=text(),
            prompt_text=prompt_text,
            prompt_text_len=torch.tensor([prompt_text.shape[1]], dtype=torch.int32),
            prompt_speech_token=prompt_speech,
            prompt_speech_token_len=torch.tensor([prompt_speech.shape[1]], dtype=torch.int32),
            embedding=torch.zeros(0, 192),
        ):
            yielded.append(int(token))
    except (OverflowError, ValueError):
        return None
    finally:
        hook.remove()
        llm.sampling = yaml_sampler
    run = {
        "out_tokens": torch.tensor(yielded, dtype=torch.int64),
        "yielded_before_piece": torch.tensor(before_piece, dtype=torch.int64),
        "num_steps": len(raw),
        "step_raw_logp": torch.stack(raw),
    }
    return run if seed is not None else run | {"step_top1_margin": torch.tensor(margins)}


def bistream_readme(cases: list[dict[str, Any]], out: Path, command: str, commit: str) -> str:
    """The README section of the `llm_bistream` group (replaced when the group is made again)."""
    lines = [
        "",
        BISTREAM_MARKER,
        "",
        f"Made by `{command}` with the official code at commit `{commit}`, torch {torch.__version__}, 1 thread; "
        "the other groups were left as they were. Each case is one official `llm.inference_bistream` with greedy "
        "tokens, the text a generator of `piece_k` ([1, n_k] ids, `num_pieces` of them); `draw` counts the input "
        "draws passed over because the greedy run picked an id the official loop rejects or ran past "
        f"{BISTREAM_MAX_TOKENS} tokens. `out_tokens`: the speech tokens yielded (the fill tokens are not yielded); "
        "`yielded_before_piece[k]`: how many had been yielded when piece k was taken (the last entry: at the end of "
        "the text); `step_raw_logp` [steps, classes]: the log-softmax of every LM step (forced fill steps "
        "included); `step_top1_margin`: the greedy margin of every sampled step. A case with a `seed` was sampled with "
        "the yaml's `ras_sampling` on the global torch RNG after `torch.manual_seed(seed)` (its `top_p`, `top_k`, "
        "`win_size`, `tau_r` recorded; the sampler's history holds the fill tokens too). `cases.pt` is now:",
        "",
        f"| `cases.pt` | {(out / 'cases.pt').stat().st_size} | `{sha256(out / 'cases.pt')}` |",
        "",
        "| case | pieces | prompt text | prompt speech | tokens | steps |",
        "|---|---|---|---|---|---|",
    ]
    for case in cases:
        sizes = ", ".join(str(case[f"piece_{k}"].shape[1]) for k in range(case["num_pieces"]))
        lines.append(
            f"| {case['name']} | {sizes} | {case['prompt_text'].shape[1]} | {case['prompt_speech_token'].shape[1]} "
            f"| {len(case['out_tokens'])} | {case['num_steps']} |"
        )
    return "\n".join(lines) + "\n"


def write_bistream_group(
    out: Path, cases: dict[str, Any], made: list[dict[str, Any]], command: str, commit: str
) -> None:
    """Add or replace the `llm_bistream` group of `out/cases.pt` (every other group as loaded) and its README
    section."""
    cases["llm_bistream"] = made
    torch.save(cases, out / "cases.pt")
    replace_readme_section(out / "README.md", BISTREAM_MARKER, bistream_readme(made, out, command, commit))


@contextlib.contextmanager
def replay(draws: list[torch.Tensor]) -> Any:
    """A context in which torch.rand, torch.randn_like and Uniform.sample return `draws` in order (each checked
    against the shape asked for): the official random source re-run on recorded draws."""
    from torch.distributions.uniform import Uniform

    pending = list(draws)

    def next_draw(shape: Any) -> torch.Tensor:
        value = pending.pop(0)
        assert tuple(value.shape) == tuple(shape), (tuple(value.shape), tuple(shape))
        return value.clone()

    def rand(*size: Any, **_kwargs: Any) -> torch.Tensor:
        return next_draw(size[0] if len(size) == 1 and not isinstance(size[0], int) else size)

    def sample(self_: Any, sample_shape: Any = ()) -> torch.Tensor:
        return next_draw(self_._extended_shape(torch.Size(sample_shape)))

    originals = torch.rand, torch.randn_like, Uniform.sample
    torch.rand, Uniform.sample = rand, sample
    torch.randn_like = lambda like, **_kwargs: next_draw(like.shape)
    try:
        yield
    finally:
        torch.rand, torch.randn_like, Uniform.sample = originals
    assert not pending, f"{len(pending)} recorded draws left unused"


def recorded_draws(case: dict[str, Any]) -> list[torch.Tensor]:
    """The random draws recorded in a v1/v2 hift case, in the order the official code drew them."""
    return [case[f"rand_draw_{k}"] for k in range(len(case["rand_draw_order"].split(",")))]


def official_hift_hidden(hift: Any, case: dict[str, Any]) -> dict[str, torch.Tensor]:
    """One official run over a recorded hift case: with recorded draws, `m_source` on the recorded f0
    (`source_sine`, `source_linear`: l_linear's input and output; `source`: after tanh and the cache overwrite);
    then `decode(mel, recorded source)` (`conv_pre_out`, `s_stft`, `conv_post_out`, `magnitude` and `phase` as
    `_istft` gets them, `speech`)."""
    out: dict[str, torch.Tensor] = {}
    with torch.inference_mode():
        if case["rand_draw_order"]:
            hook = hift.m_source.l_linear.register_forward_hook(
                lambda _m, i, o: out.update(source_sine=i[0].clone(), source_linear=o.clone())
            )
            try:
                with replay(recorded_draws(case)):
                    source = hift.m_source(hift.f0_upsamp(case["f0"][:, None]).transpose(1, 2))[0]
            finally:
                hook.remove()
            source = source.transpose(1, 2)
            source[:, :, : case["cache_source"].shape[2]] = case["cache_source"]
            out["source"] = source
        hooks = [
            hift.conv_pre.register_forward_hook(lambda _m, _i, o: out.update(conv_pre_out=o.clone())),
            hift.source_downs[0].register_forward_pre_hook(lambda _m, i: out.update(s_stft=i[0].clone())),
            hift.conv_post.register_forward_hook(lambda _m, _i, o: out.update(conv_post_out=o.clone())),
        ]
        istft = hift._istft

        def recording_istft(magnitude: torch.Tensor, phase: torch.Tensor) -> torch.Tensor:
            out.update(magnitude=magnitude.clone(), phase=phase.clone())
            return istft(magnitude, phase)

        hift._istft = recording_istft
        try:
            out["speech"] = hift.decode(x=case["mel"], s=case["source"])
        finally:
            del hift._istft
            for hook in hooks:
                hook.remove()
    return out


def official_e2e(hift: Any, **inference_args: Any) -> dict[str, torch.Tensor]:
    """One official `hift.inference(**inference_args)`, from the mel with f0 predicted: the f0 its predictor gives
    (`e2e_f0`) and the speech (`e2e_speech`)."""
    out: dict[str, torch.Tensor] = {}
    hook = hift.f0_predictor.register_forward_hook(lambda _m, _i, o: out.update(e2e_f0=o.clone()))
    try:
        with torch.inference_mode():
            out["e2e_speech"] = hift.inference(**inference_args)[0]
    finally:
        hook.remove()
    return out


def official_hift_run(hift: Any, case: dict[str, Any]) -> dict[str, torch.Tensor]:
    """What `measure_spreads` compares of a v1/v2 hift case: its hidden tensors (`official_hift_hidden`) and, where
    the case has recorded draws, the official inference from its mel and cache_source with them replayed
    (`official_e2e`)."""
    out = official_hift_hidden(hift, case)
    if case["rand_draw_order"]:
        with replay(recorded_draws(case)):
            out |= official_e2e(hift, speech_feat=case["mel"], cache_source=case["cache_source"])
    return out


@contextlib.contextmanager
def spread_variant(variant: str) -> Any:
    """One of IN_PROCESS_VARIANTS around a one-thread default run."""
    if variant == "threads2":
        torch.set_num_threads(2)
        try:
            yield
        finally:
            torch.set_num_threads(1)
    elif variant == "no_mkldnn":  # the native convolution kernels instead of oneDNN's
        with torch.backends.mkldnn.flags(enabled=False):
            yield
    else:
        raise ValueError(variant)


def kernel_isas(child_output: str, capability: str) -> dict[str, str]:
    """The instruction sets a child run used, by library (KERNEL_VARIABLES): ATen's CPU capability, and what oneDNN
    and MKL say in their verbose output ("not reported" for a library the run did not call)."""
    onednn = re.search(r"^onednn_verbose,.*,isa:(.+)$", child_output, re.MULTILINE)
    mkl = re.search(r"^MKL_VERBOSE .* architecture (.+), \S+ [\d.]+GHz", child_output, re.MULTILINE)
    return {
        "ATen": capability,
        "oneDNN": onednn[1].strip() if onednn else "not reported",
        "MKL": mkl[1].strip() if mkl else "not reported",
    }


def child_runs(
    variant: str, cases: list[dict[str, Any]], child_command: list[str]
) -> tuple[list[dict[str, torch.Tensor]], dict[str, str]]:
    """The official runs over `cases` in one of PROCESS_VARIANTS: `child_command` (the tool, its model on the
    command line) started with SPREAD_CHILD_FLAG and the variant's variables, oneDNN's and MKL's verbose output on,
    so that what each library ran is checked against the variable set for it. Returns the runs and `kernel_isas`."""
    with tempfile.TemporaryDirectory() as scratch:
        exchange = Path(scratch) / "cases.pt"
        torch.save(cases, exchange)
        env = os.environ | PROCESS_VARIANTS[variant] | {"ONEDNN_VERBOSE": "1", "MKL_VERBOSE": "1"}
        child = subprocess.run(
            [*child_command, SPREAD_CHILD_FLAG, str(exchange)], env=env, capture_output=True, text=True
        )
        if child.returncode:
            sys.exit(f"the {variant} run of the official code failed:\n{child.stderr[-4000:]}")
        answer = torch.load(exchange, weights_only=True)
    isas = kernel_isas(child.stdout, answer["capability"])
    for variable, value in PROCESS_VARIANTS[variant].items():
        library = KERNEL_VARIABLES[variable]
        if value.upper() not in isas[library].upper():
            sys.exit(f"{variant}: {library} did not honour {variable}={value}: it ran {isas[library]}")
    return answer["runs"], isas


def serve_spread_child(exchange: Path, run: Callable[[dict[str, Any]], dict[str, torch.Tensor]]) -> None:
    """The child's side of `child_runs`: `run` over the cases in `exchange`, written back there with ATen's CPU
    capability (this process's variables decide the kernels)."""
    cases = torch.load(exchange, weights_only=True)
    runs = [run(case) for case in cases]
    torch.save({"capability": torch.backends.cpu.get_cpu_capability(), "runs": runs}, exchange)


def spread_view(key: str, value: torch.Tensor) -> torch.Tensor:
    """What a spread and a parity test compare: the log of magnitudes (exp() of conv_post, up to e^5 and more),
    everything else as it is."""
    return value.double().log() if key == "magnitude" else value.double()


def largest_difference(key: str, value: torch.Tensor, reference: torch.Tensor) -> float:
    return float((spread_view(key, value) - spread_view(key, reference)).abs().max())


def cpu_description() -> str:
    """This machine's CPU as /proc/cpuinfo names it (model, vendor, AMX flags) and torch's CPU capability."""
    cpuinfo = Path("/proc/cpuinfo")
    first = cpuinfo.read_text().split("\n\n")[0] if cpuinfo.is_file() else ""
    fields = dict(line.split(":", 1) for line in first.splitlines() if ":" in line)
    fields = {name.strip(): value.strip() for name, value in fields.items()}
    amx = [flag for flag in fields.get("flags", "").split() if flag.startswith("amx")]
    return (
        f"{fields.get('model name', 'unknown CPU')} ({fields.get('vendor_id', 'unknown vendor')}; "
        f"AMX {' '.join(amx) if amx else 'none'}; torch CPU capability {torch.backends.cpu.get_cpu_capability()})"
    )


def measure_spreads(
    run: Callable[[dict[str, Any]], dict[str, torch.Tensor]],
    cases: dict[str, list[dict[str, Any]]],
    child_command: list[str],
) -> None:
    """Measure the official code's spread on every hift case of `cases` on this machine, in place.

    `run(case)` is one official run over a case (`official_hift_run`: the hidden tensors on the case's recorded
    inputs, and `e2e_f0`, `e2e_speech` where it has draws to replay); it runs here at one thread (the reference) and
    in every one of SPREAD_VARIANTS (`child_command` starts the tool again for PROCESS_VARIANTS). Each case gets the
    HIFT_INTERMEDIATES it lacks, `<variant>_spread_<key>`: the largest difference (`spread_view`) of the variant's
    tensor from the reference's, `spread_<key>` the largest over the variants, and `spread_variants`; any spread
    measured before is dropped. The kit's meta records what measured them. Checks that the reference reproduces
    the case's recorded tensors, and prints how far this machine's end-to-end run is from them.
    """
    hift_cases = cases["hift"]
    references = [run(case) for case in hift_cases]
    for case, reference in zip(hift_cases, references, strict=True):
        check_reproduced(case, reference)
    runs, kernels = {}, {}
    for variant in SPREAD_VARIANTS:
        if variant in PROCESS_VARIANTS:
            runs[variant], isas = child_runs(variant, hift_cases, child_command)
            kernels[variant] = ", ".join(f"{library} {isa}" for library, isa in isas.items())
        else:
            with spread_variant(variant):
                runs[variant] = [run(case) for case in hift_cases]
    for k, (case, reference) in enumerate(zip(hift_cases, references, strict=True)):
        for key in [key for key in case if key.startswith("spread_") or "_spread_" in key]:
            del case[key]
        case.update({key: reference[key] for key in HIFT_INTERMEDIATES if key in reference and key not in case})
        for variant, variant_runs in runs.items():
            for key, value in reference.items():
                case[f"{variant}_spread_{key}"] = largest_difference(key, variant_runs[k][key], value)
        for key in reference:
            case[f"spread_{key}"] = max(case[f"{variant}_spread_{key}"] for variant in runs)
        case["spread_variants"] = ",".join(runs)
    cases["meta"][0].update(
        spread_cpu=cpu_description(),
        spread_torch_version=str(torch.__version__),
        spread_variants=",".join(SPREAD_VARIANTS),
        spread_kernels="; ".join(f"{variant}: {isas}" for variant, isas in kernels.items()),
    )


def check_reproduced(case: dict[str, Any], reference: dict[str, torch.Tensor]) -> None:
    """Check that a one-thread run here reproduces the case's recorded source (from the recorded f0 and draws) and
    speech (decode of the recorded mel and source); print how far its end-to-end run is from the recorded f0 and
    speech (0 on the machine that recorded the case, another CPU's rounding grown through the stages elsewhere)."""
    name = case["name"]
    if "source" in reference:
        gap = float((reference["source"] - case["source"]).abs().max())
        assert gap < 1e-4, f"{name}: the source from the recorded draws is {gap} off the recorded one"
    gap = float((reference["speech"][..., : case["speech"].shape[-1]] - case["speech"]).abs().max())
    assert gap < 1e-3, f"{name}: decode of the recorded mel and source is {gap} off the recorded speech"
    if "e2e_speech" in reference:
        speech_gap = float((reference["e2e_speech"] - case["speech"]).abs().max())
        f0_gap = float((reference["e2e_f0"] - case["f0"]).abs().max())
        print(f"{name}: this machine's end-to-end run against the recorded: f0 {f0_gap:.1e}, speech {speech_gap:.1e}")


def variant_description(variant: str) -> str:
    if variant in IN_PROCESS_VARIANTS:
        return IN_PROCESS_VARIANTS[variant]
    return " and ".join(f"{name}={value}" for name, value in PROCESS_VARIANTS[variant].items())


def spread_readme(cases: dict[str, list[dict[str, Any]]]) -> list[str]:
    """README lines on the spreads of the hift cases: what measured them, and tables of them (largest and by
    variant)."""
    meta = cases["meta"][0]
    hift_cases = cases["hift"]
    keys = list(
        dict.fromkeys(
            key.removeprefix("spread_")
            for case in hift_cases
            for key in case
            if key.startswith("spread_") and key != "spread_variants"
        )
    )
    variants = meta["spread_variants"].split(",")
    described = "; ".join(f"`{variant}`: {variant_description(variant)}" for variant in variants)

    def row(case: dict[str, Any], prefix: str) -> str:
        return " | ".join(f"{case[prefix + key]:.1e}" if prefix + key in case else "-" for key in keys)

    lines = [
        f"`spread_<tensor>`: the official code's own spread, the largest difference of that tensor ({SPREAD_VIEW}) "
        f"between a one-thread run and each run of `spread_variants` ({described}); `<variant>_spread_<tensor>`: "
        "that of one variant. The stages are run on the case's recorded inputs (the source module on the recorded "
        "f0 and draws, decode on the recorded mel and source); `spread_e2e_f0` and `spread_e2e_speech` (cases with "
        "recorded draws or fixed source buffers) are of the official inference from the mel, f0 predicted, the "
        f"draws replayed. Measured on {meta['spread_cpu']}, torch {meta['spread_torch_version']}, one thread (meta "
        f"`spread_cpu`); the variants in a fresh process ran {meta['spread_kernels']} (meta `spread_kernels`). "
        "Another CPU kind rounds differently: these are one machine's spreads.",
        "",
        "| case | frames | " + " | ".join(keys) + " |",
        "|---|---|" + "---|" * len(keys),
        *(f"| {case['name']} | {case['mel'].shape[-1]} | {row(case, 'spread_')} |" for case in hift_cases),
        "",
        "By variant:",
        "",
        "| case | variant | " + " | ".join(keys) + " |",
        "|---|---|" + "---|" * len(keys),
        *(
            f"| {case['name']} | {variant} | {row(case, f'{variant}_spread_')} |"
            for case in hift_cases
            for variant in variants
        ),
    ]
    return lines


def replace_readme_section(readme: Path, marker: str, section: str) -> None:
    """Put `section` (its first line the heading `marker`; "" drops the section) in place of the README's section
    under `marker`, or at its end; every other section stays as it is."""
    text = readme.read_text(encoding="utf-8") if readme.is_file() else ""
    head, found, rest = text.partition("\n" + marker + "\n")
    next_section = rest.find("\n## ")
    tail = rest[next_section:] if found and next_section >= 0 else ""
    separator = "\n\n" if section else ""
    readme.write_text(head.rstrip("\n") + separator + section.strip("\n") + "\n" + tail, encoding="utf-8")


def write_respread(out: Path, cases: dict[str, list[dict[str, Any]]], command: str, commit: str) -> None:
    """Save `cases` (their spreads measured again) as `out/cases.pt` and write RESPREAD_MARKER's README section."""
    cases_path = out / "cases.pt"
    torch.save(cases, cases_path)
    lines = [
        RESPREAD_MARKER,
        "",
        f"Made by `{command}` with the official code at commit `{commit}`: every `spread_*` field of every hift "
        "case measured again on the machine below, and the `spread_*` fields of `meta` set to say so; every recorded "
        "tensor is as it was (a hidden tensor a case lacked was added). This supersedes any spread and `cases.pt` "
        "checksum above. `cases.pt` is now:",
        "",
        f"| `cases.pt` | {cases_path.stat().st_size} | `{sha256(cases_path)}` |",
        "",
        *spread_readme(cases),
    ]
    replace_readme_section(out / "README.md", RESPREAD_MARKER, "\n".join(lines))


def write_references(
    out: Path,
    kit: dict[str, list[dict[str, Any]]],
    made: list[dict[str, Any]],
    run: Callable[[dict[str, Any]], dict[str, torch.Tensor]],
    child_command: list[str],
    command: str,
    commit: str,
) -> None:
    """Write `made` (the hift cases a tool makes, made afresh on this machine) to `out/references/<CPU kind>.pt`
    with their hidden tensors and spreads (`measure_spreads`, as a normal run), and REFERENCES_MARKER's README
    section; `cases.pt` and every other file stay as they are. Exits, writing nothing, unless every case's inputs
    are those of the case of its name in `kit` (the kit's `cases.pt`) to the bit (`input_difference`)."""
    recorded = {case["name"]: case for case in kit.get("hift", [])}
    for case in made:
        kept = recorded.get(case["name"])
        if kept is None:
            sys.exit(f"--references: the kit has no hift case {case['name']!r} (a run without --references adds it)")
        inputs = sorted(key for key in {*case, *kept} if key in CASE_INPUTS or key.startswith("rand_draw_"))
        why = "; ".join(f"{key}: {gap}" for key in inputs if (gap := input_difference(case.get(key), kept.get(key))))
        if why:
            sys.exit(
                f"--references: hift case {case['name']!r} made here has other inputs than the kit's ({why}); "
                "nothing written"
            )
    cpu = recorded_cpu()
    meta = {
        "kit": out.name,
        "model_version": kit["meta"][0]["model_version"],
        "official_commit": commit,
        "torch_version": str(torch.__version__),
        "command": command,
        **cpu,
    }
    references = {"meta": [meta], "hift": made}
    measure_spreads(run, references, child_command)
    path = out / "references" / f"{re.sub('[^a-z0-9]+', '-', cpu['recorded_cpu_kind'].lower()).strip('-')}.pt"
    path.parent.mkdir(exist_ok=True)
    torch.save(references, path)
    replace_readme_section(out / "README.md", REFERENCES_MARKER, references_readme(out))
    print(f"{path}: {path.stat().st_size} bytes, `{sha256(path)}`; {', '.join(case['name'] for case in made)}")


def input_difference(made: Any, recorded: Any) -> str:
    """'' where a value made here is the kit's to the bit, else how it differs."""
    if isinstance(made, torch.Tensor) and isinstance(recorded, torch.Tensor) and made.shape == recorded.shape:
        gap = float((made.double() - recorded.double()).abs().max()) if made.numel() else 0.0
        return "" if torch.equal(made, recorded) else f"up to {gap:.1e} apart"
    same = not isinstance(made, torch.Tensor) and type(made) is type(recorded) and made == recorded
    return "" if same else f"{describe(made)} here, {describe(recorded)} in the kit"


def references_readme(out: Path) -> str:
    """REFERENCES_MARKER's README section: every file of `out/references`, the machine that made it and its cases."""
    lines = [
        REFERENCES_MARKER,
        "",
        "`references/<CPU kind>.pt`, `{'meta': [...], 'hift': [cases]}`: the hift cases the kit tool makes, made "
        "afresh on one machine with `--references`. Each case's inputs (`mel`, `cache_source`, the random draws or "
        "the fixed source buffers) are those of the kit's case of that name, checked to the bit by the tool; every "
        "other tensor, the hidden tensors and the spreads were recorded on that machine, whose CPU kind the meta and "
        "each case hold "
        "(`recorded_cpu_kind`, `CpuCapabilities.kernel_kind`; `recorded_cpu` in words). The parity tests hold the "
        "cases of their own machine's kind to the float32 floor and the others to the bound across CPU kinds "
        "(tests/parity/hift_pipeline.py). `--references` leaves `cases.pt` as it is.",
        "",
        "| file | bytes | sha256 | CPU kind | CPU | cases (frames) | made by |",
        "|---|---|---|---|---|---|---|",
    ]
    for path in sorted((out / "references").glob("*.pt")):
        references = torch.load(path, weights_only=True)
        meta = references["meta"][0]
        cpu = [str(meta.get(key, "not recorded")).replace("|", "\\|") for key in ("recorded_cpu_kind", "recorded_cpu")]
        cases = ", ".join(f"{case['name']} ({case['mel'].shape[-1]})" for case in references.get("hift", []))
        made_by = "not recorded"
        if "command" in meta:
            made_by = f"`{meta['command']}`, official code `{meta['official_commit']}`, torch {meta['torch_version']}"
        lines.append(
            f"| `{path.relative_to(out)}` | {path.stat().st_size} | `{sha256(path)}` | {cpu[0]} | {cpu[1]} | {cases} "
            f"| {made_by} |"
        )
    return "\n".join(lines)


def official_text_frontend(configs: dict[str, Any]) -> Any:
    """The text half of the official `CosyVoiceFrontEnd` (no ONNX models needed) with the yaml's tokenizer, set up as
    its constructor does where ttsfrd is not installed: wetext for Chinese and English, inflect."""
    import inflect
    from cosyvoice.cli.frontend import CosyVoiceFrontEnd
    from wetext import Normalizer

    frontend = CosyVoiceFrontEnd.__new__(CosyVoiceFrontEnd)
    frontend.tokenizer = configs["get_tokenizer"]()
    frontend.allowed_special = configs["allowed_special"]
    frontend.inflect_parser = inflect.engine()
    frontend.zh_tn_model, frontend.en_tn_model = Normalizer(remove_erhua=False), Normalizer()
    frontend.text_frontend = "wetext"
    return frontend


def text_path_case(frontend: Any, text: str) -> dict[str, Any]:
    """A `frontend` case: the official `text_normalize` of `text`, whole and split, and the token ids of the text and
    of each segment (`frontend`: a `CosyVoiceFrontEnd` with its text half set up)."""

    def ids(part: str) -> list[int]:
        return frontend.tokenizer.encode(part, allowed_special=frontend.allowed_special)

    segments = frontend.text_normalize(text, split=True)
    tokens = [ids(segment) for segment in segments]
    return {
        "text": text,
        "function": "cosyvoice.cli.frontend.CosyVoiceFrontEnd.text_normalize + tokenizer.encode",
        "allowed_special": str(frontend.allowed_special),
        "text_frontend": frontend.text_frontend,
        "raw_tokens": torch.tensor(ids(text), dtype=torch.int64),
        "normalized_text": frontend.text_normalize(text, split=False),
        "num_segments": len(segments),
        "segments_joined": "\n".join(segments),
        "segment_token_lens": torch.tensor([len(t) for t in tokens], dtype=torch.int64),
        "segment_tokens": torch.tensor([i for t in tokens for i in t], dtype=torch.int64),
    }


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).removeprefix('torch.')} {list(value.shape)}"
    return f"{type(value).__name__} {value!r}" if not isinstance(value, str) or len(value) < 60 else "str"


def readme_section(
    made: dict[str, list[dict[str, Any]]],
    cases: dict[str, list[dict[str, Any]]],
    meta: dict[str, Any],
    out: Path,
    command: str,
) -> str:
    lines = [
        GROUPS_MARKER,
        "",
        f"Made by `{command}` with the official code at commit `{meta['official_commit']}`, torch "
        f"{meta['torch_version']}, {meta['num_threads']} thread, seed {meta['seed']}, on the weights in `model/`.",
        "They cover, where a list of what this kit does not cover precedes this section, its streaming loop, "
        "`cache_source` and `ras_sampling` items (and the v2 front end), and add the HiFT hidden tensors and their "
        "spread to every hift case. Groups and cases the kit already had were kept as first recorded (a run on "
        "another machine rounds differently) unless `--remake` was given. The files now are (superseding any "
        "checksum above):",
        "",
        "| file | bytes | sha256 |",
        "|---|---|---|",
    ]
    for path in sorted(p for p in out.rglob("*") if p.is_file() and p.name != "README.md"):
        lines.append(f"| `{path.relative_to(out)}` | {path.stat().st_size} | `{sha256(path)}` |")
    lines += [
        "",
        "* `llm_sampled`: the yaml's own sampler (`ras_sampling`) on the global torch RNG after "
        "`torch.manual_seed(seed)`; a sampler drawing the same way from a generator seeded with `seed` replays "
        "`out_tokens`. `step_fallback[i]` is 1 where the nucleus draw repeated too often and the fallback draw ran.",
        "* `stream`: `model.tts(stream=True)` with greedy tokens and both length ratios equal (a fixed length). "
        "Chunk k: `chunk_k_tokens` (given to token2wav), `chunk_k_finalize`, `chunk_k_mel` and `chunk_k_source` "
        "(what HiFT decode got: the cached frames first, the source after the cache_source overwrite), "
        "`chunk_k_speech` (the audio yielded), and in v1 `chunk_k_noise` (the CFM start noise after the flow cache "
        "overwrite). `out_tokens`: every token the LLM generated, in order.",
        f"* `hift` `{HIFT_CACHE_CASE}`: `HiFTGenerator.inference` with a non-empty `cache_source`, draws recorded.",
        f"* `hift` `mel{{T}}_long` (v2, T in {', '.join(map(str, HIFT_LONG_FRAMES))}): `HiFTGenerator.inference` on a "
        "random mel (N(-6, 2^2), its own seed), draws recorded; without "
        f"{' and '.join(f'`{k}`' for k in LONG_CASE_OMITTED)} (size: `magnitude`/`phase` hold conv_post_out).",
        "* every `hift` case: the official hidden tensors in pipeline order, recomputed on the case's own inputs "
        "(the source module on the recorded f0 with the recorded draws replayed; `decode` on the recorded mel and "
        "source): `source_sine` [1, L, harmonics + 1] and `source_linear` [1, L, 1] (the input and output of "
        "`m_source.l_linear`, before tanh and any cache overwrite; cases with draws only), `magnitude` and `phase` "
        "[1, n_fft/2 + 1, frames] (the arguments of `_istft`: exp of conv_post before the clip at 100, and sin); "
        "their spreads below the table of cases.",
        "* `frontend`: `text_normalize` with wetext and the yaml's `get_tokenizer` (v2: the Qwen2 files in "
        "`model/CosyVoice-BlankEN`), when made by this tool.",
        "",
        "| group | case | fields |",
        "|---|---|---|",
    ]
    for group, made_cases in made.items():
        for case in made_cases:
            name = case.get("name", case.get("text", "")[:30])
            summary = ", ".join(f"{k}: {describe(v)}" for k, v in case.items() if not k.startswith("chunk_"))
            lines.append(f"| {group} | {name} | {summary[:400]} |")
    lines += ["", "The official code's spread per hift case:", "", *spread_readme(cases)]
    return "\n".join(lines) + "\n"


def add_existing_kit_modes(parser: argparse.ArgumentParser, bistream_help: str) -> None:
    """The flags of both kit tools that change one part of an existing kit and leave the rest as it is."""
    parser.add_argument(
        "--bistream-only",
        action="store_true",
        help=f"{bistream_help}make only the llm_bistream group (added or replaced); every other group stays as it is",
    )
    parser.add_argument(
        "--respread",
        action="store_true",
        help="measure only the spread_* fields of every hift case again, on this machine; the rest stays as it is",
    )
    parser.add_argument(
        "--references",
        action="store_true",
        help="record the hift cases made here afresh on this machine into KIT/references/<its CPU kind>.pt; "
        "cases.pt stays as it is",
    )
    parser.add_argument(SPREAD_CHILD_FLAG, type=Path, help=argparse.SUPPRESS)  # see child_runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--official", type=Path, required=True, help="a FunAudioLLM/CosyVoice checkout")
    parser.add_argument("--model", type=Path, help="a model dir in the official layout (default: --out/model)")
    parser.add_argument("--out", type=Path, required=True, help="the kit directory to write or extend")
    parser.add_argument("--seed", type=int, default=19)
    parser.add_argument("--qwen-tokenizer", type=Path, help="v2: Qwen2 tokenizer files for model/CosyVoice-BlankEN")
    parser.add_argument(
        "--remake", action="store_true", help="replace the groups and cases made here that the kit already has"
    )
    add_existing_kit_modes(parser, bistream_help="v2: ")
    args = parser.parse_args()
    torch.set_num_threads(1)
    import_official(args.official.resolve())
    out = args.out.resolve()
    model_dir = out / "model"
    if args.spread_child:
        serve_spread_child(args.spread_child, Maker(model_dir, args.seed).hift_run)
        return
    if args.model and args.model.resolve() != model_dir:
        shutil.copytree(args.model, model_dir, dirs_exist_ok=True)
    if args.qwen_tokenizer:
        copy_qwen_tokenizer(args.qwen_tokenizer, model_dir)
    maker = Maker(model_dir, args.seed)
    cases_path = out / "cases.pt"
    cases = torch.load(cases_path, weights_only=True) if cases_path.is_file() else {}
    command = command_line(args)
    commit = official_commit(args.official)
    # the tool again, on the kit's model, for the spread variants that need a fresh process
    child_command = [sys.executable, str(Path(__file__).resolve()), "--official", str(args.official), "--out", str(out)]
    if args.bistream_only:
        if maker.version != 2 or not cases:
            sys.exit("--bistream-only extends an existing CosyVoice2 kit")
        write_bistream_group(out, cases, maker.llm_bistream(), command, commit)
        print(json.dumps({group: len(c) for group, c in cases.items()}))
        return
    if args.respread:
        if not cases.get("hift"):
            sys.exit("--respread measures the spreads of an existing kit's hift cases again")
        measure_spreads(maker.hift_run, cases, child_command)
        write_respread(out, cases, command, commit)
        print("\n".join(spread_readme(cases)))
        return
    if args.references:
        made_hift = maker.hift_cases(maker.sampled_and_stream()["stream"][0])
        write_references(out, cases, made_hift, maker.hift_run, child_command, command, commit)
        return
    import transformers

    meta = {
        "kit": out.name,
        "model_version": "CosyVoice2 (CosyVoice2-0.5B style)"
        if maker.version == 2
        else "CosyVoice v1 (CosyVoice-300M style)",
        "official_commit": commit,
        "seed": args.seed,
        "torch_version": str(torch.__version__),
        "transformers_version": str(transformers.__version__),
        "device": "cpu",
        "dtype": "float32",
        "num_threads": 1,
        "yaml": f"model/{V2_YAML if maker.version == 2 else V1_YAML}",
        "sample_rate": 24000 if maker.version == 2 else 22050,
        "hop": maker.hop,
    }
    if cases.get("meta"):
        cases["meta"][0].update({f"kit_maker_{k}": v for k, v in meta.items() if k in ("official_commit", "seed")})
    else:
        cases["meta"] = [meta]
    made = maker.sampled_and_stream()
    if maker.version == 2 or not cases.get("frontend"):  # v1 kits made before this tool have their own
        made["frontend"] = maker.frontend_cases()
    made_hift = maker.hift_cases(made["stream"][0])
    # What the kit has stays as recorded (another machine's rounding differs: see the README), unless --remake.
    for group, made_cases in made.items():
        if args.remake or not cases.get(group):
            cases[group] = made_cases
    kept_hift = {case["name"]: case for case in cases.get("hift", [])}
    for case in made_hift:
        if args.remake or case["name"] not in kept_hift:
            kept_hift[case["name"]] = case
    cases["hift"] = list(kept_hift.values())
    measure_spreads(maker.hift_run, cases, child_command)
    for group in cases.values():
        for case in group:
            for key, value in case.items():
                if isinstance(value, torch.Tensor):
                    case[key] = value.detach().contiguous().clone()
    torch.save(cases, cases_path)
    made_names = {case["name"] for case in made_hift}
    made = {group: cases[group] for group in made} | {
        "hift": [case for case in cases["hift"] if case["name"] in made_names]
    }
    readme = out / "README.md"
    if not readme.is_file():
        readme.write_text(f"# Conformance kit `{out.name}`\n", encoding="utf-8")
    replace_readme_section(readme, RESPREAD_MARKER, "")  # the spreads were measured again just now
    section = readme_section(made, cases, {**meta, "official_commit": commit}, out, command)
    replace_readme_section(readme, GROUPS_MARKER, section)
    print(json.dumps({group: len(c) for group, c in cases.items()}))


def command_line(args: argparse.Namespace) -> str:
    """This tool's command line as given (for the README)."""
    return "python tools/make_conformance_kit.py " + " ".join(
        f"--{k.replace('_', '-')}" + ("" if v is True else f" {v}")
        for k, v in vars(args).items()
        if v is not None and v is not False
    )


if __name__ == "__main__":
    main()
