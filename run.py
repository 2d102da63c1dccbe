"""vase: decode a task under a KV-cache policy and grade it.

    python run.py                                   # the embedded offline default (real 0.5B model, CPU, ~10 min)
    python run.py policy=vase_dkv ratio=4 task=aime model=qwen3_4b
    python run.py -m policy=full,snapkv,vase_attnv task=math500      # a multirun
    python run.py -m sweep=main_table hydra/launcher=slurm          # a committed sweep on SLURM
    torchrun --nproc-per-node 8 run.py -m sweep=main_table          # every cell data-parallel on 8 local GPUs

Config groups (conf/): model, task, policy, generation, logger, sweep, hydra/launcher. Top-level keys: ratio,
budget, window, seed, n_samples, limit, results_dir, run_dir, pass_k. Results: results/<task>/<model>/<run>/.
Rerunning the same command resumes it.

Before Hydra starts (so nothing is written), the command line is composed with Hydra's compose API and every setting
checked (:func:`check_overrides`, :mod:`vase.run.checks`): a typo or a bad value is one line on stderr with a
did-you-mean or the fix, exit code 2.
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


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _compose(config_name: str, overrides: list[str]):
    """The config exactly as Hydra composes it for ``run.py`` (Hydra's compose API, Hydra's own node included)."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name=config_name, overrides=overrides, return_hydra_config=True)


def _is_group(key: str) -> bool:
    return key in GROUPS or key.startswith("hydra/") or (CONF / key).is_dir()


def _unknown_key(override: str, key: str, config_name: str, overrides: list[str], verb: str = "override") -> str:
    """One line for a key the config does not have: a did-you-mean from the composed config's keys at that level."""
    from omegaconf import OmegaConf

    groups = [o for o in overrides if _is_group(o.split("=", 1)[0].lstrip("+~"))]
    try:
        composed = _compose(config_name, groups)
        tree = OmegaConf.to_container(composed, resolve=False)
        group_names = sorted({str(g) for g in composed.hydra.runtime.choices} | set(GROUPS))
    except Exception:  # the group overrides themselves fail: no suggestion, Hydra's reason only
        tree, group_names = {}, list(GROUPS)
    if "/" in key:
        options, where, missing = group_names, "config groups", key
        known: list[str] = []
    else:
        parts, node, known = key.split("."), tree, []
        for part in parts[:-1]:
            if not (isinstance(node, dict) and part in node):
                break
            node, known = node[part], [*known, part]
        missing = parts[len(known)]
        parent = ".".join(known)
        if not isinstance(node, dict):
            return f"{override}: {parent} is a single value, it has no key {missing!r}; write {parent}=<value>"
        options = sorted(str(k) for k in node)
        if not parent:
            options = sorted(set(options) | {g for g in group_names if "/" not in g})
        where = f"keys of {parent}" if parent else "top-level settings and groups"
    close = difflib.get_close_matches(missing, options, n=1)
    hint = ""
    if close:
        fixed = close[0] if "/" in key else ".".join([*known, close[0], *key.split(".")[len(known) + 1 :]])
        hint = f" (did you mean {override.replace(key, fixed, 1)}?)"
    add = f"; to add a new key: +{override.lstrip('+~')}" if verb == "override" else ""
    return f"{override}: unknown setting {key}{hint}; {where}: {', '.join(options)}{add}"


