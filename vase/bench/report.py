"""A sweep's results: ratios against ``full`` and ``streaming``, full-length estimates, the targets, CSV, table, plot.

Rows are the dicts :meth:`vase.bench.jobs.Job.row` returns (columns: :data:`CSV_COLUMNS`).
"""

from __future__ import annotations

import csv
import json
import logging
import math
from collections.abc import Callable
from pathlib import Path

from matplotlib.figure import Figure

from vase.bench.measure import trimmed_mean

logger = logging.getLogger(__name__)

CSV_COLUMNS = [
    "model",
    "dtype",
    "device",
    "attn_backend",
    "protocol",
    "policy",
    "kind",
    "budget",
    "window",
    "batch",
    "prompt_len",
    "prompts",
    "output_len",
    "run_prompt_len",
    "run_output_len",
    "warmup",
    "repeats",
    "status",
    "decode_tok_s",
    "decode_tok_s_runs",
    "step_ms",
    "prefill_s",
    "eviction_share",
    "evictions",
    "held_tokens",
    "kv_cache_bytes",
    "kv_bytes_static",
    "kv_bytes_equal",
    "aux_bytes",
    "capacity",
    "peak_mem_bytes",
    "peak_delta_bytes",
    "peak_mem_source",
    "est_tok_s",
    "ratio_vs_full",
    "ratio_vs_streaming",
    "ratio_vs_full_paired",
    "ratio_vs_streaming_paired",
    "cpu_tok_s",
    "cpu_tok_s_runs",
    "cpu_step_ms",
    "ratio_vs_full_cpu",
    "ratio_vs_streaming_cpu",
    "load_1m",
    "wall_s",
]


def add_ratios(rows: list[dict], output_lens: list[int]) -> None:
    """``ratio_vs_full`` (same output length) and ``ratio_vs_streaming`` (same budget and output length).

    Also ``*_paired``: with the interleaved schedule, run ``i`` of every config belongs to the same round, so the
    per-round ratios are paired samples (a load drift between rounds cancels); their mean without min and max.
    ``*_cpu``: the same from CPU time (CPU runs; robust to other processes taking the cores), paired when the runs
    are. With ``--protocol steady`` the ratio against ``streaming`` compares the measured steady states (same budget,
    same held lengths: the growing phase before the first eviction is identical for both) and the ratio against
    ``full`` the estimated full-length tokens/s.
    """

    def tput(r, ref_name):
        if r is None or r.get("status") != "ok":
            return None
        steady_est = r.get("protocol") == "steady" and ref_name == "full"
        return r.get("est_tok_s") if steady_est else r.get("decode_tok_s")

    def runs(r, key):
        text = r.get(key) if r and r.get("status") == "ok" else None
        return [float(x) for x in str(text).split(";")] if text else []

    full = {r["output_len"]: r for r in rows if r["policy"] == "full"}
    stream = {(r["budget"], r["output_len"]): r for r in rows if r["policy"] == "streaming"}
    for r in rows:
        for name, ref in (
            ("full", full.get(r["output_len"])),
            ("streaming", stream.get((r["budget"], r["output_len"]))),
        ):
            v, f = tput(r, name), tput(ref, name)
            r[f"ratio_vs_{name}"] = v / f if v and f else None
            comparable = r.get("protocol") != "steady" or name == "streaming"  # same run lengths on both sides
            for key, col in (("decode_tok_s_runs", "paired"), ("cpu_tok_s_runs", "cpu")):
                a, b = runs(r, key), runs(ref, key)
                ok = comparable and len(a) == len(b) and len(a) > (1 if col == "paired" else 0)
                r[f"ratio_vs_{name}_{col}"] = trimmed_mean([x / y for x, y in zip(a, b)]) if ok else None


def add_estimates(rows: list[dict], output_lens: list[int]) -> list[dict]:
    """Steady protocol: expand eviction rows to every output length and estimate full-length tokens/s (docstring)."""
    start = next((r for r in rows if r["policy"] == "full@start" and r.get("status") == "ok"), None)
    ends = {(r["policy"], r["output_len"]): r for r in rows if r.get("kind") != "eviction" and r.get("status") == "ok"}
    out = []
    for r in rows:
        if r["policy"] == "full@start":
            out.append(r)
            continue
        for n in output_lens if r.get("kind") == "eviction" else [r["output_len"]]:
            e = dict(r, output_len=n)
            e["est_tok_s"] = _estimate(e, start, ends) if r.get("status") == "ok" else None
            out.append(e)
    return out


