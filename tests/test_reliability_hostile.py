"""Issue 29's cases and a hostile pass over the harness's features, as rows of the reliability registry.

:data:`HOSTILE_REFUSALS` (bad settings of every policy, generation, model, task and top-level setting, each refused in
one line before anything is written) are run by ``tests/test_reliability.py::test_refusals``; :data:`HOSTILE_CASES`
name the tests below: every line read back from ``samples.jsonl`` checked against one schema (a wrong type, NaN and
inf fed to every metrics and report path, the files byte for byte the same afterwards), ``metrics.json`` finite,
the report and the scripts on a foreign or unwritable tree, a 5000-digit seed, a fix hint that is accepted when
followed, and the full-disk error naming its file. The data-parallel cases are in tests/test_distributed.py.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import TINY_RUN, compose, copy_run, snapshot
from tests.reliability_registry import Case, Refusal

ROOT = Path(__file__).resolve().parents[1]
HOSTILE_AREAS = ["Policies", "Generation", "Samples read back", "Report and scripts", "Data parallel", "New settings"]
HERE = "tests/test_reliability_hostile.py"
V = "tests/test_results_validator.py"
DIST = "tests/test_distributed.py"

HOSTILE_REFUSALS = [
    Refusal(
        "seed-huge",
        "Settings",
        "an absurd integer setting (a seed of 4000 digits, `task.size=10**23`, `n_samples=10**20`): Python's "
        "own limits never reached",
        ("seed=" + "1" * 4000,),
        "seed: an integer of 4000 digits is out of range (at most 2**63 - 1 = 9223372036854775807)",
    ),
    Refusal(
        "task-size-huge",
        "Settings",
        "a task field beyond any integer (`task.size=10**23`)",
        ("task.size=99999999999999999999999",),
        "task.size: an integer of 23 digits is out of range",
    ),
    Refusal(
        "n-samples-huge",
        "Settings",
        "a sample count beyond any integer (`n_samples=10**20`)",
        ("n_samples=99999999999999999999",),
        "n_samples: an integer of 20 digits is out of range",
    ),
    Refusal(
        "policy-int-huge",
        "Policies",
        "a policy field beyond any integer (`policy.sinks=10**20`)",
        ("policy.sinks=99999999999999999999",),
        "policy.sinks: an integer of 20 digits is out of range",
    ),
    Refusal(
        "keep-prompt-hint",
        "Policies",
        "`random_keep_prompt` with a budget below prompt + window",
        ("policy=random_keep_prompt",),
        "policy.keep_prompt: a prompt of 80 tokens plus window=16 leaves -64 of budget=32 for generated "
        "tokens, random_keep_prompt needs >= 1; raise budget to >= 112 (budget=112: a multiple of the window)",
    ),
    Refusal(
        "quest-dense-layers",
        "Policies",
        "Quest's `policy.dense_layers` beyond the model's layers (`99` on a 2-layer model), checked against its config",
        ("policy=quest", "policy.dense_layers=99"),
        "policy.dense_layers: must be <= the model's num_hidden_layers = 2, got 99; e.g. policy.dense_layers=2",
    ),
    Refusal(
        "budget-multiple",
        "Policies",
        "a budget that is not a multiple of the window (`budget=40 window=16`)",
        ("budget=40",),
        "policy.budget: must be a multiple of window=16 so the eviction trigger (held % window == 0) fires; "
        "got 40 (try budget=48",
    ),
    Refusal(
        "quest-page-size",
        "Policies",
        "Quest's `policy.page_size=0`",
        ("policy=quest", "policy.page_size=0"),
        "policy.page_size: must be an integer >= 1, got 0",
    ),
    Refusal(
        "quest-group-reduce",
        "Policies",
        "Quest's `policy.group_reduce` not one of its choices",
        ("policy=quest", "policy.group_reduce=bogus"),
        "policy.group_reduce: must be one of none, max, sum, got 'bogus'",
    ),
    Refusal(
        "attnv-smooth-kernel",
        "Policies",
        "VaSE-AttnV's `policy.smooth_kernel` even (`4`)",
        ("policy.smooth_kernel=4",),
        "policy.smooth_kernel: must be an odd integer (0 or 1 = no smoothing), got 4",
    ),
    Refusal(
        "attnv-smooth-along",
        "Policies",
        "VaSE-AttnV's `policy.smooth_along` not a choice",
        ("policy.smooth_along=bogus",),
        "policy.smooth_along: must be one of storage, position, got 'bogus'",
    ),
    Refusal(
        "attnv-temperature",
        "Policies",
        "an attention temperature that overflows the logits (`policy.attn_temperature=0`)",
        ("policy.attn_temperature=0",),
        "policy.attn_temperature: must be a finite number >= 1e-6",
    ),
    Refusal(
        "attnv-temperature-nan",
        "Policies",
        "`policy.attn_temperature=nan`",
        ("policy.attn_temperature=nan",),
        "policy.attn_temperature: must be a finite number, got nan",
    ),
    Refusal(
        "dkv-rank",
        "Policies",
        "VaSE-DKV's sketch `policy.rank=0`",
        ("policy=vase_dkv", "policy.rank=0"),
        "policy.rank: must be an integer >= 1, got 0",
    ),
    Refusal(
        "sinks-negative",
        "Policies",
        "`policy.sinks=-1`",
        ("policy.sinks=-1",),
        "policy.sinks: must be an integer >= 0, got -1",
    ),
    Refusal(
        "streaming-sinks",
        "Policies",
        "StreamingLLM's sinks beyond budget - window (`policy.sinks=1000`)",
        ("policy=streaming", "policy.sinks=1000"),
        "policy.sinks: must be <= budget - window = 16, got 1000",
    ),
    Refusal(
        "keep-prompt-type",
        "Policies",
        "a boolean policy field given a word (`policy.keep_prompt=maybe`)",
        ("policy.keep_prompt=maybe",),
        "policy.keep_prompt: must be true or false, got 'maybe'",
    ),
    Refusal(
        "seer-block-size",
        "Policies",
        "SeerAttention-R's `policy.block_size=0`",
        ("policy=seer_attention_r", "policy.block_size=0"),
        "policy.block_size: must be an integer >= 1, got 0",
    ),
    Refusal(
        "snapkv-protect",
        "Policies",
        "SnapKV's protected fraction out of (0, 1) (`policy.n_protect=1.5`)",
        ("policy=snapkv", "policy.n_protect=1.5"),
        "policy.n_protect: a float is a fraction of the budget and must be in (0, 1), got 1.5",
    ),
    Refusal(
        "protect-too-many",
        "Policies",
        "more protected value slots than budget - window (`policy.n_protect=1000`)",
        ("policy.n_protect=1000",),
        "policy.n_protect: must be <= budget - window = 16, got 1000",
    ),
    Refusal(
        "rkv-lambda",
        "Policies",
        "R-KV's `policy.rkv_lambda=2`",
        ("policy=rkv", "policy.rkv_lambda=2"),
        "policy.rkv_lambda: must be in [0, 1], got 2",
    ),
    Refusal(
        "rkv-original-pool",
        "Policies",
        "the authors' R-KV `policy.pool_kernel=0`",
        ("policy=rkv_original", "policy.pool_kernel=0"),
        "policy.pool_kernel: must be an odd integer >= 1 (1 = no pooling), got 0",
    ),
    Refusal(
        "rkv-original-nan",
        "Policies",
        "the authors' R-KV `policy.similarity_threshold=nan`",
        ("policy=rkv_original", "policy.similarity_threshold=nan"),
        "policy.similarity_threshold: must be a finite number, got nan",
    ),
    Refusal(
        "value-stat",
        "Policies",
        "a value statistic that does not exist (`policy=evict_large_value policy.value_stat=bogus`)",
        ("policy=evict_large_value", "policy.value_stat=bogus"),
        "policy.value_stat: must be one of range, l2, absmax, variance, got 'bogus'",
    ),
    Refusal(
        "curdkv-leverage",
        "Policies",
        "CurDKV's `policy.leverage` not a choice",
        ("policy=curdkv_original", "policy.leverage=bogus"),
        "policy.leverage: must be one of key, value, kv_avg, kv_product, got 'bogus'",
    ),
    Refusal(
        "protocol-protect",
        "Policies",
        "the paper protocol's value slots beyond the budget (`protocol=paper protocol.n_protect=100000`)",
        ("protocol=paper", "protocol.n_protect=100000"),
        "protocol.n_protect: 100000 protected value slots (protocol 'paper', task gsm_symbolic) do not fit "
        "budget - window = 32 - 16, got 100000; raise budget (budget=100016",
    ),
    Refusal(
        "temperature",
        "Generation",
        "a negative temperature",
        ("generation.temperature=-1",),
        "generation.temperature: must be >= 0, got -1",
    ),
    Refusal(
        "temperature-nan",
        "Generation",
        "`generation.temperature=nan`",
        ("generation.temperature=nan",),
        "generation.temperature: must be a finite number >= 0, got nan",
    ),
    Refusal(
        "top-p",
        "Generation",
        "`generation.top_p=1.5`",
        ("generation.top_p=1.5",),
        "generation.top_p: must be in (0, 1], got 1.5",
    ),
    Refusal(
        "top-k",
        "Generation",
        "`generation.top_k=-1`",
        ("generation.top_k=-1",),
        "generation.top_k: must be an integer >= 0, got -1",
    ),
    Refusal(
        "max-rows",
        "Generation",
        "`generation.max_rows=0`",
        ("generation.max_rows=0",),
        "generation.max_rows: must be auto or an integer >= 1, got 0",
    ),
    Refusal(
        "batching",
        "Generation",
        "an unknown `generation.batching`",
        ("generation.batching=bogus",),
        "generation.batching: unknown choice, got 'bogus'",
    ),
    Refusal(
        "kv-memory-word",
        "Generation",
        "`generation.kv_memory=lots`",
        ("generation.kv_memory=lots",),
        "generation.kv_memory: not a size: 'lots'",
    ),
    Refusal(
        "grade-workers",
        "Generation",
        "`generation.grade_workers=-3`",
        ("generation.grade_workers=-3",),
        "generation.grade_workers: must be auto or an integer >= 0, got -3",
    ),
    Refusal(
        "max-length-zero",
        "Generation",
        "`generation.max_length=0`",
        ("generation.max_length=0",),
        "generation.max_length: must be an integer >= 1 or null (task.max_length), got 0",
    ),
    Refusal(
        "stop-on-loop",
        "Generation",
        "`generation.stop_on_loop=maybe`",
        ("generation.stop_on_loop=maybe",),
        "generation.stop_on_loop: must be true or false, got 'maybe'",
    ),
    Refusal(
        "greedy",
        "Generation",
        "`generation.greedy=maybe`",
        ("generation.greedy=maybe",),
        "generation.greedy: must be true or false, got 'maybe'",
    ),
    Refusal("window-zero", "Settings", "`window=0`", ("window=0",), "window: must be an integer >= 1, got 0"),
    Refusal(
        "budget-window",
        "Settings",
        "a budget not above the window (`budget=16 window=16`)",
        ("budget=16",),
        "budget: must be an integer > window=16 or null (from ratio), got 16",
    ),
    Refusal(
        "ratio-inf", "Settings", "`ratio=inf` (or `nan`)", ("ratio=inf",), "ratio: must be a finite number > 0, got inf"
    ),
    Refusal(
        "limit-negative",
        "Settings",
        "`limit=-1`",
        ("limit=-1",),
        "limit: must be an integer >= 0 or null (the task's default), got -1",
    ),
    Refusal(
        "n-samples-zero",
        "Settings",
        "`n_samples=0`",
        ("n_samples=0",),
        "n_samples: must be an integer >= 1 or null (the task's protocol), got 0",
    ),
    Refusal("pass-k", "Settings", "`pass_k=[0]`", ("pass_k=[0]",), "pass_k: entries must be integers >= 1, got 0"),
    Refusal(
        "record-kept",
        "Settings",
        "`record_kept=maybe`",
        ("record_kept=maybe",),
        "record_kept: must be true or false, got 'maybe'",
    ),
    Refusal(
        "dtype",
        "Model and memory",
        "an unknown `model.dtype` (`float8`)",
        ("model.dtype=float8",),
        "model.dtype: unknown choice, got 'float8'; did you mean model.dtype=float32?",
    ),
    Refusal(
        "device-word",
        "Model and memory",
        "`model.device=tpu`",
        ("model.device=tpu",),
        "model.device: must be auto, cpu, cuda or cuda:<index>, got 'tpu'",
    ),
    Refusal(
        "thinking",
        "Model and memory",
        "`model.thinking=maybe`",
        ("model.thinking=maybe",),
        "model.thinking: must be true or false, got 'maybe'",
    ),
    Refusal(
        "shard",
        "Data",
        "a shard index beyond the shards (`task.shard=3 task.num_shards=2`)",
        ("task.shard=3", "task.num_shards=2"),
        "task.shard: must be in [0, task.num_shards=2), got 3",
    ),
    Refusal(
        "problem-ids",
        "Data",
        "`task.problem_ids` naming a problem the task does not have",
        ("task.problem_ids=[nope]",),
        "task.problem_ids: no problem 'nope' in task gsm_symbolic",
    ),
    Refusal(
        "timeout-negative",
        "Sandbox",
        "`task.timeout_s=-1`",
        ("task=humaneval", "task.timeout_s=-1"),
        "task.timeout_s: must be a finite number of seconds > 0",
    ),
    Refusal(
        "run-dir-file",
        "Run directory",
        "`run_dir=` a file, not a directory",
        ("run_dir={data}/math500.jsonl",),
        "run_dir: {data}/math500.jsonl is not a directory; point run_dir at a new or empty directory",
    ),
]


def _h(name: str, file: str = HERE) -> str:
    return f"{file}::{name}"


#: refusals of the settings new in this release (h2o, keydiff, triattention, generation.compile,
#: generation.check_policy_output, model.reference_tokens, the paper protocol's knobs); area "New settings"
RELEASE_REFUSALS = [
    Refusal(
        "h2o-recent-ratio-high",
        "New settings",
        "`policy=h2o` with a recent share above 1 (`policy.recent_ratio=1.5`)",
        ("policy=h2o", "policy.recent_ratio=1.5"),
        "policy.recent_ratio: must be in [0, 1], got 1.5",
    ),
    Refusal(
        "h2o-recent-ratio-negative",
        "New settings",
        "`policy=h2o` with a negative recent share",
        ("policy=h2o", "policy.recent_ratio=-0.1"),
        "policy.recent_ratio: must be in [0, 1], got -0.1",
    ),
    Refusal(
        "h2o-evict-every-zero",
        "New settings",
        "`policy=h2o policy.evict_every=0` (the schedule field, now in every eviction YAML)",
        ("policy=h2o", "policy.evict_every=0"),
        "policy.evict_every: must be an integer >= 1 or null (= window), got 0",
    ),
    Refusal(
        "h2o-budget-multiple",
        "New settings",
        "`policy=h2o` with a budget that is not a multiple of the window: the hint is the next multiple up",
        ("policy=h2o", "budget=24"),
        "policy.budget: must be a multiple of window=16 so the eviction trigger (held % window == 0) fires; "
        "got 24 (try budget=32",
    ),
    Refusal(
        "keydiff-sinks-negative",
        "New settings",
        "`policy=keydiff policy.sinks=-1`",
        ("policy=keydiff", "policy.sinks=-1"),
        "policy.sinks: must be an integer >= 0, got -1",
    ),
    Refusal(
        "keydiff-keep-prompt-int",
        "New settings",
        "`policy=keydiff policy.keep_prompt=1` (an integer where a boolean belongs)",
        ("policy=keydiff", "policy.keep_prompt=1"),
        "policy.keep_prompt: must be true or false, got 1",
    ),
    Refusal(
        "tri-aggregation",
        "New settings",
        "`policy=triattention` with an unknown offset aggregation (`median`)",
        ("policy=triattention", "policy.score_aggregation=median"),
        "policy.score_aggregation: must be one of mean, max, got 'median'",
    ),
    Refusal(
        "tri-group-reduce",
        "New settings",
        "`policy=triattention` with an unknown group reduction (`sum`)",
        ("policy=triattention", "policy.group_reduce=sum"),
        "policy.group_reduce: must be one of max, mean, got 'sum'",
    ),
    Refusal(
        "tri-offsets",
        "New settings",
        "`policy=triattention policy.offset_max_length=0` (no future offset to score)",
        ("policy=triattention", "policy.offset_max_length=0"),
        "policy.offset_max_length: must be an integer >= 1, got 0",
    ),
    Refusal(
        "tri-calibration-tokens",
        "New settings",
        "`policy=triattention policy.calibration_tokens=0` (nothing to calibrate on)",
        ("policy=triattention", "policy.calibration_tokens=0"),
        "policy.calibration_tokens: must be an integer >= 2, got 0",
    ),
    Refusal(
        "tri-calibration-text",
        "New settings",
        "`policy=triattention` with a calibration text that does not exist, refused before weights load",
        ("policy=triattention", "policy.calibration_text={tmp}/missing.txt"),
        "policy.calibration_text: no such file '{tmp}/missing.txt'",
    ),
    Refusal(
        "tri-trig-bool",
        "New settings",
        "`policy=triattention policy.trig=maybe`",
        ("policy=triattention", "policy.trig=maybe"),
        "policy.trig: must be true or false, got 'maybe'",
    ),
    Refusal(
        "compile-choice",
        "New settings",
        "`generation.compile=maybe` (not auto, on or off)",
        ("generation.compile=maybe",),
        "generation.compile: unknown choice, got 'maybe'; choose one of auto, on, off",
    ),
    Refusal(
        "compile-case",
        "New settings",
        "`generation.compile=ON` (choices are lower case; YAML's bare on / off mean true / false, accepted)",
        ("generation.compile=ON",),
        "generation.compile: unknown choice, got 'ON'; choose one of auto, on, off",
    ),
    Refusal(
        "check-output-int",
        "New settings",
        "`generation.check_policy_output=2` (an integer where a boolean belongs)",
        ("generation.check_policy_output=2",),
        "generation.check_policy_output: must be true or false, got 2",
    ),
    Refusal(
        "reference-tokens-negative",
        "New settings",
        "`model.reference_tokens=-5`",
        ("model.reference_tokens=-5",),
        "model.reference_tokens: must be a positive number of tokens or null, got -5",
    ),
    Refusal(
        "reference-tokens-text",
        "New settings",
        "`model.reference_tokens=abc`",
        ("model.reference_tokens=abc",),
        "model.reference_tokens: must be an integer or null, got 'abc'",
    ),
    Refusal(
        "protocol-equivalence",
        "New settings",
        "`protocol.equivalence=foo` (not math_verify or authors)",
        ("protocol.equivalence=foo",),
        "protocol.equivalence: unknown choice, got 'foo'; choose one of math_verify, authors",
    ),
    Refusal(
        "protocol-extraction",
        "New settings",
        "`protocol.code_extraction=foo` (not harness or authors)",
        ("protocol.code_extraction=foo",),
        "protocol.code_extraction: unknown choice, got 'foo'; choose one of harness, authors",
    ),
    Refusal(
        "protocol-authors-data-bool",
        "New settings",
        "`protocol.require_authors_data=perhaps`",
        ("protocol.require_authors_data=perhaps",),
        "protocol.require_authors_data: must be true or false, got 'perhaps'",
    ),
]
HOSTILE_REFUSALS += RELEASE_REFUSALS

HOSTILE_CASES = [
    Case(
        "Samples read back",
        'a `samples.jsonl` line whose field has the wrong type (`"correct": "false"`, a count as a string, a '
        "float index), read back by a resume, the metrics, a merge or the report",
        "`error: <file>: line 2: field correct must be true or false (a JSON boolean), got 'false' (a JSON string); "
        "fix or delete that line ...`; nothing counted, nothing written",
        "2",
        _h("test_a_bad_sample_line_is_one_line_on_every_path_and_changes_nothing"),
    ),
    Case(
        "Samples read back",
        "a `NaN` / `Infinity` / `-Infinity` anywhere in a sample line (a count, a ratio, `meta`)",
        "`error: <file>: line 2: field compression_ratio is not a finite number (NaN or infinity is an error, never "
        "data); ...`; nothing counted, nothing written",
        "2",
        _h("test_a_bad_sample_line_is_one_line_on_every_path_and_changes_nothing"),
    ),
    Case(
        "Samples read back",
        "a sample line without a field the metrics read (`finish_reason`, `output_tokens`...)",
        "`error: <file>: line 2 is not a sample the metrics read (an object without finish_reason; ...)`",
        "2",
        _h("test_a_bad_sample_line_is_one_line_on_every_path_and_changes_nothing"),
    ),
    Case(
        "Samples read back",
        "a bad line in a rank's part file (`ranks/rank1.samples.jsonl`) with a torn last line elsewhere",
        "the one-line error names the part file; no file is repaired (cut) before every file passed",
        "2",
        _h("test_a_bad_part_file_line_is_found_before_any_file_is_repaired"),
    ),
    Case(
        "Numerics",
        "a non-finite number reaching `metrics.json` (or any JSON the run writes)",
        "`error: <file>: not written, <key> is not a finite number ...`; the file is left as it was (never a bare "
        "`NaN`)",
        "1",
        _h("test_metrics_json_can_never_hold_a_non_finite_number"),
    ),
    Case(
        "While running",
        "a write or fsync that fails without a file name (a real full disk: `ENOSPC` from `fsync`, `/dev/full`)",
        "`error: <the file it could not write>: No space left on device; fix the disk or permissions, then rerun ...`",
        "1",
        _h("test_the_full_disk_error_names_the_file_the_os_did_not"),
    ),
    Case(
        "Command line",
        "a 5000-digit seed (beyond Python's int-str limit, also under torchrun)",
        "`error: seed: an integer of 5000 digits is out of range (at most 2**63 - 1 = ...); give a value that fits "
        "the setting, e.g. seed=0`; nothing written",
        "2",
        _h("test_a_5000_digit_seed_is_one_line_naming_the_setting"),
    ),
    Case(
        "Sweeps",
        "a sweep cell with an absurd integer (`-m seed=0,<4000 digits>`)",
        "`error: job #1 (seed=111...): seed: an integer of 4000 digits is out of range ...`; the value shortened, "
        "no job starts",
        "2",
        _h("test_a_5000_digit_seed_is_one_line_naming_the_setting"),
    ),
    Case(
        "Settings",
        "a refusal that offers a value (`try budget=48`, `raise budget to >= 112 (budget=112 ...)`, "
        "`e.g. ratio=4`, `did you mean model.dtype=float32`)",
        "following it gives a command that is accepted: every hint is computed from all the constraints at once",
        "0",
        _h("test_every_refusal_that_offers_a_value_is_accepted_with_it"),
    ),
    Case(
        "Report and scripts",
        "`scripts/report.py` on a tree holding a foreign run-like directory (a `metrics.json` of another tool)",
        "one warning line `skipping <dir>: not a vase run (...)`; the report of the vase runs is written",
        "0",
        _h("test_the_report_skips_a_foreign_directory_with_one_warning"),
    ),
    Case(
        "Report and scripts",
        "`scripts/report.py` on a tree with no vase run, a missing directory, or a damaged sample line",
        "`error: results_dir: no runs (metrics.json or samples.jsonl) under <dir>` / `...: line 2: field ...`; "
        "nothing written",
        "2",
        _h("test_every_results_script_fails_in_one_line_on_a_foreign_or_missing_tree"),
    ),
    Case(
        "Report and scripts",
        "`scripts/report.py` with a read-only results directory (the report's default output inside it)",
        "`error: --out: <dir>/report cannot be created (<dir> is not writable); give --out a directory you can "
        "write ...`",
        "2",
        _h("test_the_report_into_a_read_only_directory_is_one_line"),
    ),
    Case(
        "Report and scripts",
        "any script of `scripts/` meeting a file it cannot read or write (`OSError`)",
        "`error: <file>: <reason>; check the path, its permissions and the disk, then rerun` (exit 1), never a "
        "traceback",
        "-",
        _h("test_every_script_ends_in_one_line_for_bad_input_and_unwritable_files"),
    ),
    Case(
        "Shards",
        "`merge_shards.py` with a damaged sample line in a shard",
        "`error: <shard>/samples.jsonl: line 2: field ...` (exit 2); the target is not created or changed",
        "-",
        _h("test_a_bad_sample_line_is_one_line_on_every_path_and_changes_nothing"),
    ),
    Case(
        "Data parallel",
        "ranks started by hand or by `srun` with different settings (`seed=0` on rank 0, `seed=1` on rank 1)",
        "every rank: `error: the ranks disagree on the command line: seed is '0' on rank 0 but '1' on rank 1; start "
        "every rank with the same command line ...`; nothing written",
        "2",
        _h("test_ranks_started_with_different_settings_stop_together_before_writing", DIST),
    ),
    Case(
        "Data parallel",
        "ranks whose resolved settings differ (the same command, another config or environment)",
        "every rank: `the ranks disagree on the settings: generation.temperature is 1.0 on rank 0 but 0.5 on rank 1; "
        "...`, before anything is written",
        "2",
        _h("test_ranks_whose_resolved_settings_differ_raise_the_same_line", DIST),
    ),
    Case(
        "Data parallel",
        "a world of 2 started with one rank (rank 0 alone, or rank 1 without rank 0)",
        "after `VASE_DIST_TIMEOUT_S` (default 1800 s): `error: rank 0: only 1 of 2 ranks joined within 2 s "
        "(VASE_DIST_TIMEOUT_S); ...` / `rank 1: could not reach rank 0 at <addr> within ...`",
        "1",
        _h("test_a_missing_rank_is_one_line_after_the_bounded_wait", DIST),
    ),
    Case(
        "Data parallel",
        "a bad setting under torchrun",
        "each rank's one line; torchrun's own failure summary shows that line as the rank's `traceback` (its error "
        "file), around torchrun's `ChildFailedError` traceback (README)",
        "2",
        _h("test_under_torchrun_the_summary_shows_the_one_line", DIST),
    ),
    # issue 40: the results-tree validator (vase/run/validate.py), tests/test_results_validator.py
    Case(
        "Samples read back",
        "two different lines for the same (problem, sample) in `samples.jsonl` (or in it and a rank's part)",
        "`error: <file>: line 7: sample 0 of problem '...' again, with other content than <file>: line 1 ...; delete "
        "the wrong line ...`; the same line twice counts once",
        "2",
        _h("test_issue_1_two_different_lines_for_one_sample_are_refused", V),
    ),
    Case(
        "Samples read back",
        "a line for a sample beyond `n_samples` (sample 9 of 2), on a resume, the metrics, a merge or the report",
        "`error: <file>: line 7: sample 9 of problem '...' is beyond the run's n_samples=2 (protocol.json: samples 0 "
        "to 1); delete that line ...`",
        "2",
        _h("test_issue_2_a_sample_beyond_n_samples_is_refused", V),
    ),
    Case(
        "Samples read back",
        "a line for a problem the task does not have, on a resume (a problem past this `limit` is the task's)",
        "`error: <file>: line 7: problem 'not-a-problem' is not a problem of task gsm_symbolic (...); delete that "
        "line, or resume with the task it was written for ...`",
        "2",
        _h("test_issue_2_a_problem_the_task_does_not_have_is_refused_by_the_resume", V),
    ),
    Case(
        "Samples read back",
        "a count out of its range (`output_tokens: 10**30`, a negative count, bytes past 1 PiB, a ratio <= 0, an "
        "unknown `finish_reason`): 40+ damaged lines in a table",
        "`error: <file>: line 2: field output_tokens must be an integer >= 0 and <= 1,000,000,000, got ...`",
        "2",
        _h("test_a_damaged_line_is_one_line_naming_the_file_and_the_line", V),
    ),
    Case(
        "Samples read back",
        "`kv_held_bytes_end_by_type` as a list",
        "`error: <file>: line 4: field kv_held_bytes_end_by_type must be an object of layer type -> bytes ...`",
        "2",
        _h("test_by_type_as_a_list_is_one_line", V),
    ),
    Case(
        "Samples read back",
        "a line nested 100,000 arrays deep (samples, throughput, a part file; `protocol.json`)",
        "`error: <file>: line 7 is not a line vase writes (arrays or objects nested more than 32 deep ...)`; a "
        "`metrics.json` nested so is ignored with a warning and recomputed",
        "2",
        _h("test_a_line_nested_100000_deep_is_one_line_everywhere", V),
    ),
    Case(
        "Samples read back",
        "a resumed run of an older release: a field only the new lines carry (`kv_retained_bytes_mean`)",
        "the metrics and the report show it missing (`null`, `fields_missing`: absent from 3 of 6 samples ...), "
        "never a mean over the new lines",
        "0",
        _h("test_issue_4_a_field_only_the_newer_lines_carry_is_never_averaged_over_a_subset", V),
    ),
    Case(
        "Report and scripts",
        "a results tree holding one run of an older layout (lines without `kv_held_bytes_end`)",
        "the other runs are reported; one warning `skipping <dir>: written by an older release of vase (...); rerun "
        "it into a new directory (python run.py --config-path <dir> --config-name config run_dir=<dir>-rerun) ...`",
        "0",
        _h("test_an_older_run_in_a_tree_is_named_with_a_fix_and_the_others_are_reported", V),
    ),
    Case(
        "Report and scripts",
        "a `throughput.jsonl` line out of range (negative seconds, a count as a string) or a `metrics.json` rate "
        "outside [0, 1]",
        "`error: <file>: line 1: field decode_seconds must be a finite number >= 0 ...`; the `metrics.json` is "
        "ignored with a warning and the run recomputed from its samples",
        "2",
        _h("test_a_damaged_throughput_line_is_one_line", V),
    ),
]


# --------------------------------------------------------------------------------------------------------------------
# every line read back from samples.jsonl: one schema, on every path

#: (field, the raw JSON text put in its place (None: the field removed), what the one line says of it)
BAD_FIELDS = [
    ("correct", '"false"', "field correct must be true or false"),
    ("correct", "1", "field correct must be true or false"),
    ("sample", '"0"', "field sample must be an integer >= 0"),
    ("sample", "0.5", "field sample must be an integer >= 0"),
    ("problem_id", "7", "field problem_id must be a string"),
    ("finish_reason", "null", "field finish_reason must be one of eos, stop, length, loop"),
    ("loop_class", "3", "field loop_class must be one of loop, garbage, truncated, ok"),
    ("extracted", "[1]", "field extracted must be a string, a number or null"),
    ("output_tokens", '"12"', "field output_tokens must be an integer >= 0"),
    ("output_tokens", "-1", "field output_tokens must be an integer >= 0"),
    ("output_tokens", "NaN", "field output_tokens is not a finite number"),
    ("output_tokens", "Infinity", "field output_tokens is not a finite number"),
    ("compression_ratio", '"2.0"', "field compression_ratio must be a finite number > 0"),
    ("compression_ratio", "NaN", "field compression_ratio is not a finite number"),
    ("compression_ratio", "-Infinity", "field compression_ratio is not a finite number"),
    ("kv_held_bytes_end", "1e999", "field kv_held_bytes_end is not a finite number"),
    ("kv_full_bytes_end", "true", "field kv_full_bytes_end must be an integer >= 0"),
    ("cut_by_limit", '"false"', "field cut_by_limit must be true or false"),
    ("cut_in_thinking", "0", "field cut_in_thinking must be true or false"),
    ("held_tokens_mean", "NaN", "field held_tokens_mean is not a finite number"),
    ("eviction_seconds", "Infinity", "field eviction_seconds is not a finite number"),
    ("evictions", "1.5", "field evictions must be an integer >= 0"),
    ("attended_tokens", '"x"', "field attended_tokens must be a finite number >= 0 and <= 1,000,000,000 or null"),
    ("meta.year", "NaN", "field meta.year is not a finite number"),
    ("finish_reason", None, "is not a sample the metrics read (an object without finish_reason"),
]


def _spoil(path: Path, lineno: int, field: str, raw: str | None) -> None:
    """Line ``lineno`` of ``path`` with ``field`` (``a.b``: inside ``a``) replaced by the JSON text ``raw``."""
    lines = path.read_text().splitlines(keepends=True)
    row = json.loads(lines[lineno - 1])
    node, key = (row.setdefault(field.split(".")[0], {}), field.split(".")[1]) if "." in field else (row, field)
    if raw is None:
        del node[key]
    else:
        node[key] = "@BAD@"
    lines[lineno - 1] = json.dumps(row).replace('"@BAD@"', raw or "") + "\n"
    path.write_text("".join(lines))


def _one_error(text: str) -> str:
    lines = [x for x in text.splitlines() if x.strip() and "WARNING" not in x]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in text, text[-2000:]
    return lines[0][len("error: ") :]


@pytest.mark.parametrize("field, raw, says", BAD_FIELDS, ids=[f"{f}={r}" for f, r, _ in BAD_FIELDS])
def test_a_bad_sample_line_is_one_line_on_every_path_and_changes_nothing(
    finished_run, tmp_path, capsys, field, raw, says
):
    """A resume, the metrics, the report (script and library), a shard merge and the benchmark reader: each stops at
    the line with the same one line naming the file, the line and the field; no file anywhere changed."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import report as report_script
    from merge_shards import merge

    from vase.analysis.load import load_tree
    from vase.bench.runs import read_run
    from vase.run.records import compute_metrics
    from vase.run.runner import run

    results = tmp_path / "results"
    run_dir = copy_run(finished_run, results)
    _spoil(run_dir / "samples.jsonl", 2, field, raw)
    shard = tmp_path / "shards" / "r-shard0of1"
    shutil.copytree(run_dir, shard)
    before = snapshot(tmp_path)
    expected = f"{run_dir / 'samples.jsonl'}: line 2{':' if 'field' in says else ''} {says}"

    def refused(call) -> str:
        with pytest.raises(ValueError) as err:
            call()
        assert "\n" not in str(err.value)
        return str(err.value)

    assert refused(lambda: run(compose([*TINY_RUN, "limit=3", f"results_dir={results}"]), progress=False)).startswith(
        expected
    )
    assert refused(lambda: compute_metrics(run_dir, ["x"], 2, {}, [1])).startswith(expected)
    assert refused(lambda: load_tree(results)).startswith(expected)
    assert refused(lambda: read_run(results)).startswith(expected)
    assert refused(lambda: merge(tmp_path / "shards" / "r")).startswith(f"{shard / 'samples.jsonl'}: line 2")
    capsys.readouterr()
    assert report_script.main([str(results), "--wandb", "disabled", "--formats", "png", "-q"]) == 2
    assert _one_error(capsys.readouterr().err).startswith(expected)
    assert snapshot(tmp_path) == before  # byte for byte: nothing rewritten, repaired or created


