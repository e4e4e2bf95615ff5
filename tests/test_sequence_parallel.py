"""Sequence parallelism (Ulysses, trl_lite.parallel) on the CPU: exact against 1 process and data parallelism.

`tests/distributed/sequence_parallel_step.py` runs two packed steps under
`accelerate_configs/deepspeed_sequence_parallel.yaml` (DeepSpeed ZeRO-2, `parallelism_config` with
`sp_size=2`); its rows are of very different lengths - one of 2 tokens, one of 31 that passes cut across
slices, streams of odd length (a padding row) - with response masks, mini-batches of 2 and 2 epochs.
2 processes as one group must give the weights and every statistic of 1 process on the same batch (GAE
with a PTX loss and the full KL; GRPO with `seq_mean_token_mean`; GAE with a separate critic under ZeRO-3
with gradient checkpointing and a token budget; a Qwen2 shape with rotary positions and a shared key/value
head under ZeRO-1; a LoRA policy with the LM head and the full KL in chunks and Dr. GRPO's
`seq_mean_token_sum_norm`), and so must 4 processes as one group of 4 (the 2-token row is shorter than the
number of slices); 4 processes as 2 groups must give those of 2 processes of data parallelism
(`global_token_mean`, whose normaliser counts tokens over processes). Every launched run also checks that
`generate()` gives the processes of a group the same responses, each process generating a share, and that
the group gathers only per-token numbers (never a slice's logits or hidden states); the group's processes other
than the first draw from generators of their own (the group trains in its first process's order). 4 processes
over 2 key/value heads are followed by a padded pass; a group given different rows stops with a clear error.
"""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from test_distributed import REPO, SCRIPTS, _free_port, deepspeed_cpu_collectives, launch  # noqa: F401 (fixture)

from tiny_models import make_gpt2, make_gpt2_critic, make_tokenizer
from trl_lite import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer
from trl_lite.models.packed_attention import takes_row_lengths
from trl_lite.parallel import NoSequenceParallel
from trl_lite.parallel.sequence_parallel import (
    SequenceParallel,
    check_before_prepare,
    check_heads,
    check_models,
    slice_slot_counts,
)

pytestmark = pytest.mark.xdist_group("distributed")

SCRIPT = SCRIPTS / "sequence_parallel_step.py"


