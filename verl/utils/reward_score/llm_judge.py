"""LLM-as-a-judge reward: ask another model behind an OpenAI-compatible `/v1/chat/completions` endpoint.

Owns `JudgeConfig`, `resolve_config`, `JudgeError` and `compute_score`. Settings: keyword overrides, `config`,
`VERL_JUDGE_URL` / `_MODEL` / `_API_KEY`, then defaults. The score is the last match of `score_regex`; refused
connections, timeouts, HTTP 429/5xx and replies without a score are retried with exponential backoff; at most
`max_concurrency` requests per endpoint per process. Standard library only.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, fields
from typing import Any

__all__ = ["DEFAULT_PROMPT", "DEFAULT_SCORE_REGEX", "JudgeConfig", "JudgeError", "compute_score", "resolve_config"]

DEFAULT_PROMPT = (
    "You are grading a response against a reference answer.\n"
    "Question: {question}\n"
    "Reference answer: {ground_truth}\n"
    "Response: {solution}\n"
    "Is the response correct? End your reply with one line 'Score: 1' if it is correct, 'Score: 0' if not."
)
DEFAULT_SCORE_REGEX = r"[Ss]core\s*[:=]\s*(-?\d+(?:\.\d+)?)"
ENV_VARS = {"url": "VERL_JUDGE_URL", "model": "VERL_JUDGE_MODEL", "api_key": "VERL_JUDGE_API_KEY"}
RETRYABLE_HTTP = (429, 500, 502, 503, 504)

_SEMAPHORES: dict[str, threading.BoundedSemaphore] = {}
_SEMAPHORES_LOCK = threading.Lock()


class JudgeError(RuntimeError):
    """The judge gave no usable score after every attempt."""


class _RetryableError(Exception):
    """One attempt failed in a way worth retrying (garbage reply, 5xx, refused connection, timeout)."""


@dataclass(frozen=True)
class JudgeConfig:
    """Where and how to ask the judge; see the module docstring for precedence and defaults."""

    url: str
    model: str
    api_key: str | None = None
    prompt_template: str = DEFAULT_PROMPT
    score_regex: str = DEFAULT_SCORE_REGEX
    timeout_s: float = 30.0
    max_retries: int = 3
    backoff_s: float = 0.5
    max_concurrency: int = 8
    on_error: str | float = "raise"
    temperature: float = 0.0
    max_tokens: int = 256

    @property
    def endpoint(self) -> str:
        url = self.url.rstrip("/")
        return url if url.endswith("/chat/completions") else url + "/chat/completions"


def resolve_config(config: Any = None, **overrides: Any) -> JudgeConfig:
    """Merge overrides > config > env vars > defaults into a checked JudgeConfig."""
    allowed = {f.name for f in fields(JudgeConfig)}
    values: dict[str, Any] = {key: os.environ[var] for key, var in ENV_VARS.items() if os.environ.get(var)}
    for source in (dict(config or {}), overrides):
        unknown = sorted(set(source) - allowed)
        if unknown:
            raise ValueError(f"unknown llm_judge setting(s) {unknown}; allowed: {sorted(allowed)}")
        values.update({key: value for key, value in source.items() if value is not None})
    missing = [key for key in ("url", "model") if not values.get(key)]
    if missing:
        raise ValueError(
            f"llm_judge needs {missing}: give them in the judge config/kwargs or set "
            + ", ".join(ENV_VARS[key] for key in missing)
        )
    cfg = JudgeConfig(**values)
    if not (cfg.on_error == "raise" or isinstance(cfg.on_error, (int, float))):
        raise ValueError(f"llm_judge on_error={cfg.on_error!r}; allowed: 'raise' or a number (the score to give)")
    if cfg.max_retries < 0 or cfg.max_concurrency < 1 or cfg.timeout_s <= 0:
        raise ValueError(
            f"llm_judge max_retries={cfg.max_retries} (>= 0), max_concurrency={cfg.max_concurrency} (>= 1), "
            f"timeout_s={cfg.timeout_s} (> 0)"
        )
    re.compile(cfg.score_regex)
    return cfg


def _semaphore(endpoint: str, limit: int) -> threading.BoundedSemaphore:
    """The process-wide semaphore of `endpoint` (created with the first caller's limit)."""
    with _SEMAPHORES_LOCK:
        if endpoint not in _SEMAPHORES:
            _SEMAPHORES[endpoint] = threading.BoundedSemaphore(limit)
        return _SEMAPHORES[endpoint]


def _post_chat(cfg: JudgeConfig, prompt: str) -> str:
    """One chat-completions request; the reply's message content."""
    body = {
        "model": cfg.model,
        "messages": [{"role": "user", "content": prompt}],
        "temperature": cfg.temperature,
        "max_tokens": cfg.max_tokens,
    }
    headers = {"Content-Type": "application/json"}
    if cfg.api_key:
        headers["Authorization"] = f"Bearer {cfg.api_key}"
    request = urllib.request.Request(cfg.endpoint, data=json.dumps(body).encode("utf-8"), headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=cfg.timeout_s) as response:
            raw = response.read()
    except urllib.error.HTTPError as err:
        if err.code in RETRYABLE_HTTP:
            raise _RetryableError(f"HTTP {err.code} from {cfg.endpoint}") from err
        raise JudgeError(f"judge at {cfg.endpoint} answered HTTP {err.code}: {err.read()[:300]!r}") from err
    except (urllib.error.URLError, OSError) as err:  # refused connection, DNS, timeout
        raise _RetryableError(f"cannot reach {cfg.endpoint}: {err}") from err
    try:
        return json.loads(raw)["choices"][0]["message"]["content"]
    except (ValueError, KeyError, IndexError, TypeError) as err:
        raise _RetryableError(f"reply of {cfg.endpoint} is not a chat completion: {raw[:300]!r}") from err


def _parse_score(content: str, score_regex: str) -> float:
    matches = list(re.finditer(score_regex, content or ""))
    if not matches:
        raise _RetryableError(f"no score matching {score_regex!r} in the judge's reply {str(content)[:300]!r}")
    last = matches[-1]
    try:
        return float(last.group(1) if last.groups() else last.group(0))
    except ValueError as err:
        raise _RetryableError(f"judge score {last.group(0)!r} is not a number") from err


def compute_score(
    solution_str: str,
    ground_truth: Any,
    extra_info: dict | None = None,
    config: Any = None,
    **overrides: Any,
) -> float:
    """The judge's score of `solution_str` against `ground_truth` (or `on_error` when it gives none)."""
    cfg = resolve_config(config, **overrides)
    question = (extra_info or {}).get("question", "")
    try:
        prompt = cfg.prompt_template.format(question=question, ground_truth=ground_truth, solution=solution_str)
    except (KeyError, IndexError) as err:
        raise ValueError(
            f"llm_judge prompt_template uses {err}; allowed fields: {{question}}, {{ground_truth}}, {{solution}} "
            "(write literal braces as {{ and }})"
        ) from None
    semaphore = _semaphore(cfg.endpoint, cfg.max_concurrency)
    last_error: Exception | None = None
    for attempt in range(cfg.max_retries + 1):
        if attempt:
            time.sleep(cfg.backoff_s * 2 ** (attempt - 1))
        try:
            with semaphore:
                return _parse_score(_post_chat(cfg, prompt), cfg.score_regex)
        except _RetryableError as err:
            last_error = err
        except JudgeError as err:
            last_error = err
            break
    if cfg.on_error == "raise":
        raise JudgeError(f"llm_judge gave no score after {attempt + 1} attempt(s): {last_error}")
    return float(cfg.on_error)
