"""The engine: the policy interface, the static cache, the registered attention and the decode loop.

Public API (everything else is internal to the engine):

* :class:`~vase.engine.decode.Decoder` / :class:`~vase.engine.decode.Request` / :class:`~vase.engine.decode.Finished`
  — continuous batching of many prompts' samples on one static cache;
* :func:`~vase.engine.generate.generate` — the one-prompt form;
* :class:`~vase.engine.sampling.SamplingConfig`, :func:`~vase.engine.sampling.sample_seeds`;
* :class:`~vase.engine.cache.VaseCache`, :func:`~vase.engine.geometry.cache_capacity`,
  :func:`~vase.engine.memory.plan_rows`, :func:`~vase.engine.memory.auto_dtype`;
* the policy bases in :mod:`vase.engine.policy` and the score math in :mod:`vase.engine.scores`.
"""

from vase.engine.cache import VaseCache
from vase.engine.decode import Decoder, Finished, Request, StepInfo, model_geometry, vase_attention
from vase.engine.generate import GenerationOutput, generate
from vase.engine.geometry import CacheGeometry, cache_capacity
from vase.engine.memory import auto_dtype, plan_rows
from vase.engine.sampling import SamplingConfig, sample_seeds

__all__ = [
    "CacheGeometry",
    "Decoder",
    "Finished",
    "GenerationOutput",
    "Request",
    "SamplingConfig",
    "StepInfo",
    "VaseCache",
    "auto_dtype",
    "cache_capacity",
    "generate",
    "model_geometry",
    "plan_rows",
    "sample_seeds",
    "vase_attention",
]
