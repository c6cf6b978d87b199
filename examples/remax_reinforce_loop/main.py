"""ReMax + REINFORCE in your own loop (AReaL-lite's tutorial, on this package's engines).

The four pieces: a rollout workflow on plain dict rows (a sampled and a greedy completion, the reward difference
as the signal), a REINFORCE loss over packed 1-D sequences, a two-class actor (algorithm logic / FSDP engine), and
the main loop. One process: `python examples/remax_reinforce_loop/main.py`; two: `torchrun --nproc_per_node 2
examples/remax_reinforce_loop/main.py` (gloo on CPU, nccl on GPU; every rank rolls out its share of the prompts).
Defaults: the embedded job's SFT model and RLLA data (`python -m verl.trainer.prepare_default --out
outputs/default` makes them); any verl-format parquet (`prompt` chat, `data_source`, `reward_model.ground_truth`)
works, GSM8K included.
"""

import argparse
import asyncio
import json
import uuid

import pyarrow.parquet as pq
import torch
import torch.distributed as dist
from tensordict import TensorDict
from transformers import AutoTokenizer

from verl.utils import stats_tracker
from verl.utils.fsdp_utils import destroy_distributed
from verl.utils.reward_score import default_compute_score
from verl.utils.torch_functional import logprobs_from_logits as gather_logprobs
from verl.workers.engine import FinetuneSpec, FSDPEngine, WeightUpdateMeta
from verl.workers.rollout.async_engine import GenerationHyperparameters, InferenceEngine, ModelRequest
from verl.workers.rollout.inference_engine import build_inference_engine
from verl.workers.rollout.workflows import RolloutWorkflow, load_callable


# 1. The workflow: one dict row in, one TensorDict row out.
class ReMaxRLVRWorkflow(RolloutWorkflow):
    def __init__(self, reward_fn, gconfig, tokenizer):
        self.reward_fn, self.gconfig, self.tokenizer = reward_fn, gconfig, tokenizer

    async def arun_episode(self, engine: InferenceEngine, data):
        input_ids = self.tokenizer.apply_chat_template(data["messages"], tokenize=True, add_generation_prompt=True)
        rid = uuid.uuid4().hex  # ModelRequest takes the ids as they come (a list or a BatchEncoding)
        sample_req = ModelRequest(rid=rid, input_ids=input_ids, gconfig=self.gconfig)
        greedy_req = ModelRequest(rid=rid, input_ids=input_ids, gconfig=self.gconfig.new(greedy=True))
        resp, greedy_resp = await asyncio.gather(engine.agenerate(sample_req), engine.agenerate(greedy_req))
        prompt_str = self.tokenizer.decode(resp.input_tokens)
        sample_reward = self.reward_fn(prompt_str, self.tokenizer.decode(resp.output_tokens, skip_special_tokens=True),
                                       resp.input_tokens, resp.output_tokens, **data)  # fmt: skip
        greedy_reward = self.reward_fn(prompt_str, self.tokenizer.decode(greedy_resp.output_tokens, skip_special_tokens=True),
                                       greedy_resp.input_tokens, greedy_resp.output_tokens, **data)  # fmt: skip
        length = resp.input_len + resp.output_len
        res = dict(
            input_ids=torch.tensor(resp.input_tokens + resp.output_tokens).unsqueeze(0),
            loss_mask=torch.tensor([0] * resp.input_len + [1] * resp.output_len).unsqueeze(0),
            versions=torch.tensor([-1] * resp.input_len + resp.output_versions).unsqueeze(0),
            attention_mask=torch.ones(length, dtype=torch.bool).unsqueeze(0),
            rewards=torch.tensor([float(sample_reward - greedy_reward)] * length).unsqueeze(0),
        )
        return TensorDict(res, batch_size=[1])


def reward_fn(prompt, completions, prompt_ids, completion_ids, data_source, reward_model, **kwargs):
    result = default_compute_score(data_source, completions, reward_model["ground_truth"], kwargs.get("extra_info"))
    return float(result["score"] if isinstance(result, dict) else result)


# 2. The loss: REINFORCE over packed sequences (the token at t+1 is predicted at t, so labels and mask roll by one).
def reinforce_loss_fn(logits, data):
    labels = torch.roll(data["input_ids"], shifts=-1, dims=-1)
    loss_mask = torch.roll(data["loss_mask"], shifts=-1, dims=-1).bool()
    logprobs = gather_logprobs(logits, labels)
    loss = torch.where(loss_mask, -logprobs * data["rewards"], 0.0)
    return loss.sum() / loss_mask.count_nonzero()


# 3. The two-class actor: the algorithm (any backend) and the FSDP engine it runs on.
class ReinforceActor:
    def __init__(self, engine):
        self.engine = engine

    def train_reinforce(self, data: TensorDict):
        self.engine.train()
        return self.engine.train_batch(
            data, loss_fn=reinforce_loss_fn, loss_weight_fn=lambda x: x["loss_mask"].count_nonzero()
        )


