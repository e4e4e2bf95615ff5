"""The compute floors of `bench_step.py`: hand-written PPO steps on plain transformers that do only the
model work no step can avoid (`FloorPPO`, its packed form `PackedFloorPPO`), and the floors of the critic-free,
`grpo-beta0` and separate-critic workloads. `bench_step.py`'s docstring says what the floor counts.

Only `PackedFloorPPO` imports trl_lite (its packed attention), so `--methods floor` runs without it.
"""

import copy
import ctypes
import platform
import sys

import torch
from torch import nn

# Classic PPO defaults (the same values PPOConfig uses), written here so the floor needs no trl_lite.
LEARNING_RATE = 1.41e-5
KL_COEF = 0.2
GAMMA = 1.0
LAM = 0.95
CLIPRANGE = 0.2
CLIPRANGE_VALUE = 0.2
VF_COEF = 0.1


def pack_rows(queries: list, responses: list, rows: list, pad_id: int, device: str) -> dict:
    """Right-pad `query + response` of the given rows to their own longest row.

    Shapes, with n = len(rows), L = longest query+response, K = longest response:
    input_ids, attention_mask (n, L); positions (n, K) index of the token that predicts response
    token k; targets (n, K) response token k; mask (n, K) 1 where k < len(response).
    """
    seqs = [torch.cat([queries[i], responses[i]]) for i in rows]
    q_lens = torch.tensor([len(queries[i]) for i in rows])
    r_lens = torch.tensor([len(responses[i]) for i in rows])
    longest, k_max = max(len(s) for s in seqs), int(r_lens.max())
    input_ids = torch.full((len(rows), longest), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), longest), dtype=torch.long)
    for j, s in enumerate(seqs):
        input_ids[j, : len(s)] = s
        attention_mask[j, : len(s)] = 1
    k = torch.arange(k_max).unsqueeze(0)
    mask = k < r_lens.unsqueeze(1)
    # Padded slots point at the last response-predicting position of their row: valid, and masked out.
    positions = q_lens.unsqueeze(1) - 1 + torch.minimum(k, r_lens.unsqueeze(1) - 1)
    targets = input_ids.gather(1, positions + 1)
    batch = dict(input_ids=input_ids, attention_mask=attention_mask, positions=positions, targets=targets, mask=mask)
    return {name: t.to(device) for name, t in batch.items()}


