"""Next-token choice from one position's logits, and the logprobs a request asks for (torch, no state).

`choose` follows the order vLLM's sampler documents: min_tokens, logit_bias, then the repetition,
frequency and presence penalties, then greedy or temperature, top-k, top-p and a draw seeded per
(seed, step). Logprobs are the model's raw distribution (vLLM's default `raw_logprobs`) unless the
request asks for the processed one (after bias, penalties and temperature, before top-k/top-p).
`prompt_logprobs` scores the prompt's own tokens from a chunk's logits. It does not run the model.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Collection, Sequence

import torch

from kvcentric.core.protocol import SamplingParams, TokenLogprob

SEQUENCE_STRIDE = 7_919_000_017
"""Seeds of a request's sequences lie this far apart (sequence 0 draws as a request with n = 1 does)."""
PENALISED_LOGIT_MAX = 1e30
"""Where a repetition penalty close to 0 leaves a positive logit (dividing by it would overflow float32 to inf,
and a softmax over inf is NaN); still finite after the smallest temperature divides it (1e-5)."""


def sample(logits: torch.Tensor, params: SamplingParams, step: int) -> int:
    """The next token from one position's logits, with no history (no penalties apply)."""
    return choose(logits, params, step)[0]


def choose(logits: torch.Tensor, params: SamplingParams, step: int, prompt: Sequence[int] = (),
           generated: Sequence[int] = (), stop_ids: Collection[int] = (),
           sequence: int = 0, allowed: torch.Tensor | None = None) -> tuple[int, TokenLogprob | None]:
    """The next token and, when asked for, its logprobs. `generated` is the output so far (its length is
    normally `step`), `stop_ids` the tokens min_tokens holds back (EOS and the request's stop tokens),
    `sequence` which of the request's n sequences draws (each has its own seeded draws), `allowed` the tokens
    a structured output's grammar allows (`kvcentric.engine.model.guided`; None: all)."""
    adjusted = adjust(logits.float(), params, prompt, generated, stop_ids, allowed)
    token = draw(adjusted, params, step, sequence)
    if params.logprobs is None:
        return token, None
    if params.processed_logprobs:
        scaled = adjusted / params.temperature if params.temperature > 0 else adjusted
        return token, token_logprob(torch.log_softmax(scaled, dim=-1), token, params.logprobs)
    return token, token_logprob(torch.log_softmax(logits.float(), dim=-1), token, params.logprobs)


def plain_greedy(params: SamplingParams) -> bool:
    """`choose` would return the argmax of the raw logits and no logprobs, whatever the history: greedy, no
    logprobs, nothing that adjusts the logits (no min_tokens, bias or penalty)."""
    return (params.temperature <= 0.0 and params.logprobs is None and not params.min_tokens and not params.logit_bias
            and not params.presence_penalty and not params.frequency_penalty and params.repetition_penalty == 1.0
            and not params.guide)


def adjusts(params: SamplingParams, generated: int) -> bool:
    """Whether `adjust` may change more than a grammar's mask for a sequence that has produced `generated` tokens
    (min_tokens, a bias or a penalty); False only where it changes nothing else."""
    return bool(generated < params.min_tokens or params.logit_bias or params.presence_penalty
                or params.frequency_penalty or params.repetition_penalty != 1.0)


def adjust(logits: torch.Tensor, params: SamplingParams, prompt: Sequence[int], generated: Sequence[int],
           stop_ids: Collection[int], allowed: torch.Tensor | None = None) -> torch.Tensor:
    """min_tokens, logit_bias, the penalties and a grammar's mask applied to float32 logits (a copy when any
    applies)."""
    vocab = logits.shape[-1]
    stop_ids = () if params.ignore_eos else stop_ids
    holds_stops = len(generated) < params.min_tokens and (stop_ids or params.stop_token_ids)
    if allowed is None and not adjusts(params, len(generated)):
        return logits
    logits = logits.clone() if allowed is None else torch.where(allowed.to(logits.device), logits,
                                                                refused_logit(logits.device))
    if holds_stops:
        held = [t for t in {*stop_ids, *params.stop_token_ids} if 0 <= t < vocab]
        logits[torch.tensor(held, dtype=torch.long, device=logits.device)] = float("-inf")
    if params.logit_bias:
        biased = {t: b for t, b in params.logit_bias.items() if 0 <= t < vocab}
        ids = torch.tensor(list(biased), dtype=torch.long, device=logits.device)
        logits[ids] += torch.tensor(list(biased.values()), dtype=logits.dtype, device=logits.device)
    if params.repetition_penalty != 1.0 and (prompt or generated):
        seen = torch.tensor(sorted({*prompt, *generated}), dtype=torch.long, device=logits.device)
        values = logits[seen]
        divided = (values / params.repetition_penalty).clamp(max=PENALISED_LOGIT_MAX)
        multiplied = torch.where(torch.isinf(values), values, values * params.repetition_penalty)  # -inf * 0 is NaN
        logits[seen] = torch.where(values > 0, divided, multiplied)
    if (params.presence_penalty or params.frequency_penalty) and generated:
        counts = torch.bincount(torch.tensor(list(generated), device=logits.device), minlength=vocab)[:vocab]
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
    return logits


