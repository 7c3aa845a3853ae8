"""The API registry (server/api.py, server/app.py's APIS): what a client of each API sees.

Every registered API's routes and request bodies are in /openapi.json; with an API key
set, a request without it gets a 401 in the shape of the API that owns the path, open
paths stay open, and the framework's own errors (an unknown path) keep the API's shape
too. The app runs in-process on a tiny random model; the server knows the model only
through ``describe()``.
"""

from __future__ import annotations

import re

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from mlxserve.config import EngineConfig
from mlxserve.engine.async_llm import AsyncLLM
from mlxserve.engine.llm_engine import LLMEngine
from mlxserve.engine.model_info import ModelInfo
from mlxserve.server import ServerConfig, ServerMetrics, build_app
from mlxserve.server.api import owner
from mlxserve.server.app import APIS
from mlxserve.server.served_model import make_served_model
from mlxserve.server.serving import Serving
from tests.engine_helpers import make_tiny_model_dir

KEY = "sk-registry-key"

# A path each API owns, and the 401 body its own clients parse.
PROBES = {
    "openai": "/v1/chat/completions",
    "anthropic": "/v1/messages",
    "responses": "/v1/responses",
    "ollama": "/api/chat",
}


def openai_shape(body: dict) -> None:
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]


def anthropic_shape(body: dict) -> None:
    assert set(body) == {"type", "error"} and body["type"] == "error"
    assert set(body["error"]) == {"type", "message"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]


def ollama_shape(body: dict) -> None:
    assert set(body) == {"error"} and isinstance(body["error"], str) and body["error"]


SHAPES = {
    "openai": openai_shape,
    "anthropic": anthropic_shape,
    "responses": openai_shape,
    "ollama": ollama_shape,
}


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory):
    _, model_dir = make_tiny_model_dir(tmp_path_factory.mktemp("tiny"), seed=3)
    engine = LLMEngine(EngineConfig(model=str(model_dir), num_blocks=64, max_model_len=96))
    llm = AsyncLLM(engine)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def client(llm):
    config = ServerConfig(model_names=("tiny",), api_keys=(KEY,), log_stats_interval=None)
    app = build_app(llm, ServerMetrics("tiny"), config)
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


def registered_paths(llm, api) -> set[str]:
    """The paths ``api`` registers, on an app of its own, as OpenAPI spells them."""
    app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)
    api.add_routes(app, Serving([make_served_model(llm, ("tiny",))]), 1 << 20)
    return {re.sub(r"\{(\w+):\w+\}", r"{\1}", r.path) for r in app.routes}


def test_every_api_is_probed_and_names_are_unique() -> None:
    names = [api.name for api in APIS]
    assert len(set(names)) == len(names)
    assert set(names) == set(PROBES) == set(SHAPES)


def test_every_registered_route_and_body_is_in_openapi(llm, client) -> None:
    schema = client.get("/openapi.json").json()
    for api in APIS:
        paths = registered_paths(llm, api)
        assert paths, api.name
        assert paths <= set(schema["paths"]), (api.name, paths - set(schema["paths"]))
        for path in paths:
            assert owner(APIS, path) is api, (api.name, path)
        for body in api.bodies:
            component = schema["components"]["schemas"][body.__name__]
            if "model" in component["properties"]:  # the served names, as an enum
                assert "tiny" in component["properties"]["model"]["enum"]


@pytest.mark.parametrize("name", sorted(PROBES))
def test_401_in_the_owning_apis_shape(client, name: str) -> None:
    (api,) = [a for a in APIS if a.name == name]
    path = PROBES[name]
    assert owner(APIS, path) is api
    r = client.post(path, json={})
    assert r.status_code == 401, r.text
    assert r.headers["www-authenticate"] == "Bearer"
    SHAPES[name](r.json())
    assert "API key" in str(r.json())
    wrong = client.post(path, json={}, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401
    SHAPES[name](wrong.json())


@pytest.mark.parametrize("name", sorted(PROBES))
def test_unknown_path_404_in_the_owning_apis_shape(client, name: str) -> None:
    path = PROBES[name].rstrip("/") + "/no-such-route/x"
    r = client.get(path, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code in (404, 405), r.text
    SHAPES[name](r.json())


def test_anthropic_clients_key_header_and_open_paths(client) -> None:
    r = client.post("/v1/messages/count_tokens", json={}, headers={"x-api-key": KEY})
    assert r.status_code == 400, r.text  # past the key check: the body is what is wrong
    anthropic_shape(r.json())
    assert client.get("/api/version").status_code == 200  # Ollama's open path
    assert client.get("/health").status_code == 200
    assert client.get("/version").status_code == 200
    assert client.get("/v1/models").status_code == 401


def test_owner_is_the_longest_prefix() -> None:
    by_name = {a.name: a for a in APIS}
    assert owner(APIS, "/v1/messages/count_tokens") is by_name["anthropic"]
    assert owner(APIS, "/v1/responses/resp_1/input_items") is by_name["responses"]
    assert owner(APIS, "/v1/models") is by_name["openai"]
    assert owner(APIS, "/tokenize") is by_name["openai"]
    assert owner(APIS, "/api/tags") is by_name["ollama"]
    assert owner(APIS, "/health") is None
    assert owner(APIS, "/") is None


def test_the_server_reads_the_model_through_describe(llm, client) -> None:
    info = llm.describe()
    assert isinstance(info, ModelInfo)
    engine = llm.engine
    assert info.max_model_len == engine.max_model_len == 96
    assert info.vocab_size == engine.vocab_size
    assert info.weight_bytes > 0
    assert info.architecture == engine.loaded.config["model_type"]
    assert info.file_format == "safetensors"
    auth = {"Authorization": f"Bearer {KEY}"}
    (card,) = client.get("/v1/models", headers=auth).json()["data"]
    assert card["max_model_len"] == 96
    show = client.post("/api/show", json={"model": "tiny"}, headers=auth).json()
    assert show["model_info"]["general.context_length"] == 96
    assert show["details"]["family"] == info.architecture
    (tag,) = client.get("/api/tags", headers=auth).json()["models"]
    assert tag["size"] == info.weight_bytes