def _line(start: dict | None, end: dict | None) -> Callable[[float], float] | None:
    """Step latency (s) of a growing cache as a function of held tokens: linear through two probes."""
    if start is None or end is None:
        return None
    l0 = start["run_prompt_len"] + start["run_output_len"] / 2
    l1 = end["run_prompt_len"] + end["run_output_len"] / 2
    t0, t1 = start["step_ms"] / 1e3, end["step_ms"] / 1e3
    slope = (t1 - t0) / (l1 - l0) if l1 != l0 else 0.0
    return lambda length: t0 + slope * (length - l0)


def _estimate(r: dict, start: dict | None, ends: dict) -> float | None:
    """Estimated decode tokens/s of an ``n``-token output from prompt ``P`` (see the module docstring).

    Non-eviction policies: linear between the full cache's first steps (``start``) and the policy's own last steps.
    Eviction policies: the growing phase on the full cache's line, then the measured steady-state step latency.
    """
    p, batch, n = r["prompt_len"], r["batch"], r["output_len"]
    if r["kind"] != "eviction":
        line = _line(start, ends.get((r["policy"], n)))
        if line is None:
            return None
        return batch * n / ((n - 1) * (line(p) + line(p + n - 1)) / 2)
    full_end = ends.get(("full", n)) or next((ends[k] for k in sorted(ends, reverse=True) if k[0] == "full"), None)
    line = _line(start, full_end)
    if line is None:
        return None
    grow = max(0, min(n - 1, max(p, r["budget"]) + r["window"] - p))  # steps before the first eviction
    t_grow = grow * (line(p) + line(p + grow)) / 2
    t_ss = r["step_ms"] / 1e3
    return batch * n / (t_grow + (n - 1 - grow) * t_ss)


def _ratio(r: dict, ref: str) -> float | None:
    """The ratio the targets use: CPU time when measured (load-robust), else paired rounds, else trimmed means."""
    for key in (f"ratio_vs_{ref}_cpu", f"ratio_vs_{ref}_paired", f"ratio_vs_{ref}"):
        if r.get(key) is not None:
            return r[key]
    return None


