"""Best-of-n sampling as an alternative to RL: the offline counterpart of classic TRL's best_of_n notebook.

    python examples/scripts/best_of_n_sentiment.py

The offline SFT policy and sentiment classifier of the sentiment demo (``tiny_sentiment.py``, cached
in ``--offline_models_dir``) continue review openings. For each prompt the script scores
  1. one sample of the SFT model (the notebook's base model),
  2. the best of ``--n_best_of`` samples of the same model, chosen by the classifier through
     ``BestOfNSampler`` (classic constructor and ``generate``),
  3. optionally one sample of a PPO-tuned policy (``--tuned_model``, e.g. ``outputs/ppo_sentiment/model``),
and prints the mean reward of each. Best-of-n raises the reward without any training, at n times the
generation cost.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import HfArgumentParser, pipeline

from trl_lite import AutoModelForCausalLMWithValueHead, LengthSampler, set_seed
from trl_lite.extras import BestOfNSampler

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tiny_sentiment import build_offline_models, load_reviews  # noqa: E402


@dataclass
class Arguments:
    n_best_of: int = field(default=4, metadata={"help": "Samples per prompt that best-of-n chooses from."})
    num_prompts: int = field(default=64, metadata={"help": "Prompts (openings of the offline reviews)."})
    sft_steps: int = field(default=300, metadata={"help": "SFT steps of the offline policy (as the sentiment demo)."})
    reward_model_steps: int = field(default=200, metadata={"help": "Steps of the offline classifier (as the sentiment demo)."})
    offline_models_dir: str = field(default="outputs/ppo_sentiment/offline_models", metadata={"help": "Cache of the offline models, shared with ppo_sentiment.py."})
    tuned_model: str | None = field(default=None, metadata={"help": "A PPO-tuned policy directory to compare too."})
    seed: int = field(default=0, metadata={"help": "Seed of prompts and sampling."})
    output_json: str | None = field(default=None, metadata={"help": "Write the mean rewards here."})


def main(args: Arguments) -> dict:
    set_seed(args.seed)
    offline = build_offline_models(args.offline_models_dir, args.sft_steps, args.reward_model_steps, args.seed)
    tokenizer = offline.tokenizer
    ref_model = AutoModelForCausalLMWithValueHead.from_pretrained(offline.policy)
    reward_pipe = pipeline("sentiment-analysis", model=offline.reward_model, tokenizer=offline.reward_tokenizer, device="cpu")
    sent_kwargs = {"top_k": None, "function_to_apply": "none", "batch_size": 16}

    def queries_to_scores(texts: list[str]) -> list[float]:
        """The classifier's POSITIVE logit of each text."""
        return [next(o["score"] for o in out if o["label"] == "POSITIVE") for out in reward_pipe(texts, **sent_kwargs)]

    # Openings of 2 to 7 tokens of the reviews, as the notebook cuts its prompts.
    input_size = LengthSampler(2, 8)
    reviews = load_reviews()[: args.num_prompts]
    query_tensors = [torch.tensor(tokenizer.encode(r["text"])[: input_size()]) for r in reviews]
    gen_kwargs = {"min_length": -1, "top_k": 0, "top_p": 1.0, "do_sample": True, "pad_token_id": tokenizer.pad_token_id}
    output_length_sampler = LengthSampler(4, 16)

    # One sample per prompt from the base model: best-of-1 with the same sampler.
    single = BestOfNSampler(ref_model, tokenizer, queries_to_scores, output_length_sampler, sample_size=1)
    best_of = BestOfNSampler(ref_model, tokenizer, queries_to_scores, output_length_sampler, sample_size=args.n_best_of)
    results = {
        "base model": queries_to_scores([texts[0] for texts in single.generate(query_tensors, **gen_kwargs)]),
        f"best of {args.n_best_of}": queries_to_scores([texts[0] for texts in best_of.generate(query_tensors, **gen_kwargs)]),
    }
    if args.tuned_model is not None:
        tuned = AutoModelForCausalLMWithValueHead.from_pretrained(args.tuned_model)
        tuned_single = BestOfNSampler(tuned, tokenizer, queries_to_scores, output_length_sampler, sample_size=1)
        results["PPO-tuned model"] = queries_to_scores([t[0] for t in tuned_single.generate(query_tensors, **gen_kwargs)])

    means = {name: sum(scores) / len(scores) for name, scores in results.items()}
    for name, mean in means.items():
        print(f"{name:>16}: mean reward {mean:+.3f} over {len(query_tensors)} prompts")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(means, indent=2))
    return means


if __name__ == "__main__":
    main(HfArgumentParser(Arguments).parse_args_into_dataclasses()[0])
