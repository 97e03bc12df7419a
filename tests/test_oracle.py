"""The NumPy backend against an independent implementation: HF transformers (CPU, float32)
loading the same GGUF. Greedy tokens must agree (a divergence is acceptable only where the
reference's top two logits are within 0.01) and last-position logits to cosine >= 0.999."""

import numpy as np
import pytest

from paging import contiguous_tables
from realizar_backend.backends.base import PrefillItem
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
    from real_models import real_model
    path = real_model(request.param)
    kw = dict(gguf_file=path.name)
    tok = transformers.AutoTokenizer.from_pretrained(path.parent, **kw)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path.parent, dtype=torch.float32, **kw).eval()
    ours = contiguous_tables(CPUBackend(open_model(path), max_slots=1, max_context=256))
    yield request.param, tok, ref, ours
    del ref


def _reference(torch, ref, ids):
    with torch.no_grad():
        out = ref.generate(torch.tensor([ids]), max_new_tokens=STEPS, do_sample=False, num_beams=1,
                           output_logits=True, return_dict_in_generate=True, pad_token_id=0,
                           repetition_penalty=None, temperature=None, top_p=None, top_k=None)
    return out.sequences[0, len(ids):].tolist(), [l[0].float().numpy() for l in out.logits]


def _cos(a, b):
    return float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_tokens_and_logits_match_transformers(pair, prompt):
    import torch
    name, tok, ref, ours = pair
    ids = tok(prompt, add_special_tokens=True)["input_ids"]
    ref_tokens, ref_logits = _reference(torch, ref, ids)

    logits = ours.prefill([PrefillItem(0, np.asarray(ids, dtype=np.int32), 0)])[0]
    assert _cos(logits, ref_logits[0]) >= 0.999, f"{name}: prompt logits cosine {_cos(logits, ref_logits[0])}"
    got = []
    for step in range(len(ref_tokens)):
        t = int(np.argmax(logits))
        got.append(t)
        if t != ref_tokens[step]:
            top2 = np.sort(ref_logits[step])[-2:]
            assert top2[1] - top2[0] < 0.01, (
                f"{name}: step {step} ours {t} ref {ref_tokens[step]} (ref top-2 gap {top2[1] - top2[0]:.4f})\n"
                f"ours {tok.decode(got)!r}\nref  {tok.decode(ref_tokens)!r}")
            break   # past a legitimate near-tie the two continuations differ
        logits = ours.decode([0], [t], [len(ids) + step])[0]
        if step + 1 < len(ref_logits):
            assert _cos(logits, ref_logits[step + 1]) >= 0.999