class FSDPReinforceActor(FSDPEngine):
    def __init__(self, config, **kwargs):
        super().__init__(config=config, **kwargs)
        self.actor = ReinforceActor(self)

    def train_reinforce(self, *args, **kwargs):
        return self.actor.train_reinforce(*args, **kwargs)


def load_rows(path: str) -> list[dict]:
    rows = pq.read_table(path).to_pylist()
    return [{"messages": row.pop("prompt"), **row} for row in rows]


def evaluate(engine, rows, tokenizer, score_fn, greedy: bool) -> float:
    """Mean reward over `rows` (all ranks' shares), one completion each."""

    async def score(row):
        ids = tokenizer.apply_chat_template(row["messages"], tokenize=True, add_generation_prompt=True)
        resp = await engine.agenerate(ModelRequest(input_ids=ids, gconfig=engine.default_gconfig().new(greedy=greedy)))
        text = tokenizer.decode(resp.output_tokens, skip_special_tokens=True)
        return score_fn(None, text, resp.input_tokens, resp.output_tokens, **row)

    async def run_all():
        return await asyncio.gather(*(score(row) for row in rows))

    total = torch.tensor([sum(asyncio.run(run_all())), len(rows)], dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(total)
    return float(total[0] / total[1])


# 4. The main loop.
def main(args):
    tokenizer = AutoTokenizer.from_pretrained(args.model_path)
    train_rows, test_rows = load_rows(args.train_file), load_rows(args.test_file)[: args.eval_rows]
    ft_spec = FinetuneSpec(total_train_epochs=1, dataset_size=len(train_rows), train_batch_size=args.batch_size)
    config = {"path": args.model_path, "optimizer": {"lr": args.lr}}  # AReaL's TrainEngineConfig keys (or verl's)
    actor = FSDPReinforceActor(config, tokenizer=tokenizer)
    actor.initialize(None, ft_spec)  # joins torch.distributed (torchrun's env, or one process)
    rank, world = dist.get_rank(), dist.get_world_size()
    rollout = build_inference_engine(args.model_path, {"response_length": args.max_new_tokens}, tokenizer=tokenizer,
                                     seed=args.seed + rank)  # fmt: skip
    rollout.initialize(None, ft_spec)  # in-process: nothing to start
    weight_update_meta = WeightUpdateMeta.from_colocated(rollout)
    gconfig = GenerationHyperparameters(max_new_tokens=args.max_new_tokens)
    score_fn = load_callable(args.reward_fn) if args.reward_fn else reward_fn
    workflow = ReMaxRLVRWorkflow(score_fn, gconfig, tokenizer)
    my_test_rows = test_rows[rank::world]

    def rewards() -> dict:
        return {
            mode: evaluate(rollout, my_test_rows, tokenizer, score_fn, mode == "greedy")
            for mode in ("greedy", "sampled")
        }

    before = rewards()
    history = []
    for global_step in range(args.steps):
        start = (global_step * args.batch_size) % len(train_rows)
        data = train_rows[start : start + args.batch_size][rank::world]  # this rank's share of the prompts
        with stats_tracker.record_timing("rollout"):
            batch = rollout.rollout_batch(data, workflow=workflow).to(actor.device)
        with stats_tracker.record_timing("train_step"), stats_tracker.scope("actor"):
            stats_tracker.scalar(**actor.train_reinforce(batch))
            actor.step_lr_scheduler()
            stats_tracker.denominator(n_tokens=batch["loss_mask"].bool())
            stats_tracker.stat(advantage=batch["rewards"].float(), denominator="n_tokens")
        with stats_tracker.record_timing("update_weights"):
            actor.upload_weights(weight_update_meta)  # stream the new weights into the colocated engine
            rollout.update_weights(weight_update_meta).result()
            actor.set_version(global_step + 1)
            rollout.set_version(global_step + 1)
        stats = stats_tracker.export(reduce_group=dist.group.WORLD)  # over all ranks; cleared for the next step
        stats.update(step=global_step + 1, versions=sorted(set(batch["versions"][batch["loss_mask"].bool()].tolist())))
        history.append(stats)
        if rank == 0:
            print(f"step {global_step + 1}: " + ", ".join(f"{k} {v}" for k, v in stats.items()), flush=True)
    after = rewards()
    if rank == 0:
        print(f"reward before: {before}\nreward after:  {after}", flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"before": before, "after": after, "steps": history, "world_size": world}, f)
    destroy_distributed()  # a barrier, then the group's end: a rank that left first could abort its peer (gloo)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model_path", default="outputs/default/sft_model")
    parser.add_argument("--train_file", default="outputs/default/data/train.parquet")
    parser.add_argument("--test_file", default="outputs/default/data/test.parquet")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch_size", type=int, default=16, help="prompts per step, over all ranks")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--max_new_tokens", type=int, default=100)
    parser.add_argument("--eval_rows", type=int, default=64)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--reward_fn", default=None, help="'file.py:name' with reward_fn's signature (default: verl's)")
    parser.add_argument("--out", default=None, help="write the before/after rewards and per-step stats as JSON")
    main(parser.parse_args())
