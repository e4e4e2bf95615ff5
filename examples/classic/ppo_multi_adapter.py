"""Classic TRL's `examples/scripts/ppo_multi_adapter.py`, ported to trl_lite: multi-adapter RL.

One base model serves three roles: the policy (a LoRA adapter being trained), the reward model
(a second LoRA adapter plus its score head, loaded from `--rm_adapter`) and the reference (the
base model with every adapter disabled). Ported by changing `trl` to `trl_lite` in the imports;
the model, dataset and reward adapter are the script's flags, so local directories work:

    python examples/classic/ppo_multi_adapter.py --model_name huggyllama/llama-7b \
        --dataset_name Anthropic/hh-rlhf --rm_adapter trl-lib/llama-7b-hh-rm-adapter
    python examples/classic/ppo_multi_adapter.py --model_name ./tiny-base --dataset_name ./tiny-hh \
        --rm_adapter ./tiny-rm-adapter --load_in_4bit False

Changes a machine without a GPU needs, beside the import: 4-bit loading (bitsandbytes) can be
turned off with `--load_in_4bit False` (on by default, as in the classic script), and the model goes
to the CPU when no accelerator is present. The classic script also chose `npu:0` on every machine
without an XPU (it tested the function `is_torch_npu_available` instead of calling it); this one
calls it.
"""

from dataclasses import dataclass, field
from typing import Optional

import torch
from accelerate import PartialState
from datasets import load_dataset
from peft import LoraConfig
from tqdm import tqdm
from transformers import AutoTokenizer, BitsAndBytesConfig, HfArgumentParser, is_torch_npu_available, is_torch_xpu_available

from trl_lite import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer
from trl_lite.core import LengthSampler

input_min_text_length = 6
input_max_text_length = 12


@dataclass
class ScriptArguments:
    """The base causal LM fine-tuned with PPO, its data and the reward model's adapter."""

    model_name: Optional[str] = field(default="huggyllama/llama-7b", metadata={"help": "the model name"})
    dataset_name: Optional[str] = field(default="Anthropic/hh-rlhf", metadata={"help": "the dataset name"})
    rm_adapter: Optional[str] = field(
        default="trl-lib/llama-7b-hh-rm-adapter", metadata={"help": "the reward model's adapter (name or path)"}
    )
    log_with: Optional[str] = field(default=None, metadata={"help": "use 'wandb' to log with wandb"})
    use_safetensors: Optional[bool] = field(default=False, metadata={"help": "load safetensors weights"})
    seed: Optional[int] = field(default=0, metadata={"help": "the random seed"})
    use_score_scaling: Optional[bool] = field(default=False, metadata={"help": "scale the scores"})
    use_score_norm: Optional[bool] = field(
        default=False, metadata={"help": "normalise the scores (only with use_score_scaling)"}
    )
    score_clip: Optional[float] = field(default=None, metadata={"help": "clip the scores"})
    dataset_num_proc: Optional[int] = field(default=None, metadata={"help": "workers that tokenize the data"})
    load_in_4bit: Optional[bool] = field(default=True, metadata={"help": "load the base model in 4 bit (needs a GPU)"})


parser = HfArgumentParser(ScriptArguments)
script_args = parser.parse_args_into_dataclasses()[0]


def create_and_prepare_dataset(tokenizer, num_proc):
    """The first 1% of the training split, each `chosen` dialogue cut to its first 6-12 tokens."""
    dataset = load_dataset(script_args.dataset_name, split="train[:1%]")

    input_size = LengthSampler(input_min_text_length, input_max_text_length)

    def tokenize(example):
        text_size = input_size()
        example["input_ids"] = tokenizer.encode(example["chosen"])[:text_size]
        example["query"] = tokenizer.decode(example["input_ids"])
        return example

    dataset = dataset.map(tokenize, batched=False, num_proc=num_proc)
    dataset.set_format("torch")
    return dataset


lora_config = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, bias="none", task_type="CAUSAL_LM")
nf4_config = BitsAndBytesConfig(
    load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.bfloat16
)
if is_torch_xpu_available():
    device = "xpu:0"
elif is_torch_npu_available():
    device = "npu:0"
else:
    device = 0 if torch.cuda.is_available() else "cpu"
model = AutoModelForCausalLMWithValueHead.from_pretrained(
    script_args.model_name,
    device_map={"": device},
    peft_config=lora_config,
    quantization_config=nf4_config if script_args.load_in_4bit else None,
    reward_adapter=script_args.rm_adapter,
    use_safetensors=script_args.use_safetensors,
)
tokenizer = AutoTokenizer.from_pretrained(script_args.model_name)

tokenizer.pad_token = tokenizer.eos_token

# Tokenize on the main process first; the others then read its cache.
with PartialState().local_main_process_first():
    dataset = create_and_prepare_dataset(tokenizer, script_args.dataset_num_proc)


def collator(data):
    return {key: [d[key] for d in data] for key in data[0]}


config = PPOConfig(
    model_name=script_args.model_name,
    log_with=script_args.log_with,
    learning_rate=1e-5,
    batch_size=8,
    mini_batch_size=2,
    gradient_accumulation_steps=2,
    optimize_cuda_cache=True,
    seed=script_args.seed,
    use_score_scaling=script_args.use_score_scaling,
    use_score_norm=script_args.use_score_norm,
    score_clip=script_args.score_clip,
    top_p=0.9,  # classic's nucleus sampling: PPOConfig is the one source of the sampling distribution
)

ppo_trainer = PPOTrainer(
    config,
    model,
    ref_model=None,  # the reference is the base model with both adapters disabled
    tokenizer=tokenizer,
    dataset=dataset,
    data_collator=collator,
)

generation_kwargs = {
    "top_k": 0.0,
    "do_sample": True,
    "pad_token_id": tokenizer.pad_token_id,
    "max_new_tokens": 32,
}

for _epoch, batch in tqdm(enumerate(ppo_trainer.dataloader)):
    question_tensors = batch["input_ids"]

    response_tensors = ppo_trainer.generate(
        question_tensors,
        return_prompt=False,
        **generation_kwargs,
    )
    batch["response"] = tokenizer.batch_decode(response_tensors, skip_special_tokens=True)

    # The reward adapter scores each dialogue; the reward is label 1's score at the last token.
    texts = [q + r for q, r in zip(batch["query"], batch["response"])]
    inputs = tokenizer(texts, padding=True, truncation=True, return_tensors="pt").to(ppo_trainer.accelerator.device)
    raw_rewards = ppo_trainer.accelerator.unwrap_model(ppo_trainer.model).compute_reward_score(**inputs)
    rewards = [raw_rewards[i, -1, 1] for i in range(len(raw_rewards))]

    stats = ppo_trainer.step(question_tensors, response_tensors, rewards)
    ppo_trainer.log_stats(stats, batch, rewards)
