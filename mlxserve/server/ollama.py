"""Ollama's API (/api/*) as a thin translation onto the engine.

    POST /api/chat /api/generate      NDJSON streams (Ollama streams unless "stream": false)
    POST /api/embed /api/embeddings   the embedding requests of /v1/embeddings
    POST /api/show   GET /api/tags /api/ps /api/version

    POST /api/pull /api/copy   DELETE /api/delete   (ollama_models.py)

A request's ``model`` picks one of the server's models, loaded on first use; its
``keep_alive`` says how long the model stays loaded afterwards (server/serving.py).

Errors are Ollama's shape, ``{"error": "<message>"}``, with the same status codes as the
OpenAI routes. The request bodies and their options are in ollama_protocol.py.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from datetime import datetime, timezone
from typing import Any

from fastapi import FastAPI
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from mlxserve import __version__
from mlxserve.exceptions import ParameterError
from mlxserve.parsers import ToolCall
from mlxserve.pooling_params import PoolingParams
from mlxserve.sampling_params import SamplingParams
from mlxserve.server import openapi as doc
from mlxserve.server.api import API
from mlxserve.server.chat_run import (
    ChatRequest,
    ChatResult,
    ChatRun,
    NDJSONResponse,
    framed,
    started,
)
from mlxserve.server.embeddings import MAX_EMBEDDING_INPUTS
from mlxserve.server.errors import APIError, bad_request, closing_headers
from mlxserve.server.ollama_models import OllamaModels, describe_spec, details_of_spec
from mlxserve.server.ollama_protocol import (
    OllamaChatRequest,
    OllamaCopyRequest,
    OllamaDeleteRequest,
    OllamaEmbeddingsRequest,
    OllamaEmbedRequest,
    OllamaGenerateRequest,
    OllamaPullRequest,
    OllamaShowRequest,
    _Common,
)
from mlxserve.server.served_model import ServedModel
from mlxserve.server.serving import Serving
from mlxserve.server.streams import ClientDisconnected, RequestGroup, run_unless_disconnected
from mlxserve.server.tool_messages import call_input, function_tool, ollama_messages

logger = logging.getLogger("mlxserve.server")


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def error_response(e: APIError) -> JSONResponse:
    """An error in Ollama's shape."""
    return JSONResponse(
        {"error": e.message}, status_code=e.status, headers=closing_headers(e.status)
    )


def _done_fields(res: ChatResult) -> dict[str, Any]:
    total = int((time.monotonic() - res.start_time) * 1e9)
    return {
        "done": True,
        "done_reason": "length" if res.finish_reason == "length" else "stop",
        "total_duration": total,
        "load_duration": 0,
        "prompt_eval_count": res.prompt_tokens,
        "eval_count": res.completion_tokens,
    }


