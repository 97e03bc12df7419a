"""Text <-> token ids, chat templates, and streaming detokenization.

The tokenizer is built with Hugging Face `tokenizers` (Rust) from what the model file carries:
- GGUF `tokenizer.ggml.model == "gpt2"`: byte-level BPE with the merges of the file, split by the
  regex that `tokenizer.ggml.pre` names (the table follows llama.cpp's llama-vocab.cpp);
- GGUF `tokenizer.ggml.model == "llama"`: SentencePiece-style BPE with byte fallback; the file has
  no merges, so they are derived from the vocabulary, ranked by score (Gemma: by file order);
- a safetensors directory: its own tokenizer.json.
Control (type 3) and user-defined (type 4) tokens are matched whole in text, as llama.cpp does.
The token ids equal transformers' tokenizer for the same file (checked in tests/test_tokenizer.py).

Chat templates render in a jinja2 ImmutableSandboxedEnvironment set up as transformers sets it up
(same globals, filters and options), so the prompt string is the one transformers would build.
"""

from __future__ import annotations

import json
import logging
from datetime import datetime
from pathlib import Path
from typing import Any, Mapping

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from ..errors import ModelFormatError, RequestError, UnsupportedModelError

log = logging.getLogger(__name__)

# GGUF token types (llama.cpp's llama_token_type)
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

# Pre-tokenizer split regexes, by `tokenizer.ggml.pre`. Written from llama.cpp's regex_exprs.
_GPT2 = None  # ByteLevel's own regex: 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
_DIGITS_THEN_GPT2 = "digits"  # every digit on its own, then the GPT-2 regex (StarCoder-style vocabularies)
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_PRE_SPLITS: dict[str, str | None] = {
    "default": _GPT2, "gpt2": _GPT2, "gpt-2": _GPT2, "mpt": _GPT2, "olmo": _GPT2, "jais": _GPT2,
    "smollm": _DIGITS_THEN_GPT2, "starcoder": _DIGITS_THEN_GPT2, "refact": _DIGITS_THEN_GPT2,
    "command-r": _DIGITS_THEN_GPT2, "codeshell": _DIGITS_THEN_GPT2, "exaone": _DIGITS_THEN_GPT2,
    "minerva-7b": _DIGITS_THEN_GPT2,
    "llama3": _LLAMA3, "llama-v3": _LLAMA3, "llama-bpe": _LLAMA3, "falcon3": _LLAMA3, "smaug-bpe": _LLAMA3,
    "dbrx": _LLAMA3, "pixtral": _LLAMA3,
    "qwen2": _QWEN2, "stablelm2": _QWEN2, "deepseek-r1-qwen": _QWEN2, "megrez": _QWEN2,
    "gpt-4o": _GPT4O, "llama4": _GPT4O,
}

# Token texts that end a turn or the text (llama.cpp's end-of-generation list), matched when the
# vocabulary marks them as control tokens.
_EOG_TEXTS = {
    "<|im_end|>", "<|endoftext|>", "<end_of_turn>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<|EOT|>",
    "<|end_of_text|>", "<|return|>", "<|call|>", "<eos>", "</s>", "<|end▁of▁sentence|>",
    "<｜end▁of▁sentence｜>", "<EOT>", "_<EOT>", "<|endofturn|>",
}
_SPM_SPACE = "\u2581"


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, the alphabet byte-level vocabularies are written in."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _spm_merges(tokens: list[str], rank: Mapping[str, float]) -> list[tuple[str, str]]:
    """SentencePiece BPE merges a pair whose concatenation is the best-scoring vocabulary piece.
    As an HF merge list: every split of every piece into two pieces, best piece first (ties: the
    longer left part first, then by the ids of the parts), which is how transformers derives them."""
    vocab = {t: i for i, t in enumerate(tokens)}
    merges: list[tuple[float, int, int, int, int, str, str]] = []
    for piece, score in rank.items():
        for k in range(1, len(piece)):
            left, right = piece[:k], piece[k:]
            il, ir = vocab.get(left), vocab.get(right)
            if il is not None and ir is not None:
                merges.append((-score, -len(left), -len(right), il, ir, left, right))
    merges.sort(key=lambda m: m[:5])
    return [(m[5], m[6]) for m in merges]


