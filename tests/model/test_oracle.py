"""The NumPy backend against an independent implementation: HF transformers (CPU, float32)
loading the same GGUF. Greedy tokens must agree (a divergence is acceptable only where the
reference's top two logits are within 0.01) and last-position logits to cosine >= 0.999."""

import pytest

from support.hf_oracle import assert_greedy_parity
from support.paging import contiguous_tables
from realizar_backend.backends.cpu import CPUBackend
from realizar_backend.formats import open_model

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village by the sea,",
    "<|im_start|>user\nWhat is 17 times 23?<|im_end|>\n<|im_start|>assistant\n",
]
STEPS = 24


@pytest.fixture(scope="module", params=["smol135", "qwen05"])
def pair(request):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from support.real_models import real_model
    path = real_model(request.param)
    kw = dict(gguf_file=path.name)
    tok = transformers.AutoTokenizer.from_pretrained(path.parent, **kw)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path.parent, dtype=torch.float32, **kw).eval()
    ours = contiguous_tables(CPUBackend(open_model(path), max_slots=1, max_context=256))
    yield request.param, tok, ref, ours
    del ref


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_tokens_and_logits_match_transformers(pair, prompt):
    name, tok, ref, ours = pair
    ids = tok(prompt, add_special_tokens=True)["input_ids"]
    assert_greedy_parity(ref, ours, ids, steps=STEPS, label=name, tokenizer=tok)
