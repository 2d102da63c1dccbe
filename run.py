"""vase: decode a task under a KV-cache policy and grade it.

    python run.py                                   # the embedded offline default (real 0.5B model, CPU, ~10 min)
    python run.py policy=vase_dkv ratio=4 task=aime model=qwen3_4b
    python run.py -m policy=full,snapkv,vase_attnv task=math500      # a multirun
    python run.py -m sweep=main_table hydra/launcher=slurm          # a committed sweep on SLURM

Config groups (conf/): model, task, policy, generation, logger, sweep, hydra/launcher. Top-level keys: ratio,
budget, window, seed, n_samples, limit, results_dir, run_dir, pass_k. Results: results/<task>/<model>/<run>/.
Rerunning the same command resumes it.
"""

from __future__ import annotations

import difflib
import logging
import sys
from pathlib import Path

CONF = Path(__file__).resolve().parent / "conf"
GROUPS = ("model", "task", "policy", "generation", "logger", "sweep", "hydra/launcher")
log = logging.getLogger("vase")


def check_group_choices(argv: list[str]) -> str | None:
    """One-line error for an unknown config group option (before Hydra and before anything loads)."""
    for arg in argv:
        if "=" not in arg or arg.startswith("-"):
            continue
        key, value = arg.split("=", 1)
        key = key.lstrip("+~")
        if key not in GROUPS or value in ("null", ""):
            continue
        options = sorted(p.stem for p in (CONF / key).glob("*.yaml"))
        if key == "hydra/launcher":
            options = sorted(set(options) | {"basic", "submitit_local", "submitit_slurm"})
        for v in value.split(","):
            if v not in options:
                close = difflib.get_close_matches(v, options, n=1)
                hint = f" (did you mean {close[0]}?)" if close else ""
                return f"{key}={v}: unknown {key}{hint}; valid: {', '.join(options)}"
    return None


def main() -> None:
    import hydra
    from omegaconf import DictConfig

    @hydra.main(version_base="1.3", config_path="conf", config_name="config")
    def _run(cfg: DictConfig) -> float | None:
        from vase.run.runner import run

        try:
            metrics = run(cfg, progress=cfg.progress)
        except ValueError as err:
            log.error("error: %s", err)
            if cfg.get("raise_errors", False):
                raise
            sys.exit(2)
        print_summary(metrics)
        return metrics.get("accuracy")

    _run()


def print_summary(metrics: dict) -> None:
    keys = [
        "task",
        "model",
        "policy",
        "budget",
        "problems",
        "samples",
        "accuracy",
        "accuracy_stderr",
        "pass@1",
        "answered_rate",
        "loop_rate",
        "garbage_rate",
        "truncation_rate",
        "mean_output_tokens",
        "compression_ratio",
        "kv_cache_bytes",
        "kv_cache_bytes_full",
        "peak_memory_bytes",
        "decode_tokens_per_second",
        "evictions",
        "eviction_seconds",
        "attended_tokens",
        "run_dir",
    ]
    width = max(len(k) for k in keys)
    lines = ["", "=" * 60]
    for k in keys:
        v = metrics.get(k)
        if v is None:
            continue
        lines.append(f"{k:<{width}}  {v:.4g}" if isinstance(v, float) else f"{k:<{width}}  {v}")
    lines.append("=" * 60)
    print("\n".join(lines), flush=True)  # the entry script's report to the user


if __name__ == "__main__":
    error = check_group_choices(sys.argv[1:])
    if error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    main()