class OllamaServing:
    """The /api/* routes over the server's models (Serving: model checks, in-flight requests)."""

    def __init__(self, serving: Serving) -> None:
        self.serving = serving
        self.models = OllamaModels(serving)

    def served_name(self, name: str) -> str:
        """A served name for ``name``, Ollama's ":latest" tag allowed."""
        bare = name.removesuffix(":latest")
        return bare if bare in self.serving.model_names else name

    async def model_name(self, name: str) -> ServedModel:
        """The model of a served name (loaded first if need be); 404 otherwise."""
        return await self.serving.resolve(self.served_name(name))

    def details(self, model: ServedModel) -> dict[str, Any]:
        family = model.info.architecture
        return {
            "parent_model": "",
            "format": model.info.file_format,
            "family": family,
            "families": [family],
            "parameter_size": "",
            "quantization_level": "",
        }

    def model_entry(self, model: ServedModel) -> dict[str, Any]:
        return {
            "name": model.name,
            "model": model.name,
            "modified_at": now_iso(),
            "size": model.info.weight_bytes,
            "digest": "",
            "details": self.details(model),
        }

    def unloaded_entry(self, name: str) -> dict[str, Any]:
        """A model that is not loaded: what its files say (headers only), when local."""
        entry: dict[str, Any] = {"name": name, "model": name, "modified_at": now_iso()}
        local = describe_spec(self.serving.spec_of(name))
        details = {"parent_model": "", "format": "", "family": "", "families": []}
        details |= {"parameter_size": "", "quantization_level": ""}
        if local is not None:
            details |= {"format": local.format, "family": local.architecture}
            details |= {"families": [local.architecture], "quantization_level": local.quantization}
        return entry | {"size": local.size if local else 0, "digest": "", "details": details}

    # ------------------------------------------------------------- metadata
    async def tags(self) -> dict:
        entries = []
        for name in self.serving.model_names:
            model = self.serving.loaded(name)
            if model is not None:
                entries.append(self.model_entry(model))
            else:
                entries.append(await run_in_threadpool(self.unloaded_entry, name))
        return {"models": entries}

    def ps(self) -> dict:
        models = [
            self.model_entry(m)
            | {"size_vram": m.info.weight_bytes, "expires_at": self.serving.expires_at(m)}
            | {"context_length": m.max_model_len}
            for m in self.serving.models
        ]
        return {"models": models}

    async def show(self, body: dict[str, Any]) -> dict:
        """A model's details, facts, chat template and sampling defaults: from its files
        when they are local (without loading it), else from the loaded model."""
        name = body.get("model") or body.get("name")
        if not isinstance(name, str):
            raise bad_request("model is required", "model")
        served = self.served_name(name)
        model = self.serving.loaded(served)  # 404 for a name this server does not serve
        local = await run_in_threadpool(details_of_spec, self.serving.spec_of(served))
        if model is None and local is None:
            model = await self.model_name(name)
        out: dict[str, Any] = {"modelfile": "", "parameters": "", "template": ""}
        if local is not None:
            template = local.chat_template
            if isinstance(template, dict):
                template = template.get("default") or next(iter(template.values()), "")
            out["template"] = template or ""
            defaults = local.generation_defaults
            out["parameters"] = "\n".join(f"{k} {v}" for k, v in sorted(defaults.items()))
            if license_ := local.license:
                out["license"] = license_
        if model is not None:
            info = {f"general.{k}": v for k, v in model.info.config_facts.items()}
            info["general.context_length"] = model.max_model_len
            details = self.details(model)
        else:
            assert local is not None
            arch = local.model.architecture
            info = {"general.architecture": arch, "general.parameter_count": local.parameters}
            info["general.context_length"] = local.model.context_length
            details = {"parent_model": "", "format": local.model.format, "family": arch}
            details |= {"families": [arch], "parameter_size": "", "quantization_level": ""}
            details["quantization_level"] = local.model.quantization
        return out | {
            "details": details,
            "model_info": info,
            "capabilities": ["completion", "embedding"],
            "modified_at": now_iso(),
        }

    def version(self) -> dict:
        return {"version": __version__}

    # ------------------------------------------------------------ generation
    async def chat(self, raw: Request, req: OllamaChatRequest) -> Response:
        self.models.check_keep_alive(req.keep_alive)
        model = await self.model_name(req.model)
        if not req.messages:  # Ollama's way of asking for the model to be (un)loaded
            return self._load(req, model, "message", {"role": "assistant", "content": ""})
        if any(m.images for m in req.messages):
            raise bad_request("images are not supported (no vision models here)", "messages")
        params = req.sampling_params(model.sampling_defaults)
        messages = ollama_messages([m.model_dump(exclude_none=True) for m in req.messages])
        if not messages:
            raise bad_request("messages must not be empty", "messages")
        functions = [t.get("function") or {} for t in req.tools or ()]
        tools = [
            function_tool(
                f.get("name"), f.get("description"), f.get("parameters"), "tools",
                f"tools.{i}.function.parameters",
            )
            for i, f in enumerate(functions)
        ]  # fmt: skip
        return await self._run(
            raw, req, params, model, "message", messages=messages, tools=tools or None
        )

    async def generate(self, raw: Request, req: OllamaGenerateRequest) -> Response:
        self.models.check_keep_alive(req.keep_alive)
        model = await self.model_name(req.model)
        for name in ("suffix", "context", "images"):
            if getattr(req, name):
                raise bad_request(f"{name} is not supported", name)
        if not req.prompt:  # Ollama's way of asking for the model to be (un)loaded
            return self._load(req, model, "response", "")
        params = req.sampling_params(model.sampling_defaults)
        if req.raw:
            return await self._run(raw, req, params, model, "response", prompt=req.prompt)
        messages = [{"role": "system", "content": req.system}] if req.system else []
        messages.append({"role": "user", "content": req.prompt})
        return await self._run(raw, req, params, model, "response", messages=messages)

    def _load(self, req: _Common, model: ServedModel, key: str, empty: Any) -> Response:
        """Ollama's answer to a request with nothing to generate: the model is (un)loaded."""
        unload = self.models.keep_alive(req.keep_alive, model)
        body = {"model": model.name, "created_at": now_iso(), key: empty, "done": True}
        return JSONResponse(body | {"done_reason": "unload" if unload else "load"})

    async def _run(
        self,
        raw: Request,
        req: _Common,
        params: SamplingParams,
        model: ServedModel,
        key: str,
        **what,
    ) -> Response:
        stream, keep_alive = req.stream, req.keep_alive
        run = ChatRun(self.serving, model, "ollama", "messages" if key == "message" else "prompt")
        run.field_names = {"structured_outputs": "format"}
        if not await started(run, raw, run.start(raw, ChatRequest(params, **what))):
            return Response(status_code=499)
        self.models.keep_alive(keep_alive, model)  # the request runs: acts once it is over

        def piece(content: str, thinking: str = "", calls: list | None = None) -> dict[str, Any]:
            if key == "response":
                return {"response": content} | ({"thinking": thinking} if thinking else {})
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if thinking:
                message["thinking"] = thinking
            if calls:
                message["tool_calls"] = [
                    {"function": {"name": c.name, "arguments": call_input(c.arguments)}}
                    for c in calls
                ]
            return {"message": message}

        head = {"model": model.name}
        if not stream:
            try:
                res = await run.collect(raw)
            except ClientDisconnected:
                return Response(status_code=499)
            parsed = run.parsed()
            reply = piece(parsed.content, parsed.reasoning_content, parsed.tool_calls)
            return JSONResponse(head | {"created_at": now_iso()} | reply | _done_fields(res))

        async def lines():
            async for d in run.parsed_deltas():
                calls = [ToolCall(tc.id or "", tc.name or "", tc.arguments) for tc in d.tool_calls]
                reply = piece(d.content, d.reasoning_content, calls)
                yield _line(head | {"created_at": now_iso()} | reply | {"done": False})
            yield _line(head | {"created_at": now_iso()} | piece("") | _done_fields(run.result))

        frames = framed(lines(), run, lambda e: _line({"error": e.message}))
        return NDJSONResponse(frames, run.close)

    # ------------------------------------------------------------ embeddings
    async def embed(
        self, raw: Request, model: ServedModel, texts: list[str], dimensions: int | None
    ) -> tuple[list, int]:
        """(vectors of ``texts``, their number of tokens), through the engine as
        /v1/embeddings does: as many inputs at most, checked before any is tokenized."""
        if len(texts) > MAX_EMBEDDING_INPUTS:
            raise bad_request(
                f"input holds {len(texts)} items; at most {MAX_EMBEDDING_INPUTS} per request",
                "input",
            )
        try:
            pooling = PoolingParams(dimensions=dimensions)
        except ParameterError as e:
            raise bad_request(str(e), e.parameter) from None
        self.serving.check_accepting()
        tok = model.tokenizer
        ids = await run_in_threadpool(lambda: [tok.encode(t) for t in texts])
        rid = f"ollama-embed-{uuid.uuid4().hex}"
        requests = [(f"{rid}-{i}", t, ids[i], None) for i, t in enumerate(texts)]
        group = RequestGroup(model.llm, requests, self.serving.in_flight, pooling_params=pooling)

        async def work() -> list:
            await group.start()
            vectors: list = [None] * len(texts)
            async for i, out in group.outputs():
                if out.embedding is not None:
                    vectors[i] = out.embedding
            return vectors

        try:
            return await run_unless_disconnected(raw, work()), sum(map(len, ids))
        except ParameterError as e:
            raise bad_request(str(e), "input" if e.parameter == "prompt" else e.parameter) from None
        except ValueError as e:
            raise bad_request(str(e), "input") from None
        finally:
            await group.close()


