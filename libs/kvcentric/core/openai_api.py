"""The OpenAI-compatible surface, without I/O: validate request bodies, shape responses and errors.

`parse_completion` and `parse_chat` turn a decoded JSON body into a `CompletionRequest` or raise
`ApiError` (status, OpenAI error type, message, param): a field it does not support is refused by name,
never dropped. `*_body` and `*_chunk` shape the answers (logprobs in `openai_logprobs`). The gateway
service does the network part.
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Sequence
from typing import Any

import msgspec

from kvcentric.core.api_error import ApiError, check as _check
from kvcentric.core.openai_chat import parse_messages
from kvcentric.core.openai_tools import FIELDS as TOOL_FIELDS
from kvcentric.core.openai_tools import Tools, parse_tools, tool_grammar
from kvcentric.core.structured import FIELDS as STRUCTURED_FIELDS
from kvcentric.core.structured import parse_guide
from kvcentric.core.protocol import MAX_LOGPROBS, MAX_SEQUENCES, SamplingParams


MAX_STOP_STRINGS = 4
SEED_MIN, SEED_MAX = -(2 ** 63), 2 ** 63 - 1
"""The seeds a request may give: what a 64-bit signed integer holds (the engines seed torch with it)."""
GREEDY_BELOW = 1e-5
"""Temperatures below this are taken as 0 (greedy), as vLLM does: dividing logits by less overflows."""
MAX_PRIORITY = 1000
MAX_TOP_K = 2 ** 31 - 1

MAX_PROMPTS = 256
"""Prompts one completion request may batch (each is placed and run as a request of its own)."""
Prompt = str | list[int]


@dataclasses.dataclass(frozen=True)
class CompletionRequest:
    model: str
    prompt: str | None
    prompt_token_ids: list[int] | None
    sampling: SamplingParams
    stream: bool
    include_usage: bool
    stop: tuple[str, ...] = ()
    """Strings that end the output when they appear in it (not included in the answer)."""
    user: str | None = None
    messages: list[dict] | None = None
    """Chat requests only: the conversation, each message {"role", "content"} with content as text, plus its
    `name`, `tool_calls` and `tool_call_id` when it has them (`kvcentric.core.openai_chat`)."""
    max_tokens_defaulted: bool = False
    """No max_tokens was given (chat): the gateway lowers it to what is left of the context."""
    priority: int = 0
    """vLLM's extension, its convention: lower is more important. The conductor's classes run the other
    way (higher is more important, `--top-priority`), so it is asked with `-priority`."""
    echo: bool = False
    """Completions: the answer starts with the prompt (and its logprobs, when logprobs are asked for)."""
    discard_output: bool = False
    """max_tokens 0 with echo: the engines sample one token (the prefill must end in one) that is dropped."""
    n: int = 1
    """Choices answered; the engines sample `sampling.n` sequences (best_of), the likeliest n are kept."""
    show_logprobs: bool = False
    """The client asked for logprobs (best_of > n has the engines compute them to rank the sequences)."""
    return_token_ids: bool = False
    """vLLM's extension: each choice carries the ids of its tokens (`token_ids`; streamed, those of the event)
    and the answer the prompt's (`prompt_token_ids`: in the choices of a completion, at the top of a chat
    answer; streamed, in the first event only)."""
    continuous_usage: bool = False
    """vLLM's `stream_options.continuous_usage_stats`: every streamed chunk carries the usage so far."""
    tools: Tools | None = None
    """Chat: the functions the model may call, and what the request asks of them (`openai_tools`)."""
    batch: tuple[Prompt, ...] = ()
    """Completions: the prompts of a batch of more than one (`prompt`/`prompt_token_ids` hold the first);
    `each_prompt` splits it, and prompt i's choices are answered at indices i*n .. i*n+n-1, as OpenAI's."""

    def each_prompt(self) -> list[CompletionRequest]:
        """One request per prompt of the batch (itself when it is not a batch)."""
        if not self.batch:
            return [self]
        return [dataclasses.replace(self, batch=(), prompt=p if isinstance(p, str) else None,
                                    prompt_token_ids=None if isinstance(p, str) else list(p)) for p in self.batch]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(body: dict, name: str, default: float, low: float, high: float) -> float:
    value = body.get(name, default)
    if value is None:
        return default
    _check(isinstance(value, (int, float)) and not isinstance(value, bool),
           f"'{name}' must be a number, got {type(value).__name__}", name)
    _check(low <= value <= high, f"'{name}' must be between {low} and {high}, got {value}", name)
    return float(value)


