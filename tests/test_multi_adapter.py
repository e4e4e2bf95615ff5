"""Multi-adapter RL: a reward model's LoRA adapter and score head beside the policy adapter."""

import pytest
import torch
from devices import assert_close, equal
from peft import LoraConfig, PeftModel, get_peft_model
from tiny_models import VOCAB_SIZE, make_gpt2, make_tokenizer, random_batch
from transformers import GPT2ForSequenceClassification, GPT2LMHeadModel

from trl_lite import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer

POLICY_LORA = dict(r=4, lora_alpha=8, target_modules=["c_attn"], task_type="CAUSAL_LM")


def train_reward_adapter(base_dir, out_dir, **lora_kwargs):
    """A tiny reward model: LoRA + score head on the base GPT-2, a few regression steps, saved with peft."""
    torch.manual_seed(0)
    reward_model = GPT2ForSequenceClassification.from_pretrained(base_dir, num_labels=1)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], task_type="SEQ_CLS", modules_to_save=["score"])
    for key, value in lora_kwargs.items():
        setattr(config, key, value)
    reward_model = get_peft_model(reward_model, config)
    optimizer = torch.optim.Adam([p for p in reward_model.parameters() if p.requires_grad], lr=1e-2)
    input_ids = torch.randint(3, VOCAB_SIZE, (8, 6))
    targets = torch.linspace(-1, 1, 8).unsqueeze(-1)
    for _ in range(5):
        loss = torch.nn.functional.mse_loss(reward_model(input_ids=input_ids).logits, targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    reward_model.save_pretrained(out_dir)
    return out_dir


@pytest.fixture
def dirs(tmp_path):
    base = tmp_path / "base"
    make_gpt2().save_pretrained(base)
    return base, train_reward_adapter(base, tmp_path / "reward")


def load_reward_model(base_dir, reward_dir):
    """The reward model run directly: its own class, its own adapter, float64."""
    model = GPT2ForSequenceClassification.from_pretrained(base_dir, num_labels=1)
    return PeftModel.from_pretrained(model, reward_dir).double().eval()


def make_policy(base_dir, reward_dir, perturb=True, **kwargs):
    torch.manual_seed(1)
    model = AutoModelForCausalLMWithValueHead.from_pretrained(
        str(base_dir), peft_config=LoraConfig(**POLICY_LORA), reward_adapter=str(reward_dir), **kwargs
    )
    if perturb:  # a policy adapter that changes the outputs (LoRA B starts at zero)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B.default" in name:
                    param.normal_(std=0.5)
    return model


def padded_batch():
    """Right-padded (pad id 0) rows of different lengths."""
    g = torch.Generator().manual_seed(3)
    input_ids = torch.randint(3, VOCAB_SIZE, (3, 7), generator=g)
    attention_mask = torch.ones_like(input_ids)
    for row, length in enumerate((7, 5, 3)):
        input_ids[row, length:] = 0
        attention_mask[row, length:] = 0
    return input_ids, attention_mask


def reward_model_scores(reward_model, input_ids, attention_mask):
    """(per-position scores (B, S, 1), pooled logits (B, 1)) of the reward model's own forward."""
    captured = {}
    handle = reward_model.base_model.model.score.register_forward_hook(
        lambda module, inputs, output: captured.update(scores=output)
    )
    with torch.no_grad():
        pooled = reward_model(input_ids=input_ids, attention_mask=attention_mask).logits
    handle.remove()
    return captured["scores"], pooled


def test_compute_reward_score_equals_the_reward_model(dirs):
    base_dir, reward_dir = dirs
    model = make_policy(base_dir, reward_dir).double()
    reward_model = load_reward_model(base_dir, reward_dir)
    input_ids, attention_mask = padded_batch()
    scores = model.compute_reward_score(input_ids, attention_mask=attention_mask)
    want_scores, want_pooled = reward_model_scores(reward_model, input_ids, attention_mask)
    assert scores.shape == (3, 7, 1) and scores.dtype == torch.float64 and not scores.requires_grad
    assert_close(scores, want_scores, rtol=0, atol=1e-12)
    last = attention_mask.sum(1) - 1
    assert_close(scores[torch.arange(3), last], want_pooled, rtol=0, atol=1e-12)
    # The policy adapter was not applied: on its hidden states the score head gives other numbers.
    with torch.no_grad():
        policy_hidden = model.pretrained_model(input_ids, attention_mask=attention_mask, output_hidden_states=True)
    assert (model.score(policy_hidden.hidden_states[-1]) - want_scores).abs().max() > 1e-3


@pytest.mark.parametrize("training", [True, False])
def test_policy_outputs_mode_and_grads_unchanged_after_scoring(dirs, training):
    base_dir, reward_dir = dirs
    model = make_policy(base_dir, reward_dir, summary_dropout_prob=0.0).train(training)
    input_ids, attention_mask = padded_batch()
    flags = {name: p.requires_grad for name, p in model.named_parameters()}
    with torch.no_grad():
        before = model(input_ids, attention_mask=attention_mask)
        model.compute_reward_score(input_ids, attention_mask=attention_mask)
        after = model(input_ids, attention_mask=attention_mask)
    assert equal(before[0], after[0]) and equal(before[2], after[2])
    assert model.training is training and all(m.training is training for m in model.modules())
    assert model.pretrained_model.active_adapter == "default"
    assert {name: p.requires_grad for name, p in model.named_parameters()} == flags
    trainable = [name for name, flag in flags.items() if flag]
    assert trainable and all("lora_" in n and ".default." in n or n.startswith("v_head.") for n in trainable)


def test_policy_adapter_is_restored_when_the_forward_raises(dirs):
    base_dir, reward_dir = dirs
    model = make_policy(base_dir, reward_dir).train()
    with pytest.raises(Exception):
        model.compute_reward_score(torch.randint(3, VOCAB_SIZE, (1, 500)))  # longer than n_positions
    assert model.pretrained_model.active_adapter == "default" and model.training


def test_under_the_trainer_reference_is_the_base_model_and_reward_stays_frozen(dirs):
    base_dir, reward_dir = dirs
    model = make_policy(base_dir, reward_dir, perturb=False)  # fresh policy adapter: policy == base
    config = PPOConfig(batch_size=4, mini_batch_size=2, learning_rate=1e-2, ppo_epochs=2, seed=0)
    trainer = PPOTrainer(config, model, tokenizer=make_tokenizer())
    assert trainer.ref_model is None
    queries, responses, _ = random_batch(4)
    texts = [torch.cat([q, r]) for q, r in zip(queries, responses)]
    rewards = [model.compute_reward_score(t.unsqueeze(0))[0, -1, 0] for t in texts]
    reward_before = {n: p.clone() for n, p in model.named_parameters() if "reward_adapter" in n or n.startswith("score.")}
    stats = trainer.step(queries, responses, rewards)
    # The first rollout compares the policy (fresh adapter) with the reference (no adapter at all):
    # zero KL shows neither the reward adapter nor the policy adapter ran in the reference pass.
    assert abs(stats["objective/kl"]) < 1e-6
    assert all(equal(p, reward_before[n]) for n, p in model.named_parameters() if n in reward_before)
    assert any(p.abs().max() > 0 for n, p in model.named_parameters() if "lora_B.default" in n)
    # With every adapter disabled the model is the plain base model, after training as before it.
    plain = GPT2LMHeadModel.from_pretrained(base_dir).eval()
    input_ids, attention_mask = padded_batch()
    with torch.no_grad(), model.pretrained_model.disable_adapter():
        device = trainer.accelerator.device  # the model's forward takes inputs on its device (as transformers')
        logits = model.eval()(input_ids.to(device), attention_mask=attention_mask.to(device))[0]
    assert_close(logits, plain(input_ids, attention_mask=attention_mask).logits, rtol=0, atol=1e-5)
    # And scoring still gives the reward model's scores.
    want, _ = reward_model_scores(load_reward_model(base_dir, reward_dir), input_ids, attention_mask)
    scores = model.compute_reward_score(input_ids, attention_mask=attention_mask)
    assert_close(scores.double(), want, rtol=0, atol=1e-5)


def test_score_head_bias_is_read_from_the_head_only(dirs, tmp_path):
    """LoRA with bias="all" saves other biases; the score head (no bias in GPT-2) must still load."""
    base_dir, _ = dirs
    reward_dir = train_reward_adapter(base_dir, tmp_path / "reward_bias", bias="all")
    model = make_policy(base_dir, reward_dir).double()
    assert model.score.bias is None
    input_ids, attention_mask = padded_batch()
    want, _ = reward_model_scores(load_reward_model(base_dir, reward_dir), input_ids, attention_mask)
    assert_close(model.compute_reward_score(input_ids, attention_mask), want, rtol=0, atol=1e-12)


def test_save_pretrained_keeps_the_policy_and_leaves_the_score_head_out(dirs, tmp_path):
    base_dir, reward_dir = dirs
    model = make_policy(base_dir, reward_dir).eval()
    assert "score.weight" in model.state_dict()  # checkpoints (accelerate save_state) hold everything
    model.save_pretrained(tmp_path / "policy")
    loaded = AutoModelForCausalLMWithValueHead.from_pretrained(
        str(tmp_path / "policy"), reward_adapter=str(reward_dir)
    ).eval()
    input_ids, attention_mask = padded_batch()
    with torch.no_grad():
        for got, want in zip(loaded(input_ids, attention_mask=attention_mask), model(input_ids, attention_mask=attention_mask)):
            if want is not None:
                assert_close(got, want, rtol=0, atol=0)
    assert_close(
        loaded.compute_reward_score(input_ids, attention_mask), model.compute_reward_score(input_ids, attention_mask)
    )


def test_bad_reward_adapter_arguments(dirs, tmp_path, gpt2):
    base_dir, reward_dir = dirs
    lora = LoraConfig(**POLICY_LORA)
    with pytest.raises(ValueError, match="reward_adapter must be a str"):
        AutoModelForCausalLMWithValueHead.from_pretrained(str(base_dir), peft_config=lora, reward_adapter=reward_dir)
    with pytest.raises(ValueError, match="reward_adapter_name must be a non-empty str"):
        AutoModelForCausalLMWithValueHead.from_pretrained(
            str(base_dir), peft_config=lora, reward_adapter=str(reward_dir), reward_adapter_name=""
        )
    with pytest.raises(ValueError, match="needs a PEFT policy"):
        AutoModelForCausalLMWithValueHead.from_pretrained(gpt2, reward_adapter=str(reward_dir))
    modules = [name for name, _ in gpt2.named_modules()]
    with pytest.raises(ValueError, match="holds none of"):
        AutoModelForCausalLMWithValueHead.from_pretrained(gpt2, peft_config=lora, reward_adapter=str(tmp_path))
    assert [name for name, _ in gpt2.named_modules()] == modules  # rejected before peft adapted the model
    with pytest.raises(ValueError, match="already an adapter"):
        AutoModelForCausalLMWithValueHead.from_pretrained(
            str(base_dir), peft_config=lora, reward_adapter=str(reward_dir), reward_adapter_name="default"
        )
    with pytest.raises(ValueError, match="compute_reward_score needs a reward adapter"):
        AutoModelForCausalLMWithValueHead.from_pretrained(gpt2).compute_reward_score(torch.tensor([[3, 4]]))


def test_adapter_without_score_head_is_rejected(dirs, tmp_path):
    base_dir, _ = dirs
    causal = get_peft_model(GPT2LMHeadModel.from_pretrained(base_dir), LoraConfig(**POLICY_LORA))
    causal.save_pretrained(tmp_path / "no_head")
    with pytest.raises(ValueError, match="holds no score head"):
        make_policy(base_dir, tmp_path / "no_head")