def _explain(err: Exception, overrides: list[str], config_name: str) -> str:
    """Hydra's multi-line composition error as one line naming the override, with a fix."""
    import re

    from hydra.errors import MissingConfigException

    msg = str(err)

    def find(key: str) -> str:
        for o in overrides:
            if o.split("=", 1)[0].lstrip("+~").split("@", 1)[0] == key:
                return o
        return key

    if isinstance(err, MissingConfigException) and err.missing_cfg_file and "/" in err.missing_cfg_file:
        group, option = err.missing_cfg_file.rsplit("/", 1)
        options = sorted(err.options or [])
        close = difflib.get_close_matches(option, options, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        return f"{group}={option}: unknown {group}{hint}; valid: {', '.join(options)}"
    if m := re.search(r"Could not override '(.+?)'", msg):
        return _unknown_key(find(m.group(1)), m.group(1), config_name, overrides)
    if m := re.search(r"Could not delete from config\. '(.+?)' does not exist", msg):
        return _unknown_key(find(m.group(1)), m.group(1), config_name, overrides, verb="delete")
    if m := re.search(r"An item is already at '(.+?)'", msg):
        o = find(m.group(1))
        return f"{o}: {m.group(1)} already exists; drop the + ({o.lstrip('+')}) or write ++{o.lstrip('+')}"
    return f"{' '.join(overrides) or config_name}: {_one_line(msg)}"


def check_overrides(argv: list[str]) -> str | None:
    """Compose the config as Hydra will, then check every setting: one line for any error, before Hydra starts.

    Unknown keys and groups get a did-you-mean (keys of the composed config at that level, group names, group
    options); values go through :func:`vase.run.checks.check_settings`. In a multirun (``-m``) every value of each
    swept setting is checked. Returns ``None`` when the command line is fine (or not ours to judge: ``--help``,
    another config directory).
    """
    import contextlib
    import io

    from hydra._internal.utils import get_args_parser  # the parser @hydra.main itself uses
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from vase.run.checks import check_settings

    try:
        with contextlib.redirect_stderr(io.StringIO()):
            args, _ = get_args_parser().parse_known_args(argv)
    except SystemExit:
        return None  # a malformed flag: Hydra's own parser reports it
    if args.help or args.hydra_help or args.shell_completion or args.config_path or args.config_dir:
        return None
    if args.experimental_rerun:
        return None
    config_name = args.config_name or "config"
    parser = OverridesParser.create()
    parsed = []
    for text in args.overrides:
        try:
            parsed.append((text, parser.parse_override(text)))
        except HydraException as err:
            reason = _one_line(str(err).split("\n")[0])
            fix = "write key=value, and quote values with special characters: key='a,b'"
            return f"{text}: cannot parse it ({reason}); {fix}"
    first = [text for text, _ in parsed]  # the first value of every sweep; then each other value in turn
    others: list[tuple[int, str]] = []
    for i, (text, o) in enumerate(parsed):
        if not o.is_sweep_override():
            continue
        key = o.get_key_element()
        if not args.multirun:
            return (
                f"{text}: a comma-separated value is a sweep; add -m to sweep over it, write {key}=[a,b] for a list, "
                f"or quote it: {key}='a,b'"
            )
        try:
            values = [f"{key}={v}" for v in o.sweep_string_iterator()]
        except HydraException:  # interval() / glob(): not enumerable here, left to Hydra
            values = []
        first[i] = values[0] if values else ""
        others += [(i, v) for v in values[1:]]
    variants = [first]
    for i, v in others:
        variants.append([v if j == i else t for j, t in enumerate(first)])
    for variant in variants[:64]:
        overrides = [t for t in variant if t]
        try:
            cfg = _compose(config_name, overrides)
        except (HydraException, OmegaConfBaseException) as err:
            return _explain(err, overrides, config_name)
        try:
            check_settings(cfg)
        except ValueError as err:
            return str(err)
    return None


def main() -> None:
    import hydra
    from omegaconf import DictConfig

    @hydra.main(version_base="1.3", config_path="conf", config_name="config")
    def _run(cfg: DictConfig) -> float | None:
        from vase.run.distributed import RankFailed, current_world
        from vase.run.runner import run

        try:
            metrics = run(cfg, progress=cfg.progress)
        except (ValueError, RankFailed) as err:  # RankFailed: another rank's error, the same line on every rank
            log.error("error: %s", err)
            if cfg.get("raise_errors", False):
                raise
            sys.exit(2)
        if current_world().is_leader:
            print_summary(metrics, budget_free=_budget_free(cfg))
        return metrics.get("accuracy")

    _run()


def _budget_free(cfg) -> bool:
    """Whether the run's policy ignores the budget (the full cache: kind ``none``)."""
    from hydra.utils import get_class

    try:
        return getattr(get_class(cfg.policy._target_), "kind", None) == "none"
    except Exception:
        return False


def print_summary(metrics: dict, budget_free: bool = False) -> None:
    """The end-of-run table; a policy that ignores the budget (the full cache) shows no budget."""
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
        "cut_by_limit_rate",
        "nonfinite_samples",
        "prompt_too_long_samples",
        "rows_in_flight",
        "kv_allocated_bytes",
        "kv_held_bytes_mean",
        "kv_full_bytes_mean",
        "peak_memory_bytes",
        "decode_tokens_per_second",
        "evictions",
        "eviction_seconds",
        "attended_tokens",
        "run_dir",
    ]
    shown = dict(metrics)
    if budget_free:
        shown["budget"] = "none (the full cache keeps every token)"
    width = max(len(k) for k in keys)
    lines = ["", "=" * 60]
    for k in keys:
        v = shown.get(k)
        if v is None:
            continue
        lines.append(f"{k:<{width}}  {v:.4g}" if isinstance(v, float) else f"{k:<{width}}  {v}")
    lines.append("=" * 60)
    print("\n".join(lines), flush=True)  # the entry script's report to the user


def launch_overrides(argv: list[str]) -> list[str]:
    """The command line for this process: Hydra's output directory shared by every rank of a torchrun / srun launch
    (:func:`vase.run.distributed.hydra_overrides`); on one process ``argv`` as it is, after the one-line note a
    CPU-only local launcher owes a machine with GPUs."""
    from vase.run.distributed import hydra_overrides, launch_from_env, local_launcher_note

    if launch_from_env() is not None:
        return hydra_overrides(argv, lambda name, overrides: _compose(name, overrides))
    if "hydra/launcher=local" in argv:
        from hydra._internal.utils import get_args_parser
        from hydra.core.override_parser.overrides_parser import OverridesParser

        args, _ = get_args_parser().parse_known_args(argv)
        parser = OverridesParser.create()
        fixed = [o for o in args.overrides if not parser.parse_override(o).is_sweep_override()]
        note = local_launcher_note(_compose(args.config_name or "config", fixed))
        if note:
            print(note, file=sys.stderr)
    return argv


if __name__ == "__main__":
    error = check_group_choices(sys.argv[1:]) or check_overrides(sys.argv[1:])
    if not error:
        from vase.run.distributed import RankFailed

        try:
            sys.argv[1:] = launch_overrides(sys.argv[1:])
        except (ValueError, RankFailed) as err:
            error = str(err)
    if error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    main()
