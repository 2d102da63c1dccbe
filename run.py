"""vase: decode a task under a KV-cache policy and grade it.

    python run.py                                   # the embedded offline default (real 0.5B model, CPU, ~10 min)
    python run.py policy=vase_dkv ratio=4 task=aime model=qwen3_4b
    python run.py -m policy=full,snapkv,vase_attnv task=math500      # a multirun
    python run.py -m sweep=main_table hydra/launcher=slurm          # a committed sweep on SLURM
    python run.py protocol=paper task=math500 model=qwen3_4b        # the authors' protocol knob for knob
    torchrun --nproc-per-node 8 run.py -m sweep=main_table          # every cell data-parallel on 8 local GPUs

Config groups (conf/): model, task, policy, generation, protocol (default | paper: docs/protocol.md), pilot_row,
logger, sweep, hydra/launcher. Top-level keys: ratio, budget, window, seed, n_samples, limit, results_dir, run_dir,
pass_k. Results: results/<task>/<model>/<run>/. Rerunning the same command resumes it.

Before Hydra starts (so nothing is written, not even Hydra's own directory), every cell of the command line (one run,
or every job of a multirun: the product of the swept values, the sweep file's included) is composed with Hydra's
compose API and checked: first every setting (:func:`check_overrides`, :mod:`vase.run.checks`, no torch), then
everything a run checks before it writes (:func:`check_runs`, :func:`vase.run.planning.preflight`: the policy's and
the task's fields, the data, the run directory, the model's config, the device, the memory). A typo or a bad value is
one line on stderr with a did-you-mean or the fix, exit code 2. Under ``torchrun`` (or ``srun`` with several tasks)
rank 0 runs these checks and every rank prints its verdict (:func:`check_command`); each cell then runs data-parallel on
every rank (:mod:`vase.run.distributed`), and a cell that fails fails on every rank with the same line while the sweep
goes on.

Exit codes: 0 done; 2 bad input (one line, nothing written); 1 a failure while running (one line for the machine's:
disk full, permissions; a traceback for a bug), or a multirun in which a job failed (the other jobs ran; every job's
outcome is in ``<sweep dir>/sweep_summary.json``, :mod:`vase.run.sweep`); 130 interrupted (Ctrl-C), with the command
that resumes. ``raise_errors=true`` keeps Python's tracebacks for debugging.
"""

from __future__ import annotations

import difflib
import logging
import os
import shlex
import sys
from pathlib import Path

CONF = Path(__file__).resolve().parent / "conf"
GROUPS = ("model", "task", "policy", "generation", "protocol", "pilot_row", "logger", "sweep", "hydra/launcher")
#: cells of a multirun checked before it starts; a bigger sweep's other cells are checked by their jobs
MAX_CHECKED_CELLS = 1000
_checked: dict = {}  # the last command line check_overrides passed: its arguments and composed cells (check_runs)


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


def check_conf_files(argv: list[str]) -> str | None:
    """One line naming a file of ``conf/`` and its line when YAML cannot read it, or it is empty or not a mapping
    (:mod:`vase.run.conf_files`); ``None`` with another config directory (``--config-dir``: Hydra reports it)."""
    if any(a.startswith(("--config-dir", "--config-path", "-cd", "-cp")) for a in argv):
        return None
    from vase.run.conf_files import check_conf_dir

    return check_conf_dir(CONF)


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
    # only a free-form node takes new keys (model.tiny's config fields); generation and the top level are closed
    # (vase.run.checks.check_settings) and a policy's, task's or logger's fields are its dataclass's
    add = f"; to add a new key: +{override.lstrip('+~')}" if verb == "override" and key.startswith("model.") else ""
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
        except ValueError as err:  # Python's own limits while Hydra converts a value (an int of 5000 digits)
            return _unparsable_value(text, err)
    for text, o in parsed:
        if o.is_sweep_override() and not args.multirun:
            key = o.get_key_element()
            return (
                f"{text}: a comma-separated value is a sweep; add -m to sweep over it, write {key}=[a,b] for a list, "
                f"or quote it: {key}='a,b'"
            )
    cells = _cells(parsed, config_name, args.multirun)
    if isinstance(cells, str):
        return cells
    if len(cells) > MAX_CHECKED_CELLS:
        print(
            f"warning: the sweep has {len(cells)} jobs; checking the first {MAX_CHECKED_CELLS} before it starts (each "
            "other job checks its settings when it starts, and a bad one fails alone, reported in the sweep summary)",
            file=sys.stderr,
        )
    composed = []
    for cell in cells[:MAX_CHECKED_CELLS]:
        try:
            cfg = _compose(config_name, cell)
        except (HydraException, OmegaConfBaseException) as err:
            return _explain(err, cell, config_name)
        try:
            check_settings(cfg)
        except ValueError as err:
            return _in_cell(cell, cells, str(err))
        composed.append((cell, cfg))
    if not args.multirun and composed and not (args.cfg or args.info or args.resolve or args.package):
        error = _sweep_without_m(composed[0][1], [text for text, _ in parsed])
        if error:
            return error
    _checked.clear()
    _checked.update(argv=list(argv), args=args, cells=cells, composed=composed)
    return None