def test_a_bad_part_file_line_is_found_before_any_file_is_repaired(finished_run, tmp_path):
    """A torn last line in ``samples.jsonl`` and a bad line in a rank's part file: the resume names the part file and
    cuts nothing (every file is checked before any is repaired)."""
    from vase.run.results import part_path, read_samples

    run_dir = copy_run(finished_run, tmp_path / "results")
    rows = (run_dir / "samples.jsonl").read_text().splitlines(keepends=True)
    part = part_path(run_dir, 1, "samples.jsonl")
    part.parent.mkdir()
    part.write_text(
        rows[0].replace('"correct": false', '"correct": "no"').replace('"correct": true', '"correct": "no"')
    )
    with open(run_dir / "samples.jsonl", "a") as f:
        f.write('{"problem_id": "torn')
    before = snapshot(run_dir)
    with pytest.raises(ValueError, match=r"rank1\.samples\.jsonl: line 1: field correct must be true or false"):
        read_samples(run_dir, repair=True)
    assert snapshot(run_dir) == before


def test_metrics_json_can_never_hold_a_non_finite_number(tmp_path):
    from vase.run.results import write_json

    path = tmp_path / "metrics.json"
    write_json(path, {"accuracy": 0.5})
    before = path.read_bytes()
    for bad in (math.nan, math.inf, -math.inf):
        with pytest.raises(ValueError) as err:
            write_json(path, {"accuracy": 0.5, "by": {"year": [1.0, bad]}})
        msg = str(err.value)
        assert msg.startswith(f"{path}: not written, by.year[1] is not a finite number") and "\n" not in msg
        assert path.read_bytes() == before and not path.with_suffix(".json.tmp").exists()
    json.loads(before, parse_constant=lambda c: pytest.fail(f"{c} in metrics.json"))


