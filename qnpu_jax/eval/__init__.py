"""Metrics: perplexity and zero-shot multiple-choice tasks (lm-evaluation-harness scoring)."""

from qnpu_jax.eval.perplexity import PerplexityResult, perplexity
from qnpu_jax.eval.zeroshot import (
    TASKS,
    Doc,
    LmScorer,
    NllArgmaxFn,
    RequestScore,
    evaluate_docs,
    evaluate_task,
    evaluate_tasks,
    float_scorer,
    load_task,
    mean_stderr,
)

__all__ = [
    "TASKS",
    "Doc",
    "LmScorer",
    "NllArgmaxFn",
    "PerplexityResult",
    "RequestScore",
    "evaluate_docs",
    "evaluate_task",
    "evaluate_tasks",
    "float_scorer",
    "load_task",
    "mean_stderr",
    "perplexity",
]