def _prompts(body: dict, vocab_size: int) -> list[Prompt]:
    """The prompt, or each prompt of a batch: a string, a list of token ids, or a list of either."""
    _check("prompt" in body, "'prompt' is a required property", "prompt")
    prompt = body["prompt"]
    batched = isinstance(prompt, list) and len(prompt) > 0 and any(isinstance(p, (str, list)) for p in prompt)
    prompts = prompt if batched else [prompt]
    _check(not batched or all(isinstance(p, str) for p in prompts) or all(isinstance(p, list) for p in prompts),
           "'prompt' batches either strings or lists of token ids, not both", "prompt")
    _check(len(prompts) <= MAX_PROMPTS, f"'prompt' batches at most {MAX_PROMPTS} prompts", "prompt")
    return [_one_prompt(one, vocab_size) for one in prompts]


def _one_prompt(prompt: Any, vocab_size: int) -> Prompt:
    if isinstance(prompt, str):
        _check(len(prompt) > 0, "'prompt' must not be empty", "prompt")
        return prompt
    _check(isinstance(prompt, list) and len(prompt) > 0 and all(type(t) is int for t in prompt),
           "'prompt' must be a non-empty string, a non-empty list of token ids, or a list of either", "prompt")
    if min(prompt) < 0 or max(prompt) >= vocab_size:
        bad = [t for t in prompt if not 0 <= t < vocab_size]
        raise ApiError(400, f"token ids must be in [0, {vocab_size}); got {bad[:5]}", "prompt")
    return list(prompt)


def _model(body: dict, served: str | Sequence[str]) -> str:
    names = [served] if isinstance(served, str) else list(served)
    model = body.get("model")
    if model is None:
        return names[0]
    _check(isinstance(model, str), "'model' must be a string", "model")
    if model not in names:
        raise ApiError(400, f"the model '{model}' does not exist; this server serves '{names[0]}'",
                       "model", code="model_not_found")
    return names[0]


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    _check(isinstance(stops, list) and all(isinstance(s, str) and s for s in stops),
           "'stop' must be a non-empty string or a list of non-empty strings", "stop")
    _check(len(stops) <= MAX_STOP_STRINGS, f"'stop' takes at most {MAX_STOP_STRINGS} strings", "stop")
    return tuple(stops)


def _flag(body: dict, name: str) -> bool:
    value = body.get(name, False)
    _check(isinstance(value, bool), f"'{name}' must be a boolean", name)
    return value


def _max_tokens(body: dict, allow_zero: bool = False) -> int | None:
    """The completion budget the body asks for, or None when it names none. Both names are checked;
    `max_completion_tokens` (OpenAI's newer name) wins when both are given."""
    low = 0 if allow_zero else 1
    values = {}
    for name in ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if value is not None:
            _check(_is_int(value) and value >= low, f"'{name}' must be an integer >= {low}"
                   + ("" if allow_zero else " (0 only with echo)"), name)
            values[name] = value
    return values.get("max_completion_tokens", values.get("max_tokens"))


COMMON_FIELDS = STRUCTURED_FIELDS | frozenset({
    "model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "stream", "stream_options",
    "stop", "seed", "user", "presence_penalty", "frequency_penalty", "logit_bias",
    "ignore_eos", "top_k", "priority", "repetition_penalty", "min_tokens", "logprobs_mode", "return_token_ids"})
"""What both endpoints take (the last seven are vLLM's extensions); any other field that is not null is a 400
naming it, so nothing a client asks for is silently dropped."""
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "logprobs", "echo", "best_of"}
CHAT_FIELDS = COMMON_FIELDS | TOOL_FIELDS | {"messages", "logprobs", "top_logprobs"}
MAX_LOGIT_BIAS = 300
TOKEN_ID = re.compile(r"[0-9]{1,10}")
LOGPROBS_MODES = {"raw_logprobs": False, "processed_logprobs": True}
"""vLLM's names for the distribution logprobs come from: the model's raw one (the default, as vLLM's), or the
one sampled from after bias, penalties and temperature."""


def _known_fields(body: dict, fields: frozenset[str]) -> None:
    unknown = sorted(name for name, value in body.items() if name not in fields and value is not None)
    _check(not unknown, f"'{unknown[0] if unknown else ''}' is not supported by this server",
           unknown[0] if unknown else None)


def _integer(body: dict, name: str, default: int | None, low: int, high: int) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    _check(_is_int(value) and low <= value <= high, f"'{name}' must be an integer in [{low}, {high}]", name)
    return value


