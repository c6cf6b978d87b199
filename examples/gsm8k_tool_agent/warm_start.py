"""Warm-start a small model on tool-use demonstrations of the example's training rows, so that GRPO starts from a
policy that calls the tools (a random tiny model never writes a `<tool_call>`).

Per training row, one demonstration in exactly the tokens the tool agent loop builds (verl's chat-template
token stream, `verl.experimental.agent_loop.chat_tokens`):

    prompt | calculator call | tool: value | calc_gsm8k_reward call | tool: checked | "#### <answer>"

trained with Adam on the model's turns only (the prompt and the tool messages are not in the loss), one full
batch of the first `--max_rows` rows, until the mean token loss is below `--target_loss` or `--steps` steps ran;
the model and tokenizer are saved to `--out`. Rows without an `extra_info.expression` (real GSM8K) skip the calculator turn.

    python examples/gsm8k_tool_agent/warm_start.py --model /tmp/tiny --data data/gsm8k_tool/train.parquet --out /tmp/tiny_tools
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import pandas as pd
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:  # the tool config names gsm8k_tools.<Class>, imported from this folder
    sys.path.insert(0, HERE)
from gsm8k_tools import evaluate, format_number  # noqa: E402 (this folder's module)

from verl.experimental.agent_loop.chat_tokens import ChatTokenBuilder  # noqa: E402
from verl.tools.tool_registry import initialize_tools_from_config  # noqa: E402

TOOL_CONFIG = os.path.join(HERE, "tool_config.yaml")


def call_text(name: str, arguments: dict) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def demonstration(builder: ChatTokenBuilder, tokenizer, row: dict, schemas: list) -> tuple[list[int], list[int]]:
    """(token ids, loss mask) of one row's demonstration, built as the tool agent loop builds its stream."""
    messages = [dict(m) for m in row["prompt"]]
    answer, expression = str(row["reward_model"]["ground_truth"]), row["extra_info"].get("expression") or ""
    turns = []
    if expression:
        turns.append((call_text("calculator", {"expression": expression}), format_number(evaluate(expression))))
    turns.append((call_text("calc_gsm8k_reward", {"answer": answer}), f"Current parsed answer={answer!r} reward=1.0"))
    turns.append((f"The answer is #### {answer}", None))
    ids = builder.initial_tokens(messages, tools=schemas)
    mask = [0] * len(ids)
    for text, tool_text in turns:
        turn = tokenizer.encode(text + tokenizer.eos_token, add_special_tokens=False)
        ids, mask = ids + turn, mask + [1] * len(turn)
        if tool_text is not None:
            before = messages + [{"role": "assistant", "content": text}]
            merged = builder.merge_context(
                before, before + [{"role": "tool", "content": tool_text}], ids, tools=schemas
            )
            mask += [0] * (len(merged.token_ids) - len(ids))
            ids, messages = merged.token_ids, before + [{"role": "tool", "content": tool_text}]
    return ids, mask


def warm_start(
    model_dir: str, data_file: str, out: str, steps: int, lr: float, target_loss: float, max_rows: int = 16
) -> tuple[float, int]:
    """Train on the first `max_rows` rows (see the module docstring), save to `out`; returns (last loss, steps)."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tools = initialize_tools_from_config(TOOL_CONFIG)
    schemas = [tool.tool_schema.model_dump(exclude_unset=True, exclude_none=True) for tool in tools]
    builder = ChatTokenBuilder(tokenizer)
    rows = pd.read_parquet(data_file).to_dict("records")[:max_rows]
    demos = [demonstration(builder, tokenizer, _plain(row), schemas) for row in rows]
    width = max(len(ids) for ids, _ in demos)
    input_ids = torch.full((len(demos), width), tokenizer.pad_token_id)
    attention = torch.zeros((len(demos), width), dtype=torch.long)
    labels = torch.full((len(demos), width), -100)
    for i, (ids, mask) in enumerate(demos):
        input_ids[i, : len(ids)], attention[i, : len(ids)] = torch.tensor(ids), 1
        labels[i, : len(ids)] = torch.where(torch.tensor(mask, dtype=torch.bool), torch.tensor(ids), -100)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    torch.manual_seed(0)
    loss, step = float("inf"), 0
    while step < steps and loss >= target_loss:
        step += 1
        batch_loss = model(input_ids=input_ids, attention_mask=attention, labels=labels).loss
        optimizer.zero_grad()
        batch_loss.backward()
        optimizer.step()
        loss = batch_loss.item()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return loss, step


def _plain(value):
    """A parquet row as plain Python: numpy arrays (message lists) as lists, recursively."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if hasattr(value, "tolist") and not isinstance(value, str):
        value = value.tolist()
    return [_plain(v) for v in value] if isinstance(value, list) else value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="HF model folder to start from")
    parser.add_argument("--data", required=True, help="train.parquet of prepare_data.py")
    parser.add_argument("--out", required=True, help="folder for the warm-started model")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--target_loss", type=float, default=0.05)
    parser.add_argument("--max_rows", type=int, default=16, help="demonstrations of the first rows only")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (a tiny model is fastest on one)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)  # on a busy CPU, more threads of a tiny model mostly wait for each other
    loss, steps = warm_start(args.model, args.data, args.out, args.steps, args.lr, args.target_loss, args.max_rows)
    print(f"warm-started model in {args.out}: {steps} steps, last loss {loss:.4f}")


if __name__ == "__main__":
    main()
