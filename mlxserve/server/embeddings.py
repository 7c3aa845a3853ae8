"""POST /v1/embeddings (OpenAI's shape): one engine request per input, prefill only.

The inputs run through the same AsyncLLM, scheduler and batches as generation; this module
only translates the body and the vectors (float lists, or base64 of little-endian float32
as OpenAI sends them when asked, which its Python SDK does by default).
"""

from __future__ import annotations

import base64
import uuid
from typing import Literal

import numpy as np
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from mlxserve.exceptions import ParameterError
from mlxserve.pooling_params import PoolingParams
from mlxserve.sampling_params import INT32_MAX
from mlxserve.server.errors import bad_request
from mlxserve.server.protocol import Int, _doc, _Strict
from mlxserve.server.streams import ClientDisconnected, RequestGroup, run_unless_disconnected

# Inputs per call: OpenAI's limit, which clients (LangChain, the SDKs) batch up to.
MAX_EMBEDDING_INPUTS = 2048


class EmbeddingRequest(_Strict):
    """POST /v1/embeddings."""

    model: str | None = None
    input: str | list[str] | list[Int] | list[list[Int]] = _doc(
        minLength=1, minItems=1, maxItems=MAX_EMBEDDING_INPUTS, items={"minLength": 1}
    )
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Int | None = _doc(minimum=1, maximum=INT32_MAX)
    user: str | None = None  # an end-user id for the caller's own bookkeeping; not used
    # vLLM's extra: whether the tokenizer adds its special tokens (BOS...) to text inputs.
    add_special_tokens: bool = True

    def inputs(self) -> list[str | list[int]]:
        """The inputs as a list, each a string or a list of token ids; 400 when empty."""
        items = self.input
        if isinstance(items, str) or (items and isinstance(items[0], int)):
            items = [items]
        if not items:
            raise bad_request("input must not be empty", "input")
        if len(items) > MAX_EMBEDDING_INPUTS:
            raise bad_request(
                f"input holds {len(items)} items; at most {MAX_EMBEDDING_INPUTS} per request",
                "input",
            )
        for item in items:
            if not item:
                raise bad_request("input must not hold an empty string or token list", "input")
        return list(items)


def encode_vector(vector: list[float], encoding_format: str) -> list[float] | str:
    """A vector as OpenAI returns it: floats, or base64 of its float32 bytes (little-endian)."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector


async def create_embedding(serving, raw: Request, req: EmbeddingRequest) -> Response:
    """POST /v1/embeddings over ``serving`` (server/serving.py's Serving: the models)."""
    serving.check_accepting()
    model = await serving.resolve(req.model)
    items = req.inputs()
    try:
        pooling = PoolingParams(dimensions=req.dimensions)
    except ParameterError as e:
        raise bad_request(str(e), e.parameter) from None

    def encode() -> list[tuple[str | None, list[int]]]:
        tok = model.tokenizer
        return [
            (x, tok.encode(x, add_special_tokens=req.add_special_tokens))
            if isinstance(x, str)
            else (None, list(x))
            for x in items
        ]

    prompts = await run_in_threadpool(encode)
    rid = f"embd-{uuid.uuid4().hex}"
    requests = [(f"{rid}-{i}", text, ids, None) for i, (text, ids) in enumerate(prompts)]
    group = RequestGroup(model.llm, requests, serving.in_flight, pooling_params=pooling)

    async def work() -> list[list[float]]:
        await group.start()
        vectors: list[list[float]] = [[] for _ in prompts]
        async for i, out in group.outputs():
            if out.embedding is not None:
                vectors[i] = out.embedding
        return vectors

    try:
        vectors = await run_unless_disconnected(raw, work())
    except ClientDisconnected:
        return Response(status_code=499)
    except ParameterError as e:
        name = "input" if e.parameter == "prompt" else e.parameter
        raise bad_request(str(e).replace("prompt", "input", 1), name) from None
    except ValueError as e:
        raise bad_request(str(e), None) from None
    finally:
        await group.close()
    num_tokens = sum(len(ids) for _, ids in prompts)
    data = [
        {"object": "embedding", "index": i, "embedding": encode_vector(v, req.encoding_format)}
        for i, v in enumerate(vectors)
    ]
    usage = {"prompt_tokens": num_tokens, "total_tokens": num_tokens}
    return JSONResponse({"object": "list", "data": data, "model": model.name, "usage": usage})
