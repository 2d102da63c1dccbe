"""A model's reasoning format (vase/reasoning.py): gpt-oss's harmony channels rendered into the canonical
``<think>thinking</think>answer`` text that the graders, the metrics and the records read; the setting's checks,
the presets, the manifest and a stored run from before the setting."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tasks.grading import split_thinking
from tests.conftest import TINY_RUN, compose
from vase.models import REASONING_FORMATS, ModelSpec
from vase.reasoning import output_text, render_harmony
from vase.run import checks
from vase.run.metrics import classify_output

S, E, M, C, R = "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>"
A = S + "assistant"  # the prompt ends with it: the first message's <|start|>assistant is not generated

#: (case, harmony output as decoded with its special tokens, canonical text, the answer section, cut in thinking)
GOLDEN = [
    (
        "normal",
        f"{C}analysis{M}2 + 2 is 4.{E}{A}{C}final{M}The answer is \\boxed{{4}}.{R}",
        "<think>2 + 2 is 4.</think>The answer is \\boxed{4}.",
        "The answer is \\boxed{4}.",
        False,
    ),
    ("no final channel (cut off in the analysis)", f"{C}analysis{M}2 + 2 is", "<think>2 + 2 is", "", True),
    ("analysis closed, no final yet", f"{C}analysis{M}2 + 2 is 4.{E}{A}{C}fin", "<think>2 + 2 is 4.", "", True),
    (
        "multiple analysis messages",
        f"{C}analysis{M}First.{E}{A}{C}analysis{M}Second.{E}{A}{C}final{M}4{R}",
        "<think>First.\nSecond.</think>4",
        "4",
        False,
    ),
    (
        "a commentary preamble and a tool call are thinking",
        f"{C}analysis{M}Use the tool.{E}{A}{C}commentary{M}Calling calc.{E}"
        f'{A} to=functions.calc{C}commentary <|constrain|>json{M}{{"x": 2}}<|call|>'
        f"{A}{C}final{M}4{R}",
        '<think>Use the tool.\nCalling calc.\n{"x": 2}</think>4',
        "4",
        False,
    ),
    (
        "a tool call ends the output (no final)",
        f"{C}analysis{M}Use the tool.{E}{A}{C}commentary to=functions.calc <|constrain|>json{M}{{}}<|call|>",
        "<think>Use the tool.\n{}",
        "",
        True,
    ),
    ("trailing <|end|>, no <|return|>", f"{C}analysis{M}a{E}{A}{C}final{M}4{E}", "<think>a</think>4", "4", False),
    (
        "trailing <|return|><|endoftext|>",
        f"{C}analysis{M}a{E}{A}{C}final{M}4{R}<|endoftext|>",
        "<think>a</think>4",
        "4",
        False,
    ),
    ("empty analysis", f"{C}analysis{M}{E}{A}{C}final{M}4{R}", "<think></think>4", "4", False),
    ("final only", f"{C}final{M}4{R}", "<think></think>4", "4", False),
    ("cut off in the final", f"{C}analysis{M}a{E}{A}{C}final{M}The ans", "<think>a</think>The ans", "The ans", False),
    ("two final messages", f"{C}final{M}4{E}{A}{C}final{M}four{R}", "<think></think>4\nfour", "4\nfour", False),
    ("plain text, no marker", "just text", "<think>just text", "", True),
    ("cut off in the first header", f"{C}analy", f"<think>{C}analy", "", True),
    ("another tokenizer's markers only", "text<|im_end|>", "<think>text<|im_end|>", "", True),
    ("nothing generated", "", "<think>", "", True),
]


@pytest.mark.parametrize("case,harmony,canonical,answer,cut", GOLDEN, ids=[g[0] for g in GOLDEN])
def test_render_harmony_golden_table(case, harmony, canonical, answer, cut):
    """Each harmony output renders to its canonical text, whose answer section (split_thinking, as every grader
    reads it) is the final channel, and which is cut off inside its thinking exactly when no final message came."""
    text = render_harmony(harmony)
    assert text == canonical
    assert split_thinking(text, thinking=True) == (answer, cut)
    assert split_thinking(text, thinking=False) == (answer, cut)  # an open <think> is cut off with thinking off too
    assert (classify_output(text, finished=True, thinking=True) == "truncated") == cut


class FakeHarmonyTokenizer:
    """A tokenizer of harmony's special tokens and single characters (ids: special tokens first, then ord + 100)."""

    SPECIAL = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>", "<|call|>", "<|constrain|>"]

    def encode(self, text: str) -> list[int]:
        ids, i = [], 0
        while i < len(text):
            hit = next((k for k, s in enumerate(self.SPECIAL) if text.startswith(s, i)), None)
            if hit is not None:
                ids.append(hit)
                i += len(self.SPECIAL[hit])
            else:
                ids.append(ord(text[i]) + 100)
                i += 1
        return ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        n = len(self.SPECIAL)
        return "".join(
            ("" if skip_special_tokens else self.SPECIAL[t]) if t < n else chr(t - 100) for t in (int(i) for i in ids)
        )