def _logit_bias(body: dict, vocab_size: int) -> dict[int, float]:
    """OpenAI's map of token id (a string) to a bias in [-100, 100]."""
    bias = body.get("logit_bias")
    bias = {} if bias is None else bias
    _check(isinstance(bias, dict) and len(bias) <= MAX_LOGIT_BIAS,
           f"'logit_bias' must be an object of at most {MAX_LOGIT_BIAS} token ids", "logit_bias")
    parsed = {}
    for key, value in bias.items():
        _check(isinstance(key, str) and TOKEN_ID.fullmatch(key) is not None and int(key) < vocab_size,
               f"'logit_bias' keys must be token ids in [0, {vocab_size}), got {key!r}", "logit_bias")
        _check(isinstance(value, (int, float)) and not isinstance(value, bool) and -100 <= value <= 100,
               f"'logit_bias' values must be numbers in [-100, 100], got {value!r}", "logit_bias")
        parsed[int(key)] = float(value)
    return parsed


def _penalties(body: dict, vocab_size: int, max_tokens: int) -> dict:
    """presence, frequency and repetition penalties, min_tokens, logit_bias, the logprobs mode."""
    mode = body.get("logprobs_mode")
    mode = "raw_logprobs" if mode is None else mode
    _check(isinstance(mode, str) and mode in LOGPROBS_MODES,
           f"'logprobs_mode' must be one of {', '.join(LOGPROBS_MODES)}", "logprobs_mode")
    return {"presence_penalty": _number(body, "presence_penalty", 0.0, -2.0, 2.0),
            "frequency_penalty": _number(body, "frequency_penalty", 0.0, -2.0, 2.0),
            "repetition_penalty": _positive(body, "repetition_penalty", 1.0, 2.0),
            "min_tokens": _integer(body, "min_tokens", 0, 0, max_tokens),
            "logit_bias": _logit_bias(body, vocab_size), "processed_logprobs": LOGPROBS_MODES[mode]}


def _positive(body: dict, name: str, default: float, high: float) -> float:
    value = _number(body, name, default, 0.0, high)
    _check(value > 0, f"'{name}' must be above 0", name)
    return value


STREAM_OPTIONS = ("include_usage", "continuous_usage_stats")
"""OpenAI's `include_usage` (a trailing usage chunk) and vLLM's `continuous_usage_stats` (usage on every chunk)."""


def _stream_options(body: dict, stream: bool) -> dict[str, bool]:
    """The stream options that are set. They need `stream: true`, as OpenAI and vLLM say; an empty object
    is no option."""
    options = body.get("stream_options")
    if options is None:
        return {}
    _check(isinstance(options, dict), "'stream_options' must be an object", "stream_options")
    unknown = [key for key, value in options.items() if key not in STREAM_OPTIONS and value is not None]
    _check(not unknown, f"'stream_options.{unknown[0] if unknown else ''}' is not supported by this server",
           "stream_options")
    set_ = {key: options[key] for key in STREAM_OPTIONS if options.get(key) is not None}
    _check(all(isinstance(value, bool) for value in set_.values()),
           f"'stream_options' takes booleans: {', '.join(STREAM_OPTIONS)}", "stream_options")
    _check(stream or not options, "'stream_options' is only allowed with 'stream': true", "stream_options")
    return set_


def _common(body: dict, served: str | Sequence[str], max_tokens: int, vocab_size: int) -> dict:
    """The fields /v1/completions and /v1/chat/completions share, validated."""
    n = _integer(body, "n", 1, 1, MAX_SEQUENCES) or 1
    seed = body.get("seed")
    _check(seed is None or (_is_int(seed) and SEED_MIN <= seed <= SEED_MAX),
           f"'seed' must be an integer in [{SEED_MIN}, {SEED_MAX}] (a 64-bit signed integer)", "seed")
    user = body.get("user")
    _check(user is None or isinstance(user, str), "'user' must be a string", "user")
    stream = _flag(body, "stream")
    options = _stream_options(body, stream)
    priority = body.get("priority", 0)  # vLLM's extension
    _check(_is_int(priority) and abs(priority) <= MAX_PRIORITY,
           f"'priority' must be an integer in [-{MAX_PRIORITY}, {MAX_PRIORITY}]", "priority")
    top_k = _integer(body, "top_k", 0, -1, MAX_TOP_K)  # vLLM's extension; -1 and 0 both mean no limit
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    if temperature < GREEDY_BELOW:  # so small a temperature overflows the softmax: it means greedy
        temperature = 0.0
    sampling = SamplingParams(max_tokens=max_tokens, temperature=temperature,
                              top_p=_number(body, "top_p", 1.0, 1e-6, 1.0), seed=seed,
                              ignore_eos=_flag(body, "ignore_eos"), top_k=max(0, top_k or 0),
                              n=n, guide=parse_guide(body), **_penalties(body, vocab_size, max_tokens))
    _check(not sampling.guide or not (sampling.ignore_eos or sampling.min_tokens),
           "structured output ends where its grammar does: it takes neither 'ignore_eos' nor 'min_tokens'",
           "ignore_eos" if sampling.ignore_eos else "min_tokens")
    return {"model": _model(body, served), "sampling": sampling, "n": n, "stream": stream,
            "include_usage": options.get("include_usage", False),
            "continuous_usage": options.get("continuous_usage_stats", False), "stop": _stop(body), "user": user,
            "priority": priority or 0, "return_token_ids": _flag(body, "return_token_ids")}


