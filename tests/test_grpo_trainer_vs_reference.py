"""GRPOTrainer's and RLOOTrainer's update of one generation against float64 brute-force references of TRL 1.x's
objectives, written out per row and per token (benchmarks/MEASURED_BY_HAND.md has the comparison with TRL 1.16's
own code that these references follow):

- GRPO: advantages ``(r - mean) / (std + 1e-4)`` over each group's scored rows (an unscored row, NaN: advantage 0,
  kept in the loss), the clipped token ratio, ``beta`` times k3 to the reference, the entropy bonus as the
  micro-batch's token mean, ``scale_rewards="batch"`` (the batch's std), each ``loss_type``'s normalisation per
  micro-batch (``dapo``: the generation's tokens; ``grpo``: every completion of the micro-batch, a masked one
  counting 0); TRL's ``kl`` metric, the token mean of k3;
- RLOO: the leave-one-out advantage of ``reward - beta * sum_t (lp_old - lp_ref)`` over the scored siblings, one
  clipped ratio per completion ``exp(sum_t (lp - lp_old))``, the mean over the micro-batch's completions, two
  iterations (the second one clips).

A step runs with SGD (learning rate ``lr``, no clipping of the gradient norm) and the mini-batches in row order, so
``(before - after) / lr`` is the summed gradient; tiny Qwen2 (rotary, grouped-query) beside GPT-2."""

import copy
import math

import pytest
import torch
from grpo_helpers import config, count_good, dataset, tokenizer
from tiny_models import make_gpt2, make_qwen2

import trl_lite.trainer.step.learner as learner
from trl_lite import GRPOTrainer, RLOOConfig, RLOOTrainer
from trl_lite.trainer.step.objective import PolicyObjective

K, ROWS, LMAX, MB, GA = 4, 8, 6, 4, 2
LENGTHS = [6, 3, 5, 2, 4, 6, 1, 5]  # rows 0 and 5 run to LMAX without EOS: truncated
MODELS = {"gpt2": make_gpt2, "qwen2": make_qwen2}


