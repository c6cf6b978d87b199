"""Tests of the reward-model worker (verl/workers/reward_model_worker.py) on tiny Qwen2 sequence classifiers.

Every score is checked against an independent forward of `AutoModelForSequenceClassification` on the row's
unpadded tokens (HF's own pooling: the logit of the last token), which must land on the last response token of
`rm_scores`. In process (LocalWorkerGroup, the single-process trainer's group) and on 2 Ray ranks.
"""

import os

import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer, Qwen2ForSequenceClassification

from verl.protocol import DataProto
from verl.single_controller import LocalWorkerGroup, RayClassWithInitArgs, RayResourcePool
from verl.single_controller.base.worker import ENV_KEYS
from verl.single_controller.local import close_local_worker_groups
from verl.utils.torch_functional import compute_position_id_with_mask
from verl.workers.fsdp_workers import RewardModelWorker as ReExported
from verl.workers.reward_model_worker import RewardModelWorker, check_reward_model_config
from verl.workers.rollout.base import build_rollout_output

PROMPT_LEN, RESPONSE_LEN = 24, 6
CHATS = ["How many apples?", "Hi", "Convert 5 dollars to euro.", "What time is it in Zurich", "Name a tool."]
ANSWERS = ["three apples", "hello there friend and more", "", "noon", "calculator"]


def save_reward_model(out: str, tokenizer_dir: str, seed: int) -> str:
    """A random Qwen2ForSequenceClassification (one label, head of O(1) scores) with `tokenizer_dir`'s tokenizer."""
    config = AutoConfig.from_pretrained(tokenizer_dir)
    config.num_labels = 1
    config.architectures = ["Qwen2ForSequenceClassification"]
    torch.manual_seed(seed)
    model = Qwen2ForSequenceClassification(config)
    torch.nn.init.normal_(model.score.weight, std=1.0)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(out)
    return out


@pytest.fixture(autouse=True)
def _restore_dist_env():
    """In-process workers write RANK/MASTER_PORT/... into os.environ; a later Ray session must not inherit them."""
    saved = {key: os.environ.get(key) for key in ENV_KEYS}
    yield
    close_local_worker_groups()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="module")
def rm_dir(tiny_model_dir, tmp_path_factory):
    return save_reward_model(str(tmp_path_factory.mktemp("rm")), tiny_model_dir, seed=1)


@pytest.fixture(scope="module")
def other_tokenizer_rm_dir(tmp_path_factory):
    """A reward model whose tokenizer (another locally trained vocabulary) differs from the policy's."""
    from verl.models.tiny import build_tiny_model

    tok_dir = build_tiny_model(str(tmp_path_factory.mktemp("other_tok")), size="xs", seed=7, vocab_size=300)
    return save_reward_model(str(tmp_path_factory.mktemp("rm_other")), tok_dir, seed=2)


def rollout_batch(tokenizer) -> DataProto:
    """Chat prompts (left-padded) and answers + eos (right-padded; one cut at RESPONSE_LEN), with `raw_prompt`."""
    chats = [[{"role": "user", "content": text}] for text in CHATS]
    ids = torch.full((len(chats), PROMPT_LEN), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, chat in enumerate(chats):
        tok = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False)
        assert len(tok) <= PROMPT_LEN
        ids[i, PROMPT_LEN - len(tok) :], mask[i, PROMPT_LEN - len(tok) :] = torch.tensor(tok), 1
    prompts = DataProto.from_dict(
        tensors={"input_ids": ids, "attention_mask": mask, "position_ids": compute_position_id_with_mask(mask)},
        non_tensors={"raw_prompt": np.array(chats + [None], dtype=object)[:-1]},
    )
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    responses = torch.full((len(chats), RESPONSE_LEN), pad, dtype=torch.long)
    for i, answer in enumerate(ANSWERS):
        tok = (tokenizer.encode(answer, add_special_tokens=False) + [eos])[:RESPONSE_LEN]
        responses[i, : len(tok)] = torch.tensor(tok)
    return build_rollout_output(prompts, responses, eos, pad)


def hf_score(model, ids: list[int]) -> float:
    """The classifier's logit for one unpadded sequence (HF pools the last token of a batch of one)."""
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0, 0].item()


def reference_model(path: str):
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    model.config.pad_token_id = None  # batch of one: no padding to look for, the last token is scored
    return model


def expected_scores(batch: DataProto, rm_dir: str) -> torch.Tensor:
    """Same tokenizer: each row's attended input_ids scored alone, on the last attended response column."""
    model = reference_model(rm_dir)
    ids, mask = batch.batch["input_ids"], batch.batch["attention_mask"]
    expected = torch.zeros(len(batch), RESPONSE_LEN)
    for i in range(len(batch)):
        last = int(mask[i, PROMPT_LEN:].nonzero().max())
        expected[i, last] = hf_score(model, ids[i][mask[i].bool()].tolist())
    return expected


