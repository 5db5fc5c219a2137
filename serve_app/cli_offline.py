"""The commands that need no server: `cosyvoice-serve plan` (what `run` would run where on this machine, or on one
described by the command line), `download` (a hub model into its cache) and `normalize` (what the model reads of a
text).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

from engine.errors import CosyVoiceError
from engine.loading.model_source import model_directory
from serve_app.cli_run import app_args_of, deployment_overrides_of, error_line, read_serve_config


def show_plan(options: argparse.Namespace) -> int:
    """`cosyvoice-serve plan`: the plan for this machine, or for one described by --gpus and --gpu-memory-gb."""
    from engine.loading.loader import model_sizes
    from serve_app.args import AppArgs
    from serve_app.footprints import recorded_footprints
    from serve_app.inventory import Gpu, inventory_here
    from serve_app.plan import plan_for

    application, _ = read_serve_config(options.config)
    if options.gpus and options.gpu_memory_gb is None:
        print("error: --gpus needs --gpu-memory-gb (each card's memory)", file=sys.stderr)
        return 2
    inventory = inventory_here(cpus=options.cpus)
    if options.gpus is not None:
        card = Gpu(options.gpu_name, int((options.gpu_memory_gb or 0) * 2**30), not options.no_native_bfloat16)
        inventory = replace(inventory, gpus=(card,) * options.gpus)
    try:
        app_args = AppArgs.model_validate(app_args_of(application, options))
        deployments = deployment_overrides_of(application)
        plan = plan_for(
            inventory, model_sizes(app_args.model), app_args, options.device, recorded_footprints(), deployments
        )
    except (ValueError, CosyVoiceError) as exc:
        print(f"error: {error_line(exc)}", file=sys.stderr)
        return 2
    print(json.dumps(plan.to_json(), indent=2) if options.json else "\n".join(plan.lines()))
    return 0


def download(options: argparse.Namespace) -> int:
    """Resolve a hub model into its cache (what `run` and every replica do): the step a cluster's nodes run first."""
    try:
        directory = model_directory(options.model)
    except CosyVoiceError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 2
    print(directory)
    return 0


def normalize(options: argparse.Namespace) -> int:
    """`cosyvoice-serve normalize`: the segments the model reads of a text after normalisation, each with the language
    it was read as; from the model's config and tokenizer alone (no server, no weights)."""
    from engine.loading.loader import load_frontend
    from serve_app.args import AppArgs

    application, _ = read_serve_config(options.config)
    args = dict(application.get("args") or {})
    if options.model is not None:
        args["model"] = options.model
    try:
        app_args = AppArgs.model_validate(args)
        frontend = load_frontend(
            app_args.model,
            max_text_chars=app_args.limits.max_input_chars,
            spell_out_languages=app_args.text.spell_out_languages,
        )
        segments = frontend.split_by_language(options.text, options.language)
    except (ValueError, CosyVoiceError) as exc:
        print(f"error: {error_line(exc)}", file=sys.stderr)
        return 2
    for language, segment in segments:
        print(f"[{language or 'as written'}] {segment}")
    return 0
