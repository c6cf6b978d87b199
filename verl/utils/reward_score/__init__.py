"""Rule-based reward functions picked by `data_source`: `default_compute_score` and the per-task modules.

Owns the routing table from a row's `data_source` to a scoring function (gsm8k, math, rlla, code
sandbox: local, or a SandboxFusion service when `sandbox_fusion_url` is given, LLM judge, ifeval
instruction following). Layer 3: pure functions of strings; must not import
tensors, Ray or workers.

Return values: a float, or a dict with at least "score" (rlla returns
{"score", "format", "correctness", "length"}, ifeval {"score", "acc", "instruction_acc"}); reward managers
put "score" at the last response token and collect every dict key into `reward_extra_info`.
"""

from __future__ import annotations

from typing import Any

from verl.utils.reward_score import gsm8k, ifeval, llm_judge, math_reward, rlla, sandbox

__all__ = ["KNOWN_DATA_SOURCES", "default_compute_score", "has_default_scorer"]

GSM8K_SOURCES = ("openai/gsm8k", "gsm8k")
MATH_SOURCES = ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500", "math")
RLLA_SOURCES = ("rlla", "toolrl")
CODE_SOURCES = ("code", "codecontests", "apps", "taco", "codeforces", "sandbox")
JUDGE_SOURCES = ("llm_judge",)
IFEVAL_SOURCES = ("ifeval",)
KNOWN_DATA_SOURCES = GSM8K_SOURCES + MATH_SOURCES + RLLA_SOURCES + CODE_SOURCES + JUDGE_SOURCES + IFEVAL_SOURCES


def _is_rlla(data_source: str) -> bool:
    """ "rlla", "toolrl", or a name starting with "rlla" (e.g. "rlla_toolace")."""
    return data_source in RLLA_SOURCES or data_source.startswith("rlla")


def has_default_scorer(data_source: Any) -> bool:
    """Whether `default_compute_score` has a rule for `data_source` (checked before a run starts)."""
    return isinstance(data_source, str) and (data_source in KNOWN_DATA_SOURCES or _is_rlla(data_source))


def default_compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict | None = None,
    sandbox_fusion_url: str | None = None,
    concurrent_semaphore: Any = None,
    memory_limit_mb: int | None = None,
    **kwargs: Any,
) -> float | dict[str, Any]:
    """Score one response with the rule of its `data_source`.

    Args:
        data_source: the row's data set name (see KNOWN_DATA_SOURCES).
        solution_str: the decoded response.
        ground_truth: the reference (`reward_model["ground_truth"]`).
        extra_info: the row's `extra_info` (used by the code sandbox and the judge).
        sandbox_fusion_url: a SandboxFusion `/run_code` URL (`reward.sandbox_fusion.url`): when set, the code
            data sources are run there (`sandbox_fusion.compute_score(..., continuous=True)`, verl's pass
            fraction of the first 10 cases) instead of in the local sandbox; ignored by the other sources.
        concurrent_semaphore: caps the requests in flight to that URL (`reward.sandbox_fusion.max_concurrent`).
        memory_limit_mb: memory limit of each sandbox run (`reward.sandbox_fusion.memory_limit_mb`).
        **kwargs: passed on to the task's scorer. `step` (the training step, given by reward managers)
            goes to rlla only; every other keyword must be one the scorer accepts (e.g. gsm8k
            `method`, rlla flags `withlength=True`, sandbox `timeout_s`, judge `config`, ifeval `strict`).
    """
    step = kwargs.pop("step", 0)
    if data_source in GSM8K_SOURCES:
        return gsm8k.compute_score(solution_str, ground_truth, **kwargs)
    if data_source in MATH_SOURCES:
        return math_reward.compute_score(solution_str, ground_truth, **kwargs)
    if _is_rlla(data_source):
        score, fmt, correctness, length = rlla.compute_score(solution_str, ground_truth, step=step, **kwargs)
        return {"score": score, "format": fmt, "correctness": correctness, "length": length}
    if data_source in CODE_SOURCES and sandbox_fusion_url:
        from verl.utils.reward_score import sandbox_fusion

        kwargs.setdefault("continuous", True)
        score, _ = sandbox_fusion.compute_score(
            sandbox_fusion_url, concurrent_semaphore, memory_limit_mb, solution_str, ground_truth, **kwargs
        )
        return score
    if data_source in CODE_SOURCES:
        return sandbox.compute_score(solution_str, ground_truth, extra_info=extra_info, **kwargs)
    if data_source in JUDGE_SOURCES:
        return llm_judge.compute_score(solution_str, ground_truth, extra_info=extra_info, **kwargs)
    if data_source in IFEVAL_SOURCES:
        return ifeval.compute_score(solution_str, ground_truth, extra_info=extra_info, **kwargs)
    raise ValueError(
        f"no reward function for data_source={data_source!r}; known data sources: {list(KNOWN_DATA_SOURCES)} "
        "(and any name starting with 'rlla'). To score another data set, write a function "
        "`compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs)` in a .py file and "
        "set custom_reward_function.path=<that file> custom_reward_function.name=compute_score"
    )
