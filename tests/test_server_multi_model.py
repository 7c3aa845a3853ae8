"""Several models in one server: `mlxserve serve A B --models-dir DIR` with tiny models.

A request's `model` picks one, loaded on its first request (once, however many race for
it); keep_alive unloads idle ones (0: at once), --pin keeps one, --max-loaded-models evicts
the least recently used. Loads and unloads are counted from the server's log.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from mlxserve.loader.catalog import models_in_dir
from mlxserve.server.keep_alive import parse_keep_alive
from tests.engine_helpers import make_tiny_model_dir
from tests.paths import ROOT
from tests.server_harness import metric, read_metrics, start_server, wait_until

COMMON = ["--dtype", "float32", "--max-model-len", "256", "--disable-log-stats"]
CHAT = {"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Four tiny models: a and b given by path, c and d in a models folder."""
    root = tmp_path_factory.mktemp("models")
    folder = root / "dir"
    out = {}
    for seed, name in enumerate("abcd"):
        parent = root if name in "ab" else folder
        _, out[name] = make_tiny_model_dir(parent / name, seed=seed + 1)
    out["dir"] = folder
    return out


def serve(models: dict[str, Path], tmp_path: Path, *flags: str):
    args = [str(models["a"]), str(models["b"]), "--served-model-name", "alpha"]
    args += ["--models-dir", str(models["dir"]), *COMMON, *flags]
    return start_server(args, tmp_path / "server.log")


@pytest.fixture(scope="module")
def server(models, tmp_path_factory: pytest.TempPathFactory):
    s = serve(models, tmp_path_factory.mktemp("log"), "--keep-alive", "2s", "--pin", "c")
    yield s
    s.stop()


def loaded(url: str) -> set[str]:
    return {m["name"] for m in httpx.get(url + "/api/ps", timeout=10).json()["models"]}


def chat(url: str, model: str, **extra) -> httpx.Response:
    return httpx.post(
        url + "/v1/chat/completions", json=CHAT | {"model": model} | extra, timeout=120
    )