@pytest.fixture(autouse=True)
def rows_in_order(monkeypatch):
    monkeypatch.setattr(learner, "epoch_order", lambda n, prompts=None: torch.arange(n))


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    queries = [q for q in (torch.randint(3, 40, (4,), generator=g) for _ in range(ROWS // K)) for _ in range(K)]
    responses = []
    for n in LENGTHS:
        r = torch.randint(3, 40, (n,), generator=g)
        if n < LMAX:
            r[-1] = 1  # EOS
        responses.append(r)
    return queries, responses


def perturb(model, seed=7, scale=0.05):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))


def float64_rows(model, queries, responses, temperature):
    """Per row, float64 log-probs and entropies of its response tokens (with grad), one forward per row."""
    lps, entropies = [], []
    for query, response in zip(queries, responses):
        logits = model(input_ids=torch.cat([query, response])[None]).logits[0, len(query) - 1 : -1] / temperature
        logp = torch.log_softmax(logits, -1)
        lps.append([logp[t, response[t]] for t in range(len(response))])
        entropies.append([-(logp[t].exp() * logp[t]).sum() for t in range(len(response))])
    return lps, entropies


def group_advantages(rewards, scale, leave_one_out=False, batch=False):
    """TRL's advantages of each group of K, NaN-aware, in float64 (plain Python); ``batch``: the group-centred
    rewards divided by the std of the whole batch's scored rewards + 1e-4 (TRL's ``scale_rewards="batch"``)."""
    if batch:
        centred = group_advantages(rewards, scale=False)
        scored = [r for r in rewards if not math.isnan(r)]
        mean = sum(scored) / len(scored)
        std = math.sqrt(sum((r - mean) ** 2 for r in scored) / (len(scored) - 1))
        return [a / (std + 1e-4) for a in centred]
    out = []
    for g in range(0, len(rewards), K):
        group = rewards[g : g + K]
        scored = [r for r in group if not math.isnan(r)]
        n = len(scored)
        for r in group:
            if math.isnan(r) or (leave_one_out and n < 2):
                out.append(0.0)
            elif leave_one_out:
                out.append(r - (sum(scored) - r) / (n - 1))
            else:
                mean = sum(scored) / n
                std = math.sqrt(sum((v - mean) ** 2 for v in scored) / (n - 1)) if n > 1 else math.nan
                a = (r - mean) / (std + 1e-4) if scale else r - mean
                out.append(0.0 if math.isnan(a) else a)
    return out


def sgd_update(trainer, lr, queries, responses, scores, masks=None):
    """``(before - after) / lr`` of one ``step()`` with SGD: the summed gradient of its optimizer steps."""
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    stats = trainer.ppo.step(queries, responses, [torch.tensor(s) for s in scores], response_masks=masks)
    return {n: (before[n] - p.detach()).double() / lr for n, p in trainer.model.named_parameters()}, stats


def assert_close_to(update, reference_model, lr=1.0, start=None):
    """The step's update against the reference's summed gradient (or its parameter change from ``start``)."""
    for name, p in reference_model.named_parameters():
        want = p.grad if start is None else (start[name] - p.detach()) / lr
        scale = float(want.abs().max()) + 1e-12
        assert float((update[name] - want).abs().max()) <= 2e-5 * scale + 1e-8, name


CASES = {
    "dapo_kl_entropy_unscored": dict(loss_type="dapo", beta=0.1, entropy_coef=0.05),
    "grpo_kl_entropy_temperature": dict(loss_type="grpo", beta=0.1, entropy_coef=0.05, temperature=0.7),
    "dr_grpo_unscaled_unscored": dict(loss_type="dr_grpo", scale_rewards="none", beta=0.05),
    "bnpo_masked_truncated": dict(loss_type="bnpo", mask_truncated_completions=True, entropy_coef=0.05),
    "grpo_masked_truncated": dict(loss_type="grpo", mask_truncated_completions=True, beta=0.1),  # TRL: masked count 0
    "dapo_batch_scaled_unscored": dict(loss_type="dapo", scale_rewards="batch"),
}


@pytest.mark.parametrize("model_name", sorted(MODELS))
@pytest.mark.parametrize("case", sorted(CASES))
def test_grpo_update_and_kl_match_trls_objective_in_float64(tmp_path, model_name, case):
    cfg = CASES[case]
    lm = MODELS[model_name]()
    reference = copy.deepcopy(lm).double()
    sgd = torch.optim.SGD(lm.parameters(), lr=1.0)
    trainer = GRPOTrainer(model=lm, reward_funcs=[count_good], train_dataset=dataset(), processing_class=tokenizer(),
                          optimizers=(sgd, None),
                          args=config(tmp_path, per_device_train_batch_size=MB, gradient_accumulation_steps=GA,
                                      num_generations=K, max_completion_length=LMAX, max_grad_norm=0.0,
                                      gradient_checkpointing=False, **cfg))  # fmt: skip
    perturb(trainer.model)  # the policy moves off the reference: k3 > 0
    policy = copy.deepcopy(trainer.model).double()
    queries, responses = batch()
    rewards = [1.0, 0.2, 2.5, 1.0, 0.5, 1.5, 0.0, 3.0]
    if "unscored" in case:
        rewards[2] = rewards[5] = math.nan  # TRL's None from every reward function
    keep = [not (cfg.get("mask_truncated_completions") and n == LMAX) for n in LENGTHS]
    masks = [torch.ones_like(r) * int(k) for r, k in zip(responses, keep)] if not all(keep) else None
    update, stats = sgd_update(trainer, 1.0, queries, responses, rewards, masks)

    # The reference: TRL's loss of each micro-batch, summed over the generation's GA micro-batches.
    temperature, beta, coef = cfg.get("temperature", 1.0), cfg.get("beta", 0.0), cfg.get("entropy_coef", 0.0)
    scale = cfg.get("scale_rewards", "group")
    advantages = group_advantages(rewards, scale == "group", batch=scale == "batch")
    lps, entropies = float64_rows(policy, queries, responses, temperature)
    with torch.no_grad():
        ref_lps, _ = float64_rows(reference, queries, responses, temperature)
    generation_tokens = sum(n for n, k in zip(LENGTHS, keep) if k)
    kl_means = []
    for start in range(0, ROWS, MB):
        rows = range(start, start + MB)
        row_sums, token_sum, tokens, kl_sum, entropy_sum = [], 0.0, 0, 0.0, 0.0
        for i in rows:
            row = 0.0
            for t in range(LENGTHS[i] if keep[i] else 0):
                lp, ref = lps[i][t], ref_lps[i][t]
                loss = -advantages[i] * torch.exp(lp - lp.detach())  # ratio 1: no clip binds
                k3 = torch.exp(ref - lp) - (ref - lp) - 1
                row, tokens = row + loss + beta * k3, tokens + 1
                kl_sum, entropy_sum = kl_sum + k3.detach(), entropy_sum + entropies[i][t]
            row_sums.append((row, LENGTHS[i] if keep[i] else 0))
            token_sum = token_sum + row
        loss = {
            "grpo": sum(s / max(n, 1) for s, n in row_sums) / MB / GA,
            "bnpo": token_sum / max(tokens, 1) / GA,
            "dr_grpo": token_sum / (MB * LMAX) / GA,
            "dapo": token_sum / generation_tokens,
        }[cfg["loss_type"]]
        if coef:
            loss = loss - coef * entropy_sum / max(tokens, 1) / GA
        loss.backward()
        kl_means.append(float(kl_sum) / max(tokens, 1))
    assert_close_to(update, policy)
    if beta:
        assert trainer._kl(stats) == pytest.approx(sum(kl_means) / len(kl_means), rel=1e-4)


def test_rloo_clips_one_ratio_per_completion_with_trls_advantages_over_two_iterations(tmp_path):
    for model_name, make in MODELS.items():
        lm = make()
        reference = copy.deepcopy(lm).double()
        lr, beta, epsilon = 0.5, 0.1, 0.1
        args = RLOOConfig(output_dir=str(tmp_path / model_name), per_device_train_batch_size=MB, gradient_accumulation_steps=GA,
                          num_generations=K, max_completion_length=LMAX, max_grad_norm=0.0, gradient_checkpointing=False,
                          beta=beta, epsilon=epsilon, num_iterations=2, report_to="none", max_steps=2)  # fmt: skip
        trainer = RLOOTrainer(model=lm, reward_funcs=[count_good], args=args, train_dataset=dataset(),
                              processing_class=tokenizer(), optimizers=(torch.optim.SGD(lm.parameters(), lr=lr), None))  # fmt: skip
        perturb(trainer.model)
        policy = copy.deepcopy(trainer.model).double()
        start = {n: p.detach().clone() for n, p in policy.named_parameters()}
        queries, responses = batch(seed=1)
        rewards = [1.0, 0.2, math.nan, 1.0, 0.5, 1.5, 0.0, 3.0]
        update, stats = sgd_update(trainer, lr, queries, responses, rewards)

        with torch.no_grad():
            old = [sum(row) for row in float64_rows(policy, queries, responses, 1.0)[0]]
            ref = [sum(row) for row in float64_rows(reference, queries, responses, 1.0)[0]]
        rho = [r - beta * (o - f) for r, o, f in zip(rewards, old, ref)]  # NaN stays NaN: unscored
        advantages = group_advantages(rho, scale=False, leave_one_out=True)
        shares = []  # per micro-batch, the share of its completions where the clip binds (TRL's clip_ratio/region_mean)
        for _ in range(2):  # num_iterations: the second pass clips against the first one's start
            policy.zero_grad()
            lps = [sum(row) for row in float64_rows(policy, queries, responses, 1.0)[0]]
            for begin in range(0, ROWS, MB):
                losses, binds = [], 0
                for i in range(begin, begin + MB):
                    ratio = torch.exp(lps[i] - old[i])
                    r, a = float(ratio.detach()), advantages[i]
                    binds += int((a > 0 and r > 1 + epsilon) or (a < 0 and r < 1 - epsilon))
                    losses.append(torch.max(-advantages[i] * ratio, -advantages[i] * ratio.clamp(1 - epsilon, 1 + epsilon)))
                (sum(losses) / MB / GA).backward()
                shares.append(binds / MB)
            with torch.no_grad():
                for p in policy.parameters():
                    p -= lr * p.grad
        assert max(shares) > 0  # the check covers the clip
        assert_close_to(update, policy, lr, start)
        assert float(stats["ppo/policy/clipfrac_seq"]) == pytest.approx(sum(shares) / len(shares), abs=1e-9)
        kl = float(sum(o - f for o, f in zip(old, ref))) / sum(LENGTHS)
        assert trainer._kl(stats) == pytest.approx(kl, rel=1e-4)  # TRL's RLOO kl: mean per-token lp_old - lp_ref


def test_sequence_sum_ratio_of_the_objective_against_a_per_token_loop():
    """``importance_sampling_level="sequence_sum"`` on given tensors where the clip binds (a row) and where a ratio
    is out of the range on the side that does not bind (another): loss, gradient and the share of rows clipped."""
    g = torch.Generator().manual_seed(5)
    rows, width = 5, 6
    lengths = [6, 2, 4, 1, 5]
    mask = (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).double()
    old = -torch.rand(rows, width, generator=g, dtype=torch.float64)
    lp = (old + 0.05 * torch.randn(rows, width, generator=g, dtype=torch.float64)).requires_grad_(True)
    advantages = torch.randn(rows, generator=g, dtype=torch.float64)
    objective = PolicyObjective(cliprange=0.1, cliprange_high=0.2, importance_sampling_level="sequence_sum",
                                loss_type="seq_mean_token_mean")  # fmt: skip
    loss, stats = objective(lp, old, advantages[:, None] * mask, mask)
    (got,) = torch.autograd.grad(loss, lp)
    lp_ref = lp.detach().clone().requires_grad_(True)
    total, clipped, binds = 0.0, 0, 0
    for i in range(rows):
        ratio = torch.exp(sum(lp_ref[i, t] - old[i, t] for t in range(lengths[i])))
        clipped += int(not 0.9 <= float(ratio.detach()) <= 1.2)
        binds += int((advantages[i] > 0 and float(ratio) > 1.2) or (advantages[i] < 0 and float(ratio) < 0.9))
        total = total + torch.max(-advantages[i] * ratio, -advantages[i] * ratio.clamp(0.9, 1.2))
    want_loss = total / rows
    (want,) = torch.autograd.grad(want_loss, lp_ref)
    assert 0 < binds < clipped < rows
    # TRL's clip_ratio/region_mean of one ratio per completion: the share of the completions where the clip binds
    assert float(stats["policy/clipfrac_seq"]) == pytest.approx(binds / rows, abs=1e-12)
    assert float(loss) == pytest.approx(float(want_loss), abs=1e-12)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
