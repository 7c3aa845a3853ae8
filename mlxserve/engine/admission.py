"""Request admission: the checks a request passes before the engine queues it.

Each check lives here once and raises ParameterError naming its field, with the numbers
(the value and the model's limit), so a request that can never run is refused up front.
"""

from __future__ import annotations

from mlxserve.exceptions import ParameterError
from mlxserve.pooling_params import PoolingParams
from mlxserve.sampling_params import SamplingParams
from mlxserve.structured_output.grammar import GrammarCompiler, StructuredOutputRequest
from mlxserve.tokenizer import Tokenizer


def prompt_token_ids_of(
    tokenizer: Tokenizer, prompt: str | list[int] | None, prompt_token_ids: list[int] | None
) -> list[int]:
    """The prompt's token ids (given, or encoded from its text); never empty."""
    if prompt_token_ids is None:
        if isinstance(prompt, str):
            prompt_token_ids = tokenizer.encode(prompt)
        elif prompt is not None:
            prompt_token_ids = list(prompt)
    if not prompt_token_ids:
        raise ParameterError("prompt must not be empty", parameter="prompt")
    return prompt_token_ids


def check_request(
    prompt_token_ids: list[int], params: SamplingParams, vocab_size: int, max_model_len: int
) -> int:
    """Check token ids against the vocabulary and the length against max_model_len; the
    request's max_tokens (the room left when the params leave it unset)."""
    check_token_ids("prompt", prompt_token_ids, vocab_size)
    check_token_ids("logit_bias", list(params.logit_bias or ()), vocab_size)
    check_token_ids("stop_token_ids", params.stop_token_ids or [], vocab_size)
    return max_tokens_for(len(prompt_token_ids), params, max_model_len)


def check_token_ids(parameter: str, token_ids: list[int], vocab_size: int) -> None:
    """Every id in [0, vocab_size); ParameterError naming ``parameter`` otherwise."""
    bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab_size]
    if bad:
        what = "prompt token ids" if parameter == "prompt" else f"{parameter} token ids"
        raise ParameterError(
            f"{what} must be in [0, {vocab_size}) (the model's vocabulary), got {bad[:5]}",
            parameter=parameter,
        )


def max_tokens_for(prompt_len: int, params: SamplingParams, max_model_len: int) -> int:
    """The tokens the request may generate: params.max_tokens, or all the room left."""
    room = max_model_len - prompt_len
    if room < 1:
        raise ParameterError(
            f"prompt is {prompt_len} tokens, but max_model_len is {max_model_len}: "
            f"it must be at most {max_model_len - 1} tokens to generate anything",
            parameter="prompt",
        )
    if params.max_tokens is None:
        return room
    if params.max_tokens > room:
        raise ParameterError(
            f"max_tokens {params.max_tokens} + prompt {prompt_len} tokens = "
            f"{params.max_tokens + prompt_len} exceeds max_model_len {max_model_len}; "
            f"use max_tokens <= {room}",
            parameter="max_tokens",
        )
    return params.max_tokens


def check_pooling(pooling: PoolingParams, embedding_size: int, is_matryoshka: bool) -> None:
    """``dimensions`` only for a Matryoshka model, and at most its hidden size."""
    dims = pooling.dimensions
    if dims is None:
        return
    if not is_matryoshka:
        raise ParameterError(
            f"dimensions {dims}: this model was not trained for shorter embeddings "
            "(no matryoshka_dimensions in its config), so it always returns "
            f"{embedding_size}; leave dimensions out",
            parameter="dimensions",
        )
    if dims > embedding_size:
        raise ParameterError(
            f"dimensions must be at most {embedding_size} (the model's hidden size), got {dims}",
            parameter="dimensions",
        )


def compile_structured_output(
    grammars: GrammarCompiler, params: SamplingParams, starts_after: str | None = None
) -> StructuredOutputRequest | None:
    """The compiled constraint of ``params`` (None without one); ParameterError if it is
    invalid or cannot be combined with the other params."""
    so = params.structured_outputs
    if so is None:
        return None
    for name, bad in (("ignore_eos", params.ignore_eos), ("min_tokens", params.min_tokens)):
        if bad:
            raise ParameterError(
                f"{name} cannot be combined with structured_outputs: a constrained "
                "request ends when its grammar does",
                parameter=name,
            )
    trigger = starts_after.encode() if starts_after else None
    return StructuredOutputRequest(grammars.compile(so), trigger)