def parse_completion(body: Any, served_model: str | Sequence[str], vocab_size: int) -> CompletionRequest:
    """Validate a /v1/completions body (OpenAI schema plus vLLM's extensions); `served_model` is the
    served name, or the names it answers to with the canonical one first. `logprobs` with `echo` scores
    the prompt too; `max_tokens` 0 is allowed with `echo` (the prompt alone is answered)."""
    _check(isinstance(body, dict), "the request body must be a JSON object", None)
    _known_fields(body, COMPLETION_FIELDS)
    prompts = _prompts(body, vocab_size)
    first = prompts[0]
    echo = _flag(body, "echo")
    max_tokens = _max_tokens(body, allow_zero=echo)
    common = _common(body, served_model, 16 if max_tokens is None else max(1, max_tokens), vocab_size)
    best_of = _integer(body, "best_of", common["n"], common["n"], MAX_SEQUENCES) or common["n"]
    _check(best_of == common["n"] or not common["stream"], "'best_of' above 'n' cannot be streamed", "best_of")
    logprobs = _integer(body, "logprobs", None, 0, MAX_LOGPROBS)
    ranked = 0 if best_of > common["n"] and logprobs is None else logprobs  # best_of ranks by logprobs
    sampling = msgspec.structs.replace(common.pop("sampling"), logprobs=ranked, n=best_of,
                                       prompt_logprobs=logprobs if echo else None)
    return CompletionRequest(prompt=first if isinstance(first, str) else None,
                             prompt_token_ids=None if isinstance(first, str) else first,
                             batch=tuple(prompts) if len(prompts) > 1 else (), sampling=sampling, echo=echo,
                             discard_output=max_tokens == 0, show_logprobs=logprobs is not None, **common)


def parse_chat(body: Any, served_model: str | Sequence[str], context_len: int,
               vocab_size: int = 1 << 31) -> CompletionRequest:
    """Validate a /v1/chat/completions body; max_tokens defaults to what is left of the context (the
    gateway caps it once the prompt is tokenized), as vLLM does."""
    _check(isinstance(body, dict), "the request body must be a JSON object", None)
    _known_fields(body, CHAT_FIELDS)
    messages = parse_messages(body)
    max_tokens = _max_tokens(body)
    common = _common(body, served_model, max_tokens or context_len, vocab_size)
    wants = _flag(body, "logprobs")
    top = _integer(body, "top_logprobs", None, 0, MAX_LOGPROBS)
    _check(top is None or wants, "'top_logprobs' needs 'logprobs': true", "top_logprobs")
    sampling = msgspec.structs.replace(common.pop("sampling"), logprobs=(top or 0) if wants else None)
    tools = parse_tools(body)
    sampling = _tool_sampling(sampling, tools)
    return CompletionRequest(prompt=None, prompt_token_ids=None, messages=messages, sampling=sampling,
                             max_tokens_defaulted=max_tokens is None, show_logprobs=wants, tools=tools, **common)


def _tool_sampling(sampling: SamplingParams, tools: Tools | None) -> SamplingParams:
    """With tool_choice required or a named function, the sampling follows the calls' grammar; it cannot
    also follow a response format, nor go on past its end (ignore_eos, min_tokens)."""
    grammar = tool_grammar(tools) if tools is not None else ""
    if not grammar:
        return sampling
    _check(not sampling.guide, "'tool_choice' required or a named function cannot be combined with a structured "
                               "output (response_format, structured_outputs, guided_*)", "tool_choice")
    _check(not (sampling.ignore_eos or sampling.min_tokens), "'tool_choice' required or a named function takes "
                                                            "neither 'ignore_eos' nor 'min_tokens'", "tool_choice")
    return msgspec.structs.replace(sampling, guide=grammar)


