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
