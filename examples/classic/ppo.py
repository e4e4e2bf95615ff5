"""Classic TRL's `examples/scripts/ppo.py`, ported to trl_lite: sentiment tuning with PPO.

Ported by changing `trl` to `trl_lite` in the imports. The hub names are the `PPOConfig` fields the
classic script already reads, with classic's defaults (`gpt2`, `stanfordnlp/imdb`,
`sentiment-analysis:lvwerra/distilbert-imdb`: no flags runs classic's setup where the hub is reachable),
so local directories go in the same flags:

    python examples/classic/ppo.py --model_name lvwerra/gpt2-imdb --query_dataset stanfordnlp/imdb \
        --reward_model sentiment-analysis:lvwerra/distilbert-imdb --log_with wandb
    python examples/classic/ppo.py --model_name ./tiny-gpt2 --query_dataset ./tiny-imdb \
        --reward_model sentiment-analysis:./tiny-classifier --batch_size 4 --mini_batch_size 2

One change for today's transformers: the sentiment pipeline no longer takes `return_all_scores`;
`top_k=None` returns every label's score, sorted by score, so the positive score is found by its
label (the classifier's label 1, "POSITIVE" for the IMDB classifier) rather than by position. With
`--use_peft` on a machine without a GPU the model goes to the CPU (classic asked for GPU 0). Under a
ZeRO-3 config with `zero3_init_flag: true` the classifier loads whole inside classic's
`zero3_init_context_manager(enable=False)`: the trainer makes that context unregister transformers' ZeRO-3
config, which accelerate 1.x leaves registered there.
"""

from dataclasses import dataclass, field
from typing import Optional

import torch
from accelerate import Accelerator, PartialState
from datasets import load_dataset
from peft import LoraConfig
from tqdm import tqdm
from transformers import AutoTokenizer, HfArgumentParser, is_torch_npu_available, is_torch_xpu_available, pipeline

from trl_lite import AutoModelForCausalLMWithValueHead, AutoModelForSeq2SeqLMWithValueHead, PPOConfig, PPOTrainer, set_seed
from trl_lite.core import LengthSampler

tqdm.pandas()


@dataclass
class ScriptArguments:
    use_seq2seq: bool = field(default=False, metadata={"help": "wrap a seq2seq model instead of a causal LM"})
    trust_remote_code: bool = field(default=False, metadata={"help": "pass trust_remote_code to from_pretrained"})

    # LoRA settings, used with --use_peft
    use_peft: bool = field(default=False, metadata={"help": "train a LoRA adapter instead of the whole model"})
    lora_alpha: Optional[float] = field(default=16, metadata={"help": "LoRA alpha"})
    lora_r: Optional[int] = field(default=16, metadata={"help": "LoRA rank"})


parser = HfArgumentParser((ScriptArguments, PPOConfig))
args, ppo_config = parser.parse_args_into_dataclasses()

# Every label's raw logit for each text (no softmax), 16 texts per classifier batch.
sent_kwargs = {"top_k": None, "function_to_apply": "none", "batch_size": 16}

trl_model_class = AutoModelForCausalLMWithValueHead if not args.use_seq2seq else AutoModelForSeq2SeqLMWithValueHead

tokenizer = AutoTokenizer.from_pretrained(ppo_config.model_name)
tokenizer.pad_token = tokenizer.eos_token


def build_dataset(query_dataset, dataset_num_proc, input_min_text_length=2, input_max_text_length=8):
    """Reviews longer than 200 characters, each cut to its first 2-8 tokens: the PPO queries.

    Returns a torch-formatted dataset with `review`, `input_ids` (the query tokens) and `query`
    (their text).
    """
    ds = load_dataset(query_dataset, split="train")
    ds = ds.rename_columns({"text": "review"})
    ds = ds.filter(lambda x: len(x["review"]) > 200, num_proc=dataset_num_proc)

    input_size = LengthSampler(input_min_text_length, input_max_text_length)

    def tokenize(sample):
        sample["input_ids"] = tokenizer.encode(sample["review"])[: input_size()]
        sample["query"] = tokenizer.decode(sample["input_ids"])
        return sample

    ds = ds.map(tokenize, num_proc=dataset_num_proc)
    ds.set_format(type="torch")
    return ds