def test_the_full_disk_error_names_the_file_the_os_did_not(tmp_path, monkeypatch):
    """``fsync`` and ``write`` report ENOSPC without a file name; the one line still names the file."""
    import errno

    from vase.run import results
    from vase.run.sweep import classify

    def full(_fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    path = tmp_path / "samples.jsonl"
    monkeypatch.setattr(results.os, "fsync", full)
    with pytest.raises(OSError) as err:
        results.append_jsonl(path, [{"a": 1}])
    kind, line, code = classify(err.value)
    assert (kind, code) == ("machine", 1) and line.startswith(f"{path}: No space left on device; fix the disk")
    monkeypatch.undo()
    if Path("/dev/full").exists():  # the real thing: the kernel's always-full device
        with pytest.raises(OSError) as err:
            results.append_jsonl(Path("/dev/full"), [{"a": 1}])
        assert classify(err.value)[1].startswith("/dev/full: No space left on device; ")


# --------------------------------------------------------------------------------------------------------------------
# the command line: absurd integers


def _run_py(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "disabled", **(env or {})}
    return subprocess.run(
        [sys.executable, "run.py", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )


def test_a_5000_digit_seed_is_one_line_naming_the_setting(tmp_path):
    results = tmp_path / "results"
    r = _run_py(*TINY_RUN, f"results_dir={results}", "seed=" + "1" * 5000)
    assert r.returncode == 2
    line = _one_error(r.stderr)
    assert line.startswith("seed: an integer of 5000 digits is out of range") and line.endswith("e.g. seed=0")
    assert len(line) < 300 and not results.exists()
    r = _run_py("-m", *TINY_RUN, f"results_dir={results}", "seed=0," + "1" * 4000)
    assert r.returncode == 2
    line = _one_error(r.stderr)
    assert line.startswith("job #1 (seed=1111") and "seed: an integer of 4000 digits is out of range" in line
    assert len(line) < 400 and not results.exists()


# --------------------------------------------------------------------------------------------------------------------
# fix hints: following one gives a command that is accepted

_HINT = re.compile(
    r"(?:\be\.g\.|\btry|\bdid you mean|\(|\bset|\bor|\bsuch as)\s*(\+{0,2}[a-z_][\w.]*=(?:\[[^\]]*\]|[^\s;:,()?<>]+))"
)


@pytest.mark.slow
def test_every_refusal_that_offers_a_value_is_accepted_with_it(tmp_path, monkeypatch):
    """For every refusal of the registry whose line offers a value (``key=value`` in its fix), the same command with
    that value passes every check of that setting (it reaches the weights): it is never refused again for the setting
    it fixed (``budget=140`` -> "not a multiple of the window"), only, at most, for another setting the original
    command also got wrong."""
    from tests.test_reliability import REFUSALS
    from vase.models import ModelSpec
    from vase.run.runner import run

    class Accepted(Exception):
        """Every check passed: the weights would load now."""

    def accepted(*_args, **_kwargs):
        raise Accepted

    monkeypatch.setattr(ModelSpec, "load", accepted)
    data = tmp_path / "data"
    data.mkdir()
    shutil.copytree(ROOT / "conf", tmp_path / "conf")  # as test_refusals: run_dir={tmp}/conf is a foreign directory
    tried = []
    for case in REFUSALS:
        (data / "math500.jsonl").write_bytes(case.data)
        overrides = [*TINY_RUN, "limit=1", f"results_dir={tmp_path / case.id}"]
        overrides += [o.format(tmp=tmp_path, data=data) for o in case.overrides]
        try:
            run(compose(overrides), progress=False)
        except ValueError as err:
            message = str(err)
        except Accepted:
            pytest.fail(f"{case.id}: not refused")
        fix = message.split("; ", 1)[1] if "; " in message else message
        hints = [h for h in _HINT.findall(fix) if "<" not in h]
        if not hints:
            continue
        key, value = hints[0].lstrip("+").split("=", 1)
        kept = [o for o in overrides if o.lstrip("+").split("=", 1)[0] != key]
        try:
            run(compose([*kept, f"{key}={value}"]), progress=False)
        except Accepted:
            pass
        except ValueError as again:  # another setting of the original command may be wrong too; never this one
            setting = message.split(":", 1)[0]
            assert not str(again).startswith((f"{setting}:", f"{key}:", f"policy.{key}:")), (
                f"{case.id}: followed the hint {key}={value} of {message!r}; refused again: {again}"
            )
        tried.append(case.id)
    assert {"keep-prompt-hint", "budget-multiple", "quest-dense-layers", "dtype", "setting"} <= set(tried), tried


# --------------------------------------------------------------------------------------------------------------------
# the report and the scripts on trees that are not (only) vase runs


def _foreign(root: Path) -> Path:
    """A run-like directory of another tool: a ``metrics.json`` without policy, task or model."""
    other = root / "other-tool" / "x"
    other.mkdir(parents=True)
    (other / "metrics.json").write_text('{"accuracy": 0.5}\n')
    return other


def test_the_report_skips_a_foreign_directory_with_one_warning(finished_run, tmp_path, caplog):
    from vase.analysis.report import build_report

    results = tmp_path / "results"
    copy_run(finished_run, results)
    other = _foreign(results)
    with caplog.at_level(logging.WARNING):
        report = build_report(results, tmp_path / "out", formats=["png"])
    warned = [r.getMessage() for r in caplog.records if str(other) in r.getMessage()]
    assert len(warned) == 1 and warned[0].startswith(f"skipping {other}: not a vase run (")
    assert len(report.summary) == 1 and (tmp_path / "out" / "report.md").is_file()


def test_every_results_script_fails_in_one_line_on_a_foreign_or_missing_tree(tmp_path, capsys):
    """report.py, pilot_report.py, pilot_select.py and merge_shards.py (the scripts that read a results tree): one
    line, exit 2, nothing written, for a tree that holds no vase run, and for one that does not exist."""
    sys.path.insert(0, str(ROOT / "scripts"))
    foreign = tmp_path / "foreign"
    _foreign(foreign)
    before = snapshot(tmp_path)
    scripts = {
        "report.py": ["--wandb", "disabled", "--formats", "png"],
        "pilot_report.py": [],
        "pilot_select.py": [],
    }
    for tree in (foreign, tmp_path / "missing"):
        for name, extra in scripts.items():
            r = subprocess.run(
                [sys.executable, f"scripts/{name}", str(tree), *extra],
                cwd=ROOT,
                env={**os.environ, "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1"},
                capture_output=True,
                text=True,
                timeout=300,
            )
            assert r.returncode == 2, (name, r.stderr[-2000:])
            lines = [x for x in r.stderr.splitlines() if x.strip()]
            errors = [x for x in lines if x.startswith("error: ")]
            warnings = [x for x in lines if x not in errors]  # one per directory that is not a vase run
            assert len(errors) == 1 and str(tree) in errors[0] and "Traceback" not in r.stderr, (name, r.stderr)
            assert len(warnings) <= 1 and all("not a vase run" in x for x in warnings), (name, r.stderr)
        r = subprocess.run(
            [sys.executable, "scripts/merge_shards.py", str(tree / "run")], cwd=ROOT, capture_output=True, text=True
        )
        assert r.returncode == 2 and "no shard directories match" in _one_error(r.stderr)
    assert snapshot(tmp_path) == before


@pytest.mark.slow  # test_i9 (a read-only results dir) stays
def test_the_report_into_a_read_only_directory_is_one_line(finished_run, tmp_path):
    from tests.test_runner_inputs import _read_only

    results = tmp_path / "ro"
    copy_run(finished_run, results)
    before = snapshot(results)
    prefix = _read_only(results)
    cmd = [*prefix, sys.executable, "scripts/report.py", str(results), "--wandb", "disabled", "--formats", "png", "-q"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    results.chmod(0o755)
    assert r.returncode == 2, r.stderr[-2000:]
    line = _one_error(r.stderr)
    assert line.startswith(f"--out: {results / 'report'} cannot be created") and "is not writable" in line, line
    assert snapshot(results) == before


def test_every_script_ends_in_one_line_for_bad_input_and_unwritable_files(tmp_path, capsys):
    """Every script of ``scripts/`` runs its ``main`` under :func:`vase.run.oneline.script_main`: a ``ValueError`` is
    ``error: <line>`` (exit 2), an ``OSError`` names its file (exit 1), never a traceback."""
    from vase.run.oneline import script_main

    for path in sorted((ROOT / "scripts").glob("*.py")):
        assert "script_main(main)" in path.read_text(), f"{path.name}: run main() under script_main"

    def unwritable() -> int:
        (tmp_path / "no" / "such" / "dir.json").write_text("{}")
        return 0

    def bad() -> int:
        raise ValueError("results_dir: a bad\ntree; fix it")

    for fn, code, start in ((unwritable, 1, f"{tmp_path / 'no' / 'such' / 'dir.json'}: "), (bad, 2, "results_dir")):
        with pytest.raises(SystemExit) as exit_:
            script_main(fn)
        assert exit_.value.code == code
        assert _one_error(capsys.readouterr().err).startswith(start)