def test_output_text_decodes_per_format():
    """think_tags: decoded with special tokens skipped (today's behaviour, which loses harmony's channel markers and
    with them the answer); harmony: decoded keeping them, then rendered. An unknown format is refused in one line."""
    tok = FakeHarmonyTokenizer()
    ids = tok.encode(GOLDEN[0][1])
    assert output_text(tok, ids, "harmony") == GOLDEN[0][2]
    skipped = output_text(tok, ids, "think_tags")
    assert skipped == "analysis2 + 2 is 4.assistantfinalThe answer is \\boxed{4}."
    assert split_thinking(skipped, thinking=True) == ("", True)  # graded as cut off: why harmony needs its format
    with pytest.raises(ValueError, match=r"^model\.reasoning_format: unknown format 'xml'; choose one of"):
        output_text(tok, ids, "xml")


def test_reasoning_format_setting_is_checked_in_one_line_before_anything():
    """The default is think_tags; a bad value is refused by the ModelSpec and by the settings check (before any file
    is written), naming model.reasoning_format and the allowed values; the two lists agree."""
    assert checks.REASONING_FORMATS == REASONING_FORMATS == ("think_tags", "harmony")
    assert ModelSpec(key="k", name="tiny:qwen3").reasoning_format == "think_tags"
    with pytest.raises(ValueError, match=r"^model\.reasoning_format: must be one of think_tags, harmony, got 'xml'"):
        ModelSpec(key="k", name="tiny:qwen3", reasoning_format="xml")
    with pytest.raises(ValueError, match=r"^model\.reasoning_format: unknown choice, got 'harmoni'; did you mean"):
        checks.check_settings(compose(["model=tiny", "model.reasoning_format=harmoni"]))


def test_presets_name_their_reasoning_format():
    """gpt-oss-20b writes harmony; the tiny gpt_oss model (the Qwen3 tokenizer, no harmony tokens) and every other
    preset write think tags."""
    from hydra.utils import instantiate

    root = Path(__file__).resolve().parents[1] / "conf" / "model"
    formats = {p.stem: instantiate(compose([f"model={p.stem}"]).model).reasoning_format for p in root.glob("*.yaml")}
    assert formats.pop("gpt_oss_20b") == "harmony" and formats.pop("tiny_gpt_oss") == "think_tags"
    assert set(formats.values()) == {"think_tags"}


def test_a_run_stored_before_the_reasoning_format_resumes_as_think_tags(tmp_path):
    """protocol.json of a run made before the setting: think_tags (how it was decoded) resumes it; harmony is
    another protocol and is refused."""
    from vase.run.planning import prepare
    from vase.run.protocol import comparable
    from vase.run.results import check_protocol

    prep = prepare(compose([*TINY_RUN, f"results_dir={tmp_path}"]))
    assert prep.protocol["model"]["reasoning_format"] == "think_tags"
    old = json.loads(json.dumps(prep.protocol, default=str))
    del old["model"]["reasoning_format"]
    (tmp_path / "protocol.json").write_text(json.dumps(old))
    check_protocol(tmp_path, comparable(tmp_path, prep.protocol), write=False)
    other = prepare(compose([*TINY_RUN, f"results_dir={tmp_path}", "model.reasoning_format=harmony"]))
    with pytest.raises(ValueError, match=r"different protocol \(model\.reasoning_format: '<unset>' -> 'harmony'"):
        check_protocol(tmp_path, comparable(tmp_path, other.protocol), write=False)


@pytest.mark.slow  # ~14 s alone (imports, the tokenizer, the task's generator): the runner's one call is tested here
def test_a_harmony_run_records_the_rendered_text_graded_on_the_final_channel(tmp_path, monkeypatch):
    """The runner path: a tiny run with ``model.reasoning_format=harmony`` whose tokenizer's decode (keeping special
    tokens) gives a harmony output: samples.jsonl holds the rendered text, its answer read from the final channel
    (the analysis boxes another number), not cut off; the manifest records the format."""
    from vase.run.runner import run

    harmony = f"{C}analysis{M}Maybe \\boxed{{7}}?{E}{A}{C}final{M}So \\boxed{{12}}.{R}"

    class Tokenizer:
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def __call__(self, *args, **kwargs):
            return self.inner(*args, **kwargs)

        def __len__(self):
            return len(self.inner)

        def decode(self, ids, skip_special_tokens=False, **kwargs):
            if skip_special_tokens:
                return self.inner.decode(ids, skip_special_tokens=True, **kwargs)
            return harmony

    load = ModelSpec.load
    monkeypatch.setattr(ModelSpec, "load", lambda self: (lambda m, t: (m, Tokenizer(t)))(*load(self)))
    overrides = [o for o in TINY_RUN if o not in ("n_samples=2", "generation.max_length=120")]
    tail = ["policy=full", "limit=1", "n_samples=1", "generation.max_length=84", "model.reasoning_format=harmony"]
    tail.append("generation.grade_workers=0")
    metrics = run(compose([*overrides, *tail, f"results_dir={tmp_path}"]), progress=False)
    assert metrics["complete"] and metrics["samples"] == 1
    run_dir = Path(metrics["run_dir"])
    row = json.loads((run_dir / "samples.jsonl").read_text().splitlines()[0])
    assert row["output"] == "<think>Maybe \\boxed{7}?</think>So \\boxed{12}."
    assert row["extracted"] == "12" and row["extracted_last_boxed"] == "12" and not row["cut_in_thinking"]
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["model"]["reasoning_format"] == "harmony"