# Tokenize on the main process first; the others then read its cache.
with PartialState().local_main_process_first():
    dataset = build_dataset(ppo_config.query_dataset, ppo_config.dataset_num_proc)


def collator(data):
    return {key: [d[key] for d in data] for key in data[0]}


# Seed before the value head is created, so runs are repeatable.
set_seed(ppo_config.seed)

if not args.use_peft:
    ref_model = trl_model_class.from_pretrained(ppo_config.model_name, trust_remote_code=args.trust_remote_code)
    device_map = None
    peft_config = None
else:
    peft_config = LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, bias="none", task_type="CAUSAL_LM")
    ref_model = None  # the reference is the same model with its adapter disabled
    # One copy of the model per GPU process (the classic script assumed a GPU; the CPU otherwise).
    device_map = {"": Accelerator().local_process_index if torch.cuda.is_available() else "cpu"}

model = trl_model_class.from_pretrained(
    ppo_config.model_name,
    trust_remote_code=args.trust_remote_code,
    device_map=device_map,
    peft_config=peft_config,
)

tokenizer = AutoTokenizer.from_pretrained(ppo_config.model_name)
# GPT-2's tokenizer has no padding token; its end-of-text token serves.
tokenizer.pad_token_id = tokenizer.eos_token_id

ppo_trainer = PPOTrainer(ppo_config, model, ref_model, tokenizer, dataset=dataset, data_collator=collator)

# The classifier runs where the trainer's model runs (a device index for pipeline on one process).
device = ppo_trainer.accelerator.device
if ppo_trainer.accelerator.num_processes == 1:
    if is_torch_xpu_available():
        device = "xpu:0"
    elif is_torch_npu_available():
        device = "npu:0"
    else:
        device = 0 if torch.cuda.is_available() else "cpu"
ds_plugin = ppo_trainer.accelerator.state.deepspeed_plugin
task, model_name = ppo_config.reward_model.split(":")
if ds_plugin is not None and ds_plugin.is_zero3_init_enabled():
    # The classifier is not trained: keep it whole rather than partitioned by ZeRO-3.
    with ds_plugin.zero3_init_context_manager(enable=False):
        sentiment_pipe = pipeline(task, model=model_name, device=device)
else:
    sentiment_pipe = pipeline(task, model=model_name, device=device)

if sentiment_pipe.tokenizer.pad_token_id is None:
    sentiment_pipe.tokenizer.pad_token_id = tokenizer.pad_token_id
if sentiment_pipe.model.config.pad_token_id is None:
    sentiment_pipe.model.config.pad_token_id = tokenizer.pad_token_id
positive_label = sentiment_pipe.model.config.id2label[1]


def positive_score(output):
    """The positive label's logit among every label's scores of one text."""
    return next(item["score"] for item in output if item["label"] == positive_label)


# Pure sampling from the policy (no top-k, no nucleus), up to 32 new tokens.
generation_kwargs = {
    "min_length": -1,
    "top_k": 0.0,
    "top_p": 1.0,
    "do_sample": True,
    "pad_token_id": tokenizer.eos_token_id,
    "max_new_tokens": 32,
}

for batch in tqdm(ppo_trainer.dataloader):
    query_tensors = batch["input_ids"]

    # Responses of the policy and, for comparison, of the reference model.
    response_tensors, ref_response_tensors = ppo_trainer.generate(
        query_tensors, return_prompt=False, generate_ref_response=True, **generation_kwargs
    )
    batch["response"] = tokenizer.batch_decode(response_tensors)
    batch["ref_response"] = tokenizer.batch_decode(ref_response_tensors)

    # The reward of a query and its response: the classifier's positive logit.
    texts = [q + r for q, r in zip(batch["query"], batch["response"])]
    pipe_outputs = sentiment_pipe(texts, **sent_kwargs)
    rewards = [torch.tensor(positive_score(output)) for output in pipe_outputs]
    ref_texts = [q + r for q, r in zip(batch["query"], batch["ref_response"])]
    ref_pipe_outputs = sentiment_pipe(ref_texts, **sent_kwargs)
    ref_rewards = [torch.tensor(positive_score(output)) for output in ref_pipe_outputs]
    batch["ref_rewards"] = ref_rewards

    stats = ppo_trainer.step(query_tensors, response_tensors, rewards)
    ppo_trainer.log_stats(stats, batch, rewards, columns_to_log=["query", "response", "ref_response", "ref_rewards"])
