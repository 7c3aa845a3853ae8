"""The ops dispatch point: backend choice, kernel caching, and exporting the Metal path."""

from __future__ import annotations

import contextlib

import mlx.core as mx
import numpy as np
import pytest

from metal.checker.cases import (
    Case,
    decode_requests,
    fallback_backend,
    make_inputs,
    metal_backend,
    mixed_requests,
)
from metal.checker.cases import run as run_case
from mlxserve import ops
from mlxserve.cpu import kernels as cpu
from mlxserve.ops import AttentionMetadata
from tests.paths import ROOT

ON_METAL = mx.metal.is_available()
# MLX 0.32.0 says "[Fence::wait] Invalid stream." where newer releases name the GPU
NEEDS_GPU = r"(?i)gpu|Invalid stream"


def test_auto_picks_what_the_machine_has() -> None:
    backend, reason = ops.kernel_backend()
    if ON_METAL and mx.default_device() == mx.Device(mx.gpu):
        assert backend == "metal"
    else:  # mlxserve's CPU primitives where they are built (these tests build them)
        assert backend == ("cpu" if cpu.available() else "fallback")
        assert "mx.metal.is_available() is False" in reason or "default device" in reason


def test_kernels_setting_is_an_engine_field_checked_at_start_up(monkeypatch) -> None:
    """MLXSERVE_KERNELS is only the default of EngineConfig.kernels, checked up front."""
    from mlxserve.config import EngineConfig
    from mlxserve.exceptions import ParameterError

    monkeypatch.setenv("MLXSERVE_KERNELS", "Metal ")
    assert EngineConfig().kernels == "metal"
    monkeypatch.delenv("MLXSERVE_KERNELS")
    assert EngineConfig().kernels == "auto"
    assert EngineConfig(kernels="fallback").kernels == "fallback"
    with pytest.raises(ParameterError, match=r"kernels \(MLXSERVE_KERNELS\) must be one of") as e:
        EngineConfig(kernels="cuda")
    assert e.value.parameter == "kernels"
    ops.check_kernels("fallback")
    ops.check_kernels("auto")
    if ON_METAL:
        ops.check_kernels("metal")
    else:
        with pytest.raises(ValueError, match=r"kernels='metal'.*is_available\(\) is False"):
            ops.check_kernels("metal")


def test_use_kernels_scopes_the_choice() -> None:
    with ops.use_kernels("fallback"):
        assert ops.kernel_backend()[0] == "fallback"
    with ops.use_kernels("auto"):  # no override: the machine decides
        assert not ops._override


def test_force_backend_wins_and_nests() -> None:
    with ops.force_backend("fallback"):
        with ops.force_backend("metal", lambda **kw: None):
            assert ops.kernel_backend()[0] == "metal"
            with ops.force_backend("fallback"):
                assert ops.kernel_backend()[0] == "fallback"
            assert ops.kernel_backend()[0] == "metal"
        assert ops.kernel_backend()[0] == "fallback"
    with pytest.raises(ValueError, match="backend must be"):
        with ops.force_backend("cuda"):
            pass


def test_kernel_objects_are_built_once() -> None:
    from metal.checker.record import Recorder

    rec = Recorder()
    built: list[str] = []

    def counting(**kw):
        built.append(kw["name"])
        return rec.metal_kernel(**kw)

    inp = make_inputs(Case(decode_requests(8), 8, 2, 64))
    with ops.force_backend("metal", counting) as kernels:
        for _ in range(3):
            run_case(inp, "float32", contextlib.nullcontext)
        assert kernels is not None and kernels.factory is counting
    assert built == ["paged_decode"]


@pytest.mark.skipif(ON_METAL, reason="checks the error where Metal is missing")
def test_forced_metal_without_metal_fails_at_launch() -> None:
    inp = make_inputs(Case(decode_requests(8), 8, 1, 64))
    with pytest.raises(RuntimeError, match="No Metal back-end"):
        run_case(inp, "float32", metal_backend())


def test_standalone_ops_match_the_fallback(emulator_factory) -> None:
    """write_kv (always MLX's scatter) and paged_attention called separately."""
    inp = make_inputs(Case(mixed_requests(16), 16, 4, 96, "float16", pad_tokens=1))

    def separate(backend):
        k = mx.array(inp.k_pool).astype(mx.float16)
        v = mx.array(inp.v_pool).astype(mx.float16)
        with backend():
            k, v = ops.write_kv(
                k,
                v,
                mx.array(inp.keys).astype(mx.float16),
                mx.array(inp.values).astype(mx.float16),
                inp.md.slot_mapping,
            )
            out = ops.paged_attention(mx.array(inp.q).astype(mx.float16), k, v, inp.md, inp.scale)
            return np.array(out.astype(mx.float32)), np.array(k.astype(mx.float32))

    got, got_k = separate(metal_backend(emulator_factory))
    want, want_k = separate(fallback_backend)
    np.testing.assert_array_equal(got_k, want_k)
    np.testing.assert_allclose(got, want, atol=4e-3, rtol=4e-3)