# Rows of the (n, V) logits per log-softmax call: about 2 MiB of float32 on CPU, which stays in
# cache (the fused kernel is then about twice as fast as on the whole tensor); large on GPUs.
def rows_per_chunk(z: torch.Tensor) -> int:
    return max(1, (2 << 20 if z.device.type == "cpu" else 256 << 20) // (4 * z.shape[-1]))


def head_logits(hidden: torch.Tensor, weight: torch.Tensor, buffer=None) -> torch.Tensor:
    """`hidden @ weight.T` (N, V) in float32, written into the first N rows of `buffer` (R >= N, V).

    The floor reuses one buffer for every pass (see `FloorPPO.step`); without one, a fresh tensor.
    """
    if buffer is None:
        buffer = torch.empty((len(hidden), weight.shape[0]), device=hidden.device)
    out = buffer[: len(hidden)]
    if hidden.dtype == torch.float32 and weight.dtype == torch.float32:
        return torch.mm(hidden, weight.t(), out=out)
    return out.copy_(hidden @ weight.t())


class HeadLogProb(torch.autograd.Function):
    """`log softmax(hidden W^T)[target]`, the LM head and the log-softmax in one buffer.

    The logits buffer turns into the softmax a cache-sized chunk at a time; the backward makes the
    gradient of the logits in place in it (`(onehot - softmax) * grad`), then the two products of
    the head's backward. Shapes: hidden (N, H), weight (V, H), target (N,) -> (N,).
    """

    @staticmethod
    def forward(ctx, hidden, weight, target, buffer):
        z = head_logits(hidden, weight, buffer)
        chosen = z.new_empty(len(z))
        step = rows_per_chunk(z)
        work = z.new_empty((min(step, len(z)), z.shape[1]))
        for start in range(0, len(z), step):
            rows = slice(start, start + step)  # slices are views: no copy of the chunk
            log_p = torch.log_softmax(z[rows], -1, out=work[: len(z[rows])])
            chosen[rows] = log_p.gather(-1, target[rows, None])[:, 0]
            torch.exp(log_p, out=z[rows])
        ctx.save_for_backward(hidden, weight, z, target)
        return chosen

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, softmax, target = ctx.saved_tensors
        grad = grad[:, None]
        grad_z = softmax.mul_(-grad).scatter_add_(-1, target[:, None], grad).to(weight.dtype)
        return grad_z @ weight, grad_z.t() @ hidden, None, None


def head_logprob_no_grad(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, buffer=None):
    """`log softmax(hidden W^T)[target]` without grad, the log-softmax a cache-sized chunk at a time. -> (N,)"""
    z = head_logits(hidden, weight, buffer)
    step = rows_per_chunk(z)
    chunks = [
        torch.log_softmax(z[start : start + step], -1).gather(-1, target[start : start + step, None])[:, 0]
        for start in range(0, len(z), step)
    ]
    return torch.cat(chunks)


def response_logprobs(lm, batch: dict, v_head=None, buffer=None) -> tuple:
    """Log-probs (and values) of the response tokens, with the LM head only where a token is predicted.

    Shapes: log-probs (n, K) = gathered logit - logsumexp over the vocabulary, 0 past each
    response; values (n, K) or None. The LM head sees only the N = mask.sum() hidden states that
    predict a response token, not the padding of shorter responses.
    """
    # No key/value cache: building one is work that a training forward does not need.
    inputs = batch.get("model_inputs") or dict(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    hidden = lm.base_model(**inputs, use_cache=False).last_hidden_state
    mask = batch["mask"]
    # A packed batch is one row (1, N_total) shared by the n rows of `positions`.
    hidden = hidden.expand(mask.shape[0], -1, -1)
    index = batch["positions"].unsqueeze(-1).expand(-1, -1, hidden.shape[-1])
    picked = hidden.gather(1, index)  # (n, K, H)
    h, weight, targets = picked[mask], lm.lm_head.weight, batch["targets"][mask]  # h: (N, H)
    if torch.is_grad_enabled():
        chosen = HeadLogProb.apply(h, weight, targets, buffer)
    else:
        chosen = head_logprob_no_grad(h, weight, targets, buffer)
    logprobs = torch.zeros(mask.shape, device=chosen.device).masked_scatter(mask, chosen)
    values = v_head(picked).squeeze(-1) if v_head is not None else None
    return logprobs, values


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of `x` over the entries where `mask` is 1."""
    return (x * mask).sum() / mask.sum()


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> tuple:
    """Advantages (whitened over the mask) and returns; inputs (B, K) in response-token order."""
    rewards, values = rewards * mask, values * mask
    advantages = torch.zeros_like(rewards)
    next_value = next_adv = torch.zeros_like(rewards[:, 0])
    for k in reversed(range(rewards.shape[1])):
        delta = rewards[:, k] + GAMMA * next_value - values[:, k]
        advantages[:, k] = delta + GAMMA * LAM * next_adv
        next_value, next_adv = values[:, k], advantages[:, k]
    returns = advantages + values
    mean = masked_mean(advantages, mask)
    var = masked_mean((advantages - mean) ** 2, mask) * mask.sum() / (mask.sum() - 1)
    return (advantages - mean) * torch.rsqrt(var + 1e-8) * mask, returns


def keep_freed_heap() -> None:
    """Make glibc keep freed blocks of up to 32 MiB for reuse (Linux with glibc; elsewhere nothing).

    The same two mallopt settings `PPOConfig.keep_freed_cpu_memory` makes the trainer apply when it
    is constructed, written here so the floor needs no trl_lite. The floor applies them at the same
    point, once its models are built: applied at process start instead, the memory freed while
    building would stay resident, count in the baseline of the peak and be reused for free.
    """
    if sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc":
        mallopt = ctypes.CDLL(None).mallopt
        mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD: glibc's largest accepted value on 64-bit systems
        mallopt(-1, 2**31 - 1)  # M_TRIM_THRESHOLD: never trim the heap


class FloorPPO:
    """The unavoidable model work of one PPO step, hand-written on a plain GPT2LMHeadModel."""

    def __init__(self, lm, mini_batch_size: int, ppo_epochs: int):
        self.lm = lm.train()
        self.ref = copy.deepcopy(lm).eval().requires_grad_(False)
        param = next(lm.parameters())
        self.v_head = nn.Linear(lm.config.hidden_size, 1).to(device=param.device, dtype=param.dtype)
        if param.device.type == "cpu":  # as the trainer: on CPU, after its models, before its optimizer
            keep_freed_heap()
        self.optimizer = torch.optim.Adam([*lm.parameters(), *self.v_head.parameters()], lr=LEARNING_RATE, fused=True)
        self.mini_batch_size = mini_batch_size
        self.ppo_epochs = ppo_epochs
        self.pad_id = lm.config.pad_token_id
        self.device = param.device
        self.buffer = None

    def _pack(self, queries, responses, rows):
        return pack_rows(queries, responses, rows, self.pad_id, self.device)

    @torch.no_grad()
    def _rollout(self, queries, responses, scores) -> dict:
        """Old log-probs, values, advantages and returns, each (B, K_max) in response-token order."""
        n, k_max = len(queries), max(len(r) for r in responses)
        old = {key: torch.zeros(n, k_max, device=self.device) for key in ("logprobs", "ref", "values", "mask")}
        for start in range(0, n, self.mini_batch_size):
            rows = list(range(start, min(start + self.mini_batch_size, n)))
            batch = self._pack(queries, responses, rows)
            logprobs, values = response_logprobs(self.lm, batch, self.v_head, self.buffer)
            values = self._values(batch, values)
            ref, _ = response_logprobs(self.ref, batch, buffer=self.buffer)
            k = batch["mask"].shape[1]
            for key, t in (("logprobs", logprobs), ("ref", ref), ("values", values), ("mask", batch["mask"])):
                old[key][start : start + len(rows), :k] = t
        mask = old["mask"]
        rewards = -KL_COEF * (old["logprobs"] - old["ref"]) * mask
        last = torch.tensor([len(r) - 1 for r in responses], device=self.device)
        rewards[torch.arange(n, device=self.device), last] += torch.stack(scores).to(self.device).float()
        old["advantages"], old["returns"] = gae(rewards, old["values"], mask)
        return old

    def _train_minibatch(self, queries, responses, rows, old: dict):
        """One forward + backward + Adam step on the clipped PPO loss of the given rows."""
        batch = self._pack(queries, responses, rows)
        mask = batch["mask"]
        index = torch.tensor(rows, device=self.device)
        take = {key: t[index, : mask.shape[1]] for key, t in old.items()}
        logprobs, values = response_logprobs(self.lm, batch, self.v_head, self.buffer)
        values = self._values(batch, values)
        ratio = torch.exp(logprobs.float() - take["logprobs"])
        adv = take["advantages"]
        pg_loss = masked_mean(torch.max(-adv * ratio, -adv * ratio.clamp(1 - CLIPRANGE, 1 + CLIPRANGE)), mask)
        v_old, ret = take["values"], take["returns"]
        v_clip = torch.clamp(values.float(), v_old - CLIPRANGE_VALUE, v_old + CLIPRANGE_VALUE)
        vf_loss = 0.5 * masked_mean(torch.max((values.float() - ret) ** 2, (v_clip - ret) ** 2), mask)
        self._update(pg_loss, vf_loss)

    def _values(self, batch: dict, values: torch.Tensor) -> torch.Tensor:
        """The values of a pass: here the policy's value head's (a separate critic replaces this)."""
        return values

    def _update(self, pg_loss: torch.Tensor, vf_loss: torch.Tensor) -> None:
        (pg_loss + VF_COEF * vf_loss).backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def step(self, queries: list, responses: list, scores: list) -> None:
        """One PPO step: rollout forward passes, then `ppo_epochs` shuffled passes over mini-batches."""
        # One LM-head buffer for every pass, with the rows of the largest possible mini-batch and kept
        # between steps: no vocabulary-sized block is freed and allocated again (the trainer does the
        # same on CPU), so the glibc heap does not fragment.
        rows = sum(sorted((len(r) for r in responses), reverse=True)[: self.mini_batch_size])
        if self.buffer is None or len(self.buffer) < rows:
            self.buffer = None
            self.buffer = torch.empty((rows, self.lm.config.vocab_size), device=self.device)
        old = self._rollout(queries, responses, scores)
        n = len(queries)
        for _ in range(self.ppo_epochs):
            order = torch.randperm(n).tolist()
            for start in range(0, n, self.mini_batch_size):
                self._train_minibatch(queries, responses, order[start : start + self.mini_batch_size], old)


class PackedFloorPPO(FloorPPO):
    """The floor over packed mini-batches: each mini-batch is one row ``(1, N_total)`` of its rows'
    tokens with position ids restarting per row, so no padding token is computed, and attends within
    each row through trl_lite's packed attention - one varlen kernel call per layer on CUDA, sdpa per
    row elsewhere: the attention of the packed step, so the two differ by overhead only."""

    def _pack(self, queries, responses, rows):
        from trl_lite.models.packed_attention import ROW_LENGTHS, rows_mask
        from trl_lite.models.varlen_attention import packed_rows

        seqs = [torch.cat([queries[i], responses[i]]) for i in rows]
        lengths = [len(s) for s in seqs]
        starts = torch.tensor([0, *lengths[:-1]]).cumsum(0)
        q_lens = torch.tensor([len(queries[i]) for i in rows])
        r_lens = torch.tensor([len(responses[i]) for i in rows])
        k = torch.arange(int(r_lens.max())).unsqueeze(0)
        mask = k < r_lens.unsqueeze(1)
        # Padded slots point at the last response-predicting position of their row: valid, and masked out.
        positions = (starts + q_lens - 1).unsqueeze(1) + torch.minimum(k, r_lens.unsqueeze(1) - 1)
        input_ids = torch.cat(seqs)
        batch = {"positions": positions, "targets": input_ids[positions + 1], "mask": mask}
        batch = {name: t.to(self.device) for name, t in batch.items()}
        attention = packed_rows(lengths, self.device)
        batch["model_inputs"] = {
            "input_ids": input_ids.unsqueeze(0).to(self.device),
            "position_ids": torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0).to(self.device),
            ROW_LENGTHS: attention,
        }
        mask_4d = rows_mask(attention, self.device)
        if mask_4d is not None:
            batch["model_inputs"]["attention_mask"] = mask_4d
        return batch

    def step(self, queries: list, responses: list, scores: list) -> None:
        from trl_lite.models.packed_attention import attend_per_row

        with attend_per_row([self.lm, self.ref]):
            super().step(queries, responses, scores)


# --- critic-free floors (docs/algorithm.md sections 3 and 12): GRPO advantages, no value head -------------
class CriticFreeFloor(FloorPPO):
    """The unavoidable model work of one GRPO step: the policy and reference forwards without grad,
    then forward + backward + Adam per mini-batch on the clipped loss plus `KL_COEF * k3`. No value head."""

    def __init__(self, lm, mini_batch_size: int, ppo_epochs: int, num_samples_per_query: int):
        super().__init__(lm, mini_batch_size, ppo_epochs)
        self.v_head = None
        self.optimizer = torch.optim.Adam(lm.parameters(), lr=LEARNING_RATE, fused=True)
        self.k = num_samples_per_query

    @torch.no_grad()
    def _rollout(self, queries, responses, scores) -> dict:
        """Old and reference log-probs, mask and GRPO advantages, each (B, K_max) in response-token order."""
        n, k_max = len(queries), max(len(r) for r in responses)
        old = {key: torch.zeros(n, k_max, device=self.device) for key in ("logprobs", "ref", "mask")}
        for start in range(0, n, self.mini_batch_size):
            rows = list(range(start, min(start + self.mini_batch_size, n)))
            batch = self._pack(queries, responses, rows)
            logprobs, _ = response_logprobs(self.lm, batch, buffer=self.buffer)
            ref, _ = response_logprobs(self.ref, batch, buffer=self.buffer)
            k = batch["mask"].shape[1]
            for key, t in (("logprobs", logprobs), ("ref", ref), ("mask", batch["mask"])):
                old[key][start : start + len(rows), :k] = t
        groups = torch.stack(scores).to(self.device).float().view(-1, self.k)
        advantages = (groups - groups.mean(-1, keepdim=True)) / (groups.std(-1, keepdim=True) + 1e-6)
        old["advantages"] = advantages.reshape(-1, 1) * old["mask"]
        return old

    def _train_minibatch(self, queries, responses, rows, old: dict):
        batch = self._pack(queries, responses, rows)
        mask = batch["mask"]
        index = torch.tensor(rows, device=self.device)
        take = {key: t[index, : mask.shape[1]] for key, t in old.items()}
        logprobs, _ = response_logprobs(self.lm, batch, buffer=self.buffer)
        ratio = torch.exp(logprobs.float() - take["logprobs"])
        adv = take["advantages"]
        pg_loss = masked_mean(torch.max(-adv * ratio, -adv * ratio.clamp(1 - CLIPRANGE, 1 + CLIPRANGE)), mask)
        log_ratio = take["ref"] - logprobs.float()
        k3 = torch.exp(log_ratio) - log_ratio - 1
        (pg_loss + KL_COEF * masked_mean(k3, mask)).backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


class OnPolicyFloor(CriticFreeFloor):
    """The unavoidable model work of the `grpo-beta0` step: no pass without grad; forward + backward per
    mini-batch with `lp_old = lp` detached, gradients accumulated over the batch, one Adam step."""

    def step(self, queries: list, responses: list, scores: list) -> None:
        rows = sum(sorted((len(r) for r in responses), reverse=True)[: self.mini_batch_size])
        if self.buffer is None or len(self.buffer) < rows:
            self.buffer = None
            self.buffer = torch.empty((rows, self.lm.config.vocab_size), device=self.device)
        n = len(queries)
        groups = torch.stack(scores).to(self.device).float().view(-1, self.k)
        advantages = ((groups - groups.mean(-1, keepdim=True)) / (groups.std(-1, keepdim=True) + 1e-6)).reshape(-1)
        order = torch.randperm(n).tolist()
        for start in range(0, n, self.mini_batch_size):
            rows = order[start : start + self.mini_batch_size]
            batch = self._pack(queries, responses, rows)
            mask = batch["mask"]
            logprobs, _ = response_logprobs(self.lm, batch, buffer=self.buffer)
            ratio = torch.exp(logprobs.float() - logprobs.detach().float())
            adv = advantages[torch.tensor(rows, device=self.device)].unsqueeze(1)
            pg_loss = masked_mean(torch.max(-adv * ratio, -adv * ratio.clamp(1 - CLIPRANGE, 1 + CLIPRANGE)), mask)
            (pg_loss * self.mini_batch_size / n).backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


# --- separate critic (docs/algorithm.md section 9): the policy and a critic, each with its own Adam ---------
class FloorCriticPPO(FloorPPO):
    """The floor with a separate critic: the policy's loss and the critic's value loss each backward
    into their own model, each model stepped by its own fused Adam."""

    def __init__(self, lm, critic, mini_batch_size: int, ppo_epochs: int):
        super().__init__(lm, mini_batch_size, ppo_epochs)
        self.v_head = None
        self.critic = critic.train()
        self.optimizer = torch.optim.Adam(lm.parameters(), lr=LEARNING_RATE, fused=True)
        self.critic_optimizer = torch.optim.Adam(critic.parameters(), lr=LEARNING_RATE, fused=True)

    def _values(self, batch: dict, values) -> torch.Tensor:
        """The critic's score head on its backbone's hidden states at the response positions. (n, K)"""
        inputs = dict(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False)
        hidden = self.critic.transformer(**inputs).last_hidden_state
        index = batch["positions"].unsqueeze(-1).expand(-1, -1, hidden.shape[-1])
        return self.critic.score(hidden.gather(1, index)).squeeze(-1)

    def _update(self, pg_loss: torch.Tensor, vf_loss: torch.Tensor) -> None:
        pg_loss.backward()
        vf_loss.backward()
        for optimizer in (self.optimizer, self.critic_optimizer):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
