"""The NumPy backend against transformers on tiny random models of each architecture, written by
transformers and converted to GGUF by llama.cpp's own convert_hf_to_gguf.py (tests/support/hf_oracle.py):
greedy tokens equal (a divergence acceptable only at the reference's own near-tie) and logits to
cosine >= 0.999 at every step. The same checkpoints, read as safetensors directories, check that
loader too. A prompt cut into prefill chunks gives the logits of one prefill (the hybrids' state
carried across chunks)."""

import numpy as np
import pytest

from support.hf_oracle import ARCHS, STEPS, assert_greedy_parity, available, reference_greedy, reference_model, \
    tiny_gguf, tokenizer_dir
from support.paging import contiguous_tables
from realizar_backend.backends.base import PrefillItem
from realizar_backend.backends.cpu import CPUBackend
from realizar_backend.formats import open_model

pytestmark = pytest.mark.slow

# case -> (tiny architecture, config.json overrides, prompts run, greedy steps)
CASES = {
    "llama": ("llama", {}, 3, STEPS),
    "qwen2": ("qwen2", {}, 3, STEPS),
    "qwen3": ("qwen3", {}, 3, STEPS),
    "gemma3": ("gemma3", {}, 3, STEPS),
    "qwen3moe": ("qwen3_moe", {}, 3, STEPS),
    "gpt-oss": ("gpt_oss", {}, 3, STEPS),
    "qwen35": ("qwen3_5", {}, 3, STEPS),
    "qwen35moe": ("qwen3_5_moe", {}, 3, STEPS),
    # Gemma 3 27B scales its queries by 1/sqrt(hidden / heads) (168), not 1/sqrt(head_dim) (128).
    # GGUF has no key for that: llama.cpp tells the model by its 62 layers, and so must a reader.
    # One prompt and a few steps: the reference takes a second per step through 62 layers.
    "gemma3-27b": ("gemma3", dict(num_hidden_layers=62, num_attention_heads=2, num_key_value_heads=1,
                                  head_dim=64, query_pre_attn_scalar=32, intermediate_size=64), 1, 4),
}
SAFETENSORS = ("llama", "qwen2", "qwen3")     # the architectures our safetensors loader reads

# Longer than gemma3's tiny sliding window (8 positions), so that it matters from the prompt on.
PROMPTS = [
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    if n < 2:",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "<|endoftext|>SELECT name, count(*) FROM users WHERE age > 30 GROUP BY name;",
]
RUNS = [(name, source, i) for name, (_, _, n, _) in CASES.items()
        for source in ("gguf", "safetensors") if source == "gguf" or name in SAFETENSORS
        for i in range(n)]


@pytest.fixture(scope="module")
def tokenizer():
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(tokenizer_dir())


class _Models:
    """The module's models, made on first use: per case the transformers reference and its greedy
    runs (shared by the GGUF and safetensors runs), per (case, source) our backend."""

    def __init__(self):
        self.refs: dict[str, tuple] = {}
        self.ours: dict[tuple[str, str], CPUBackend] = {}

    def get(self, name: str, source: str):
        arch, overrides, _, _ = CASES[name]
        if not available(arch):
            pytest.skip(f"this transformers has no {ARCHS[arch].hf_class}")
        path = tiny_gguf(arch, **overrides)
        if name not in self.refs:
            self.refs[name] = (reference_model(path), {})
        if (name, source) not in self.ours:
            model = open_model(path if source == "gguf" else path.parent / "hf")
            self.ours[name, source] = contiguous_tables(CPUBackend(model, max_slots=1, max_context=256))
        return self.refs[name], self.ours[name, source]


@pytest.fixture(scope="module")
def models():
    pytest.importorskip("torch")
    return _Models()


@pytest.mark.parametrize("run", RUNS, ids=[f"{n}-{s}-{i}" for n, s, i in RUNS])
def test_greedy_tokens_and_logits_match_transformers(models, tokenizer, run):
    name, source, i = run
    (ref, memo), ours = models.get(name, source)
    ids = tokenizer(PROMPTS[i])["input_ids"]
    steps = CASES[name][3]
    if i not in memo:
        memo[i] = reference_greedy(ref, ids, steps)
    assert_greedy_parity(ref, ours, ids, steps, label=f"{name} ({source})", tokenizer=tokenizer,
                         reference=memo[i])


@pytest.mark.parametrize("name", ["qwen35", "qwen35moe", "qwen3"])
def test_a_prompt_split_into_prefill_chunks_equals_one_prefill(models, tokenizer, name):
    """A chunked prefill carries the recurrent state (and the KV) from chunk to chunk: the last
    position's logits equal one prefill of the whole prompt, wherever the prompt is cut."""
    _, ours = models.get(name, "gguf")
    ids = np.asarray(tokenizer(PROMPTS[1])["input_ids"], dtype=np.int32)
    whole = ours.prefill([PrefillItem(0, ids, 0)])[0]
    for cut in (1, 7, len(ids) - 1):
        ours.prefill([PrefillItem(0, ids[:cut], 0)])           # a sequence's first chunk starts from zero state
        split = ours.prefill([PrefillItem(0, ids[cut:], cut)])[0]
        np.testing.assert_allclose(split, whole, rtol=1e-4, atol=1e-4 * float(np.abs(whole).max()),
                                   err_msg=f"{name}: prompt cut at {cut}")