class Tokenizer:
    """One model's tokenizer. Build it with `Tokenizer.from_model_file`."""

    def __init__(self, tk: HFTokenizer, *, path: str, vocab_size: int, bos_id: int | None, eos_id: int | None,
                 add_bos: bool, add_eos: bool, manual_specials: bool, special_tokens: dict[str, str],
                 stop_ids: set[int], chat_template: str | None, spm_pieces: bool):
        self._tk = tk
        self._path = path
        self.vocab_size = vocab_size
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.add_bos = add_bos
        self.add_eos = add_eos
        self._manual_specials = manual_specials   # GGUF: BOS/EOS added here, not by a post-processor
        self.special_tokens = special_tokens      # bos_token, eos_token, ... as the chat template sees them
        self.stop_ids = stop_ids
        self.chat_template = chat_template
        self._spm_pieces = spm_pieces             # token pieces spell a space as U+2581
        self._template: jinja2.Template | None = None
        self._special_ids = {i for i, t in tk.get_added_tokens_decoder().items() if t.special}
        # byte-fallback pieces (<0xE4>): the streaming detokenizer treats a run of them as one unit
        self._byte_ids: frozenset[int] = frozenset()
        if getattr(tk.model, "byte_fallback", False):
            self._byte_ids = frozenset(i for p, i in tk.get_vocab(with_added_tokens=False).items()
                                       if len(p) == 6 and p.startswith("<0x") and p.endswith(">"))

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_model_file(cls, mf) -> "Tokenizer":
        if mf.format == "gguf":
            tok = cls._from_gguf(mf.path, mf.metadata)
        elif mf.tokenizer_json is not None:
            tok = cls._from_tokenizer_json(mf.path, mf.tokenizer_json, mf.tokenizer_config or {}, mf.metadata)
        else:
            raise UnsupportedModelError(mf.path, "the model directory has no tokenizer.json")
        log.debug("%s: tokenizer with %d tokens, bos=%s eos=%s add_bos=%s stop=%s, chat template: %s", mf.path,
                  tok.vocab_size, tok.bos_id, tok.eos_id, tok.add_bos, sorted(tok.stop_ids), tok.has_chat_template)
        return tok

    @classmethod
    def _from_gguf(cls, path, md: Mapping[str, Any]) -> "Tokenizer":
        kind = md.get("tokenizer.ggml.model")
        tokens = md.get("tokenizer.ggml.tokens")
        if kind is None or tokens is None:
            raise UnsupportedModelError(path, "the model file has no tokenizer (tokenizer.ggml.model / tokens missing)")
        tokens = [str(t) for t in tokens]
        n = len(tokens)
        raw_types = md.get("tokenizer.ggml.token_type")
        types = [int(t) for t in raw_types] if raw_types is not None else [_NORMAL] * n
        if len(types) != n:
            raise ModelFormatError(path, f"tokenizer.ggml.token_type has {len(types)} entries for {n} tokens")

        def tid(key: str) -> int | None:
            v = md.get(f"tokenizer.ggml.{key}")
            if v is None:
                return None
            v = int(v)
            if not 0 <= v < n:
                raise ModelFormatError(path, f"tokenizer.ggml.{key} = {v} is outside the vocabulary of {n}")
            return v

        bos, eos, unk, pad = tid("bos_token_id"), tid("eos_token_id"), tid("unknown_token_id"), tid("padding_token_id")
        add_bos = md.get("tokenizer.ggml.add_bos_token")
        if kind == "gpt2":
            tk = cls._gguf_byte_level(path, md, tokens, types)
            add_bos = bool(add_bos) if add_bos is not None else False
            spm = False
        elif kind == "llama":
            tk = cls._gguf_sentencepiece(path, md, tokens, types, unk)
            # llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise
            add_bos = bool(add_bos) if add_bos is not None else True
            spm = True
        else:
            raise UnsupportedModelError(path, f"tokenizer type {kind!r} is not supported (supported: gpt2, llama)")

        specials = {name: tokens[i] for name, i in
                    (("bos_token", bos), ("eos_token", eos), ("unk_token", unk), ("pad_token", pad)) if i is not None}
        stops = {i for i in (eos, tid("eot_token_id"), tid("eom_token_id")) if i is not None}
        stops |= {i for i, (t, ty) in enumerate(zip(tokens, types)) if ty == _CONTROL and t in _EOG_TEXTS}
        template = md.get("tokenizer.chat_template")
        return cls(tk, path=str(path), vocab_size=n, bos_id=bos, eos_id=eos, add_bos=add_bos,
                   add_eos=bool(md.get("tokenizer.ggml.add_eos_token", False)), manual_specials=True,
                   special_tokens=specials, stop_ids=stops, chat_template=str(template) if template else None,
                   spm_pieces=spm)

    @staticmethod
    def _gguf_byte_level(path, md, tokens: list[str], types: list[int]) -> HFTokenizer:
        alphabet = bytes_to_unicode()
        spelled = set(alphabet.values())
        # A token outside the byte alphabet (rare: some added tokens) is respelled byte by byte,
        # so the vocabulary the BPE model sees is all in one alphabet.
        vocab = {(t if set(t) <= spelled else "".join(alphabet[b] for b in t.encode("utf-8"))): i
                 for i, t in enumerate(tokens)}
        merges_raw = md.get("tokenizer.ggml.merges")
        if merges_raw is None or len(merges_raw) == 0:
            raise ModelFormatError(path, "byte-level BPE vocabulary without tokenizer.ggml.merges")
        merges = []
        for m in merges_raw:
            a, sep, b = str(m).partition(" ")
            if not sep:
                raise ModelFormatError(path, f"malformed merge {m!r}")
            merges.append((a, b))
        tk = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
        pre = str(md.get("tokenizer.ggml.pre") or "default")
        if pre not in _PRE_SPLITS:
            log.warning("%s: pre-tokenizer %r is not known; splitting with the GPT-2 regex", path, pre)
        split = _PRE_SPLITS.get(pre, _GPT2)
        if split is _GPT2:
            tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        elif split == _DIGITS_THEN_GPT2:
            tk.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
        else:
            tk.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        tk.decoder = decoders.ByteLevel()
        # A control token spelled outside the byte alphabet is a mislabelled ordinary token: as a
        # special token it would get a new id past the model's vocabulary, so it stays ordinary.
        Tokenizer._add_gguf_added_tokens(tk, tokens, types, lambda t: set(t) <= spelled, vocab)
        return tk

    @staticmethod
    def _gguf_sentencepiece(path, md, tokens: list[str], types: list[int], unk: int | None) -> HFTokenizer:
        arch = str(md.get("general.architecture", ""))
        gemma = arch.startswith("gemma")
        if gemma:
            # Gemma stores its runs-of-spaces pieces with real spaces; the BPE sees U+2581 instead.
            tokens = [_SPM_SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
            rank = {t: -float(i) for i, t in enumerate(tokens)}   # Gemma's merge order is file order
        else:
            scores = md.get("tokenizer.ggml.scores")
            if scores is None or len(scores) != len(tokens):
                raise ModelFormatError(path, "SentencePiece vocabulary without one score per token")
            rank = {t: float(s) for t, s in zip(tokens, scores)}
        vocab = {t: i for i, t in enumerate(tokens)}
        tk = HFTokenizer(models.BPE(vocab=vocab, merges=_spm_merges(tokens, rank), fuse_unk=True, byte_fallback=True,
                                    unk_token=tokens[unk] if unk is not None else None))
        if gemma:
            tk.normalizer = normalizers.Replace(" ", _SPM_SPACE)
            tk.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
            tk.decoder = decoders.Sequence([decoders.Replace(_SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
        else:
            prepend = bool(md.get("tokenizer.ggml.add_space_prefix", True))
            tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement=_SPM_SPACE, prepend_scheme="first" if prepend else "never",
                                                        split=False)
            steps = [decoders.Replace(_SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
            if prepend:
                steps.append(decoders.Strip(" ", 1, 0))
            tk.decoder = decoders.Sequence(steps)
        Tokenizer._add_gguf_added_tokens(tk, tokens, types, lambda t: True, vocab)
        return tk

    @staticmethod
    def _add_gguf_added_tokens(tk: HFTokenizer, tokens, types, may_be_special, vocab) -> None:
        """Control tokens (like <|im_start|>) become special added tokens and user-defined ones
        (like <tool_call>) plain added tokens: both are then matched whole in the text."""
        control = [AddedToken(t, normalized=False, special=True)
                   for t, ty in zip(tokens, types) if ty == _CONTROL and may_be_special(t)]
        if control:
            tk.add_special_tokens(control)
        user = [AddedToken(t, normalized=False, special=False)
                for t, ty in zip(tokens, types) if ty == _USER_DEFINED and t in vocab]
        if user:
            tk.add_tokens(user)

    @classmethod
    def _from_tokenizer_json(cls, path, tokenizer_json: Path, cfg: Mapping[str, Any],
                             md: Mapping[str, Any]) -> "Tokenizer":
        try:
            tk = HFTokenizer.from_file(str(tokenizer_json))
        except Exception as e:
            raise ModelFormatError(tokenizer_json, f"cannot load tokenizer.json: {e}") from None

        def token_str(v) -> str | None:
            if isinstance(v, dict):
                v = v.get("content")
            return str(v) if v is not None else None

        specials = {k: s for k in ("bos_token", "eos_token", "unk_token", "pad_token")
                    if (s := token_str(cfg.get(k))) is not None}
        bos = tk.token_to_id(specials["bos_token"]) if "bos_token" in specials else None
        eos = tk.token_to_id(specials["eos_token"]) if "eos_token" in specials else None
        # else the ids config.json / generation_config.json gave (the loader puts them in metadata)
        bos = bos if bos is not None else md.get("tokenizer.ggml.bos_token_id")
        eos = eos if eos is not None else md.get("tokenizer.ggml.eos_token_id")
        for name, i in (("bos_token", bos), ("eos_token", eos)):
            if i is not None and name not in specials and tk.id_to_token(int(i)) is not None:
                specials[name] = tk.id_to_token(int(i))
        stops = {eos} if eos is not None else set()
        stops |= {i for i, t in tk.get_added_tokens_decoder().items() if t.special and t.content in _EOG_TEXTS}
        # generation_config.json lists the ids the model was trained to stop on
        gen = Path(tokenizer_json).parent / "generation_config.json"
        if gen.is_file():
            try:
                ids = json.loads(gen.read_text()).get("eos_token_id")
                stops |= set(ids if isinstance(ids, list) else [ids] if ids is not None else [])
            except (ValueError, OSError) as e:
                log.warning("%s: unreadable generation_config.json: %s", path, e)
        template = cfg.get("chat_template")
        if isinstance(template, list):   # named templates: [{"name": ..., "template": ...}]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        jinja_file = Path(tokenizer_json).parent / "chat_template.jinja"
        if not template and jinja_file.is_file():
            template = jinja_file.read_text()
        return cls(tk, path=str(path), vocab_size=tk.get_vocab_size(with_added_tokens=True), bos_id=bos, eos_id=eos,
                   add_bos=bool(cfg.get("add_bos_token", False)), add_eos=bool(cfg.get("add_eos_token", False)),
                   manual_specials=False, special_tokens=specials, stop_ids={int(i) for i in stops},
                   chat_template=template or None, spm_pieces=False)

    # ------------------------------------------------------------------ text <-> ids
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self._manual_specials:
            ids = self._tk.encode(text, add_special_tokens=False).ids
            if add_special_tokens:
                if self.add_bos and self.bos_id is not None:
                    ids.insert(0, self.bos_id)
                if self.add_eos and self.eos_id is not None:
                    ids.append(self.eos_id)
            return ids
        return self._tk.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tk.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_text(self, id: int) -> str:
        """The text of one token on its own (for logprobs); a partial UTF-8 byte reads as U+FFFD."""
        id = int(id)
        text = self._tk.decode([id], skip_special_tokens=False)
        # SentencePiece decoders may strip the leading space of the first piece; a lone token keeps it
        piece = self._tk.id_to_token(id)
        if piece and piece.startswith(_SPM_SPACE) and not text.startswith(" ") and id not in self._special_ids:
            text = " " + text
        return text

    def id_to_piece(self, id: int) -> str | None:
        return self._tk.id_to_token(int(id))

    def is_special(self, id: int) -> bool:
        return int(id) in self._special_ids

    def detokenizer(self, prompt_ids: list[int] | None = None, skip_special_tokens: bool = True) -> "IncrementalDetokenizer":
        return IncrementalDetokenizer(self, prompt_ids, skip_special_tokens)

    def to_json(self) -> str:
        """The tokenizer as HF tokenizer.json text (what llguidance builds its vocabulary from)."""
        return self._tk.to_str()

    # ------------------------------------------------------------------ chat templates
    @property
    def has_chat_template(self) -> bool:
        return bool(self.chat_template)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        """The prompt string transformers' `apply_chat_template(messages, tokenize=False, ...)` renders.
        Extra keyword arguments (tools, documents, enable_thinking, ...) are visible to the template."""
        if not self.chat_template:
            raise UnsupportedModelError(self._path, "the model has no chat template (tokenizer.chat_template); "
                                                    "use the completions endpoint with a plain prompt")
        if not isinstance(messages, (list, tuple)) or not messages:
            raise RequestError("messages must be a non-empty list", param="messages")
        if self._template is None:
            try:
                self._template = _jinja_env().from_string(self.chat_template)
            except (jinja2.TemplateSyntaxError, SyntaxError) as e:   # SyntaxError: e.g. a break outside a loop
                raise UnsupportedModelError(self._path, f"the chat template does not parse: {e}") from None
        chat = []
        for m in messages:
            if not isinstance(m, Mapping):
                raise RequestError(f"every message must be an object, got {type(m).__name__}", param="messages")
            # A None value (OpenAI's content=None, tool_calls=None) is dropped, as transformers does.
            chat.append(_alias_reasoning(_tool_call_arguments(_plain({k: v for k, v in m.items() if v is not None}))))
        tools = _plain(kwargs.pop("tools", None))
        documents = _plain(kwargs.pop("documents", None))
        context = {**self.special_tokens, **_plain(kwargs)}
        try:
            return self._template.render(messages=chat, tools=tools, documents=documents,
                                         add_generation_prompt=add_generation_prompt, **context)
        except jinja2.TemplateError as e:
            # raise_exception() in the template (e.g. "roles must alternate"), or a sandbox refusal
            raise RequestError(f"chat template error: {e}", param="messages") from None
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as e:
            raise RequestError(f"the messages do not fit the model's chat template: {e}", param="messages") from None


# ---------------------------------------------------------------------- jinja environment
class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; rendering
    just emits the body, as transformers does when it is not tracking."""
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


class _TemplateDict:
    """`dict(...)` for templates without handing them the dict type itself."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """A namespace that refuses underscore names, so a template cannot reach Python internals."""

    def __init__(*args, **kwargs):  # noqa: N805 (same signature trick as jinja2's Namespace)
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"templates cannot store underscore attributes ({name!r})")


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # jinja2's own tojson escapes HTML characters; chat templates expect plain json.dumps
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


def _jinja_env() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now,
                       dict=_TemplateDict(), namespace=_TemplateNamespace)
    return env


_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _tool_call_arguments(message: dict) -> dict:
    """OpenAI sends a tool call's arguments as a JSON string; templates write them with `tojson`
    and expect the object (as transformers documents), so a string that parses becomes it."""
    calls = message.get("tool_calls")
    if not isinstance(calls, list):
        return message
    out = []
    for call in calls:
        nested = isinstance(call, dict) and isinstance(call.get("function"), dict)
        fn = call["function"] if nested else call
        if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
            try:
                parsed = json.loads(fn["arguments"])
            except ValueError:
                parsed = None
            if isinstance(parsed, dict):
                fn = {**fn, "arguments": parsed}
                call = {**call, "function": fn} if nested else fn
        out.append(call)
    return {**message, "tool_calls": out}


def _alias_reasoning(message: dict) -> dict:
    # Templates read reasoning under different names; fill them all from whichever was given.
    reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _plain(value: Any) -> Any:
    """Rebuild template inputs from plain JSON types: the sandbox does not know which methods of a
    rich object are dangerous, so none reach the template."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if hasattr(value, "item") and callable(value.item) and type(value).__module__ == "numpy":
        return _plain(value.item())
    if callable(getattr(value, "model_dump", None)):   # pydantic models (the OpenAI schemas)
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


# ---------------------------------------------------------------------- streaming
class IncrementalDetokenizer:
    """Turns a stream of token ids into text chunks. Each chunk is the text the latest token adds;
    a token that ends inside a UTF-8 character (byte tokens of an emoji) is held back until the
    character is complete, so every chunk is whole characters and the chunks join to decode(ids).

    It decodes a window that starts at the tokens of the previous chunk rather than one token
    alone, because a token's text can depend on its neighbours (SentencePiece drops the leading
    space of the first piece). Byte-fallback decoding (SentencePiece) reads a run of byte tokens as
    one unit and turns all of it into U+FFFD if any of it is not valid UTF-8, so such a run is held
    until a token that is not a byte ends it; windows never start inside a run."""

    _CONTEXT = 6   # prompt ids decoded as context before the first new token

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int] | None = None, skip_special_tokens: bool = True):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = [int(i) for i in prompt_ids or ()]
        self._read = len(self._ids)                      # ids before this have been emitted
        self._prefix = max(0, self._read - self._CONTEXT)
        while self._prefix > 0 and self._decode(self._prefix, self._read).startswith("\ufffd"):
            self._prefix -= 1                            # back up to a character boundary
        self._prefix_text = self._decode(self._prefix, self._read)
        self._in_byte_run = False
        self.text = ""

    def _decode(self, start: int, end: int) -> str:
        return self._tok.decode(self._ids[start:end], skip_special_tokens=self._skip) if end > start else ""

    def add(self, token_id: int) -> str:
        token_id = int(token_id)
        self._ids.append(token_id)
        if not (self._skip and token_id in self._tok._special_ids):   # a skipped token does not end a run
            self._in_byte_run = token_id in self._tok._byte_ids
        if self._in_byte_run:
            return ""
        full = self._decode(self._prefix, len(self._ids))
        if full.endswith("\ufffd") or len(full) <= len(self._prefix_text):
            return ""           # an incomplete character (or nothing new yet): wait for more
        return self._emit(full)

    def flush(self) -> str:
        """The held-back tail (an incomplete character at the very end decodes as U+FFFD)."""
        if self._read == len(self._ids):
            return ""
        return self._emit(self._decode(self._prefix, len(self._ids)))

    def _emit(self, full: str) -> str:
        new = full[len(self._prefix_text):]
        # the text up to here ends on a character boundary, so the next window may start here
        self._prefix, self._read = self._read, len(self._ids)
        self._prefix_text = self._decode(self._prefix, self._read)
        self.text += new
        return new


__all__ = ["Tokenizer", "IncrementalDetokenizer"]