@pytest.fixture
def emulator_factory():
    import sys

    if sys.platform != "linux" and not ON_METAL:
        pytest.skip("needs the Linux emulator or Metal")
    if ON_METAL:
        return None  # the real mx.fast.metal_kernel
    from metal.checker.emulator import Emulator

    return Emulator().metal_kernel


# ---- export -------------------------------------------------------------------------------
def _layer_inputs(md: AttentionMetadata, num_blocks: int, hidden: int = 128):
    rng = np.random.default_rng(0)
    n = md.slot_mapping.shape[0]
    shapes = [
        (n, hidden),
        (hidden, 4 * 64),
        (hidden, 2 * 64),
        (hidden, 2 * 64),
        (num_blocks, 8, 2, 64),
        (num_blocks, 8, 2, 64),
    ]
    return [mx.array(rng.standard_normal(s).astype(np.float32) * 0.1) for s in shapes]


def _layer(md: AttentionMetadata):
    """A forward-like attention layer: projections, then the paged cache ops."""

    def forward(x, wq, wk, wv, k_cache, v_cache):
        n = x.shape[0]
        q = (x @ wq).reshape(n, 4, 64)
        k = (x @ wk).reshape(n, 2, 64)
        v = (x @ wv).reshape(n, 2, 64)
        k_cache, v_cache = ops.write_kv(k_cache, v_cache, k, v, md.slot_mapping)
        out = ops.paged_attention(q, k_cache, v_cache, md, 0.125)
        return out.reshape(n, 4 * 64), k_cache, v_cache

    return forward


