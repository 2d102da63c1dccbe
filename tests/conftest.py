"""Test-wide settings: never touch the network, keep torch deterministic and small."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The suite's own programs are trusted: on a root machine without namespaces, grade them in basic mode rather than
# refuse (tasks/sandbox.py); the hostile-program tests skip there, and the refusal itself is tested with this unset.
os.environ.setdefault("VASE_SANDBOX_ALLOW_ROOT_FALLBACK", "1")

import torch  # noqa: E402

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


# ---- a finished run directory, shared by the tests that try to damage one (tests/test_reliability.py) -------------
import json  # noqa: E402
import shutil  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
#: the tiny model on gsm_symbolic, 2 samples per problem, a short output cap (the finished run adds limit=3)
TINY_RUN = [
    "model=tiny",
    "task=gsm_symbolic",
    "logger=none",
    "n_samples=2",
    "budget=32",
    "window=16",
    "generation.max_length=120",
    "progress=false",
]


def compose(overrides: list[str]):
    """The config ``python run.py <overrides>`` composes."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return hydra_compose(config_name="config", overrides=overrides)


@pytest.fixture(scope="session")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished run directory (``TINY_RUN + limit=3``: 3 problems x 2 samples) under ``<tmp>/results``; copy it
    with :func:`copy_run`, never change it."""
    from vase.run.runner import run

    results = tmp_path_factory.mktemp("finished") / "results"
    metrics = run(compose([*TINY_RUN, "limit=3", f"results_dir={results}"]), progress=False)
    assert metrics["complete"] and metrics["samples"] == 6
    return Path(metrics["run_dir"])


def copy_run(finished: Path, results_dir: Path) -> Path:
    """A copy of ``finished`` where ``results_dir=<results_dir>`` with the same settings finds it (resumes it)."""
    rel = finished.relative_to(finished.parents[2])
    target = Path(results_dir) / rel
    shutil.copytree(finished, target)
    return target


def snapshot(directory: Path, skip: tuple[str, ...] = (".vase.lock",)) -> dict[str, bytes]:
    """Every file under ``directory`` and its bytes (the lock file, which holds its last holder's pid, left out)."""
    return {
        str(p.relative_to(directory)): p.read_bytes()
        for p in sorted(Path(directory).rglob("*"))
        if p.is_file() and p.name not in skip
    }


# Metrics that differ between two decode sessions of the same samples: wall-clock numbers, and the engine's sizing of
# each session (a resumed run's last session, or one rank's share, has fewer rows and a smaller KV allocation).
PER_SESSION = frozenset(
    {
        "decode_seconds",
        "decode_tokens_per_second",
        "decode_seconds_per_correct",
        "compile_seconds",
        "compile_buckets",
        "decode_tokens_per_second_after_compile",
        "eviction_seconds",
        "prefill_seconds",
        "peak_memory_bytes",
        "wall_seconds",
        "rows_in_flight",
        "rows_in_flight_mean",
        "kv_allocated_bytes",
        "kv_allocated_bytes_per_row",
        "run_dir",
    }
)


def sample_metrics(run_dir) -> dict:
    """``run_dir/metrics.json`` without the per-session numbers (:data:`PER_SESSION`): what the samples determine."""
    metrics = json.loads((Path(run_dir) / "metrics.json").read_text())
    return {k: v for k, v in metrics.items() if k not in PER_SESSION}