def local_group(config: dict) -> LocalWorkerGroup:
    group = LocalWorkerGroup(RayResourcePool([1]), RayClassWithInitArgs(RewardModelWorker, config=config))
    group.init_model()
    return group


def test_scores_equal_an_independent_forward_on_the_last_response_token(rm_dir, tiny_model_dir):
    assert ReExported is RewardModelWorker  # verl's import path
    batch = rollout_batch(AutoTokenizer.from_pretrained(tiny_model_dir))
    expected = expected_scores(batch, rm_dir)
    assert [int(c) for c in expected.abs().argmax(-1)] == [3, 5, 0, 2, 1]  # by hand: the eos column, or the cut
    config = {"model_path": rm_dir, "micro_batch_size_per_gpu": 2, "input_tokenizer": tiny_model_dir}
    group = local_group(config)
    assert group.workers[0].input_tokenizer is None  # same tokenizer: the batch's own ids are scored
    scores = group.compute_rm_score(batch).batch["rm_scores"]
    torch.testing.assert_close(scores, expected, atol=1e-5, rtol=0)
    assert (expected.abs().sum(-1) > 1e-3).all()
    group.close()
    one = local_group({**config, "micro_batch_size_per_gpu": 16}).compute_rm_score(batch).batch["rm_scores"]
    torch.testing.assert_close(one, scores, atol=1e-5, rtol=0)  # micro-batching changes nothing


def test_legacy_section_layout_is_read(rm_dir, tiny_model_dir):
    batch = rollout_batch(AutoTokenizer.from_pretrained(tiny_model_dir))
    worker = RewardModelWorker({"model": {"path": rm_dir}, "micro_batch_size_per_gpu": 3})  # verl's reward_model
    worker.init_model()
    torch.testing.assert_close(worker.compute_rm_score(batch).batch["rm_scores"], expected_scores(batch, rm_dir))


def test_other_tokenizer_re_renders_the_chat_with_the_reward_models_template(other_tokenizer_rm_dir, tiny_model_dir):
    policy_tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    rm_tok = AutoTokenizer.from_pretrained(other_tokenizer_rm_dir)
    assert policy_tok.get_vocab() != rm_tok.get_vocab()
    batch = rollout_batch(policy_tok)
    config = {"model_path": other_tokenizer_rm_dir, "input_tokenizer": tiny_model_dir, "micro_batch_size_per_gpu": 2}
    group = local_group(config)
    assert group.workers[0].input_tokenizer is not None
    scores = group.compute_rm_score(batch).batch["rm_scores"]

    model = reference_model(other_tokenizer_rm_dir)
    mask = batch.batch["attention_mask"][:, PROMPT_LEN:]
    for i, (chat, answer) in enumerate(zip(CHATS, ANSWERS)):
        if i == 1:  # cut at RESPONSE_LEN: the reward model reads the part that was generated
            answer = policy_tok.decode(batch.batch["responses"][i])
        messages = [{"role": "user", "content": chat}, {"role": "assistant", "content": answer}]
        text = rm_tok.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
        last = int(mask[i].nonzero().max())
        assert scores[i, last].item() == pytest.approx(
            hf_score(model, rm_tok.encode(text, add_special_tokens=False)), abs=1e-5
        )
        assert scores[i].count_nonzero() == 1

    no_chat = DataProto(batch=batch.batch, non_tensor_batch={}, meta_info={})
    with pytest.raises(ValueError, match="data.return_raw_chat=true"):
        group.compute_rm_score(no_chat)


def test_config_errors(rm_dir, tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match=r"reward.reward_model.model_path=None is not an HF model folder"):
        check_reward_model_config({"enable": True})
    with pytest.raises(ValueError, match=r"micro_batch_size_per_gpu=0 must be a positive integer"):
        check_reward_model_config({"model_path": rm_dir, "micro_batch_size_per_gpu": 0})
    causal_lm = RewardModelWorker({"model_path": tiny_model_dir})
    with pytest.raises(ValueError, match=r"no trained classification head \(missing \['score.weight'\]\)"):
        causal_lm.init_model()


@pytest.mark.ray
@pytest.mark.slow
def test_two_ranks_score_like_one(ray_session, rm_dir, tiny_model_dir):
    from verl.single_controller.ray import RayWorkerGroup

    batch = rollout_batch(AutoTokenizer.from_pretrained(tiny_model_dir))  # 5 rows: one padding row on rank 1
    config = {"model_path": rm_dir, "micro_batch_size_per_gpu": 2, "input_tokenizer": tiny_model_dir}
    pool = RayResourcePool(process_on_nodes=[2], use_gpu=False)
    try:
        group = RayWorkerGroup(pool, RayClassWithInitArgs(RewardModelWorker, config=config))
        group.init_model()
        scores = group.compute_rm_score(batch).batch["rm_scores"]
    finally:
        pool.remove_placement_groups()
    torch.testing.assert_close(scores, expected_scores(batch, rm_dir), atol=1e-5, rtol=0)
