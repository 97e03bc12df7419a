"""Hard text for tokenizer tests, and the tokenizers under test, cached per process so the three
tokenizer test files share one build (the transformers references take seconds each).

The corpus is hand-written strings (unicode, emoji, CJK, code, whitespace runs, numbers,
contractions, special tokens) plus deterministic mixtures of their fragments."""

from __future__ import annotations

import functools
import random

from support.real_models import real_model

HAND = [
    "", " ", "  ", "   ", "\t", "\n", "\n\n", "\n\n\n\n\n", "\r\n", " \n \n ", "\t\t\t", " \t \t", "\u00a0", "\u3000",
    "Hello world", "Hello, world!", "hello", "HELLO", "  leading spaces", "trailing spaces   ", "  both  ",
    "multiple    internal     spaces", "tabs\tbetween\twords", "mixed \t\n whitespace \r\n end",
    "line one\nline two\nline three", "para\n\n\npara", "x\n  \n  y", "\n\n    indented after blank",
    "don't", "I'm", "you're", "we've", "they'll", "she'd", "it's", "DON'T SHOUT", "I'M HERE", "rock 'n' roll",
    "O'Neil's", "'quoted'", "\"double\"", "``backticks``", "can't won't shouldn't'", "y'all'd've",
    "0", "7", "42", "123", "1234", "12345", "3.14159", "-273.15", "1,000,000", "1e-9", "0x1F600", "2024-01-31",
    "12:34:56", "a 1", "a  1", "a   123", "x1y2z3", "v2.0.1", "$100", "100%", "#1", "No. 5", "١٢٣ arabic digits",
    "½ ¾ ⅓", "²³ superscripts", "Ⅻ roman", "①②③",
    "naïve café résumé", "façade Ångström", "e\u0301 combining acute", "Zoë Brontë", "straße", "İstanbul ı",
    "Привет, мир!", "Ελληνικά γράμματα", "שלום עולם", "مرحبا بالعالم", "हिन्दी पाठ", "ภาษาไทย", "ქართული",
    "中文字符测试", "你好，世界！这是一个测试。", "日本語のテキスト", "カタカナ ひらがな 漢字", "한국어 텍스트입니다",
    "中文 and English mixed 混合", "全角ＡＢＣ１２３", "𠀋𡈽𡌛 rare CJK", "Tiếng Việt có dấu",
    "😀", "😀😃😄", "👍🏽", "👨‍👩‍👧‍👦 family", "🇺🇸🇯🇵 flags", "❤️ heart", "🫠 melting", "🧑🏿‍🚀", "emoji😀inside",
    "𓀀𓀁 hieroglyphs", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 math", "∀x∈ℝ: x²≥0", "→ ← ↑ ↓ ⇒", "© ® ™ § ¶", "€ £ ¥ ₹ ₿",
    "\u200b zero width", "a\u200db", "\ufeffBOM", "\u2581 lower one eighth block", "\ufffd replacement char",
    "def f(x):\n    return x ** 2\n", "if (a && b) { return; }", "for i in range(10):\n\tprint(i)",
    "#include <stdio.h>\nint main(void) { printf(\"%d\\n\", 42); }", "SELECT * FROM t WHERE id = 1;",
    "const x = () => { console.log('hi'); };", "fn main() -> Result<(), Box<dyn Error>> {}",
    "<div class=\"a\">text</div>", "{\"key\": [1, 2, {\"nested\": null}]}", "a[i][j] += b[j] * c",
    "$ ls -la | grep foo > out.txt 2>&1", "x = y != z == w <= v >= u", "/* comment */ // another",
    "    indented four", "\tindented tab", "        eight", "`inline code`", "```python\nprint('x')\n```",
    "https://example.com/path?q=1&r=2#frag", "user@example.com", "C:\\Windows\\System32", "~/.bashrc",
    "!!!", "???", "...", "---", "___", "***", "==", "<<>>", "((()))", "[[]]", "{{}}", "|||", "@#$%^&*",
    "a.b.c", "a,b,c", "end.", "Mr. Smith.", "U.S.A.", "e.g. i.e. etc.", "—em dash—", "–en–", "«guillemets»",
    "the quick brown fox jumps over the lazy dog", "THE QUICK BROWN FOX", "CamelCaseIdentifier",
    "snake_case_identifier", "kebab-case-thing", "SCREAMING_SNAKE", "mIxEd CaSe", "aaaaaaaaaaaaaaaaaaaaaaaa",
    "ababababababababab", "           many spaces before", "after many spaces           ",
    "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_start|>user\nHi there<|im_end|>\n",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>assistant\n", "text<|im_end|>more",
    "<|im_start|><|im_end|>", "< |im_start| >", "<|im_start", "im_start|>", "<tool_call>{}</tool_call>",
    "<|fim_prefix|>def<|fim_suffix|>x<|fim_middle|>", "<repo_name>x<file_sep>y", "<bos>", "<eos>",
    "<start_of_turn>user\nhello<end_of_turn>\n<start_of_turn>model\n", "<pad><unk><mask>", "<unused0>",
    "[multimodal]", "<h1>title</h1>", "<strong>bold</strong>", "</s>", "<s>", "<0x41>", "[PAD151665]",
    " <|im_start|> spaced ", "\n<|im_end|>\n", "<|endoftext|><|endoftext|>",
]

_FRAGMENTS = [f for f in HAND if f.strip()] + [" ", "  ", "\n", "\t", "\n\n", "    "]


def _mixtures(n: int, seed: int = 1234) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        k = rng.randint(2, 6)
        out.append("".join(rng.choice(_FRAGMENTS) for _ in range(k)))
    return out


CORPUS: list[str] = HAND + _mixtures(120)

MODELS = ["smol135", "qwen05", "qwen15", "gemma270"]

CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Tell me a joke about 🐍 and 中文."}],
    [{"role": "system", "content": "Be nice."}, {"role": "user", "content": "a"},
     {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}],
    [{"role": "user", "content": "  spaces  \n\n and newlines\t"}],
    [{"role": "user", "content": "code:\n```py\nprint('x')\n```"}, {"role": "assistant", "content": "ok"}],
]


@functools.lru_cache(maxsize=None)
def model_file(name: str):
    from realizar_backend.formats import open_model
    return open_model(real_model(name))


@functools.lru_cache(maxsize=None)
def ours(name: str):
    from realizar_backend.model.tokenizer import Tokenizer
    return Tokenizer.from_model_file(model_file(name))


@functools.lru_cache(maxsize=None)
def reference(name: str):
    """transformers' tokenizer for the same GGUF."""
    from transformers import AutoTokenizer
    path = real_model(name)
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@functools.lru_cache(maxsize=None)
def reference_smollm_fixed():
    """transformers' SmolLM2 tokenizer with the pre-tokenizer of SmolLM2's own tokenizer.json.

    transformers' GGUF loader has no entry for `tokenizer.ggml.pre = "smollm"` and falls back to
    the plain GPT-2 split, so it does not isolate digits as SmolLM2 (and llama.cpp's "smollm"
    rule: \\p{N}, then the GPT-2 regex) does. The two differ only where a digit follows a run of
    spaces ("a  1"); test_tokenizer.py checks that, and otherwise compares against transformers as is."""
    import copy

    from tokenizers import pre_tokenizers
    tok = copy.deepcopy(reference("smol135"))
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    return tok