def _sweep_without_m(cfg, overrides: list[str]) -> str | None:
    """A ``sweep=`` preset run without ``-m``: Hydra would run one job of its defaults silently. One line, unless the
    command line sets every swept key itself (``sweep=pilot policy=snapkv``: one cell of the preset, on purpose)."""
    from omegaconf import OmegaConf

    node = cfg.hydra.sweeper.get("params") if "sweeper" in cfg.hydra else None
    params = OmegaConf.to_container(node, resolve=False) if node is not None else {}
    given = {o.split("=", 1)[0].lstrip("+~") for o in overrides}
    left = {k: v for k, v in (params or {}).items() if k not in given}
    if not left:
        return None
    preset = next((o for o in overrides if o.split("=", 1)[0] == "sweep"), "the sweep preset")
    swept = "; ".join(f"{k} over {v}" for k, v in left.items())
    one = " ".join(f"{k}={str(v).split(',')[0]}" for k, v in left.items())
    return (
        f"{preset}: a sweep preset runs its jobs only with -m (it sweeps {swept}); add -m (python run.py -m "
        f"{' '.join(overrides)}), or pick one cell: {' '.join([*overrides, one])}"
    )


def _unparsable_value(text: str, err: ValueError) -> str:
    """One line for an override whose value Python itself cannot convert (the int-str limit: 4300 digits), naming the
    setting without echoing the value."""
    key = text.split("=", 1)[0].lstrip("+~")
    value = text.split("=", 1)[1] if "=" in text else ""
    if "integer string conversion" in str(err):
        digits = sum(ch.isdigit() for ch in value)
        return (
            f"{key}: an integer of {digits} digits is out of range (at most 2**63 - 1 = 9223372036854775807); give a "
            "value that fits the setting" + (f", e.g. {key}=0" if key.endswith("seed") else "")
        )
    return f"{key}: cannot read its value ({_one_line(err)[:200]}); write key=value with a value that fits the setting"


