"""LLM: the offline API, shaped like vLLM's (`LLM(model).generate(prompts, params)`).

Runs in the caller's thread: no worker process, so a notebook or a plain script
needs no ``if __name__ == "__main__"`` guard.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from mlxserve.config import EngineConfig
from mlxserve.core.request import EmbeddingOutput, EmbeddingRequestOutput, RequestOutput
from mlxserve.engine.llm_engine import LLMEngine
from mlxserve.exceptions import ParameterError, RequestFailedError
from mlxserve.pooling_params import PoolingParams
from mlxserve.sampling_params import SamplingParams

Prompt = str | list[int] | dict[str, Any]
Message = dict[str, Any]


class LLM:
    """Load a model once, then generate for batches of prompts or conversations."""

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        self.engine = LLMEngine(EngineConfig.from_kwargs(model=model, **engine_args))
        self._counter = itertools.count()

    def shutdown(self) -> None:
        """Write what the KV disk tier has still to keep, and stop the other tensor-parallel
        ranks (they are also killed when this process exits)."""
        self.engine.shutdown()

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's own defaults (generation_config.json, a GGUF's
        general.sampling.*, the embedded model's card), as vLLM's; used when none is given."""
        return SamplingParams(**self.engine.loaded.generation_defaults)

    def get_tokenizer(self):
        """The model's tokenizer (encode/decode/apply_chat_template)."""
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Complete every prompt; outputs come back in the order of the prompts.

        A prompt is a string, a list of token ids, or a dict with "prompt" or
        "prompt_token_ids" (vLLM's TextPrompt / TokensPrompt). No ``sampling_params``:
        the model's defaults (:meth:`get_default_sampling_params`). A prompt that cannot run
        (too long, empty...) raises ParameterError before anything is queued. A request
        that fails while running comes back finished with finish_reason "error" and
        ``RequestOutput.error`` saying why; the other prompts' outputs are unaffected.
        """
        items = _as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = _as_params_list(sampling_params, len(items))
        ids = []
        for item, p in zip(items, params, strict=True):
            rid = str(next(self._counter))
            try:
                self._add(rid, item, p)
            except ValueError:
                self._abort(ids)  # a bad prompt queues nothing: the earlier ones are dropped
                raise
            ids.append(rid)
        return self._run(ids, use_tqdm)

    def embed(
        self,
        prompts: Prompt | Sequence[Prompt],
        pooling_params: PoolingParams | None = None,
        use_tqdm: bool = True,
    ) -> list[EmbeddingRequestOutput]:
        """Embed every prompt (``out.outputs.embedding``), in the order of the prompts.

        Pooled as the model's files say (the last token, or the mean over the prompt),
        normalized to unit length unless ``PoolingParams(normalize=False)``. The prompts
        run through the same scheduler as generation (prefill only), batched.
        """
        pooling_params = pooling_params or PoolingParams()
        ids = []
        for item in _as_prompt_list(prompts):
            rid = str(next(self._counter))
            try:
                self._add(rid, item, None, pooling_params)
            except ValueError:
                self._abort(ids)
                raise
            ids.append(rid)
        results = []
        for out in self._run(ids, use_tqdm):
            if out.error is not None:
                raise RequestFailedError(out.error, out.request_id)
            assert out.embedding is not None, out
            results.append(
                EmbeddingRequestOutput(
                    out.request_id, out.prompt_token_ids, EmbeddingOutput(out.embedding)
                )
            )
        return results

    def _add(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams | None,
        pooling_params: PoolingParams | None = None,
    ) -> None:
        kwargs = {"pooling_params": pooling_params} if pooling_params is not None else {}
        if not isinstance(prompt, dict):
            self.engine.add_request(request_id, prompt, params, **kwargs)
        elif "prompt_token_ids" in prompt:
            token_ids = list(prompt["prompt_token_ids"])
            self.engine.add_request(
                request_id, prompt.get("prompt"), params, prompt_token_ids=token_ids, **kwargs
            )
        elif "prompt" in prompt:
            self.engine.add_request(request_id, prompt["prompt"], params, **kwargs)
        else:
            raise ParameterError(
                "a prompt dict needs 'prompt' or 'prompt_token_ids'", parameter="prompt"
            )

    def chat(
        self,
        messages: list[Message] | Sequence[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        continue_final_message: bool = False,
    ) -> list[RequestOutput]:
        """Generate the assistant's reply to one conversation or a list of them
        (``continue_final_message``: continue the final message instead, as vLLM's)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.engine.tokenizer
        prompts: list[Prompt] = []
        for conv in conversations:
            text = tok.apply_chat_template(
                conv,
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                chat_template=chat_template,
                continue_final_message=continue_final_message,
            )
            prompts.append({"prompt": text, "prompt_token_ids": tok.encode_rendered_chat(text)})
        return self.generate(prompts, sampling_params, use_tqdm)

    def _abort(self, ids: list[str]) -> None:
        self.engine.abort_request(ids)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm and len(ids) > 1:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), desc="Generating", unit="req", dynamic_ncols=True)
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            self._abort([i for i in ids if i not in finished])  # Ctrl-C leaves no leftovers
            raise
        finally:
            if bar is not None:
                bar.close()
        return [finished[i] for i in ids]


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    return prompts


def _as_params_list(
    params: SamplingParams | Sequence[SamplingParams], n: int
) -> list[SamplingParams]:
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ParameterError(
            f"got {len(params)} SamplingParams for {n} prompts; pass one or {n}",
            parameter="sampling_params",
        )
    return params
