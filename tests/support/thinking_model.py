"""A tiny random qwen3 model whose chat template thinks and calls tools the way Qwen3.5's does, for
the reasoning and tool-format tests (CPU, no real weights needed): `write_thinking_model(path)`.

Its template (written for these tests, in the shape of Qwen3.5's) lists the tools and asks for
`<tool_call>\\n<function=NAME>\\n<parameter=ARG>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>`
calls, renders past thoughts (`reasoning_content`) and calls, and opens a thought in its
generation prompt unless `enable_thinking` is false (then it writes an empty, closed one).
<think>, </think>, <tool_call> and </tool_call> are user-defined tokens of the vocabulary, as in
Qwen's, so each is one token and is kept in decoded text.
"""

from __future__ import annotations

from pathlib import Path

from support import synth

ADDED_TOKENS = ("<think>", "</think>", "<tool_call>", "</tool_call>")

THINKING_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n# Tools\\n<tools>' }}"
    "{%- for t in tools %}{{- '\\n' + (t | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\nTo call a function reply:\\n<tool_call>\\n<function=example_function_name>\\n'"
    "    '<parameter=example_parameter_1>\\nvalue_1\\n</parameter>\\n</function>\\n</tool_call><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if m.reasoning_content %}{{- '<think>\\n' + m.reasoning_content + '\\n</think>\\n\\n' }}{%- endif %}"
    "{{- m.content or '' }}"
    "{%- for c in m.tool_calls or [] %}"
    "{{- '\\n<tool_call>\\n<function=' + c.function.name + '>\\n' }}"
    "{%- for k, v in c.function.arguments | items %}"
    "{{- '<parameter=' + k + '>\\n' }}"
    "{{- (v | tojson) if v is mapping or (v is sequence and v is not string) else (v | string) }}"
    "{{- '\\n</parameter>\\n' }}"
    "{%- endfor %}"
    "{{- '</function>\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif m.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + m.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- else %}{{- '<think>\\n' }}{%- endif %}"
    "{%- endif %}")


def write_thinking_model(path: str | Path, context_length: int = 1024) -> Path:
    m = synth.write_gguf(path, "qwen3", added_tokens=ADDED_TOKENS, seed=3, context_length=context_length, tied=False,
                         name="thinker", extra_metadata={"tokenizer.chat_template": THINKING_TEMPLATE})
    return m.path
