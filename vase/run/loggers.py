"""Loggers the runner drives (``conf/logger/*.yaml``): W&B (offline by default) or none.

The run directory is the source of truth; W&B mirrors it: the resolved config, progress while decoding, the
metrics as the run summary, a table of the samples and the run directory as an artifact. The W&B run id is a
hash of the run directory and its protocol, so a resumed run continues the same W&B run (``resume="allow"``).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)


class NullLogger:
    """Logs nothing (tests, or when W&B is not wanted); accepts and ignores a logger's settings (e.g. a sweep's
    ``logger.group``), so a sweep runs with ``logger=none`` too."""

    def __init__(self, **_settings) -> None:
        pass

    def start(self, run_dir: Path, config: dict, run_id: str) -> None:
        pass

    def log_progress(self, values: dict) -> None:
        pass

    def finish(self, metrics: dict, run_dir: Path) -> None:
        pass

    def abort(self) -> None:
        pass


class WandbLogger(NullLogger):
    """Mirror a run to Weights & Biases.

    Args:
        mode: ``offline`` (default: no network; ``wandb sync <run_dir>/wandb/offline-run-*`` uploads later),
            ``online`` or ``disabled``.
        project, entity: where the run goes.
        group: W&B group (e.g. the sweep name) so a sweep's runs and its summary run sit together.
        tags: extra tags.
        log_samples: log ``samples.jsonl`` as a table (output text truncated to ``max_text`` characters).
        log_artifact: upload the run directory as an artifact.
    """

    def __init__(
        self,
        mode: str = "offline",
        project: str = "vase",
        entity: str | None = None,
        group: str | None = None,
        tags: list[str] | None = None,
        log_samples: bool = True,
        log_artifact: bool = True,
        max_text: int = 2000,
    ):
        if mode not in ("offline", "online", "disabled"):
            raise ValueError(f"logger.mode: must be offline, online or disabled, got {mode!r}")
        self.mode = os.environ.get("WANDB_MODE", mode)
        self.project, self.entity, self.group = project, entity, group
        self.tags = list(tags or [])
        self.log_samples, self.log_artifact, self.max_text = log_samples, log_artifact, max_text
        self.run = None

    def start(self, run_dir: Path, config: dict, run_id: str) -> None:
        if self.mode == "disabled":
            return
        import wandb

        name = "/".join(Path(run_dir).parts[-3:])
        self.run = wandb.init(
            project=self.project,
            entity=self.entity,
            group=self.group,
            tags=self.tags,
            name=name,
            id=run_id,
            resume="allow",
            mode=self.mode,
            dir=str(run_dir),
            config=config,
            reinit="finish_previous",
        )

    def log_progress(self, values: dict) -> None:
        if self.run is not None:
            self.run.log(values)

    def finish(self, metrics: dict, run_dir: Path) -> None:
        if self.run is None:
            return
        import wandb

        from vase.run.results import read_samples

        self.run.summary.update({k: v for k, v in metrics.items() if v is not None})
        if self.log_samples:
            rows = read_samples(Path(run_dir))  # the schema-checked lines
            cols = [
                "problem_id",
                "sample",
                "correct",
                "extracted",
                "loop_class",
                "finish_reason",
                "output_tokens",
                "output",
            ]
            table = wandb.Table(columns=cols)
            for r in rows:
                table.add_data(*[str(r.get(c))[: self.max_text] if c == "output" else r.get(c) for c in cols])
            self.run.log({"samples": table})
        if self.log_artifact:
            art = wandb.Artifact(f"run-{self.run.id}", type="run-dir")
            for name in (
                "config.yaml",
                "protocol.json",
                "manifest.json",
                "samples.jsonl",
                "throughput.jsonl",
                "metrics.json",
            ):
                if (Path(run_dir) / name).exists():
                    art.add_file(str(Path(run_dir) / name))
            self.run.log_artifact(art)
        self.run.finish()
        self.run = None

    def abort(self) -> None:
        if self.run is not None:
            self.run.finish(exit_code=1)
            self.run = None
