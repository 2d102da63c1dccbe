"""A model's reasoning format: how its generated tokens become the text that is graded and recorded.

The graders (:func:`tasks.grading.split_thinking`), the failure metrics (:func:`vase.run.metrics.is_truncated`), the
loop detectors and ``samples.jsonl`` all read one canonical text: ``<think>thinking</think>answer``, with no
``</think>`` when the output ended inside its thinking. ``model.reasoning_format``
(:data:`vase.models.REASONING_FORMATS`, like vLLM's reasoning parsers) says how a model's tokens are turned into it:

* ``think_tags`` (Qwen3, DeepSeek-R1 distills, Phi-4-reasoning, SmolLM3, OLMo-3): the model writes ``<think>`` /
  ``</think>`` as text; the tokens are decoded with the special tokens skipped.
* ``harmony`` (gpt-oss): the model writes channels, ``<|channel|>analysis<|message|>…<|end|><|start|>assistant
  <|channel|>final<|message|>…<|return|>``, whose markers are special tokens; the tokens are decoded keeping them and
  :func:`render_harmony` renders the channels into the canonical text.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from vase.models import REASONING_FORMATS

#: the harmony tokens that end a message's content (``<|endoftext|>``: the tokenizer's own end of text)
HARMONY_ENDS = ("<|end|>", "<|return|>", "<|call|>", "<|endoftext|>")
_END_RE = re.compile("|".join(re.escape(t) for t in HARMONY_ENDS))
_CHANNEL_RE = re.compile(r"<\|channel\|>\s*([^\s<]+)")


def render_harmony(text: str) -> str:
    """gpt-oss's harmony output (decoded keeping its special tokens) → ``<think>thinking</think>final``.

    The output is split into messages at ``<|start|>``; a message's header runs to ``<|message|>`` (its channel: the
    word after ``<|channel|>``; a header may also carry a role, ``to=functions.x`` and ``<|constrain|>json``), its
    content from there to the first of :data:`HARMONY_ENDS` or the end of the text (a message cut off by the length
    limit). The ``final`` channel's contents (joined by newlines) are the answer; every other message's content,
    ``analysis`` and ``commentary`` (preambles, tool calls) alike, is thinking, joined by newlines in order (the
    split vLLM's harmony parsing makes between reasoning and final content). A header cut off before its
    ``<|message|>`` contributes nothing; a text in which no message began at all (plain text, no ``<|message|>``)
    is kept as decoded, as thinking.

    Without a ``final`` message the output ended inside its thinking: ``<think>`` + thinking, with no ``</think>``
    (graded as cut off inside the thinking, as a ``think_tags`` model that never closed it).

    Args:
        text: the generated tokens decoded with ``skip_special_tokens=False`` (without the prompt, which ends with
            ``<|start|>assistant``).

    Returns:
        The canonical text: ``"<think>" + thinking + "</think>" + final`` or ``"<think>" + thinking``.
    """
    if "<|message|>" not in text:
        return "<think>" + text  # no message began (plain text, or a header cut off): thinking, as decoded
    thinking: list[str] = []
    final: list[str] = []
    for segment in text.split("<|start|>"):
        if "<|message|>" not in segment:
            continue  # empty, or a header cut off before its <|message|>
        header, content = segment.split("<|message|>", 1)
        content = _END_RE.split(content, 1)[0]
        channel = _CHANNEL_RE.search(header)
        (final if channel is not None and channel.group(1) == "final" else thinking).append(content)
    if not final:
        return "<think>" + "\n".join(thinking)
    return "<think>" + "\n".join(thinking) + "</think>" + "\n".join(final)


def output_text(tokenizer, tokens: Sequence[int], reasoning_format: str) -> str:
    """A sample's generated ``tokens`` as the canonical text of its model's ``reasoning_format`` (module docstring).

    Args:
        tokenizer: the model's tokenizer (``decode(ids, skip_special_tokens=...)``).
        tokens: the generated token ids, without the prompt.
        reasoning_format: one of :data:`vase.models.REASONING_FORMATS`.
    """
    if reasoning_format == "think_tags":
        return tokenizer.decode(tokens, skip_special_tokens=True)
    if reasoning_format == "harmony":
        return render_harmony(tokenizer.decode(tokens, skip_special_tokens=False))
    raise ValueError(
        f"model.reasoning_format: unknown format {reasoning_format!r}; choose one of {', '.join(REASONING_FORMATS)}"
    )