def check_targets(rows: list[dict], kvpress_ratio: float | None = None) -> list[dict]:
    """The issue's targets, evaluated on the rows of one sweep (``full`` protocol, or ``est_tok_s`` when steady).

    * ``vase_attnv`` / ``vase_dkv`` tokens/s >= 0.95x ``streaming`` at equal budget (every budget and output length);
    * at output >= 8x budget every eviction policy faster than ``full``;
    * allocated KV bytes == the static size from the config, every row;
    * peak memory growth <= 2% between outputs of 4x and 16x the budget, every eviction policy (needs both lengths).
    """
    ok = [r for r in rows if r.get("status") == "ok" and "@" not in r["policy"]]
    out = []

    def timer(ref: str) -> str:
        for suffix, label in (("cpu", "paired CPU-time"), ("paired", "paired wall-clock")):
            if any(r.get(f"ratio_vs_{ref}_{suffix}") is not None for r in ok):
                return label
        return "wall-clock" if ref == "streaming" or not any(r.get("est_tok_s") for r in ok) else "estimated"

    for name in ("vase_attnv", "vase_dkv"):
        vals = [(r["budget"], r["output_len"], _ratio(r, "streaming")) for r in ok if r["policy"] == name]
        vals = [v for v in vals if v[2] is not None]
        if vals:
            worst = min(vals, key=lambda v: v[2])
            out.append(
                dict(
                    target=f"{name} >= 0.95x streaming ({timer('streaming')} ratios)",
                    met=worst[2] >= 0.95,
                    detail=f"min ratio {worst[2]:.3f} (B={worst[0]}, N={worst[1]}); all: "
                    + ", ".join(f"{v[2]:.3f}" for v in vals),
                )
            )
    long = [r for r in ok if r["kind"] == "eviction" and r["output_len"] >= 8 * r["budget"]]
    if long and not any(r["policy"] == "full" for r in ok):
        long = []  # no full-cache row in this sweep (--policies without full): the target is not evaluated
    if long:
        slow = [r for r in long if not (_ratio(r, "full") or 0) > 1]
        worst = min(long, key=lambda r: _ratio(r, "full") or 0)
        out.append(
            dict(
                target=f"output >= 8x budget: every eviction policy faster than full ({timer('full')})",
                met=not slow,
                detail=f"min ratio {_ratio(worst, 'full') or float('nan'):.3f} ({worst['policy']}, "
                f"B={worst['budget']}, N={worst['output_len']})"
                + (f"; slower: {', '.join(r['policy'] for r in slow)}" if slow else ""),
            )
        )
    bad = [r for r in ok if r.get("kv_bytes_equal") is not True]
    out.append(
        dict(
            target="allocated KV bytes == static size",
            met=not bad and bool(ok),
            detail=f"{len(ok) - len(bad)}/{len(ok)} rows equal to the byte",
        )
    )
    growth = []
    for r in ok:
        if r["kind"] != "eviction" or r["output_len"] != 16 * r["budget"]:
            continue
        base = next(
            (
                q
                for q in ok
                if q["policy"] == r["policy"] and q["budget"] == r["budget"] and q["output_len"] == 4 * r["budget"]
            ),
            None,
        )
        if base and base.get("peak_mem_bytes") and r.get("peak_mem_bytes"):
            growth.append(
                (
                    r["policy"],
                    r["peak_mem_bytes"] / base["peak_mem_bytes"] - 1,
                    (r.get("peak_delta_bytes") or 0) - (base.get("peak_delta_bytes") or 0),
                )
            )
    if growth:
        worst = max(growth, key=lambda g: g[1])
        out.append(
            dict(
                target="peak memory growth 4x -> 16x budget <= 2%",
                met=worst[1] <= 0.02,
                detail=f"max {100 * worst[1]:+.2f}% ({worst[0]}); per policy: "
                + ", ".join(f"{g[0]} {100 * g[1]:+.2f}% ({g[2] / 2**20:+.1f} MiB)" for g in growth),
            )
        )
    if kvpress_ratio is not None:
        out.append(
            dict(
                target="snapkv >= 2x kvpress DecodingPress(SnapKVPress)",
                met=kvpress_ratio >= 2,
                detail=f"ratio {kvpress_ratio:.2f}",
            )
        )
    for t in out:
        logger.info("[%s] %s: %s", "MET" if t["met"] else "NOT MET", t["target"], t["detail"])
    return out


def write_csv(rows: list[dict], path: Path) -> None:
    """The rows as CSV with the columns :data:`CSV_COLUMNS` (floats to 6 significant digits)."""
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: _fmt(r.get(k)) for k in CSV_COLUMNS})


def _fmt(v: object) -> object:
    if isinstance(v, float):
        return f"{v:.6g}"
    return "" if v is None else v


