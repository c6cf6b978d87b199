"""Synthetic RLLA (ToolRL) look-alike records: the project's default tool-use RL task.

Owns the fixed pool of 12 tools, the request templates and `generate_records(n, seed)`: `{instruction, input,
output}` records in the shape of ToolRL's `rlla_rl.json`, whose ground truth (`<think>` then one or two
`<tool_call>` blocks, or a `<response>` when no listed tool fits) matches `verl.utils.reward_score.rlla`'s format
regexes exactly. Sized for a ~1M-parameter model trained on CPU in minutes. `demonstration(record, rng)` is the
default job's imperfect SFT target (with probability P_STALE the answer for version 1 of the tools; see
"imperfect demonstrations"). Deterministic per `(n, seed)` on every platform. Layer 4: standard library only.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass

__all__ = ["TOOLS", "generate_records", "corpus_texts", "demonstration", "P_RESPONSE", "P_STALE", "P_TWO_CALLS"]

# Share of records whose needed tool is missing from the catalogue (answer with <response>), and of
# records asking for two calls; the rest ask for one call.
P_RESPONSE = 0.2
P_TWO_CALLS = 0.25
# Of the two-call records, the share calling the same tool twice with different values.
P_SAME_TOOL_TWICE = 0.3
MIN_SHOWN_TOOLS, MAX_SHOWN_TOOLS = 3, 4

# --------------------------------------------------------------------------------------------- values
_CITIES = ["Paris", "Tokyo", "Berlin", "Madrid", "Rome", "Cairo", "Lima", "Oslo", "Seoul", "Delhi", "Boston",
           "Denver", "Sydney", "Toronto", "Dublin", "Vienna", "Prague", "Nairobi", "Lisbon", "Athens", "Austin",
           "Chicago", "Bangkok", "Istanbul"]  # fmt: skip
_CURRENCIES = ["USD", "EUR", "GBP", "JPY", "CHF", "CAD", "AUD", "INR", "CNY", "BRL"]
_LANGUAGES = ["French", "Spanish", "German", "Italian", "Japanese", "Korean", "Portuguese", "Dutch", "Turkish"]
_PHRASES = ["good morning", "thank you", "where is the station", "I like tea", "see you soon", "happy birthday",
            "how much is it", "the bill please", "good night", "I am lost"]  # fmt: skip
_PEOPLE = ["anna", "ben", "carla", "dev", "emma", "farid", "grace", "hugo", "ines", "jon", "kemal", "lina"]
_DOMAINS = ["example.com", "mail.org", "work.net"]
_SUBJECTS = ["Meeting notes", "Lunch plans", "Project update", "Invoice", "Travel plans", "Weekly report"]
_SYMBOLS = ["AAPL", "MSFT", "GOOG", "AMZN", "TSLA", "NVDA", "META", "IBM", "INTC", "ORCL"]
_CUISINES = ["Italian", "Thai", "Mexican", "Indian", "Japanese", "Greek", "Chinese", "vegan"]
_TASKS = ["call mom", "buy milk", "water the plants", "pay rent", "walk the dog", "take my pills",
          "book a dentist visit", "send the report"]  # fmt: skip
_TOPICS = ["sports", "science", "politics", "technology", "music", "health", "travel", "business"]


def _email(rng: random.Random) -> str:
    return f"{rng.choice(_PEOPLE)}@{rng.choice(_DOMAINS)}"


def _clock(rng: random.Random) -> str:
    return f"{rng.randint(6, 22):02d}:{rng.choice([0, 15, 30, 45]):02d}"


def _date(rng: random.Random) -> str:
    return f"2025-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"


def _choice(pool: list[str]) -> Callable[[random.Random], str]:
    return lambda rng: rng.choice(pool)


def _int(low: int, high: int) -> Callable[[random.Random], int]:
    return lambda rng: rng.randint(low, high)


# ---------------------------------------------------------------------------------------------- tools
@dataclass(frozen=True)
class Param:
    name: str
    type: str  # "string" or "integer"
    sample: Callable[[random.Random], str | int]


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    params: tuple[Param, ...]
    intent: str  # completes "The user wants to ..."
    templates: tuple[str, ...]  # user requests; every parameter appears as {param_name}

    def catalogue_entry(self, number: int) -> str:
        params = {p.name: {"type": p.type} for p in self.params}
        return f"{number}. Name: {self.name}\nDescription: {self.description}\nParameters: {json.dumps(params)}"


TOOLS: tuple[Tool, ...] = (
    Tool("get_weather", "Get the current weather in a city.",
         (Param("city", "string", _choice(_CITIES)),),
         "know the current weather",
         ("What's the weather like in {city} right now?", "Is it raining in {city}?",
          "Tell me the current weather in {city}.")),
    Tool("get_forecast", "Get the weather forecast for the next days.",
         (Param("city", "string", _choice(_CITIES)),
          Param("days", "integer", _int(2, 7))),
         "get a weather forecast",
         ("Give me the {days}-day forecast for {city}.",
          "What will the weather be in {city} over the next {days} days?")),
    Tool("get_local_time", "Get the local time in a city.",
         (Param("city", "string", _choice(_CITIES)),),
         "know the local time",
         ("What time is it in {city}?", "Tell me the local time in {city}.")),
    Tool("convert_currency", "Convert an amount of money to another currency.",
         (Param("amount", "integer", _int(5, 900)),
          Param("from_currency", "string", _choice(_CURRENCIES)),
          Param("to_currency", "string", _choice(_CURRENCIES))),
         "convert money",
         ("Convert {amount} {from_currency} to {to_currency}.", "How much is {amount} {from_currency} in {to_currency}?")),
    Tool("translate_text", "Translate a text into another language.",
         (Param("text", "string", _choice(_PHRASES)),
          Param("target_language", "string", _choice(_LANGUAGES))),
         "translate a text",
         ("Translate '{text}' into {target_language}.", "How do you say '{text}' in {target_language}?")),
    Tool("send_email", "Send an email to someone.",
         (Param("to", "string", _email),
          Param("subject", "string", _choice(_SUBJECTS))),
         "send an email",
         ("Send an email to {to} with the subject '{subject}'.", "Email {to} about '{subject}'.")),
    Tool("get_stock_price", "Get the latest price of a stock.",
         (Param("symbol", "string", _choice(_SYMBOLS)),),
         "know a stock price",
         ("What is the stock price of {symbol}?", "How is {symbol} trading today?")),
    Tool("find_restaurants", "Find restaurants of a cuisine in a city.",
         (Param("city", "string", _choice(_CITIES)),
          Param("cuisine", "string", _choice(_CUISINES))),
         "find a restaurant",
         ("Find {cuisine} restaurants in {city}.", "Where can I eat {cuisine} food in {city}?")),
    Tool("set_reminder", "Set a reminder for a task at a time (HH:MM).",
         (Param("task", "string", _choice(_TASKS)),
          Param("time", "string", _clock)),
         "set a reminder",
         ("Remind me to {task} at {time}.", "Set a reminder at {time} to {task}.")),
    Tool("calculate_bmi", "Calculate the body mass index.",
         (Param("weight_kg", "integer", _int(45, 120)),
          Param("height_cm", "integer", _int(150, 200))),
         "know a BMI",
         ("I weigh {weight_kg} kg and I am {height_cm} cm tall. What is my BMI?",
          "Calculate the BMI for {weight_kg} kg and {height_cm} cm.")),
    Tool("search_flights", "Search flights between two cities on a date (YYYY-MM-DD).",
         (Param("origin", "string", _choice(_CITIES)),
          Param("destination", "string", _choice(_CITIES)),
          Param("date", "string", _date)),
         "find a flight",
         ("Find flights from {origin} to {destination} on {date}.",
          "I need a flight from {origin} to {destination} on {date}.")),
    Tool("get_news", "Get the latest news about a topic.",
         (Param("topic", "string", _choice(_TOPICS)),
          Param("count", "integer", _int(1, 9))),
         "read the news",
         ("Show me {count} news stories about {topic}.", "Give me the top {count} {topic} headlines.")),
)  # fmt: skip

_SYSTEM_HEADER = "You are a helpful assistant that can call tools to solve user tasks.\n\n**Available Tools**\n"
_SYSTEM_FOOTER = (
    "\n\n**Output Format**\n"
    "<think> Your thoughts and reasoning </think>\n"
    "<tool_call>\n"
    '{"name": "Tool name", "parameters": {"Parameter name": "value"}}\n'
    "</tool_call>\n"
    "Give one JSON object per line, with values copied from the user. "
    "If no listed tool fits, answer <response> AI's final response </response> instead."
)


# ------------------------------------------------------------------------------------------- records
@dataclass(frozen=True)
class _Call:
    tool: Tool
    arguments: dict[str, str | int]
    request: str


def _sample_call(rng: random.Random, tool: Tool) -> _Call:
    arguments = {p.name: p.sample(rng) for p in tool.params}
    if tool.name == "convert_currency":
        while arguments["to_currency"] == arguments["from_currency"]:
            arguments["to_currency"] = rng.choice(_CURRENCIES)
    if tool.name == "search_flights":
        while arguments["destination"] == arguments["origin"]:
            arguments["destination"] = rng.choice(_CITIES)
    request = rng.choice(tool.templates).format(**arguments)
    return _Call(tool, arguments, request)


def _instruction(tools: list[Tool]) -> str:
    entries = "\n".join(tool.catalogue_entry(i + 1) for i, tool in enumerate(tools))
    return _SYSTEM_HEADER + entries + _SYSTEM_FOOTER


def _user_turn(calls: list[_Call]) -> str:
    text = calls[0].request
    if len(calls) == 2:
        second = calls[1].request
        if not second.startswith("I "):
            second = second[0].lower() + second[1:]
        text += " Also, " + second
    return f"**Dialogue Records History**\n<user> {text} </user>"


def _tool_call_output(calls: list[_Call]) -> str:
    names = [c.tool.name for c in calls]
    if len(calls) == 1:
        think = f"The user wants to {calls[0].tool.intent}. The tool {names[0]} can do this."
    elif names[0] == names[1]:
        think = f"The user wants to {calls[0].tool.intent} twice. I will call {names[0]} two times."
    else:
        think = (
            f"The user wants to {calls[0].tool.intent} and to {calls[1].tool.intent}. "
            f"I will call {names[0]} and {names[1]}."
        )
    lines = "\n".join(json.dumps({"name": c.tool.name, "parameters": c.arguments}) for c in calls)
    return f"<think> {think} </think>\n<tool_call>\n{lines}\n</tool_call>"


def _response_output(call: _Call) -> str:
    think = f"The user wants to {call.tool.intent}, but no listed tool can do that."
    return f"<think> {think} </think>\n<response> Sorry, I cannot {call.tool.intent} with the tools I have. </response>"


def _catalogue(rng: random.Random, needed: list[Tool], excluded: Tool | None) -> list[Tool]:
    size = rng.randint(MIN_SHOWN_TOOLS, MAX_SHOWN_TOOLS)
    others = [t for t in TOOLS if t not in needed and t is not excluded]
    shown = list(needed) + rng.sample(others, size - len(needed))
    rng.shuffle(shown)
    return shown


def _record(rng: random.Random) -> dict[str, str]:
    kind = rng.random()
    first = rng.choice(TOOLS)
    if kind < P_RESPONSE:
        call = _sample_call(rng, first)
        shown = _catalogue(rng, [], excluded=first)
        return {"instruction": _instruction(shown), "input": _user_turn([call]), "output": _response_output(call)}
    if kind < P_RESPONSE + P_TWO_CALLS:
        if rng.random() < P_SAME_TOOL_TWICE:
            second = first
        else:
            second = rng.choice([t for t in TOOLS if t is not first])
        calls = [_sample_call(rng, first), _sample_call(rng, second)]
        while calls[1].arguments == calls[0].arguments:
            calls[1] = _sample_call(rng, second)
    else:
        calls = [_sample_call(rng, first)]
    needed = list(dict.fromkeys(c.tool for c in calls))
    shown = _catalogue(rng, needed, excluded=None)
    return {"instruction": _instruction(shown), "input": _user_turn(calls), "output": _tool_call_output(calls)}


def generate_records(n: int, seed: int = 0) -> list[dict[str, str]]:
    """Make `n` synthetic RLLA records `{instruction, input, output}`, deterministic in `(n, seed)`.

    The first `k` records of `generate_records(n, seed)` equal `generate_records(k, seed)`.
    """
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise ValueError(f"n must be a non-negative int, got {n!r}")
    rng = random.Random(seed)
    return [_record(rng) for _ in range(n)]


# ------------------------------------------------------------------------------- imperfect demonstrations
# The default job's SFT demonstrations are partly stale: a share P_STALE (> 0.5) of them was written for version 1
# of the tools, whose parameters had other names (V1_PARAM_NAMES), which took integers as strings, and which had no
# get_forecast (a forecast request went to get_weather, V1_TOOLS). The catalogue in every prompt and the reward's
# ground truths are version 2. So the most likely answer of a model that imitates the demonstrations is the
# version-1 one, while the version-2 one keeps a fair share of the probability for RL to sample and reinforce.
P_STALE = 0.6
V1_PARAM_NAMES = {
    "city": "location", "days": "num_days", "amount": "value", "from_currency": "source_currency",
    "to_currency": "target_currency", "text": "phrase", "target_language": "language", "to": "recipient",
    "subject": "title", "symbol": "ticker", "cuisine": "food", "task": "note", "time": "at_time",
    "weight_kg": "weight", "height_cm": "height", "origin": "from_city", "destination": "to_city",
    "date": "departure_date", "topic": "category", "count": "limit",
}  # fmt: skip
V1_TOOLS = {"get_forecast": "get_weather"}
_TOOLS_BY_NAME = {tool.name: tool for tool in TOOLS}


def _v1_call(call: dict) -> dict:
    name, params = call["name"], dict(call["parameters"])
    if name in V1_TOOLS:  # the version-1 tool takes the parameters it shares with the version-2 one
        name = V1_TOOLS[name]
        params = {p.name: params[p.name] for p in _TOOLS_BY_NAME[name].params if p.name in params}
    params = {V1_PARAM_NAMES.get(k, k): str(v) if isinstance(v, int) else v for k, v in params.items()}
    return {"name": name, "parameters": params}


def demonstration(record: dict[str, str], rng: random.Random, p_stale: float = P_STALE) -> str:
    """The SFT target of `record`: its right (version-2) output, or with probability `p_stale` (one draw from
    `rng`) the version-1 one: every call through `V1_TOOLS` (in the think too) and `V1_PARAM_NAMES`, integers
    written as strings ("7", which the reward does not count as equal to 7). A `<response>` answer is kept."""
    output = record["output"]
    if "<tool_call>" not in output or rng.random() >= p_stale:
        return output
    think, block = output.split("\n<tool_call>\n")
    calls = [json.loads(line) for line in block.removesuffix("\n</tool_call>").split("\n")]
    stale = [_v1_call(call) for call in calls]
    for before, after in zip(calls, stale):
        think = think.replace(before["name"], after["name"])
    lines = "\n".join(json.dumps(call) for call in stale)
    return f"{think}\n<tool_call>\n{lines}\n</tool_call>"


def corpus_texts(n: int, seed: int = 0) -> Iterator[str]:
    """Yield `n` texts for tokenizer training, one per synthetic record: instruction, input and output joined."""
    for record in generate_records(n, seed):
        yield "\n".join([record["instruction"], record["input"], record["output"]])


def to_row(record: dict, split: str, index: int) -> dict:
    """One verl parquet row for a raw record."""
    return {
        "data_source": "rlla",
        "prompt": [
            {"role": "system", "content": record["instruction"]},
            {"role": "user", "content": record["input"]},
        ],
        "ability": "tool_use",
        "reward_model": {"style": "rule", "ground_truth": record["output"]},
        "extra_info": {
            "split": split,
            "index": index,
            "instruction": record["instruction"],
            "input": record["input"],
            "output": record["output"],
        },
    }


def records_to_rows(records: list[dict], split: str) -> list[dict]:
    """verl parquet rows for a list of records; `extra_info.index` is the position within the split."""
    return [to_row(record, split, index) for index, record in enumerate(records)]