def _cells(parsed: list, config_name: str, multirun: bool) -> list[list[str]] | str:
    """The override list of every job the command line launches: one for a run; for a multirun, the product of the
    swept values, the sweep file's ``hydra.sweeper.params`` included, as Hydra's basic sweeper makes it (an error
    string when the command line does not compose)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    texts = [text for text, _ in parsed]
    if not multirun:
        return [texts]
    plain = [text for text, o in parsed if not o.is_sweep_override()]  # the primary config: sweeps left out, as Hydra
    try:
        base = _compose(config_name, plain)
    except (HydraException, OmegaConfBaseException) as err:
        return _swept_group_key(err, parsed, config_name) or _explain(err, plain, config_name)
    params = {}
    if str(base.hydra.sweeper.get("_target_", "")).endswith("BasicSweeper"):
        node = base.hydra.sweeper.get("params")
        params = OmegaConf.to_container(node, resolve=False) if node is not None else {}
    try:
        overrides = OverridesParser.create().parse_overrides([f"{k}={v}" for k, v in params.items()] + texts)
        return [list(cell) for batch in BasicSweeper.split_arguments(overrides, None) for cell in batch]
    except HydraException:  # interval() / a sweeper of its own: not enumerable here, the first values only
        return [[t for t in texts if t in plain]]


def _swept_group_key(err: Exception, parsed: list, config_name: str) -> str | None:
    """A key of a swept group (``-m policy=quest,snapkv policy.page_size=8``): Hydra composes a multirun's command
    line with the group's default first (the sweep left out), so it refuses a key the default lacks. One line that
    names the first job whose own option lacks the key, with that option's keys; or, when every swept option has it,
    the fix Hydra takes (``++key=value``). ``None`` when the error is not about a swept group's key."""
    import re

    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    m = re.search(r"Could not override '(.+?)'", str(err))
    if not m:
        return None
    key = m.group(1)
    swept = [o for _, o in parsed if o.is_sweep_override() and _is_group(o.get_key_element())]
    groups = [o.get_key_element() for o in swept if key.startswith(o.get_key_element().replace("/", ".") + ".")]
    if not groups:
        return None
    text = next(t for t, o in parsed if o.get_key_element().lstrip("+~") == key)
    rest = [t for t, _ in parsed if t != text]
    try:
        overrides = OverridesParser.create().parse_overrides(rest)
        cells = [list(cell) for batch in BasicSweeper.split_arguments(overrides, None) for cell in batch]
    except Exception:
        return None
    for cell in cells:
        try:
            cfg = _compose(config_name, cell)
        except Exception:
            return None
        if OmegaConf.select(cfg, key, default=_MISSING) is _MISSING:
            message = _unknown_key(text, key, config_name, cell, verb="sweep")
            return _in_cell([*cell, text], [[*c, text] for c in cells], message)
    value = text.split("=", 1)[1]
    return (
        f"{text}: every swept {groups[0]} has {key}, but Hydra checks a multirun's command line against the default "
        f"{groups[0]} first, which does not; write ++{key}={value}"
    )


_MISSING = object()


def _in_cell(cell: list[str], cells: list[list[str]], message: str) -> str:
    """``message``, prefixed with the job's swept values when the command line launches several jobs."""
    if len(cells) < 2:
        return message
    swept = [o if len(o) <= 60 else o[:57] + "..." for o in cell if any(o not in other for other in cells)]
    return f"job #{cells.index(cell)} ({' '.join(swept)}): {message}"


def check_runs(argv: list[str]) -> str | None:
    """Everything each job will check before it writes (:func:`vase.run.planning.plan`), for every cell, before Hydra
    starts; and Hydra's own output directory. Run after :func:`check_overrides` passed. The device and memory checks
    are skipped for a SLURM launch (its nodes check them); a single run also checks that no other run holds its
    directory. ``None`` when every cell would start."""
    if _checked.get("argv") != list(argv):
        error = check_overrides(argv)
        if error or _checked.get("argv") != list(argv):
            return error
    args, cells = _checked["args"], _checked["cells"]
    if args.cfg or args.info or args.resolve or args.package:
        return None
    from vase.run.planning import preflight

    handler = logging.StreamHandler(sys.stderr)  # warnings of the checks, before Hydra configures logging
    handler.setFormatter(logging.Formatter("[%(asctime)s %(levelname)s %(name)s] %(message)s", "%H:%M:%S"))
    handler.setLevel(logging.WARNING)
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        for cell, cfg in _checked["composed"]:
            try:
                preflight(cfg, multirun=args.multirun)
            except ValueError as err:
                return _in_cell(cell, cells, str(err))
            except ModuleNotFoundError as err:
                from vase.run.preflight import missing_package

                return _in_cell(cell, cells, str(missing_package(err, "run")))
    finally:
        root.removeHandler(handler)
    return None


