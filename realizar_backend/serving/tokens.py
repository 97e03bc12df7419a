"""Token-level API: vLLM's /tokenize and /detokenize, and `echo` on completions.

Functions ready for a route to call with the parsed JSON body (run them off the event loop:
tokenizing and rendering a chat template are CPU work). Shapes are vLLM's:
    /tokenize   {model?, prompt, add_special_tokens=true, return_token_strs=false}
             or {model?, messages, add_generation_prompt=true, continue_final_message=false,
                 add_special_tokens=false, return_token_strs=false, tools?, chat_template_kwargs?}
             -> {count, max_model_len, tokens, token_strs}
    /detokenize {model?, tokens} -> {prompt}
"""

from __future__ import annotations

from typing import Any

from ..errors import RequestError
from .chat_request import template_kwargs
from .tools import parse_tool_request


def _bad(param: str, message: str, code: str | None = None) -> RequestError:
    return RequestError(f"{param}: {message}", param=param, code=code)


def _flag(data: dict, name: str, default: bool) -> bool:
    v = data.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _bad(name, "expected a boolean", "invalid_type")
    return v


def _model(engine, data: dict) -> None:
    model = data.get("model")
    if model is not None and model != engine.model_name:
        raise RequestError(f"the model {model!r} does not exist; this server serves {engine.model_name!r}",
                           status=404, param="model", code="model_not_found")


def tokenize(engine, data: dict, messages: list[dict] | None = None) -> dict:
    """/tokenize. messages: the chat form's messages as the chat route checks them (role,
    content and tool fields); None: the body's `prompt` is tokenized."""
    _model(engine, data)
    tok = engine.tokenizer
    want_strs = _flag(data, "return_token_strs", False)
    if messages is not None:
        if data.get("prompt") is not None:
            raise _bad("prompt", "give either prompt or messages")
        cont = _flag(data, "continue_final_message", False)
        gen = _flag(data, "add_generation_prompt", not cont)
        if gen and cont:
            raise _bad("continue_final_message", "cannot be combined with add_generation_prompt (set it to false)")
        kwargs = template_kwargs(data.get("chat_template_kwargs"))
        req = parse_tool_request(data.get("tools"), None, None, tok.chat_template)
        text = tok.apply_chat_template(messages, add_generation_prompt=gen, continue_final_message=cont,
                                       tools=req.template_tools if req else None, **kwargs)
        ids = tok.encode(text, add_special_tokens=_flag(data, "add_special_tokens", False))
    else:
        prompt = data.get("prompt")
        if not isinstance(prompt, str):
            raise _bad("prompt", "expected a string (or give messages)", "invalid_type")
        ids = tok.encode(prompt, add_special_tokens=_flag(data, "add_special_tokens", True))
    return {"count": len(ids), "max_model_len": engine.max_context, "tokens": ids,
            "token_strs": [tok.id_to_piece(i) for i in ids] if want_strs else None}


def detokenize(engine, data: dict) -> dict:
    """/detokenize: the text of token ids (special tokens included, as vLLM does)."""
    _model(engine, data)
    ids = data.get("tokens")
    vocab = engine.config.vocab_size
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise _bad("tokens", "expected an array of token ids", "invalid_type")
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise _bad("tokens", f"{bad} is not a token id of this model (0 .. {vocab - 1})")
    return {"prompt": engine.tokenizer.decode(ids, skip_special_tokens=False)}


def echo_text(engine, prompt: str | list[int], echo: Any, logprobs: int | None) -> str:
    """What a completion with `echo` puts before the generated text: the prompt itself (token
    prompts decoded, special tokens included). "" without echo. echo with logprobs would need
    the prompt's logprobs, which the engine does not compute: a 400."""
    if echo is None or echo is False:
        return ""
    if not isinstance(echo, bool):
        raise _bad("echo", "expected a boolean", "invalid_type")
    if logprobs is not None:
        raise _bad("echo", "echo together with logprobs is not supported (prompt logprobs are not computed)",
                   "unsupported_parameter")
    if isinstance(prompt, str):
        return prompt
    return engine.tokenizer.decode(list(prompt), skip_special_tokens=False)