@pytest.mark.parametrize(
    "query_lens,context_lens,kernels",
    [
        ([1, 1, 5], [7, 16, 9], [b"custom_kernel_paged_prefill_tiled"]),
        (
            [1, 1],
            [7, 1500],
            [
                b"custom_kernel_paged_decode_split",
                b"custom_kernel_paged_decode_reduce",
            ],
        ),
        ([1, 1], [7, 16], [b"custom_kernel_paged_decode"]),
    ],
)
def test_export_a_forward_through_the_metal_path(tmp_path, query_lens, context_lens, kernels):
    """mx.export_function records the Metal kernels without compiling them (Linux too)."""
    blocks = [[1 + 200 * i + j for j in range(-(-c // 8))] for i, c in enumerate(context_lens)]
    md = AttentionMetadata.build(query_lens, context_lens, blocks, 8, num_tokens_padded=8)
    num_blocks = 1 + max(max(b) for b in blocks)
    args = _layer_inputs(md, num_blocks)
    path = tmp_path / "layer.mlxfn"
    with ops.force_backend("metal"):
        mx.export_function(str(path), _layer(md), *args)
    data = path.read_bytes()
    for name in kernels:
        assert name in data
    if not ON_METAL:  # the graph needs a GPU to run: importing or evaluating it says so
        with pytest.raises((ValueError, RuntimeError), match=NEEDS_GPU):
            mx.eval(mx.import_function(str(path))(*args))
        return
    imported = mx.import_function(str(path))
    got = imported(*[mx.array(a) for a in args])
    with ops.force_backend("fallback"):
        want = _layer(md)(*args)
    np.testing.assert_allclose(np.array(got[0]), np.array(want[0]), atol=1e-4, rtol=1e-4)


# ---- packaging ----------------------------------------------------------------------------
def test_kernels_come_from_the_source_tree_of_the_code(monkeypatch, tmp_path) -> None:
    """An editable install of another checkout maps mlxserve._metal to *its* kernels; a
    source tree must use its own metal/ (else kernel edits are silently not tested)."""
    from mlxserve.ops import metal

    monkeypatch.setattr(metal.importlib.resources, "files", lambda name: tmp_path)
    assert metal.kernel_dir() == ROOT / "metal"


def test_kernel_sources_ship_in_the_package(tmp_path) -> None:
    """setup.py maps metal/*.metal into mlxserve._metal; the checker stays out."""
    import shutil
    import subprocess
    import sys

    root = ROOT
    src = tmp_path / "src"
    src.mkdir()
    for name in ("setup.py", "pyproject.toml"):
        shutil.copy(root / name, src / name)
    for name in ("mlxserve", "metal"):
        shutil.copytree(root / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path / "lib"
    subprocess.run(
        [sys.executable, "setup.py", "-q", "build_py", "--build-lib", str(out)],
        cwd=src,
        check=True,
        capture_output=True,
    )
    shipped = sorted(p.name for p in (out / "mlxserve" / "_metal").iterdir())
    kernels = sorted(p.name for p in (root / "metal").glob("*.metal"))
    assert shipped == sorted(["__init__.py", *kernels])
    assert (out / "mlxserve" / "ops" / "metal.py").exists()


@pytest.mark.parametrize("query_lens,context_lens", [([1, 1, 6], [9, 17, 6]), ([1, 1], [9, 30])])
def test_export_a_tiny_model_forward_through_the_metal_path(tmp_path, query_lens, context_lens):
    """A whole (tiny, random) llama forward takes the Metal path when exported."""
    from mlxserve.models import KVCache, get_model_class

    model_cls, args_cls = get_model_class("llama")
    config = {
        "model_type": "llama",
        "hidden_size": 256,
        "num_hidden_layers": 2,
        "intermediate_size": 256,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 64,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 512,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
    }
    mx.random.seed(0)
    model = model_cls(args_cls.from_dict(config))
    blocks = [[1 + 10 * i + j for j in range(-(-c // 8))] for i, c in enumerate(context_lens)]
    md = AttentionMetadata.build(query_lens, context_lens, blocks, 8)
    num_layers, num_blocks = 2, 1 + max(max(b) for b in blocks)
    pools = KVCache.allocate(num_layers, num_blocks, 8, 2, 64, mx.float32)
    input_ids = mx.array(np.arange(md.slot_mapping.shape[0]) % 64, dtype=mx.int32)
    positions = mx.array(md.positions(), dtype=mx.int32)

    def forward(input_ids, positions, *flat_pools):
        cache = KVCache(list(flat_pools[:num_layers]), list(flat_pools[num_layers:]))
        logits = model(input_ids, positions, md, cache)
        return (logits, *cache.keys, *cache.values)

    args = [input_ids, positions, *pools.keys, *pools.values]
    path = tmp_path / "model.mlxfn"
    with ops.force_backend("metal"):
        mx.export_function(str(path), forward, *args)
    prefill = b"custom_kernel_paged_prefill_tiled"
    kernel = prefill if max(query_lens) > 1 else b"custom_kernel_paged_decode"
    assert path.read_bytes().count(kernel) >= 1
    if not ON_METAL:
        with pytest.raises((ValueError, RuntimeError), match=NEEDS_GPU):
            mx.eval(mx.import_function(str(path))(*args))
        return
    got = mx.import_function(str(path))(*args)[0]
    with ops.force_backend("fallback"):
        want = forward(*args)[0]
    np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("split", [False, True])
def test_a_kernel_name_always_means_one_source(split: bool) -> None:
    """Batches of 1 to 10 requests: before MLX 0.32 a kernel's library is keyed by its name
    and template arguments only, so the generated source (address spaces of the inputs
    included) must not change with the batch size, or MLX recompiles and evicts a pipeline
    still in use. Metadata arrays are padded to 8 elements so they never flip to `constant`."""
    from metal.checker.cases import split_config
    from metal.checker.record import Recorder

    rec = Recorder()
    config = split_config(4) if split else None
    for n in range(1, 11):
        for requests in ([(1, 3 + i) for i in range(n)], [(1, 5)] * (n - 1) + [(3, 9)]):
            case = Case(requests=tuple(requests), block_size=4, gqa=2, head_dim=32)
            run_case(make_inputs(case), "float32", metal_backend(rec.metal_kernel, config))
    sources: dict[tuple[str, str], set[str]] = {}
    for g in rec.variants:
        name = g.kernel_name.split("__")[0]  # MLX < 0.32's name: no input types
        sources.setdefault((name, g.template_def), set()).add(g.source)
    assert len(sources) == (3 if split else 2)  # prefill, decode (+ split, reduce)
    flips = {key: len(v) for key, v in sources.items() if len(v) > 1}
    assert not flips, flips


def test_a_forced_backend_holds_in_its_thread_only() -> None:
    """Two engines in one process (each runner steps on its own thread) with different
    ``kernels`` settings never see each other's choice."""
    import threading

    seen: dict[str, tuple[str, str]] = {}
    inside = threading.Event()
    done = threading.Event()

    def other_engine() -> None:
        inside.wait(timeout=30)
        seen["other"] = ops.kernel_backend()
        with ops.force_backend("cpu"):
            seen["other forced"] = ops.kernel_backend()
        done.set()

    thread = threading.Thread(target=other_engine)
    thread.start()
    with ops.force_backend("fallback"):
        inside.set()
        assert done.wait(timeout=30)
        seen["this"] = ops.kernel_backend()
    thread.join(timeout=30)
    assert seen["this"][0] == "fallback"
    assert not seen["other"][1].startswith("forced")  # the machine's own choice there
    assert seen["other forced"][0] == "cpu"
    assert not ops.kernel_backend()[1].startswith("forced")
