"""Code reward through a SandboxFusion-compatible HTTP service (https://github.com/bytedance/SandboxFusion).

Owns verl's `compute_score(sandbox_fusion_url, concurrent_semaphore, memory_limit_mb, completion, test_cases,
continuous=False, timeout=10) -> (score, metadata_list)`, used by `default_compute_score` for code data sources
when `reward.sandbox_fusion.url` is set. As in verl: the program is the last ```python block (else the first ```
block; none scores 0.0); test cases are stdin/stdout pairs (optionally `fn_name`) or `assert_case` blocks (also the
local sandbox's `[{"input", "output"}]` and `{"asserts"}`); the score is the fraction passed (with `continuous`,
of the first 10). Standard library only.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from verl.utils.reward_score.sandbox_fusion.utils import check_correctness

__all__ = ["compute_score"]

logger = logging.getLogger(__name__)

CONTINUOUS_CASES = 10  # continuous=True scores the first this-many cases


def _extract_solution(completion: str) -> str | None:
    """The code of `completion`'s code block (see the module docstring); None when there is none."""
    if "```python" in completion:
        return completion.split("```python")[-1].split("```")[0]
    if "```" not in completion:
        return None
    solution = completion.split("```")[1]
    if "\n" in solution:
        first_line, rest = solution.split("\n", 1)
        if first_line.strip().isalpha():  # a language tag such as "py" or "cpp"
            solution = rest
    return solution


def _as_in_outs(test_cases: Any) -> dict | None:
    """verl's {"inputs", "outputs"[, "assert_case", "fn_name"]} dict from the accepted forms; None if invalid."""
    if (
        isinstance(test_cases, list)
        and test_cases
        and all(isinstance(t, dict) and {"input", "output"} <= set(t) for t in test_cases)
    ):
        return {"inputs": [t["input"] for t in test_cases], "outputs": [t["output"] for t in test_cases]}
    if not isinstance(test_cases, dict):
        return None
    test_cases = dict(test_cases)
    if "asserts" in test_cases and "assert_case" not in test_cases:
        test_cases["assert_case"] = test_cases.pop("asserts")
    if isinstance(test_cases.get("assert_case"), list):
        test_cases.setdefault("inputs", ["" for _ in test_cases["assert_case"]])
        test_cases.setdefault("outputs", [None for _ in test_cases["assert_case"]])
    if "inputs" not in test_cases or "outputs" not in test_cases:
        return None
    return test_cases


def compute_score(
    sandbox_fusion_url: str,
    concurrent_semaphore: Any,
    memory_limit_mb: int | None,
    completion: str,
    test_cases: Any,
    continuous: bool = False,
    timeout: int = 10,
) -> tuple[float, list[dict[str, Any]]]:
    """Score `completion` on `test_cases` in the sandbox at `sandbox_fusion_url` (e.g. "http://host:8080/run_code").

    Args:
        concurrent_semaphore: held around each request (None: no cap); `threading.Semaphore(max_concurrent)`.
        memory_limit_mb: memory limit of each run (None: 1024).
        completion: the model's response.
        test_cases: dict or JSON string (see the module docstring).
        continuous: score the first 10 cases only.
        timeout: compile and run time limit of each case, seconds.

    Returns:
        (score in [0, 1], one metadata dict per case: status, stdout, stderr, exit_code, ...).
    """
    solution = _extract_solution(completion)
    if solution is None:
        return 0.0, [{"error": "Invalid completion (missing code block)"}]
    if isinstance(test_cases, str):
        try:
            test_cases = json.loads(test_cases)
        except json.JSONDecodeError as err:
            logger.error(f"sandbox_fusion: test cases are not valid JSON: {err}")
            return 0.0, [{"error": "Invalid test_cases JSON format"}]
    in_outs = _as_in_outs(test_cases)
    if in_outs is None:
        logger.error(f"sandbox_fusion: test cases lack inputs/outputs: {str(test_cases)[:200]!r}")
        return 0.0, [{"error": "Invalid test_cases structure (missing inputs/outputs)"}]
    try:
        results, metadata_list = check_correctness(
            sandbox_fusion_url=sandbox_fusion_url,
            in_outs=in_outs,
            generation=solution,
            timeout=timeout,
            memory_limit_mb=memory_limit_mb,
            concurrent_semaphore=concurrent_semaphore,
        )
    except Exception as err:  # verl scores 0 rather than failing the batch
        logger.exception("sandbox_fusion: check_correctness failed")
        return 0.0, [{"error": f"Unhandled exception: {type(err).__name__}: {err}"}]
    considered = results[:CONTINUOUS_CASES] if continuous else results
    if not considered:
        return 0.0, metadata_list
    passed = sum(1 for result in considered if result is True)
    return float(passed / len(considered)), metadata_list