NDJSON = "application/x-ndjson"


def _line(obj: dict[str, Any]) -> str:
    return json.dumps(obj, ensure_ascii=False) + "\n"


def add_ollama_routes(app: FastAPI, serving: Serving, limit: int) -> None:
    """Register /api/* on ``app`` over ``serving``; every error leaves in Ollama's shape."""
    from mlxserve.server.body import parse_body, parse_json, read_body

    ollama = OllamaServing(serving)

    def route(method: str, path: str, body: type | None = None, stream: bool = False):
        documented = doc.other_api_route(body, doc.OllamaError, NDJSON if stream else None)

        def register(handler):
            async def endpoint(request: Request) -> Response:
                try:
                    out = await handler(request)
                except APIError as e:
                    return error_response(e)
                except ClientDisconnected:  # nobody is left to answer; not a server error
                    return Response(status_code=499)
                except Exception as e:  # noqa: BLE001 -- every error in Ollama's shape
                    logger.exception("internal error while handling a request")
                    message = f"internal server error: {type(e).__name__}: {e}"
                    return error_response(APIError(500, message))
                return out if isinstance(out, Response) else JSONResponse(out)

            app.add_api_route(path, endpoint, methods=[method], **documented)
            return handler

        return register

    @route("GET", "/api/tags")
    async def tags(request: Request):
        return await ollama.tags()

    @route("GET", "/api/ps")
    async def ps(request: Request):
        return ollama.ps()

    @route("GET", "/api/version")
    async def version(request: Request):
        return ollama.version()

    @route("POST", "/api/show", OllamaShowRequest)
    async def show(request: Request):
        body = parse_json(await read_body(request, limit))
        if not isinstance(body, dict):
            raise bad_request("the body must be a JSON object")
        return await ollama.show(body)

    @route("POST", "/api/pull", OllamaPullRequest, stream=True)
    async def pull(request: Request):
        body = parse_json(await read_body(request, limit))
        statuses = ollama.models.pull(body)
        first = await anext(statuses)  # a refusal (404, 400) is an error response
        if isinstance(body, dict) and body.get("stream") is False:
            return [first, *[status async for status in statuses]][-1]

        async def lines():
            yield _line(first)
            try:
                async for status in statuses:
                    yield _line(status)
            except APIError as e:  # the stream has begun: Ollama's error line
                yield _line({"error": e.message})

        return StreamingResponse(lines(), media_type=NDJSON)

    @route("DELETE", "/api/delete", OllamaDeleteRequest)
    async def delete(request: Request):
        await ollama.models.delete(parse_json(await read_body(request, limit)))

    @route("POST", "/api/copy", OllamaCopyRequest)
    async def copy(request: Request):
        ollama.models.copy(parse_json(await read_body(request, limit)))

    @route("POST", "/api/chat", OllamaChatRequest, stream=True)
    async def chat(request: Request):
        return await ollama.chat(request, await parse_body(request, OllamaChatRequest, limit))

    @route("POST", "/api/generate", OllamaGenerateRequest, stream=True)
    async def generate(request: Request):
        body = await parse_body(request, OllamaGenerateRequest, limit)
        return await ollama.generate(request, body)

    @route("POST", "/api/embed", OllamaEmbedRequest)
    async def embed(request: Request):
        body = await parse_body(request, OllamaEmbedRequest, limit)
        ollama.models.check_keep_alive(body.keep_alive)
        model = await ollama.model_name(body.model)
        texts = [body.input] if isinstance(body.input, str) else list(body.input)
        start = time.monotonic()
        vectors, num_tokens = await ollama.embed(request, model, texts, body.dimensions)
        ollama.models.keep_alive(body.keep_alive, model)
        return {
            "model": model.name,
            "embeddings": vectors,
            "total_duration": int((time.monotonic() - start) * 1e9),
            "load_duration": 0,
            "prompt_eval_count": num_tokens,
        }

    @route("POST", "/api/embeddings", OllamaEmbeddingsRequest)
    async def embeddings(request: Request):
        body = await parse_body(request, OllamaEmbeddingsRequest, limit)
        ollama.models.check_keep_alive(body.keep_alive)
        model = await ollama.model_name(body.model)
        (vector,), _ = await ollama.embed(request, model, [body.prompt], None)
        ollama.models.keep_alive(body.keep_alive, model)
        return {"embedding": vector}


OLLAMA_API = API(
    name="ollama",
    add_routes=add_ollama_routes,
    prefixes=("/api/",),
    bodies=(
        OllamaChatRequest,
        OllamaGenerateRequest,
        OllamaEmbedRequest,
        OllamaEmbeddingsRequest,
        OllamaShowRequest,
        OllamaPullRequest,
        OllamaDeleteRequest,
        OllamaCopyRequest,
    ),
    open_paths=("/api/version",),  # like /version
    error_response=error_response,
)
