"""Value-magnitude analysis of a real model: decode a few problems with the full cache and study the value states.

    python scripts/value_analysis.py --model qwen2.5_coder_0.5b --task gsm_symbolic --limit 3 \
        --layers 0,6,12,18,23 --max-new-tokens 256 --out docs/figures/value_analysis

Per selected layer: violins of the value range and L2 norm, the share of tokens above k x the median range, where the
large-value tokens sit (sinks, position buckets, prompt/output, which text tokens) and the Spearman correlation
between a token's value range and its quantization error (2 and 4 bits, groups of 32 and 64 channels; min-max
quantization and Spearman by default, the paper's HQQ and Pearson with --quantizer hqq --correlation pearson).
Writes CSV tables, PNG (and PDF) figures and summary.json into --out. Decoding is greedy unless --sample (the model
config's sampling). See docs/analysis.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="qwen2.5_coder_0.5b", help="conf/model/<name>.yaml (default: %(default)s)")
    p.add_argument("--task", default="gsm_symbolic", help="conf/task/<name>.yaml (default: %(default)s)")
    p.add_argument("--limit", type=int, default=3, help="problems to decode (default: %(default)s)")
    p.add_argument(
        "--layers",
        default="auto",
        help="comma-separated layer indices (the model's), or auto: five spread over the full-attention layers\n"
        "(0,6,12,18,23 on a 24-layer model; sliding-window layers, which hold only their window, when named;\n"
        "linear-attention layers hold no per-token values) (default: %(default)s)",
    )
    p.add_argument("--max-new-tokens", type=int, default=256, help="output tokens per problem (default: %(default)s)")
    p.add_argument("--out", default="docs/figures/value_analysis", help="output directory (default: %(default)s)")
    p.add_argument(
        "--large",
        default="5x,top1%",
        help="definitions of a large-value token for the position/token analyses: kx (range > k x the median of its\n"
        "layer and head) and/or topP%% (the largest P%% per layer and head) (default: %(default)s)",
    )
    p.add_argument("--records", default=None, help="reuse a records.csv.gz from --save-records instead of decoding")
    p.add_argument("--bits", default="2,4", help="quantization bits (default: %(default)s)")
    p.add_argument("--groups", default="32,64", help="quantization group sizes (default: %(default)s)")
    p.add_argument(
        "--quantizer",
        choices=("minmax", "hqq"),
        default="minmax",
        help="minmax: per-group asymmetric min-max (KIVI-style); hqq: the paper's HQQ (half-quadratic zero point, "
        "vase/analysis/hqq.py) (default: %(default)s)",
    )
    p.add_argument(
        "--correlation",
        choices=("spearman", "pearson"),
        default="spearman",
        help="spearman: of range and relative error; pearson: the paper's, of range and per-token MSE without the "
        "sinks (default: %(default)s). The table has both",
    )
    p.add_argument("--formats", default="png,pdf", help="figure formats (default: %(default)s)")
    p.add_argument("--sample", action="store_true", help="sample with the model config's settings (default: greedy)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-records", action="store_true", help="also write the per-token records (records.csv.gz)")
    return p.parse_args(argv)


def _ints(text: str, name: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--{name}: expected comma-separated integers, got {text!r}") from None


def load_tokenizer(spec):
    """The tokenizer of a model spec without loading the weights (for --records)."""
    from transformers import AutoTokenizer

    from vase.models import OFFLINE_MODELS, convert_offline_model, qwen3_tokenizer_dir

    if spec.name in OFFLINE_MODELS:
        return AutoTokenizer.from_pretrained(convert_offline_model(spec.name))
    if spec.name.startswith("tiny:"):
        return AutoTokenizer.from_pretrained(qwen3_tokenizer_dir())
    return AutoTokenizer.from_pretrained(spec.name, revision=spec.revision)


def decode(args, spec, task, layers: list[int] | None, bits: list[int], groups: list[int]):
    """Decode the task's problems with the full cache; return (records, tokenizer, facts for summary.json).
    ``layers``: the model's layer indices, ``None`` for the default (``--layers auto``)."""
    import pandas as pd
    import torch

    from vase.analysis.value_analysis import capture_values, model_layer_types, select_layers, token_records
    from vase.engine import SamplingConfig
    from vase.engine.linear_state import text_config
    from vase.run.decoding import eos_ids

    problems = task.load()
    if spec.dtype == "auto":  # one row decodes at a time: the runner's rule for model.dtype=auto
        from dataclasses import replace

        from vase.engine import auto_dtype

        spec = replace(spec, dtype=auto_dtype(spec.resolved_device(), 1)[0])
    t0 = time.perf_counter()
    model, tokenizer = spec.load()
    print(f"model {spec.name} loaded in {time.perf_counter() - t0:.1f} s; {len(problems)} problems of {task.name}")
    types = model_layer_types(model)
    try:
        layers = select_layers(types, layers)
    except ValueError as err:
        raise SystemExit(f"--{err}") from None
    if args.sample:
        sampling = SamplingConfig(temperature=spec.temperature, top_p=spec.top_p, top_k=spec.top_k)
    else:
        sampling = SamplingConfig(greedy=True)
    stop = eos_ids(model, tokenizer)
    thinking = bool(spec.thinking and task.thinking)
    frames, tokens_total = [], 0
    t_dec = time.perf_counter()
    for i, problem in enumerate(problems):
        prompt = task.render(problem, tokenizer, enable_thinking=thinking)
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        cap = capture_values(
            model,
            ids,
            layers,
            max_new_tokens=args.max_new_tokens,
            sampling=sampling,
            eos_token_ids=stop,
            seed=args.seed + i,
            problem_id=problem.id,
        )
        n_out = len(cap.token_ids) - cap.prompt_len
        tokens_total += n_out
        print(f"problem {problem.id}: {cap.prompt_len} prompt + {n_out} output tokens in the cache")
        frames.append(token_records(cap, bits, groups, quantizer=args.quantizer))
    config = text_config(model.config)  # a multimodal checkpoint's language model (Qwen3.5)
    facts = {
        "problems": [p.id for p in problems],
        "layers": layers,
        "layer_types": {str(li): types[li] for li in layers},
        "num_layers": len(types),
        "kv_heads": config.num_key_value_heads,
        "head_dim": getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
        "dtype": str(next(model.parameters()).dtype),
        "greedy": not args.sample,
        "max_new_tokens": args.max_new_tokens,
        "output_tokens": tokens_total,
        "decode_seconds": round(time.perf_counter() - t_dec, 1),
        "torch": torch.__version__,
        "quantizer": args.quantizer,
    }
    return pd.concat(frames, ignore_index=True), tokenizer, facts


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="[%(asctime)s %(levelname)s %(name)s] %(message)s", datefmt="%H:%M:%S"
    )
    layers = None if args.layers.strip() == "auto" else _ints(args.layers, "layers")
    bits, groups = _ints(args.bits, "bits"), _ints(args.groups, "groups")
    large = [x.strip() for x in args.large.split(",") if x.strip()]
    model_cfg, task_cfg = ROOT / "conf" / "model" / f"{args.model}.yaml", ROOT / "conf" / "task" / f"{args.task}.yaml"
    for path, what in ((model_cfg, "model"), (task_cfg, "task")):
        if not path.exists():
            options = sorted(p.stem for p in path.parent.glob("*.yaml"))
            raise SystemExit(f"--{what}: no {path.name} in conf/{what}; choose one of {', '.join(options)}")

    import pandas as pd
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from vase.analysis.value_analysis import analyze, parse_large
    from vase.analysis.value_figures import CORRELATIONS, write_outputs

    try:
        for x in large:
            parse_large(x)
    except ValueError as err:
        raise SystemExit(f"--large: {err}") from None
    spec = instantiate(OmegaConf.load(model_cfg))
    task_conf = OmegaConf.load(task_cfg)
    task_conf.limit = args.limit
    task = instantiate(task_conf)
    if args.records:
        records = pd.read_csv(args.records)
        tokenizer = load_tokenizer(spec)
        previous = Path(args.records).with_name("summary.json")  # the decoding run's facts, when next to it
        facts = json.loads(previous.read_text()) if previous.exists() else {}
        facts["records_from"] = Path(args.records).name
        layers = sorted(int(x) for x in records["layer"].unique())
        print(f"{len(records)} records from {args.records}")
    else:
        records, tokenizer, facts = decode(args, spec, task, layers, bits, groups)
        layers = facts["layers"]
    res = analyze(records, token_text=lambda t: tokenizer.decode([t]), large=large)
    title = f"{spec.name}, {task.name}, {records['problem_id'].nunique()} problems"
    formats = [f for f in args.formats.split(",") if f]
    paths = write_outputs(
        res, args.out, formats=formats, title=title, save_records=args.save_records, correlation=args.correlation
    )
    settings = sorted(
        {tuple(int(x) for x in c[len("qerr_b") :].split("_g")) for c in records if c.startswith("qerr_b")}
    )
    summary = {
        **facts,
        "model": spec.name,
        "task": task.name,
        "layers": layers,
        "records": len(records),
        "large": large,
        "bits": sorted({b for b, _ in settings}),
        "group_sizes": sorted({g for _, g in settings}),
        "quantizer": facts.get("quantizer", args.quantizer),  # the one the records were made with
        "correlation": args.correlation,
    }
    Path(args.out, "summary.json").write_text(json.dumps(summary, indent=2) + "\n")

    pd.set_option("display.width", 160)
    fmt = {"float_format": lambda x: f"{x:.4g}", "index": False}
    cols = [
        "layer",
        "layer_type",
        "range_median",
        "range_p99",
        "range_max",
        "range_max_over_median",
        "l2_median",
        "sink_over_median",
    ] + [c for c in res.per_layer.columns if c.startswith("share_above_")]
    print("\nper-layer value range (share_above: of tokens, per (layer, head) median):")
    print(res.per_layer[cols].to_string(**fmt))
    column, _, what = CORRELATIONS[args.correlation]
    print(f"\n{what} per layer and (bits, group size), {summary['quantizer']} quantization:")
    pivot = res.correlation.pivot(index="layer", columns=["bits", "group_size"], values=column)
    print(pivot.to_string(float_format=lambda x: f"{x:.3f}"))
    loc = res.locations[res.locations["kind"] == "bucket"]
    for definition in res.definitions:
        sub = loc[(loc["definition"] == definition) & (loc["large_tokens"] > 0)]
        print(f"\nwhere the large-value tokens sit ({definition}):")
        if sub.empty:
            print("  none")
            continue
        print(sub[["layer", "where", "large_tokens", "large_share", "all_share", "enrichment"]].to_string(**fmt))
        tok = res.tokens[res.tokens["definition"] == definition]
        print(f"top tokens ({definition}):")
        print(tok.drop(columns="definition").head(10).to_string(**fmt))
    print(f"\n{len(paths)} files in {args.out}")
    return 0


if __name__ == "__main__":
    from vase.run.oneline import script_main

    script_main(main)