@functools.cache
def refused_logit(device: torch.device) -> torch.Tensor:
    """-inf, the logit of a token a grammar refuses, as a tensor on `device` made once (`torch.where` would wrap a
    Python float in a new tensor on every call)."""
    return torch.tensor(float("-inf"), device=device)


def draw(logits: torch.Tensor, params: SamplingParams, step: int, sequence: int = 0) -> int:
    """Greedy at temperature 0; else temperature, top-k and top-p, seeded per (seed, sequence, step)."""
    return draw_rows(logits[None], [params], [step], [sequence])[0]


def draw_rows(logits: torch.Tensor, params: Sequence[SamplingParams], steps: Sequence[int],
              sequences: Sequence[int]) -> list[int]:
    """`draw` of each row of `logits` (rows, vocabulary), with its own parameters, step and sequence: the same
    token as that row drawn alone, in a few ops for the batch rather than a dozen a row.

    A sampled row takes the exponential race: the argmax of p / q, where q is a row of Exp(1) noise from the row's
    seeded generator, picks token i with probability p_i. It is how torch.multinomial draws one sample (so the
    tokens are the ones it drew), but multinomial checks its row with three reductions and a sync of each, 40 µs a
    row on a CPU; here the rows share one softmax, one check and one argmax, and only the noise is a call a row.
    A row whose probabilities are not a distribution (NaN: logits all -inf, or NaN) raises, as multinomial did."""
    greedy = [row for row, p in enumerate(params) if p.temperature <= 0.0]
    sampled = [row for row, p in enumerate(params) if p.temperature > 0.0]
    tokens = [0] * len(params)
    if greedy:
        chosen = logits if len(greedy) == len(params) else logits[greedy]
        for row, token in zip(greedy, chosen.argmax(dim=-1).tolist()):
            tokens[row] = token
    if not sampled:
        return tokens
    if len(sampled) < len(params):
        logits = logits[sampled]
    params = [params[row] for row in sampled]
    temperatures = [p.temperature for p in params]
    if len(set(temperatures)) == 1:  # (a Python float divides as a row of it does, bit for bit; by 1, a no-op)
        probs = torch.softmax(logits if temperatures[0] == 1.0 else logits / temperatures[0], dim=-1)
    else:
        probs = torch.softmax(logits / torch.tensor(temperatures, dtype=logits.dtype, device=logits.device)[:, None],
                              dim=-1)
    for slot, p in enumerate(params):
        if p.top_k > 0 or p.top_p < 1.0:  # (with neither, the sort would keep every token where it is)
            probs[slot] = top_k_top_p(probs[slot], p)
    noise = torch.empty_like(probs)
    generator = torch.Generator(device=probs.device)
    for row_noise, row, p in zip(noise.unbind(), sampled, params):
        if p.seed is not None:
            generator.manual_seed((p.seed * 1_000_003 + steps[row] + sequences[row] * SEQUENCE_STRIDE) % 2 ** 64)
        else:
            generator.seed()
        row_noise.exponential_(1.0, generator=generator)
    if math.isnan(float(probs.sum())):  # a softmax's only failure (of logits all -inf, or NaN); top-k and top-p
        raise RuntimeError("the sampling distribution is not one (NaN: no token left to draw)")  # keep one token
    for row, token in zip(sampled, (probs / noise).argmax(dim=-1).tolist()):
        tokens[row] = token
    return tokens


def top_k_top_p(probs: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """One row's probabilities with only its top-k tokens and its top-p nucleus kept (not renormalised: a draw
    needs no sum of 1)."""
    sorted_probs, order = torch.sort(probs, descending=True)
    keep = torch.ones_like(sorted_probs, dtype=torch.bool)
    if params.top_k > 0:
        keep[params.top_k:] = False
    if params.top_p < 1.0:
        keep &= torch.cumsum(sorted_probs, dim=-1) - sorted_probs < params.top_p
    return torch.zeros_like(probs).scatter(0, order[keep], sorted_probs[keep])


def token_logprob(logprobs: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """Token `token`'s entry in one position's log-probabilities, with the `top` likeliest tokens."""
    return logprob_rows(logprobs[None], torch.tensor([token], device=logprobs.device), top)[0]


def prompt_logprobs(logits: torch.Tensor, next_tokens: Sequence[int], top: int) -> list[TokenLogprob]:
    """Each row of `logits` scores the token that follows it: the logprob of `next_tokens[i]` from row i
    (the model's raw distribution, as vLLM's prompt logprobs)."""
    rows = logits[: len(next_tokens)].float()
    tokens = torch.tensor(list(next_tokens), dtype=torch.long, device=rows.device)
    return logprob_rows(torch.log_softmax(rows, dim=-1), tokens, top)


def logprob_rows(logprobs: torch.Tensor, tokens: torch.Tensor, top: int) -> list[TokenLogprob]:
    chosen = logprobs.gather(1, tokens[:, None])
    ranks = (logprobs > chosen).sum(dim=1) + 1
    top_values, top_ids = logprobs.topk(top, dim=1) if top else (logprobs[:, :0], tokens[:, None][:, :0])
    return [TokenLogprob(token_id=token, logprob=value, rank=rank, top_ids=ids, top_logprobs=values)
            for token, value, rank, ids, values in zip(tokens.tolist(), chosen[:, 0].tolist(), ranks.tolist(),
                                                        top_ids.tolist(), top_values.tolist())]