def main() -> None:
    import hydra
    from omegaconf import DictConfig

    @hydra.main(version_base="1.3", config_path="conf", config_name="config")
    def _run(cfg: DictConfig) -> float | None:
        from vase.run.sweep import run_job

        return run_job(cfg, lambda metrics: print_summary(metrics, budget_free=_budget_free(cfg)))

    _run()
    from vase.run import sweep

    if sweep.last_summary is not None and sweep.last_summary["failed"]:
        sys.exit(1)  # a multirun in which a job failed; the summary says which


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
        "grader",
        "accuracy",
        "accuracy_stderr",
        "accuracy_strict",
        "accuracy_last_boxed",
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
    (:func:`vase.run.distributed.hydra_overrides`; a submitit launcher there is refused in one line); on one process
    ``argv`` as it is, after the one-line note a CPU-only local launcher owes a machine with GPUs."""
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


def check_command(argv: list[str]) -> tuple[str | None, int]:
    """Every check before Hydra starts, and the command line Hydra gets: ``(one-line error or None, exit code)``.

    The checks (:func:`check_group_choices`, :func:`check_overrides`, :func:`check_runs`) run in one process: the one
    process, or rank 0 of a torchrun / srun launch, which hands its verdict to every rank (the process group starts
    here), so a bad cell is the same one line on every rank before any of them writes anything. Then every rank gets
    rank 0's Hydra output directory (:func:`launch_overrides`). A bug in a check keeps its traceback.
    """
    from vase.run.agreement import SAME_COMMAND, agree_on, command_settings
    from vase.run.distributed import RankFailed, current_world

    raise_errors = any(a.replace(" ", "") in ("raise_errors=true", "raise_errors=True") for a in argv)

    def first_error(check) -> str | None:
        try:
            return check()
        except Exception as err:
            if raise_errors:
                raise
            from vase.run.sweep import classify

            kind, line, _ = classify(err)
            if kind == "bug":
                raise
            return line

    try:
        world = current_world()
        agree_on(world, "the command line", command_settings(argv), SAME_COMMAND)
        cheap = lambda: check_conf_files(argv) or check_group_choices(argv) or check_overrides(argv)  # noqa: E731
        error = world.leader("checking the command line", lambda: first_error(cheap))
        if error is None:
            sys.argv[1:] = launch_overrides(argv)
            error = world.leader("checking every run", lambda: first_error(lambda: check_runs(argv)))
    except ValueError as err:  # the launcher's environment, or a submitit launcher under torchrun
        error = _one_line(err)
    except RankFailed as err:  # rank 0 failed (its traceback is in its log), or a rank was lost
        return _one_line(err), 1
    return error, 2


def _resume_hint(argv: list[str]) -> str:
    from vase.run.distributed import launch_from_env

    try:
        launch = launch_from_env()
    except ValueError:
        launch = None
    if launch is None:
        command = shlex.join(["python", "run.py", *argv])
    elif launch.source == "torchrun":
        command = shlex.join(["torchrun", "--nproc-per-node", str(launch.size), "run.py", *argv])
    else:
        command = f"srun ... python {shlex.join(['run.py', *argv])}"
    return f"interrupted: every finished sample is saved; rerun the same command to resume: {command}"


def _say(line: str) -> None:
    """``line`` on stderr in one write: the ranks of a torchrun share the stream, and a line must not interleave."""
    sys.stderr.flush()
    os.write(sys.stderr.fileno(), (line + "\n").encode("utf-8", "replace"))


def missing_environment() -> str | None:
    """One line when this Python lacks the harness's packages (``python run.py`` outside the project's virtual
    environment): which module, and how to activate it, before anything imports Hydra (a 36-line traceback)."""
    import importlib.util

    for module in ("hydra", "omegaconf", "torch", "transformers"):
        if importlib.util.find_spec(module) is None:
            venv = Path(__file__).resolve().parent / ".venv"
            made = "" if venv.is_dir() else " (make setup creates it)"
            return (
                f"this Python ({sys.executable}) has no module {module!r}: the harness's packages live in the "
                f"project's .venv{made}; activate it (source .venv/bin/activate) and rerun, or use "
                'make run ARGS="...", which needs no activation'
            )
    return None


if __name__ == "__main__":
    argv = sys.argv[1:]
    if missing := missing_environment():
        _say(f"error: {missing}")
        sys.exit(2)
    try:
        error, code = check_command(argv)
        if error:
            _say(f"error: {error}")
            from vase.run.agreement import record_for_torchrun

            record_for_torchrun(f"error: {error}")
            sys.exit(code)
        main()
    except KeyboardInterrupt:
        from vase.run.sweep import is_leader

        if is_leader():
            _say(_resume_hint(argv))
        sys.exit(130)