@dataclasses.dataclass(frozen=True)
class TokenizeRequest:
    """vLLM's POST /tokenize: a prompt, or messages rendered as a chat request would be."""

    prompt: str | None
    messages: list[dict] | None
    add_special_tokens: bool = True
    """The prompt form: BOS as a completion's prompt gets it (vLLM's default); the messages form takes only false
    (what a chat request is prompted with: the template writes its own special tokens)."""
    add_generation_prompt: bool = True
    return_token_strs: bool = False
    tools: list[dict] | None = None
    """The messages form: the tools a chat request would show the template (OpenAI's declarations)."""


TOKENIZE_FIELDS = frozenset({"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt",
                             "return_token_strs", "tools"})


def parse_tokenize(body: Any, served_model: str | Sequence[str]) -> TokenizeRequest:
    """Validate a /tokenize body: `prompt` (a string) or `messages`, as vLLM takes them."""
    _check(isinstance(body, dict), "the request body must be a JSON object", None)
    _known_fields(body, TOKENIZE_FIELDS)
    _model(body, served_model)
    chat = body.get("messages") is not None
    _check(chat != (body.get("prompt") is not None), "give either 'prompt' or 'messages'", "prompt")
    if not chat:
        _check(isinstance(body["prompt"], str), "'prompt' must be a string", "prompt")
        for name in ("add_generation_prompt", "tools"):
            _check(body.get(name) is None, f"'{name}' goes with 'messages'", name)
    special = body.get("add_special_tokens")
    special = not chat if special is None else special
    _check(isinstance(special, bool) and (not chat or not special),
           "'add_special_tokens' must be a boolean (false with 'messages': the template writes them)",
           "add_special_tokens")
    generation = body.get("add_generation_prompt")
    tools = parse_tools({"tools": body.get("tools")})
    return TokenizeRequest(prompt=None if chat else body["prompt"], messages=parse_messages(body) if chat else None,
                           add_special_tokens=special, add_generation_prompt=True if generation is None else
                           _flag(body, "add_generation_prompt"), return_token_strs=_flag(body, "return_token_strs"),
                           tools=tools.shown if tools is not None else None)


def parse_detokenize(body: Any, served_model: str | Sequence[str], vocab_size: int) -> list[int]:
    """Validate a /detokenize body: {"model"?, "tokens": [ids]}; the ids."""
    _check(isinstance(body, dict), "the request body must be a JSON object", None)
    _known_fields(body, frozenset({"model", "tokens"}))
    _model(body, served_model)
    tokens = body.get("tokens")
    _check(isinstance(tokens, list) and all(_is_int(t) and 0 <= t < vocab_size for t in tokens),
           f"'tokens' must be a list of token ids in [0, {vocab_size})", "tokens")
    return tokens


def check_context(n_prompt: int, max_tokens: int, max_model_len: int) -> None:
    """400 when prompt plus completion exceed the model's context, worded as OpenAI and vLLM do."""
    if n_prompt + max_tokens > max_model_len:
        raise ApiError(400, f"This model's maximum context length is {max_model_len} tokens. However, you "
                            f"requested {n_prompt + max_tokens} tokens ({n_prompt} in the prompt, "
                            f"{max_tokens} for the completion). Please reduce the length of the prompt "
                            f"or of the completion.", "prompt", code="context_length_exceeded")


def completion_body(request_id: str, model: str, text: str, finish_reason: str | None,
                    usage: dict | None, created: int | None = None, logprobs: dict | None = None,
                    index: int = 0) -> dict:
    """A text_completion object (whole answer) or one SSE chunk of it."""
    body = {"id": request_id, "object": "text_completion", "created": created or int(time.time()),
            "model": model,
            "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}]}
    if usage is not None:
        body["usage"] = usage
    return body


def chat_body(request_id: str, model: str, text: str, finish_reason: str | None, usage: dict | None,
              created: int | None = None, logprobs: dict | None = None, index: int = 0) -> dict:
    """A chat.completion object (the whole answer)."""
    message = {"role": "assistant", "content": text}
    return {"id": request_id, "object": "chat.completion", "created": created or int(time.time()), "model": model,
            "choices": [{"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}],
            "usage": usage}


def chat_chunk(request_id: str, model: str, delta: dict, finish_reason: str | None, usage: dict | None,
               created: int, logprobs: dict | None = None, index: int = 0) -> dict:
    """One chat.completion.chunk SSE event; the first carries delta {"role": "assistant"}."""
    body = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]}
    if usage is not None:
        body["usage"] = usage
    return body


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict:
    body: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens:  # OpenAI's field; absent means none were cached
        body["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return body
