"""Checks shared by the vLLM engine tests (colocated and server)."""

import math

import torch


def assert_sampled_rows_and_logprobs(rows, logprobs, lm, queries, k: int, max_new_tokens: int, eos: int,
                                     temperature: float = 1.0, tolerance: float = 1e-4) -> float:  # fmt: skip
    """``generate(queries, return_prompt=True, num_return_sequences=k, return_logprobs=True)``'s output:
    rows ``i*k .. i*k+k-1`` answer query ``i``, each response is cut after its first ``eos``, and every
    returned log-prob equals a float64 recomputation of ``log_softmax(z / temperature)`` with ``lm`` (a
    transformers causal LM) to ``tolerance``. Returns the largest gap."""
    assert len(rows) == len(queries) * k and len(logprobs) == len(rows)
    lm64 = type(lm)(lm.config).double().eval()
    lm64.load_state_dict({name: t.double() for name, t in lm.state_dict().items()})
    worst = 0.0
    for index, (row, row_logprobs) in enumerate(zip(rows, logprobs)):
        query = queries[index // k]
        assert row[: len(query)].tolist() == query.tolist()
        response = row[len(query) :].tolist()
        assert eos not in response[:-1] and (response[-1] == eos or len(response) == max_new_tokens)
        assert row_logprobs.shape == (len(response),)
        with torch.no_grad():
            logits = lm64(input_ids=row[None]).logits[0] / temperature
        for t, token in enumerate(response):  # response token t is predicted at the position before it
            position = len(query) + t - 1
            log_z = math.log(sum(math.exp(v) for v in logits[position].tolist()))
            worst = max(worst, abs(float(row_logprobs[t]) - (float(logits[position, token]) - log_z)))
    assert worst < tolerance
    return worst
