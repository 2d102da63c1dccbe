"""What CUDA-graph capture did for each row bucket of the compiled decode step, and what a skip means for the run.

On CUDA the compiled step runs under torch's cudagraph trees (``mode="reduce-overhead"``): a graph's first call runs
it once (*warmup*), the second *records* a CUDA graph, later calls *replay* it. A graph the trees cannot capture is
*skipped*: torch logs one ``skipping cudagraphs due to <reason>`` warning on its ``cudagraphs`` artifact logger
(``torch/_inductor/cudagraph_utils.py``: ``log_cudagraph_skip_and_bump_counter``), bumps
``torch._dynamo.utils.counters["inductor"]["cudagraph_skips"]`` and runs the plain compiled function at every later
call (a launch-bound step). The skip happens at the graph's compile (inductor's post-compile checks: mutated
non-static inputs, CPU ops, ...) or at its first calls in the tree manager.

:class:`CaptureWatch` wraps every compiled forward: it reads torch's skip counter before and after, collects the
reasons logged meanwhile and, after the forward, the tree manager's state (``WARMUP``, ``RECORDING``,
``EXECUTION``), and folds them into the bucket's :class:`BucketCapture` with :func:`observe` (pure: the counters come
in as arguments, so the CPU tests feed it skips). :func:`verdict` then says what a skip means:
``generation.compile=on`` raises an error naming torch's reason; ``auto`` logs one warning line per bucket and the
bucket goes on compiled without graphs, recorded as such. The manifest, ``metrics.json`` and the smoke table carry
:meth:`CaptureWatch.report` (per bucket: compile seconds, forwards, recorded, replayed, skipped and the reason).

Torch counts no replays: they are read from the tree manager's state after each call (``EXECUTION``), so a count is
exact for a captured bucket. On the CPU nothing is captured: every forward reads as ``state=None``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import torch

logger = logging.getLogger(__name__)

#: the logger torch's skip reasons go to (``torch._logging.getArtifactLogger(cudagraph_utils, "cudagraphs")``)
SKIP_LOGGER = "torch._inductor.cudagraph_utils.__cudagraphs"
NO_REASON = "torch counted a cudagraph skip without logging a reason"


@dataclass
class BucketCapture:
    """One row bucket's compile and capture (see the module docstring).

    Attributes:
        rows: the bucket (rows the compiled step covers).
        compile_seconds: host seconds of its first forward (dynamo's trace, inductor's compile or cache load).
        forwards: compiled forwards run in the bucket.
        warmups / recorded / replayed: calls the tree manager ran as warmup, recording and replay of a CUDA graph.
        skipped: skips torch counted for the bucket's graph (0: none); reason: the first one's logged reason.
    """

    rows: int
    compile_seconds: float = 0.0
    forwards: int = 0
    warmups: int = 0
    recorded: int = 0
    replayed: int = 0
    skipped: int = 0
    reason: str | None = None


def observe(bucket: BucketCapture, skips: int, reasons: list[str], state: str | None) -> None:
    """Fold one compiled forward of ``bucket`` into its counts.

    Args:
        skips: how much torch's ``cudagraph_skips`` counter rose over the forward.
        reasons: the skip messages torch logged over the forward.
        state: the cudagraph tree manager's state after it (``"WARMUP"``, ``"RECORDING"``, ``"EXECUTION"``), or
            ``None`` where there is none (the CPU). A skipped bucket's later calls bypass the tree manager, whose
            state is then another bucket's: they are not counted.
    """
    bucket.forwards += 1
    if skips:
        bucket.skipped += skips
        if bucket.reason is None:
            bucket.reason = reasons[0] if reasons else NO_REASON
        return
    if bucket.skipped:
        return
    if state == "WARMUP":
        bucket.warmups += 1
    elif state == "RECORDING":
        bucket.recorded += 1
    elif state == "EXECUTION":
        bucket.replayed += 1


def verdict(setting: str, bucket: BucketCapture) -> str | None:
    """What a skipped bucket means: ``None`` (no skip), a warning line (``auto``: the bucket runs the compiled step
    without CUDA graphs, knowingly), or a ``RuntimeError`` naming torch's reason (``on``)."""
    if not bucket.skipped:
        return None
    what = f"CUDA graphs were not captured for the decode step's bucket of {bucket.rows} rows: {bucket.reason}"
    if setting == "on":
        raise RuntimeError(
            f"generation.compile=on: {what}; fix the cause, or run generation.compile=auto (the compiled step without "
            "CUDA graphs) or off"
        )
    return f"generation.compile={setting}: {what}; this bucket runs the compiled step without CUDA graphs"