def plot(rows: list[dict], path_stem: Path) -> list[Path]:
    """Tokens/s against output length (one panel per budget) and peak memory at the longest output."""
    ok = [r for r in rows if r.get("status") == "ok"]
    budgets = sorted({r["budget"] for r in ok if r["kind"] != "none"}) or [0]
    key = "est_tok_s" if any(r.get("protocol") == "steady" for r in ok) else "decode_tok_s"
    fig = Figure(figsize=(13, 4.2 * len(budgets)))
    axes = fig.subplots(len(budgets), 2, squeeze=False)
    for i, b in enumerate(budgets):
        ax, axm = axes[i]
        sel = [r for r in ok if (r["budget"] == b or r["kind"] == "none") and "@" not in r["policy"]]
        for name in sorted({r["policy"] for r in sel}):
            pts = sorted((r["output_len"], r.get(key)) for r in sel if r["policy"] == name and r.get(key))
            if pts:
                style = "--" if name in ("full", "streaming") else "-"
                ax.plot([x for x, _ in pts], [y for _, y in pts], style, marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("output tokens")
        ax.set_ylabel("decode tokens/s" + (" (estimated)" if key == "est_tok_s" else ""))
        ax.set_title(f"budget {b}" if b else "")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
        longest = max((r["output_len"] for r in sel), default=0)
        last = sorted(
            [r for r in sel if r["output_len"] == longest and r.get("peak_mem_bytes")], key=lambda r: r["policy"]
        )
        axm.barh([r["policy"] for r in last], [r["peak_mem_bytes"] / 2**20 for r in last], color="tab:gray")
        axm.barh(
            [r["policy"] for r in last],
            [r["kv_cache_bytes"] / 2**20 for r in last],
            color="tab:blue",
            label="allocated KV",
        )
        axm.set_xlabel("MiB (gray: peak memory, blue: allocated KV)")
        axm.set_title(f"memory at {longest} output tokens")
        axm.tick_params(axis="y", labelsize=7)
    fig.tight_layout()
    paths = [path_stem.with_suffix(".png"), path_stem.with_suffix(".pdf")]
    for p in paths:
        fig.savefig(p, dpi=120)
    return paths


def _cell(v: object, spec: str, width: int) -> str:
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and not (isinstance(v, float) and math.isnan(v))
    return format(format(v, spec) if ok else "-", f">{width}")


def format_table(rows: list[dict]) -> str:
    """The human-readable table: tokens/s, ratios, eviction share, KV bytes check, peak memory."""
    steady = any(r.get("protocol") == "steady" for r in rows)
    key = "est_tok_s" if steady else "decode_tok_s"
    cols = [
        ("policy", 18),
        ("budget", 7),
        ("output", 7),
        ("est tok/s" if steady else "tok/s", 10),
        ("step ms", 9),
        ("x full", 8),
        ("x strm", 8),
        ("cpu tok/s", 10),
        ("xfull cpu", 10),
        ("xstrm cpu", 10),
        ("evict%", 8),
        ("KV MiB", 9),
        ("KV=static", 10),
        ("peak MiB", 10),
        ("dpeak MiB", 10),
    ]
    hdr = "".join(name.ljust(w) if i == 0 else name.rjust(w) for i, (name, w) in enumerate(cols)) + "  status"
    lines = [hdr, "-" * len(hdr)]
    mib = lambda v: v / 2**20 if isinstance(v, (int, float)) else None
    order = lambda r: (r["budget"] if r.get("kind") != "none" else -1, r["output_len"], r["policy"])
    for r in sorted(rows, key=order):
        share = r.get("eviction_share")
        lines.append(
            f"{r['policy']:<18}{r['budget']:>7}{r['output_len']:>7}"
            + _cell(r.get(key), ".1f", 10)
            + _cell(r.get("step_ms"), ".2f", 9)
            + _cell(r.get("ratio_vs_full"), ".2f", 8)
            + _cell(r.get("ratio_vs_streaming"), ".3f", 8)
            + _cell(r.get("cpu_tok_s"), ".1f", 10)
            + _cell(r.get("ratio_vs_full_cpu"), ".3f", 10)
            + _cell(r.get("ratio_vs_streaming_cpu"), ".3f", 10)
            + _cell(100 * share if isinstance(share, float) else None, ".1f", 8)
            + _cell(mib(r.get("kv_cache_bytes")), ".2f", 9)
            + f"{str(r.get('kv_bytes_equal', '-')):>10}"
            + _cell(mib(r.get("peak_mem_bytes")), ".1f", 10)
            + _cell(mib(r.get("peak_delta_bytes")), ".1f", 10)
            + f"  {r.get('status')}"
        )
    return "\n".join(lines)


def reanalyze(out: Path) -> list[dict]:
    """Recompute ratios, targets, CSV, table and plot from a finished sweep's ``rows.json`` (no new measurement)."""
    rows = json.loads((out / "rows.json").read_text())
    lens = sorted({r["output_len"] for r in rows})
    add_ratios(rows, lens)
    write_csv(rows, out / "bench.csv")
    (out / "rows.json").write_text(json.dumps(rows, indent=2, default=str))
    table = format_table(rows)
    logger.info("%s", table)
    (out / "table.txt").write_text(table + "\n")
    (out / "targets.json").write_text(json.dumps(check_targets(rows), indent=2))
    plot(rows, out / "bench")
    return rows
