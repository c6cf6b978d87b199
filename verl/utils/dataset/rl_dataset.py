"""RL prompt dataset: parquet rows of chat prompts (verl's layout) -> left-padded token tensors, every other column
carried as a non-tensor field. Owns `RLHFDataset`, its `collate_fn` and `create_rl_sampler` (the `ResumableSampler`
of `samplers.py`: the data order and its bit-exact resume state live there, not in the picklable dataset).
Layer 4: never Ray.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch.utils.data import Dataset

from verl.utils.dataset.samplers import ResumableSampler
from verl.utils.torch_functional import compute_position_id_with_mask, tokenize_and_postprocess_data

logger = logging.getLogger(__name__)

__all__ = ["RLHFDataset", "collate_fn", "create_rl_sampler", "ResumableSampler"]

TRUNCATION_MODES = ("error", "left", "right", "middle")


def collate_fn(data_list: list[dict]) -> dict:
    """Stack the tensor fields of `data_list` and put every other field in a numpy object array.

    Returns a dict that `DataProto.from_single_dict` accepts: tensors of shape (bs, ...) and numpy arrays
    of dtype object and shape (bs,). Lists (e.g. `raw_prompt_ids`) stay one object per row, never a 2-D array.
    """
    if not data_list:
        raise ValueError("collate_fn got an empty batch")
    keys = list(data_list[0].keys())
    for i, item in enumerate(data_list):
        if item.keys() != data_list[0].keys():
            raise ValueError(f"batch item {i} has keys {sorted(item)}, item 0 has {sorted(keys)}")
    batch: dict[str, Any] = {}
    for key in keys:
        values = [item[key] for item in data_list]
        if isinstance(values[0], torch.Tensor):
            batch[key] = torch.stack(values, dim=0)
        else:
            array = np.empty(len(values), dtype=object)
            for i, value in enumerate(values):
                array[i] = value
            batch[key] = array
    return batch


class RLHFDataset(Dataset):
    """Chat prompts from one or more parquet files, tokenised with the chat template and left-padded.

    Config keys (read with `.get`, verl's names and defaults): `prompt_key` ("prompt"), `max_prompt_length`
    (1024), `truncation` ("error" | "left" | "right" | "middle"), `filter_overlong_prompts` (True),
    `return_raw_chat` (False), `return_full_prompt` (False). `cache_dir` and other keys are ignored.

    `__getitem__(i)` returns:
        input_ids, attention_mask, position_ids: (max_prompt_length,) int64 tensors, left-padded.
        raw_prompt_ids: list[int], the prompt's ids without padding (after truncation).
        index: `extra_info["index"]` when present, else the row number over all files (before filtering).
        raw_prompt: the chat messages (only with return_raw_chat).
        full_prompts: the chat-templated text (only with return_full_prompt).
        every other column of the row (data_source, reward_model, extra_info, ability, ...).
    """

    def __init__(
        self,
        data_files: str | Sequence[str],
        tokenizer: Any,
        config: Mapping | Any,
        processor: Any = None,
        max_samples: int = -1,
    ):
        if processor is not None:
            raise NotImplementedError("multi-modal prompts (a processor) are not supported by this RLHFDataset")
        self.data_files = [data_files] if isinstance(data_files, (str, os.PathLike)) else list(data_files)
        self.data_files = [os.path.expanduser(os.fspath(f)) for f in self.data_files]
        if not self.data_files:
            raise ValueError("RLHFDataset needs at least one parquet file, got an empty list")
        self.tokenizer = tokenizer
        self.prompt_key = config.get("prompt_key", "prompt")
        self.max_prompt_length = int(config.get("max_prompt_length", 1024))
        self.truncation = config.get("truncation", "error")
        self.filter_overlong_prompts = bool(config.get("filter_overlong_prompts", True))
        self.return_raw_chat = bool(config.get("return_raw_chat", False))
        self.return_full_prompt = bool(config.get("return_full_prompt", False))
        self.chat_template_kwargs = dict(config.get("apply_chat_template_kwargs") or {})  # e.g. enable_thinking
        if self.truncation not in TRUNCATION_MODES:
            raise ValueError(f"data.truncation={self.truncation!r} is not allowed; choose one of {TRUNCATION_MODES}")
        if self.max_prompt_length < 1:
            raise ValueError(f"data.max_prompt_length must be >= 1, got {self.max_prompt_length}")
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError(
                f"tokenizer {type(tokenizer).__name__} has no chat template; RLHFDataset renders prompts with "
                "apply_chat_template, so set tokenizer.chat_template (e.g. a Qwen-style <|im_start|> template)"
            )
        if tokenizer.pad_token_id is None:
            raise ValueError("tokenizer has no pad token; load it with verl.utils.tokenizer.hf_tokenizer")

        self.rows: list[dict] = []
        self.origins: list[tuple[str, int, int]] = []  # (file, row in file, row over all files) per kept row
        self._read_files()
        if max_samples is not None and max_samples > 0:  # verl's data.train_max_samples / val_max_samples
            self.rows, self.origins = self.rows[:max_samples], self.origins[:max_samples]
        if self.filter_overlong_prompts:
            self._filter_overlong()
        elif self.truncation == "error":
            self._reject_overlong()

    # ------------------------------------------------------------------------------------------ loading
    def _read_files(self) -> None:
        all_columns: dict[str, None] = {}
        for path in self.data_files:
            if not os.path.isfile(path):
                raise ValueError(f"parquet file {path!r} does not exist")
            # ParquetFile reads one file without pyarrow's dataset layer, which imports pandas (~50 MB resident in
            # the driver for the whole run); read_table would go through it
            try:
                with pq.ParquetFile(path) as parquet_file:
                    table = parquet_file.read()
            except (pa.ArrowException, OSError) as e:
                raise ValueError(f"parquet file {path!r} cannot be read: {type(e).__name__}: {e}") from e
            if self.prompt_key not in table.column_names:
                raise ValueError(
                    f"parquet file {path!r} has no prompt column {self.prompt_key!r} (data.prompt_key); "
                    f"its columns are {table.column_names}"
                )
            all_columns.update(dict.fromkeys(table.column_names))
            for row_number, row in enumerate(table.to_pylist()):
                row[self.prompt_key] = self._check_messages(row[self.prompt_key], path, row_number)
                self.origins.append((path, row_number, len(self.rows)))
                self.rows.append(row)
        if not self.rows:
            raise ValueError(f"RLHFDataset is empty: the parquet files {self.data_files} hold no rows")
        for row in self.rows:  # every row carries the union of the files' columns, so batches collate
            for column in all_columns:
                row.setdefault(column, None)

    @staticmethod
    def _check_messages(messages: Any, path: str, row_number: int) -> list[dict]:
        where = f"parquet file {path!r} row {row_number}"
        if not isinstance(messages, list) or not messages:
            raise ValueError(
                f"{where}: the prompt must be a non-empty list of chat messages [{{'role': ..., 'content': ...}}], "
                f"got {type(messages).__name__} {str(messages)[:80]!r}"
            )
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str) or "content" not in message:
                raise ValueError(
                    f"{where}: prompt message {i} must be a dict with a 'role' string and a 'content', "
                    f"got {str(message)[:80]!r}"
                )
        return messages

    def _render(self, messages: list[dict]) -> str:
        return self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False, **self.chat_template_kwargs
        )

    def _prompt_lengths(self) -> list[int]:
        texts = [self._render(row[self.prompt_key]) for row in self.rows]
        return [len(ids) for ids in self.tokenizer(texts, add_special_tokens=False)["input_ids"]]

    def _reject_overlong(self) -> None:
        """truncation=error without filtering: fail at load time (not mid-run), naming the first long prompt."""
        for (path, row_number, _), n in zip(self.origins, self._prompt_lengths()):
            if n > self.max_prompt_length:
                raise ValueError(
                    f"parquet file {path!r} row {row_number}: the prompt has {n} tokens, more than "
                    f"data.max_prompt_length={self.max_prompt_length} with data.truncation=error; raise "
                    "max_prompt_length, set data.filter_overlong_prompts=true, or truncation=left|right|middle"
                )

    def _filter_overlong(self) -> None:
        lengths = self._prompt_lengths()
        keep = [i for i, n in enumerate(lengths) if n <= self.max_prompt_length]
        dropped = len(self.rows) - len(keep)
        if dropped:
            logger.warning(
                "filter_overlong_prompts: dropped %d of %d prompts longer than max_prompt_length=%d",
                dropped,
                len(self.rows),
                self.max_prompt_length,
            )
        if not keep:
            raise ValueError(
                f"every prompt in {self.data_files} is longer than max_prompt_length={self.max_prompt_length} "
                f"(shortest has {min(lengths)} tokens); raise data.max_prompt_length"
            )
        self.rows = [self.rows[i] for i in keep]
        self.origins = [self.origins[i] for i in keep]

    # ------------------------------------------------------------------------------------------- access
    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, item: int) -> dict:
        row = dict(self.rows[item])
        messages = row.pop(self.prompt_key)
        text = self._render(messages)
        try:
            input_ids, attention_mask = tokenize_and_postprocess_data(
                prompt=text,
                tokenizer=self.tokenizer,
                max_length=self.max_prompt_length,
                pad_token_id=self.tokenizer.pad_token_id,
                left_pad=True,
                truncation=self.truncation,
            )
        except ValueError as err:
            path, row_number, _ = self.origins[item]
            raise ValueError(f"parquet file {path!r} row {row_number} (dataset item {item}): {err}") from err
        position_ids = compute_position_id_with_mask(attention_mask)

        row["input_ids"] = input_ids[0]
        row["attention_mask"] = attention_mask[0]
        row["position_ids"] = position_ids[0]
        row["raw_prompt_ids"] = input_ids[0][attention_mask[0].bool()].tolist()
        if self.return_raw_chat:
            row["raw_prompt"] = messages
        if self.return_full_prompt:
            row["full_prompts"] = text
        extra_info = row.get("extra_info")
        index = extra_info.get("index") if isinstance(extra_info, dict) else None
        row["index"] = self.origins[item][2] if index is None else index
        return row


# --------------------------------------------------------------------------------------------- sampler
def create_rl_sampler(data_config: Mapping | Any, dataset: Dataset) -> ResumableSampler:
    """The training sampler: shuffled with `data_config.seed` (default 1) if `data_config.shuffle` (default
    True), else sequential. Replaces verl's RandomSampler(generator seeded with seed)/SequentialSampler pair
    with one `ResumableSampler` that yields the same orders and can save its place."""
    seed = data_config.get("seed", 1)
    return ResumableSampler(
        num_samples=len(dataset),
        shuffle=bool(data_config.get("shuffle", True)),
        seed=1 if seed is None else int(seed),
    )