def ollama_chat(url: str, model: str, **extra) -> dict:
    body = {"model": model, "messages": CHAT["messages"], "stream": False}
    body |= {"options": {"temperature": 0, "num_predict": 4}} | extra
    r = httpx.post(url + "/api/chat", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def mlxserve_ps(url: str) -> list[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run(
        [sys.executable, "-m", "mlxserve.cli", "ps", "--url", url],
        env=env, capture_output=True, text=True, cwd=ROOT, timeout=60, check=True,
    )  # fmt: skip
    return [line.split()[0] for line in out.stdout.splitlines()[1:]]


def test_each_model_answers_by_name_and_lists(server) -> None:
    served = [m["id"] for m in httpx.get(server.url + "/v1/models").json()["data"]]
    assert served == ["alpha", "b", "c", "d"]
    tags = httpx.get(server.url + "/api/tags").json()["models"]
    assert [t["name"] for t in tags] == served
    assert all(t["size"] > 0 and t["details"]["family"] == "llama" for t in tags)
    texts = {}
    for name in ("alpha", "b", "c"):
        r = chat(server.url, name)
        assert r.status_code == 200, r.text
        assert r.json()["model"] == name
        texts[name] = r.json()["choices"][0]["message"]["content"]
        reply = ollama_chat(server.url, f"{name}:latest")
        assert reply["model"] == f"{name}:latest" or reply["model"] == name
        assert reply["done"] and reply["eval_count"] > 0
    assert len(set(texts.values())) > 1  # three models with their own weights
    values = read_metrics(server.url)  # each model under its own label
    for name in ("alpha", "b", "c"):
        assert metric(values, "vllm:generation_tokens_total", model_name=name) >= 8
        assert metric(values, "mlxserve:prefix_caching_enabled", model_name=name, reason="") == 1
    r = chat(server.url, "nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = httpx.post(server.url + "/api/chat", json={"model": "nope", "messages": []})
    assert r.status_code == 404 and set(r.json()) == {"error"}


def test_racing_first_requests_load_a_model_once(server) -> None:
    assert "d" not in loaded(server.url)
    with ThreadPoolExecutor(20) as pool:
        replies = list(pool.map(lambda _: chat(server.url, "d"), range(20)))
    assert [r.status_code for r in replies] == [200] * 20
    assert server.log().count("loading model 'd'") == 1
    assert server.log().count("loaded model 'd'") == 1


def test_keep_alive_zero_unloads_at_once(server) -> None:
    reply = ollama_chat(server.url, "b", keep_alive="-1")  # loaded (and kept for now)
    assert "b" in loaded(server.url) and "b" in mlxserve_ps(server.url)
    reply = ollama_chat(server.url, "b", keep_alive=0)
    assert reply["done"]
    assert wait_until(lambda: "b" not in loaded(server.url), timeout=10)
    assert "b" not in mlxserve_ps(server.url)
    assert "unloaded model 'b'" in server.log()
    # Ollama's unload request (no messages): answered, and the model goes.
    assert ollama_chat(server.url, "b")["done"]
    r = httpx.post(server.url + "/api/generate", json={"model": "b", "keep_alive": 0})
    assert r.json()["done_reason"] == "unload"
    assert wait_until(lambda: "b" not in loaded(server.url), timeout=10)
    bad = {"model": "b", "messages": [], "keep_alive": "soon"}
    r = httpx.post(server.url + "/api/chat", json=bad)
    assert r.status_code == 400 and "keep_alive" in r.json()["error"]


def test_an_idle_model_unloads_after_its_keep_alive_a_pinned_one_does_not(server) -> None:
    for name in ("alpha", "c"):
        assert chat(server.url, name).status_code == 200
    ps = {m["name"]: m for m in httpx.get(server.url + "/api/ps").json()["models"]}
    assert ps["c"]["expires_at"].startswith("2999")  # pinned: for ever
    assert not ps["alpha"]["expires_at"].startswith("2999")
    assert wait_until(lambda: "alpha" not in loaded(server.url), timeout=15)
    assert "unloading model 'alpha' (keep_alive 2s is over)" in server.log()
    assert "c" in loaded(server.url)
    assert "unloading model 'c'" not in server.log()
    # The unloaded default model loads again on its next request.
    num_loads = server.log().count("loading model 'alpha'")
    assert chat(server.url, "alpha").status_code == 200
    assert server.log().count("loading model 'alpha'") == num_loads + 1


def test_a_load_past_max_loaded_models_evicts_the_least_recently_used(models, tmp_path) -> None:
    s = serve(models, tmp_path, "--max-loaded-models", "2")  # keep-alive: 5m
    try:
        assert loaded(s.url) == {"alpha"}
        assert chat(s.url, "b").status_code == 200
        assert chat(s.url, "alpha").status_code == 200  # b is now the least recently used
        assert chat(s.url, "c").status_code == 200
        assert loaded(s.url) == {"alpha", "c"}
        assert "unloading model 'b' (to load 'c' (least recently used))" in s.log()
    finally:
        s.stop()


def test_one_model_stays_loaded_as_before(models, tmp_path) -> None:
    s = start_server([str(models["a"]), *COMMON], tmp_path / "server.log")
    try:
        ps = httpx.get(s.url + "/api/ps").json()["models"]
        assert [m["name"] for m in ps] == ["a"] and ps[0]["expires_at"].startswith("2999")
        r = httpx.post(s.url + "/api/generate", json={"model": "a", "keep_alive": 0})
        assert r.json()["done_reason"] == "unload"
        assert loaded(s.url) == {"a"}  # a one-model server keeps its model
    finally:
        s.stop()


@pytest.mark.parametrize(
    ("value", "seconds"),
    [("5m", 300.0), ("1h30m", 5400.0), ("10s", 10.0), ("0", 0.0), ("0s", 0.0), (30, 30.0),
     ("300", 300.0), ("-1", None), (-1, None), ("-1m", None), ("1.5s", 1.5), ("500ms", 0.5)],
)  # fmt: skip
def test_parse_keep_alive(value, seconds) -> None:
    assert parse_keep_alive(value) == seconds


@pytest.mark.parametrize("value", ["soon", "5 m", "", "m", "5x", True])
def test_parse_keep_alive_refuses(value) -> None:
    with pytest.raises(ValueError, match="keep_alive"):
        parse_keep_alive(value)


def test_models_in_dir(tmp_path) -> None:
    for d in ("x", "nested/y", "x/inner"):
        (tmp_path / d).mkdir(parents=True)
        (tmp_path / d / "config.json").write_text("{}")
    (tmp_path / "nested" / "z.gguf").write_bytes(b"")
    (tmp_path / "x" / "w.gguf").write_bytes(b"")  # part of model x
    names = [name for name, _ in models_in_dir(tmp_path)]
    assert names == ["nested/y", "nested/z", "x"]


def test_pull_show_copy_and_delete_are_real(models, tmp_path) -> None:
    """A server of several models pulls from the (fake) hub with progress, serves what it
    pulled, shows a model without loading it, copies (one more name) and deletes."""
    from tests.fake_hub import serve_fake_hub

    _, tiny = make_tiny_model_dir(tmp_path / "hubmodel", seed=9)
    files = {f.name: f.read_bytes() for f in tiny.iterdir() if f.is_file()}
    home = tmp_path / "home"
    with serve_fake_hub({"acme/tiny": files}) as hub:
        env = {"HF_HOME": str(home), "HF_ENDPOINT": hub.url, "HF_HUB_ETAG_TIMEOUT": "5"}
        env |= {"HF_HUB_OFFLINE": "0"}
        args = [str(models["a"]), str(models["b"]), *COMMON]
        s = start_server(args, tmp_path / "server.log", env=env)
        try:
            url = s.url
            with httpx.stream("POST", url + "/api/pull", json={"model": "acme/tiny"}) as r:
                assert r.status_code == 200
                lines = [json.loads(line) for line in r.iter_lines() if line]
            assert lines[0] == {"status": "pulling manifest"} and lines[-1] == {"status": "success"}
            weights = [x for x in lines if x["status"] == "pulling model.safetensors"]
            assert weights[-1]["completed"] == weights[-1]["total"] > 0
            assert "acme/tiny" in [m["name"] for m in httpx.get(url + "/api/tags").json()["models"]]
            assert chat(url, "acme/tiny").status_code == 200
            # Pulled already: at once.
            again = httpx.post(url + "/api/pull", json={"model": "acme/tiny", "stream": False})
            assert again.json() == {"status": "success"}
            bad = httpx.post(url + "/api/pull", json={"model": "acme/nope", "stream": False})
            assert bad.status_code == 500 and "acme/nope" in bad.json()["error"]

            shown = httpx.post(url + "/api/show", json={"model": "b"}).json()
            assert shown["details"]["family"] == "llama" and shown["template"]
            assert shown["model_info"]["general.parameter_count"] > 0
            assert "loading model 'b'" not in s.log()  # shown from its files

            r = httpx.post(url + "/api/copy", json={"source": "acme/tiny", "destination": "mine"})
            assert r.status_code == 200
            assert chat(url, "mine").json()["model"] == "mine"
            assert s.log().count("loading model 'acme/tiny'") == 1  # the same model
            r = httpx.post(url + "/api/copy", json={"source": "nope", "destination": "x"})
            assert r.status_code == 404

            assert (
                httpx.request("DELETE", url + "/api/delete", json={"model": "a"}).status_code == 400
            )
            assert (
                httpx.request("DELETE", url + "/api/delete", json={"model": "x"}).status_code == 404
            )
            r = httpx.request("DELETE", url + "/api/delete", json={"model": "acme/tiny"})
            assert r.status_code == 200, r.text
            names = [m["name"] for m in httpx.get(url + "/api/tags").json()["models"]]
            assert names == ["a", "b"]  # "mine" named the same model: gone too
            assert chat(url, "acme/tiny").status_code == 404
            assert not (home / "hub" / "models--acme--tiny").exists()
        finally:
            s.stop()


# ---- Serving alone, with stand-in models (no engine): loads, leases, unloads -----------
class _StubLLM:
    is_running = True

    def __init__(self) -> None:
        self.is_stopped = False

    def shutdown(self) -> None:
        self.is_stopped = True


def _stub_serving(num_models: int = 3, **policy):
    import threading
    import time

    from mlxserve.server.served_model import ModelSpec, ServedModel
    from mlxserve.server.serving import ModelPolicy, Serving

    loads: list[str] = []
    lock = threading.Lock()

    def load(spec: ModelSpec) -> ServedModel:  # a worker thread, as a real load
        time.sleep(0.05)
        with lock:
            loads.append(spec.names[0])
        return ServedModel(spec.names[0], spec.names, _StubLLM(), None, None)  # type: ignore[arg-type]

    specs = [ModelSpec((f"m{i}",)) for i in range(num_models)]
    first = ServedModel("m0", ("m0",), _StubLLM(), None, None)  # type: ignore[arg-type]
    serving = Serving([first], specs, load, ModelPolicy(unloads=True, **policy))
    return serving, loads


async def _request(serving, name: str, hold: float = 0.0, keep_alive: float | None = -1.0):
    """One HTTP request's use of a model, as ModelLeases scopes it."""
    import asyncio

    from mlxserve.server import serving as serving_module

    leases: list = []
    token = serving_module._LEASES.set(leases)
    try:
        model = await serving.resolve(name)
        if keep_alive != -1.0:
            serving.set_keep_alive(model, keep_alive)
        await asyncio.sleep(hold)
        return model
    finally:
        serving_module._LEASES.reset(token)
        for lease in leases:
            serving.release(lease)


def test_serving_loads_once_per_race_and_never_unloads_under_a_request() -> None:
    import asyncio

    async def main() -> None:
        serving, loads = _stub_serving(keep_alive=60.0)
        serving.start()
        models = await asyncio.gather(*(_request(serving, "m1") for _ in range(20)))
        assert loads == ["m1"] and len({id(m.llm) for m in models}) == 1
        # A request holds m1 while another asks for it to unload at once: it waits.
        holder = asyncio.create_task(_request(serving, "m1", hold=0.3))
        await asyncio.sleep(0.05)
        await _request(serving, "m1", keep_alive=0.0)
        await asyncio.sleep(0.1)
        assert serving.loaded("m1") is not None  # still in use
        await holder
        for _ in range(50):
            if serving.loaded("m1") is None:
                break
            await asyncio.sleep(0.02)
        assert serving.loaded("m1") is None and models[0].llm.is_stopped
        await serving.stop()

    asyncio.run(main())


def test_serving_evicts_the_least_recently_used_idle_model_never_a_pinned_one(
    monkeypatch,
) -> None:
    import asyncio

    from mlxserve.server import serving as serving_module
    from mlxserve.server.errors import APIError

    async def main() -> None:
        serving, loads = _stub_serving(4, max_loaded_models=2, pinned=frozenset({"m0"}))
        await _request(serving, "m1")
        await _request(serving, "m2")  # m0 is pinned: m1 goes
        assert [m.name for m in serving.models] == ["m0", "m2"]
        # m0 pinned, m2 in use: m3 waits for m2's request to end, then m2 goes.
        busy = asyncio.create_task(_request(serving, "m2", hold=0.3))
        await asyncio.sleep(0.05)
        await _request(serving, "m3")
        assert busy.done() and [m.name for m in serving.models] == ["m0", "m3"]
        assert loads == ["m1", "m2", "m3"]
        # No room in time: a 503.
        monkeypatch.setattr(serving_module, "ROOM_WAIT_S", 0.1)
        busy = asyncio.create_task(_request(serving, "m3", hold=0.5))
        await asyncio.sleep(0.05)
        with pytest.raises(APIError) as e:
            await _request(serving, "m1")
        assert e.value.status == 503 and "--max-loaded-models 2" in e.value.message
        await busy

    asyncio.run(main())


def test_racing_loads_of_different_models_keep_within_max_loaded_models() -> None:
    import asyncio

    async def main() -> None:
        serving, loads = _stub_serving(4, max_loaded_models=2)
        peaks: list[int] = []
        load = serving.loader

        def counted(spec):
            peaks.append(len(serving.models) + serving._num_loading)
            return load(spec)

        serving.loader = counted
        await asyncio.gather(*(_request(serving, f"m{i}") for i in (1, 2, 3)))
        assert sorted(loads) == ["m1", "m2", "m3"] and max(peaks) <= 2
        assert len(serving.models) <= 2

    asyncio.run(main())


def test_a_pin_that_names_no_model_is_refused_before_anything_loads(models) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    argv = [sys.executable, "-m", "mlxserve.cli", "serve", str(models["a"]), "--pin", "nope"]
    out = subprocess.run(argv, env=env, capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1] == (
        "error: --pin 'nope': no model is served under that name"
    )
    assert "loading" not in out.stderr
