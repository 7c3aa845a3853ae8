"""OpenAI's API (and vLLM's extras) as one registered API: OPENAI_API.

GET  /v1/models /v1/models/{id}
POST /v1/completions /v1/chat/completions /v1/embeddings /tokenize /detokenize

/v1/responses is its own API (server/responses.py). Errors are OpenAI's shape,
``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import time

from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from mlxserve.server import openapi as doc
from mlxserve.server.api import API
from mlxserve.server.body import parse_body
from mlxserve.server.embeddings import EmbeddingRequest, create_embedding
from mlxserve.server.errors import bad_request
from mlxserve.server.openai_serving import OpenAIServing
from mlxserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from mlxserve.server.served_model import ServedModel
from mlxserve.server.serving import Serving


def add_openai_routes(app: FastAPI, serving: Serving, limit: int) -> None:
    """Register the OpenAI routes over ``serving`` (bodies of at most ``limit`` bytes)."""
    openai = OpenAIServing(serving)
    created = int(time.time())

    def model_card(name: str) -> dict:
        """A servable model's card; max_model_len once it is loaded (or set by a flag)."""
        model, spec = serving.loaded(name), serving.spec_of(name)
        card = {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "mlxserve",
            "root": (model.root if model else spec.root) or name,
            "parent": None,
        }
        if model is not None:
            card["max_model_len"] = model.max_model_len
        elif spec.config is not None and spec.config.max_model_len is not None:
            card["max_model_len"] = spec.config.max_model_len
        return card

    @app.get("/v1/models", response_model=None, responses={200: doc.ok(doc.ModelList)} | doc.ERRORS)
    async def list_models() -> dict:
        return {"object": "list", "data": [model_card(n) for n in serving.model_names]}

    @app.get(
        "/v1/models/{model_id:path}",
        response_model=None,
        responses={200: doc.ok(doc.ModelCard), 404: doc.BODY_ERRORS[404]} | doc.ERRORS,
    )
    async def retrieve_model(model_id: str) -> dict:
        return model_card(model_id)

    @app.post(
        "/v1/completions",
        openapi_extra=doc.request_body(CompletionRequest),
        responses=doc.generation_responses(doc.CompletionResponse),
    )
    async def completions(request: Request) -> Response:
        body = await parse_body(request, CompletionRequest, limit)
        return await openai.create_completion(request, body)

    @app.post(
        "/v1/chat/completions",
        openapi_extra=doc.request_body(ChatCompletionRequest),
        responses=doc.generation_responses(doc.ChatCompletionResponse),
    )
    async def chat_completions(request: Request) -> Response:
        body = await parse_body(request, ChatCompletionRequest, limit)
        return await openai.create_chat_completion(request, body)

    @app.post(
        "/v1/embeddings",
        openapi_extra=doc.request_body(EmbeddingRequest),
        response_model=None,
        responses={200: doc.ok(doc.EmbeddingResponse)} | doc.GENERATE_ERRORS,
    )
    async def embeddings(request: Request) -> Response:
        body = await parse_body(request, EmbeddingRequest, limit)
        return await create_embedding(serving, request, body)

    @app.post(
        "/tokenize",
        openapi_extra=doc.request_body(TokenizeRequest),
        response_model=None,
        responses={200: doc.ok(doc.TokenizeResponse)} | doc.BODY_ERRORS,
    )
    async def tokenize(request: Request) -> dict:
        body = await parse_body(request, TokenizeRequest, limit)
        model = await serving.resolve(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("give exactly one of prompt and messages", "prompt")
        tokens, strs = await run_in_threadpool(_tokenize, model, body)
        out = {"count": len(tokens), "max_model_len": model.max_model_len, "tokens": tokens}
        if strs is not None:
            out["token_strs"] = strs
        return out

    @app.post(
        "/detokenize",
        openapi_extra=doc.request_body(DetokenizeRequest),
        response_model=None,
        responses={200: doc.ok(doc.DetokenizeResponse)} | doc.BODY_ERRORS,
    )
    async def detokenize(request: Request) -> dict:
        body = await parse_body(request, DetokenizeRequest, limit)
        model = await serving.resolve(body.model)
        model.check_token_ids(body.tokens, "tokens")
        text = await run_in_threadpool(model.tokenizer.decode, body.tokens, False)
        return {"prompt": text}


def _tokenize(model: ServedModel, body: TokenizeRequest) -> tuple[list[int], list | None]:
    """/tokenize's ids (and their token strings if asked), in a worker thread."""
    tokenizer = model.tokenizer
    if body.prompt is not None:
        add = True if body.add_special_tokens is None else body.add_special_tokens
        tokens = tokenizer.encode(body.prompt, add_special_tokens=add)
    else:
        tools = [t.model_dump(exclude_none=True) for t in body.tools or []]
        messages, tools = model.features.template_inputs(
            [m.to_template() for m in body.messages], tools
        )
        try:
            text = tokenizer.apply_chat_template(
                messages,
                tools=tools,
                add_generation_prompt=body.add_generation_prompt,
                continue_final_message=body.continue_final_message,
            )
        except ValueError as e:
            raise bad_request(str(e), getattr(e, "parameter", None) or "messages") from None
        if body.add_special_tokens:
            tokens = tokenizer.encode(text, add_special_tokens=True)
        else:
            tokens = tokenizer.encode_rendered_chat(text)
    strs = [tokenizer.id_to_token(t) for t in tokens] if body.return_token_strs else None
    return tokens, strs


OPENAI_API = API(
    name="openai",
    add_routes=add_openai_routes,
    prefixes=("/v1/", "/tokenize", "/detokenize"),
    bodies=(
        CompletionRequest,
        ChatCompletionRequest,
        EmbeddingRequest,
        TokenizeRequest,
        DetokenizeRequest,
    ),
)
