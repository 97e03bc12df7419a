"""What a request goes through before it is queued: tokenizing (the chat template for messages),
the range checks of its sampling parameters, the context and KV pool limits, and its grammar's
compilation. Shared by the engine and by the server side of an engine in another process
(engine/process.py), which both have a tokenizer, a grammar compiler and the model's limits."""

from __future__ import annotations

import threading

from ..errors import ContextOverflowError, RequestError
from .sampling import SamplingParams


class RequestPrep:
    """prepare(); the class that mixes it in has tokenizer, config, guidance, max_context and
    kv_capacity (tokens the KV pool holds)."""

    def prepare(self, prompt: str | list[int] | None, params: SamplingParams,
                messages: list[dict] | None = None, tools: list[dict] | None = None, *,
                template_kwargs: dict | None = None, add_generation_prompt: bool = True,
                continue_final_message: bool = False, cancel: threading.Event | None = None) -> list[int]:
        """Tokenize and validate a request; fills params.max_tokens when it is None, compiles
        params.constraint (cached), and sets params.thinking's `inside` from the rendered prompt.
        Blocking work: call it off the event loop. Raises RequestError / ContextOverflowError
        before anything is queued. tools: the chat template's `tools` (OpenAI's function
        definitions), rendered with the messages; template_kwargs: more template variables (checked
        by the caller); add_generation_prompt / continue_final_message: as transformers takes them;
        cancel: set when the request's client has left (the grammar's check stops then)."""
        if messages is not None:
            kwargs = {**(template_kwargs or {}), **({"tools": tools} if tools else {})}
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                      continue_final_message=continue_final_message, **kwargs)
            if params.thinking is not None:
                params.thinking = params.thinking.after_prompt(text)
            ids = self.tokenizer.encode(text, add_special_tokens=False, limit=self.max_context)
        elif isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt, add_special_tokens=True, limit=self.max_context)
        elif isinstance(prompt, list):
            vocab = self.config.vocab_size
            if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in prompt):
                raise RequestError(f"prompt token ids must be integers in [0, {vocab})", param="prompt")
            ids = list(prompt)
        else:
            raise RequestError("prompt must be a string or a list of token ids", param="prompt")
        if not ids:
            raise RequestError("prompt is empty", param="prompt")
        params.validate(self.config.vocab_size)
        room = self.max_context - len(ids)
        if room < 1:
            raise ContextOverflowError(f"prompt has {len(ids)} tokens; this server's context is "
                                       f"{self.max_context} tokens", param="prompt")
        # one sequence must fit in the whole KV pool, or it could never finish
        pool_room = self.kv_capacity - len(ids)
        if pool_room < 1:
            raise ContextOverflowError(f"prompt has {len(ids)} tokens; this server's KV cache holds "
                                       f"{self.kv_capacity} tokens", param="prompt")
        if params.max_tokens is None:
            params.max_tokens = min(room, pool_room)
        elif params.max_tokens > room:
            raise ContextOverflowError(f"prompt ({len(ids)} tokens) plus max_tokens ({params.max_tokens}) "
                                       f"exceeds this server's context of {self.max_context} tokens")
        elif params.max_tokens > pool_room:
            raise ContextOverflowError(f"prompt ({len(ids)} tokens) plus max_tokens ({params.max_tokens}) "
                                       f"exceeds this server's KV cache of {self.kv_capacity} tokens")
        if params.constraint is not None:
            self.guidance.compile(params.constraint, cancel)     # a 400 naming the field, or cached for the guide
        return ids