def run_alone(out, *args: str) -> dict:
    """The script on one plain process (no launcher, no DeepSpeed): the reference."""
    result = subprocess.run([sys.executable, str(SCRIPT), *args, "--output_dir", str(out)], cwd=SCRIPTS,
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr[-5000:]
    return torch.load(out / "result.pt", weights_only=False)


def run_launched(config: str, processes: int, out, *args: str, zero_stage: int = 2, sp_size: int = 2) -> dict:
    """The script under ``accelerate_configs/<config>.yaml``, or a copy of it with another ZeRO stage or sp_size."""
    if (zero_stage, sp_size) != (2, 2):
        text = (REPO / "accelerate_configs" / f"{config}.yaml").read_text()
        for key, value in (("zero_stage", zero_stage), ("parallelism_config_sp_size", sp_size)):
            assert f"{key}: 2" in text
            text = text.replace(f"{key}: 2", f"{key}: {value}")
        (out / "changed.yaml").write_text(text)
        config = str((out / "changed").resolve())  # launch() reads accelerate_configs/<config>.yaml: an absolute path wins
    launch(config, SCRIPT, *args, "--output_dir", str(out), num_processes=processes)
    return torch.load(out / "result.pt", weights_only=False)


def assert_one_generation_per_group(result: dict) -> None:
    """The processes of each group returned the same sampled responses, and the groups different ones; each
    process generated its share of the group's 4 queries (one engine call each)."""
    generations, size = result["generations"], result["sp_size"]
    groups = [generations[start : start + size] for start in range(0, len(generations), size)]
    assert all(member == group[0] for group in groups for member in group)
    assert len({str(group[0]) for group in groups}) == len(groups)
    assert all(len(group[0]) == 4 for group in groups)
    assert result["generated_queries"] == [[4 // size]] * len(generations)


KL_ATOL = 8 * torch.finfo(torch.float32).eps * 6  # 8 ulps of a log-prob of magnitude 6: 5.7e-6


def assert_same_training(result: dict, reference: dict) -> None:
    """Same weights after the steps and the same statistics of both steps, to float32 rounding."""
    assert sorted(result["named_parameters"]) == sorted(reference["named_parameters"])
    for name, weight in reference["named_parameters"].items():
        torch.testing.assert_close(result["named_parameters"][name], weight, rtol=1e-5, atol=1e-6, msg=name)
    assert result["stats"][0]["ppo/loss/total"] != result["stats"][1]["ppo/loss/total"]
    for ours, theirs in zip(result["stats"], reference["stats"]):
        assert ours.keys() == theirs.keys()
        for key, value in theirs.items():
            if key == "memory/lm_head_chunk_size" and ours[key] == -1:
                continue  # ZeRO-3 keeps the model's own head (-1) where one process fuses it: the path, not a number
            # A KL is a difference of two log-probs of magnitude up to log(vocabulary) ~ 6, each rounded in float32
            # (a few ulps of 6 is ~2e-6) and summed in another order when cut: its absolute error scales with the
            # log-probs, not with the (small) KL itself.
            atol = KL_ATOL if "kl" in key.rsplit("/", 1)[-1] else 1e-6
            np.testing.assert_allclose(ours[key], value, rtol=1e-5, atol=atol, err_msg=key)


@pytest.mark.parametrize(
    "sp_size, zero_stage, args",
    [
        (2, 2, ("--estimator", "gae", "--ptx", "1", "--kl_penalty", "full")),
        (2, 2, ("--estimator", "grpo", "--loss_type", "seq_mean_token_mean")),
        # A separate critic (its own DeepSpeed engine, its passes cut too).
        (2, 3, ("--estimator", "gae", "--gradient_checkpointing", "1", "--max_tokens", "40", "--critic", "1")),
        (2, 1, ("--estimator", "gae", "--model", "qwen2")),  # ZeRO-1
        # A LoRA policy whose reference is its base model; the LM head (and the full KL) in chunks of 5 tokens;
        # Dr. GRPO's loss.
        (2, 2, ("--estimator", "gae", "--peft", "1", "--lm_head_chunk_size", "5", "--loss_type", "seq_mean_token_sum_norm",
                "--kl_penalty", "full")),
        # 4 slices: the 2-token row is shorter than the number of slices, the long rows span several.
        (4, 2, ("--estimator", "grpo", "--model", "gpt2_4_heads")),
        # 4 processes over 2 key/value heads (DeepSpeed repeats them for the exchange), then a padded pass.
        (4, 2, ("--estimator", "gae", "--model", "qwen2_4_heads", "--padded_pass", "1")),
    ],
)
def test_one_group_equals_one_process(tmp_path, sp_size, zero_stage, args):
    (tmp_path / "sp").mkdir()
    (tmp_path / "alone").mkdir()
    parallel = run_launched("deepspeed_sequence_parallel", sp_size, tmp_path / "sp", *args, zero_stage=zero_stage,
                            sp_size=sp_size)  # fmt: skip
    alone = run_alone(tmp_path / "alone", *args)
    assert (parallel["sp_size"], parallel["num_processes"], alone["sp_size"]) == (sp_size, sp_size, 1)
    assert_one_generation_per_group(parallel)
    # Each process embedded about half of every packed pass: the longest slice is half the longest pass.
    assert parallel["longest_slice"] < alone["longest_slice"]
    if "--ptx" not in args:  # a PTX pass is not cut
        assert parallel["longest_slice"] <= -(-alone["longest_slice"] // sp_size)
    assert_same_training(parallel, alone)
    assert parallel["gathered_shapes"] == [()]  # one number per slot or token: no (tokens x vocabulary) gather
    if "--padded_pass" in args:  # the padded pass kept the model's own key/value grouping
        assert parallel["greedy"] == alone["greedy"] and len(parallel["greedy"]) == 2
    if "--lm_head_chunk_size" in args:
        assert all(stats["memory/lm_head_chunk_size"] == 5 for stats in parallel["stats"])
    if "--peft" in args:  # the adapter trained: its B matrices start at zero
        adapters = {name: w for name, w in parallel["named_parameters"].items() if "lora_B" in name}
        assert adapters and all(w.abs().max() > 0 for w in adapters.values())


def test_two_groups_equal_two_processes_of_data_parallelism(tmp_path):
    args = ("--estimator", "gae", "--loss_type", "global_token_mean")
    (tmp_path / "sp").mkdir()
    (tmp_path / "dp").mkdir()
    parallel = run_launched("deepspeed_sequence_parallel", 4, tmp_path / "sp", *args)
    data_parallel = run_launched("deepspeed_zero2", 2, tmp_path / "dp", *args)
    assert (parallel["sp_size"], parallel["num_processes"]) == (2, 4)
    assert (data_parallel["sp_size"], data_parallel["num_processes"]) == (1, 2)
    assert_one_generation_per_group(parallel)
    assert_same_training(parallel, data_parallel)


def test_a_group_given_different_rows_stops_on_every_process_with_a_clear_error(tmp_path):
    """The second process of the group gets other scores than the first: both refuse step() at once (a gather of
    the rows' fingerprints), naming the cause, instead of training on wrong numbers or failing in an exchange."""
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file",
        str(REPO / "accelerate_configs" / "deepspeed_sequence_parallel.yaml"), "--num_processes", "2",
        "--main_process_port", str(_free_port()), str(SCRIPT), "--estimator", "gae", "--different_rows", "1",
        "--output_dir", str(tmp_path),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    run = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    output = run.stdout + run.stderr
    assert run.returncode != 0
    for rank in range(2):
        assert f"[rank{rank}]: ValueError: step() got different rows on the 2 processes of a sequence-parallel group" in output
    assert not (tmp_path / "result.pt").exists()


def test_slice_slot_counts_match_brute_force():
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        rows = int(torch.randint(1, 6, (1,), generator=g))
        lengths = torch.randint(2, 20, (rows,), generator=g).tolist()
        firsts, counts, start = [], [], 0
        for length in lengths:
            query = int(torch.randint(1, length, (1,), generator=g))
            firsts.append(start + query - 1)
            counts.append(length - query)
            start += length
        size = int(torch.randint(1, 5, (1,), generator=g))
        chunk = -(-start // size)
        positions = [f + k for f, n in zip(firsts, counts) for k in range(n)]
        expected = tuple(sum(1 for p in positions if p // chunk == slice_index) for slice_index in range(size))
        assert slice_slot_counts(size, chunk, firsts, counts) == expected
        assert sum(expected) == sum(counts)


def test_each_process_generates_a_contiguous_share_of_the_queries():
    for size in range(1, 6):
        for count in range(13):
            items = list(range(count))
            shares = []
            for rank in range(size):
                group = SequenceParallel.__new__(SequenceParallel)  # no process group: only rank and size are read
                group.rank, group.size = rank, size
                shares.append(group.own_share(items))
            assert [item for share in shares for item in share] == items
            assert max(map(len, shares)) - min(map(len, shares)) <= 1
            assert count < size or all(shares)


def test_checks_name_what_sequence_parallelism_needs():
    model = make_gpt2()  # 2 heads
    check_heads(2, model)
    with pytest.raises(ValueError, match="sp_size=4 .*2 query and 2 key/value heads"):
        check_heads(4, model)
    with pytest.raises(ValueError, match="set padding_free=True"):
        check_models(2, False, [model], {id(model): model})
    with pytest.raises(ValueError, match="attend per row"):
        check_models(2, True, [model], {})
    model.config._attn_implementation = "sdpa"
    assert takes_row_lengths(model)
    check_models(2, True, [model], {id(model): model})
    critic = make_gpt2_critic()
    assert getattr(model.config, "num_key_value_heads", None) is None
    check_before_prepare(model, critic)
    assert model.config.num_key_value_heads == model.config.num_attention_heads == 2
    assert critic.config.num_key_value_heads == 2


def _group(rank: int, size: int) -> SequenceParallel:
    group = SequenceParallel.__new__(SequenceParallel)  # no process group: only rank and size are read
    group.rank, group.size = rank, size
    return group


def test_a_group_keeps_one_copy_of_its_rows_and_counts_each_row_once():
    """one_per_group and row_share against brute force, for groups of 1 (the no-op part), 2 and 4: of every
    process's gathered piece, those of each group's first process; a sum over processes weighted by row_share
    adds each group's rows once."""
    for size, processes in ((1, 3), (2, 2), (2, 6), (4, 8)):
        pieces = [torch.arange(3, dtype=torch.float64) + 10 * (p // size) for p in range(processes)]  # a group's alike
        gathered = torch.cat(pieces)
        part = NoSequenceParallel() if size == 1 else _group(0, size)
        want = torch.cat([pieces[p] for p in range(processes) if p % size == 0])
        assert torch.equal(part.one_per_group(gathered, processes), want)
        assert sum(part.row_share * piece.sum() for piece in pieces) == want.sum()


def test_without_sequence_parallelism_every_part_gets_the_trainers_no_op_part():
    """One process: the trainer's sequence-parallel part is a NoSequenceParallel, the one its parts hold; it
    shares and generates as a lone process does (the same objects back, ``generate`` called as asked, no check)."""
    config = PPOConfig(batch_size=2, mini_batch_size=2, seed=0)
    model = AutoModelForCausalLMWithValueHead.from_pretrained(make_gpt2())
    trainer = PPOTrainer(config, model, tokenizer=make_tokenizer())
    sequence = trainer.sequence
    assert isinstance(sequence, NoSequenceParallel) and (sequence.size, sequence.cuts) == (1, False)
    parts = (trainer.forward, trainer.learner, trainer.experience_maker, trainer.statistics, trainer.generation)
    assert all(part.sequence is sequence for part in parts)
    order = [2, 0, 1]
    assert sequence.share(order) is order
    calls = []
    assert sequence.generate(lambda queries: calls.append(queries) or "out", order, check=calls.append) == "out"
    assert calls == [order]
    assert trainer.memory.forwards_synchronise is False