class _Reasons(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def skip_count() -> int:
    """torch's ``counters["inductor"]["cudagraph_skips"]`` (process-wide; read as differences)."""
    from torch._dynamo.utils import counters

    return int(counters["inductor"]["cudagraph_skips"])


def tree_state(device: torch.device) -> str | None:
    """The cudagraph tree manager's state on ``device`` after the last call (``None``: not CUDA, or no manager)."""
    if device.type != "cuda":
        return None
    from torch._inductor import cudagraph_trees

    index = device.index if device.index is not None else torch.cuda.current_device()
    manager = cudagraph_trees.get_manager(index, create_if_none_exists=False)
    return None if manager is None else manager.path_state.name


class CaptureWatch:
    """Watches every compiled forward of one decoder (:meth:`forward`) and keeps its buckets' :class:`BucketCapture`.

    ``setting``: ``generation.compile`` (``on``: a skip raises; ``auto``: one warning per skipped bucket).
    """

    def __init__(self, device: torch.device, setting: str):
        self.device, self.setting = device, str(setting)
        self.buckets: dict[int, BucketCapture] = {}
        self._warned: set[int] = set()
        self._log = logging.getLogger(SKIP_LOGGER)

    @contextmanager
    def forward(self, rows: int) -> Iterator[BucketCapture]:
        """Around one compiled forward of the bucket of ``rows``: observe it, then apply :func:`verdict`."""
        bucket = self.buckets.setdefault(rows, BucketCapture(rows))
        handler = _Reasons()
        self._log.addHandler(handler)
        before = skip_count()
        try:
            yield bucket
        finally:
            self._log.removeHandler(handler)
        observe(bucket, skip_count() - before, handler.messages, tree_state(self.device))
        warning = verdict(self.setting, bucket)
        if warning is not None and rows not in self._warned:
            self._warned.add(rows)
            logger.warning(warning)

    def report(self) -> list[dict]:
        """Per bucket (ascending rows): :class:`BucketCapture` as a dict."""
        return [asdict(self.buckets[r]) for r in sorted(self.buckets)]


#: the counts of a bucket's report (summed over decoders and over ``throughput.jsonl`` lines)
NUMBERS = ("compile_seconds", "forwards", "warmups", "recorded", "replayed", "skipped")


def report_delta(now: list[dict], last: list[dict]) -> list[dict]:
    """What a report gained since ``last`` (an earlier :meth:`CaptureWatch.report` of the same decoder): the buckets
    with new forwards, their counts the differences (a ``throughput.jsonl`` line holds its stretch's)."""
    before = {b["rows"]: b for b in last}
    out = []
    for b in now:
        prev = before.get(b["rows"])
        if prev is None:
            out.append(dict(b))
        elif b["forwards"] > prev["forwards"]:
            out.append({**b, **{k: b[k] - prev[k] for k in NUMBERS}})
    return out


def merge_reports(reports: list[list[dict]]) -> list[dict]:
    """Several decoders' :meth:`CaptureWatch.report` (a ``batching=per_problem`` run builds one per problem) summed
    per bucket; the first reason of a bucket kept."""
    out: dict[int, dict] = {}
    for report in reports:
        for b in report:
            acc = out.setdefault(b["rows"], {**b, **dict.fromkeys(NUMBERS, 0), "reason": None})
            for k in NUMBERS:
                acc[k] += b[k]
            acc["reason"] = acc["reason"] or b["reason"]
    return [out[r] for r in sorted(out)]
