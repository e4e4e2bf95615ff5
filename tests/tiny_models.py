"""Tiny models and a word-level tokenizer built from configs, for tests and multi-process scripts.

Nothing here touches the network: the tokenizer is built with the `tokenizers` library from a fixed
word list, the models from transformers configs with random weights.
"""

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    GPT2Config,
    GPT2ForSequenceClassification,
    GPT2LMHeadModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    T5Config,
    T5ForConditionalGeneration,
)

WORDS = (
    "the a an this that movie film story plot actor actress scene music ending was is were are very "
    "really quite so good great fine wonderful bad awful boring dull funny sad long short and but "
    "i you we they it loved hated liked enjoyed watched saw again never always not too much more"
).split()
SPECIAL = ["<pad>", "<eos>", "<unk>"]


def make_tokenizer(padding_side: str = "right") -> PreTrainedTokenizerFast:
    """A word-level tokenizer over `WORDS` with `<pad>` (id 0), `<eos>` (id 1) and `<unk>` (id 2)."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL + WORDS)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>", padding_side=padding_side
    )
    return tok


VOCAB_SIZE = len(SPECIAL) + len(WORDS)


def make_gpt2(seed: int = 0, n_layer: int = 2, n_embd: int = 32, dropout: float = 0.0, n_head: int = 2) -> GPT2LMHeadModel:
    """A randomly initialised 2-layer GPT-2 (2 heads unless ``n_head``) over the tiny tokenizer's vocabulary."""
    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=VOCAB_SIZE,
        n_positions=128,
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_head,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        bos_token_id=1,
        eos_token_id=1,
        pad_token_id=0,
    )
    return GPT2LMHeadModel(config)


def make_qwen2(seed: int = 0, n_layer: int = 2, hidden: int = 64, heads: int = 2, kv_heads: int = 1) -> Qwen2ForCausalLM:
    """A randomly initialised tiny Qwen2 (rotary positions, grouped-query attention, gated MLP, tied
    embeddings; a model vLLM serves LoRA adapters for) over the tiny tokenizer's vocabulary: by default 2 heads
    of ``hidden / 2`` (vLLM's CPU attention needs at least 32) sharing one key/value head."""
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=VOCAB_SIZE, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=n_layer,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=128, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=1, pad_token_id=0,
    )  # fmt: skip
    model = Qwen2ForCausalLM(config)
    model.config.architectures = ["Qwen2ForCausalLM"]
    return model


def make_qwen2_critic(seed: int = 0, n_layer: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2):
    """A randomly initialised one-output tiny Qwen2 classifier (rotary, grouped-query: a critic) over the tiny vocabulary."""
    from transformers import Qwen2ForSequenceClassification

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=VOCAB_SIZE, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=n_layer,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=128, num_labels=1,
        bos_token_id=1, eos_token_id=1, pad_token_id=0,
    )  # fmt: skip
    return Qwen2ForSequenceClassification(config)


def make_gpt2_critic(seed: int = 0, n_layer: int = 2, n_embd: int = 32) -> GPT2ForSequenceClassification:
    """A randomly initialised one-output GPT-2 classifier (a reward model or critic) over the tiny vocabulary."""
    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=VOCAB_SIZE, n_positions=128, n_embd=n_embd, n_layer=n_layer, n_head=2, num_labels=1,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=1, pad_token_id=0,
    )  # fmt: skip
    return GPT2ForSequenceClassification(config)


def make_t5(seed: int = 0) -> T5ForConditionalGeneration:
    """A randomly initialised tiny T5 over the tiny tokenizer's vocabulary."""
    torch.manual_seed(seed)
    config = T5Config(
        vocab_size=VOCAB_SIZE,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=2,
        dropout_rate=0.0,
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
    )
    return T5ForConditionalGeneration(config)


def random_batch(batch_size: int, seed: int = 0, query_len=(2, 6), response_len=(2, 8)):
    """Random (queries, responses, scores) lists with ids in [3, VOCAB_SIZE) and varied lengths."""
    g = torch.Generator().manual_seed(seed)
    queries, responses = [], []
    for _ in range(batch_size):
        lq = int(torch.randint(query_len[0], query_len[1] + 1, (1,), generator=g))
        lr = int(torch.randint(response_len[0], response_len[1] + 1, (1,), generator=g))
        queries.append(torch.randint(3, VOCAB_SIZE, (lq,), generator=g))
        responses.append(torch.randint(3, VOCAB_SIZE, (lr,), generator=g))
    scores = [torch.randn((), generator=g) for _ in range(batch_size)]
    return queries, responses, scores
