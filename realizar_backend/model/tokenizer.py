"""Text <-> token ids, chat templates, and streaming detokenization.

The tokenizer is built with Hugging Face `tokenizers` (Rust) from what the model file carries:
- GGUF `tokenizer.ggml.model == "gpt2"`: byte-level BPE with the merges of the file, split by the
  regex that `tokenizer.ggml.pre` names (the table follows llama.cpp's llama-vocab.cpp);
- GGUF `tokenizer.ggml.model == "llama"`: SentencePiece-style BPE with byte fallback; the file has
  no merges, so they are derived from the vocabulary, ranked by score (Gemma: by file order);
- a safetensors directory: its own tokenizer.json.
Control (type 3) and user-defined (type 4) tokens are matched whole in text, as llama.cpp does.
The token ids equal transformers' tokenizer for the same file (checked in tests/model/test_tokenizer.py).

Chat templates render as transformers renders them, in worker processes with time, output and
memory limits (chat_template.py); every metadata value is read through model/metadata.py, so a
malformed vocabulary is a ModelFormatError naming the key.
"""

from __future__ import annotations

import json
import logging
import re
from itertools import compress, repeat
from pathlib import Path
from typing import Any, Mapping

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from .. import timeline
from ..errors import CapacityError, ContextOverflowError, ModelFormatError, RequestError, UnsupportedModelError
from ..settings import Settings
from .chat_template import (MAX_TEMPLATE_CHARS, ChatTemplateError, TemplateLimits, TemplateRenderer,
                            alias_reasoning, is_harmony, plain, renderer)
from .metadata import Metadata

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
# Qwen3.5's (its tokenizer.json): Qwen2's with combining marks (\p{M}) kept in the letters' run
_QWEN35 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
           r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
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
    "qwen35": _QWEN35,
    "gpt-4o": _GPT4O, "llama4": _GPT4O,
}

# harmony's (gpt-oss) message markers: special tokens kept in the decoded text of a harmony model
_HARMONY_MARKERS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|constrain|>", "<|return|>", "<|call|>")

# Token texts that end a turn or the text (llama.cpp's end-of-generation list), matched when the
# vocabulary marks them as control tokens.

_EOG_TEXTS = {
    "<|im_end|>", "<|endoftext|>", "<end_of_turn>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<|EOT|>",
    "<|end_of_text|>", "<|return|>", "<|call|>", "<eos>", "</s>", "<|end▁of▁sentence|>",
    "<｜end▁of▁sentence｜>", "<EOT>", "_<EOT>", "<|endofturn|>",
}
_SPM_SPACE = "\u2581"
# a normalizer may shorten text (NFC composes pairs of characters): the character bound on the
# tokens of a text allows for that much
_NORMALIZE_SLACK = 4


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


# any character outside GPT-2's byte alphabet (bytes_to_unicode's values: 188 printable Latin-1
# characters and U+0100-U+0143)
_NOT_BYTE_ALPHABET = re.compile("[^!-~\u00a1-\u00ac\u00ae-\u00ff\u0100-\u0143]")


def _outside_alphabet(tokens: list[str]) -> bool:
    """Whether any token has a character outside the byte alphabet (one regex pass over them all)."""
    return _NOT_BYTE_ALPHABET.search("".join(tokens)) is not None


def _split_merges(merges: list[str]) -> list[tuple[str, str]] | None:
    """GGUF merges ("a b") as pairs, when every entry holds exactly one space; else None. One
    split of the joined list instead of a partition per entry (150k+ of them)."""
    parts = " ".join(merges).split(" ")
    if len(parts) != 2 * len(merges) or not all(map(str.__contains__, merges, repeat(" "))):
        return None
    pairs = iter(parts)
    return list(zip(pairs, pairs))


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
                 stop_ids: set[int], chat_template: str | None, spm_pieces: bool, max_piece_chars: int):
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
        self._max_piece_chars = max(1, max_piece_chars)   # no token covers more characters of text
        self._renderer: TemplateRenderer | None = None    # set by from_model_file once the template passed
        self._special_ids = {i for i, t in tk.get_added_tokens_decoder().items() if t.special}
        # special ids that decoding with skip_special_tokens drops (all of them, but harmony's markers)
        self._skipped_ids = self._special_ids
        if is_harmony(chat_template):
            self._harmony_tokens()
        # decode([id]) by skip_special_tokens: the streaming detokenizer's window after each chunk
        # is usually one token, the same few thousand of them over and over
        self._one: dict[bool, dict[int, str]] = {False: {}, True: {}}
        # byte-fallback pieces (<0xE4>): the streaming detokenizer treats a run of them as one unit
        self._byte_ids: frozenset[int] = frozenset()
        if getattr(tk.model, "byte_fallback", False):
            self._byte_ids = frozenset(i for p, i in tk.get_vocab(with_added_tokens=False).items()
                                       if len(p) == 6 and p.startswith("<0x") and p.endswith(">"))

    def _harmony_tokens(self) -> None:
        """A harmony (gpt-oss) model: its reply's structure is spelled in special tokens
        (<|channel|>analysis<|message|>...<|end|>), which the serving layer's parser
        (serving/harmony.py) must see, so decoding keeps them even with skip_special_tokens. Its
        messages end with <|end|> before the next one starts: only <|return|> and <|call|> end a
        reply (as llama.cpp does for gpt-oss)."""
        decoder = self._tk.get_added_tokens_decoder()
        by_text = {t.content: i for i, t in decoder.items() if t.special}
        shown = {by_text[m] for m in _HARMONY_MARKERS if m in by_text}
        self._skipped_ids = self._special_ids - shown
        ends = {by_text[m] for m in ("<|return|>", "<|call|>") if m in by_text}
        if ends and "<|end|>" in by_text:
            self.stop_ids = (set(self.stop_ids) - {by_text["<|end|>"]}) | ends

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_model_file(cls, mf, template_limits: TemplateLimits | None = None) -> "Tokenizer":
        """The model's tokenizer; its chat template (if any) is compiled and trial-rendered here,
        within `template_limits` (default: Settings' defaults), so a broken or runaway template
        fails the load with a ModelFormatError naming the key."""
        limits = template_limits or TemplateLimits.from_settings(Settings())
        if cls._names_a_template(mf):
            # the render worker the check uses (a new process) comes up while the vocabulary builds
            renderer(limits).prestart()
        if mf.format == "gguf":
            tok = cls._from_gguf(mf.path, mf.metadata)
        elif mf.tokenizer_json is not None:
            tok = cls._from_tokenizer_json(mf.path, mf.tokenizer_json, mf.tokenizer_config or {}, mf.metadata)
        else:
            raise UnsupportedModelError(mf.path, "the model directory has no tokenizer.json")
        timeline.mark("tokenizer built")
        if tok.chat_template:
            tok._renderer = renderer(limits)
            try:
                tok._renderer.check(tok.chat_template, tok.special_tokens)
            except ChatTemplateError as e:
                if e.kind == "unavailable":
                    raise
                # it does not parse, runs away, or fails on every trial conversation: no chat could work
                why = e.message if e.kind != "render" else \
                    f"the chat template fails on every conversation tried at load ({e.message})"
                raise ModelFormatError(mf.path, f"metadata key 'tokenizer.chat_template': {why}") from None
        log.debug("%s: tokenizer with %d tokens, bos=%s eos=%s add_bos=%s stop=%s, chat template: %s", mf.path,
                  tok.vocab_size, tok.bos_id, tok.eos_id, tok.add_bos, sorted(tok.stop_ids), tok.has_chat_template)
        return tok

    @staticmethod
    def _names_a_template(mf) -> bool:
        """Whether the model file carries a chat template, by a look at where it would be (the
        tokenizer's build reads and checks it)."""
        if mf.format == "gguf":
            return bool(mf.metadata.get("tokenizer.chat_template"))
        if mf.tokenizer_json is None:
            return False
        return bool((mf.tokenizer_config or {}).get("chat_template")) or \
            (Path(mf.tokenizer_json).parent / "chat_template.jinja").is_file()

    @classmethod
    def _from_gguf(cls, path, md: Mapping[str, Any]) -> "Tokenizer":
        m = Metadata(path, md)
        if "tokenizer.ggml.model" not in m or "tokenizer.ggml.tokens" not in m:
            raise UnsupportedModelError(path, "the model file has no tokenizer (tokenizer.ggml.model / tokens missing)")
        kind = m.string("tokenizer.ggml.model")
        tokens = m.strings("tokenizer.ggml.tokens", nonempty=True)
        n = len(tokens)
        types = m.integers("tokenizer.ggml.token_type", None, lo=0, hi=_BYTE, length=n) or [_NORMAL] * n
        # id of each text (the last one of a duplicated text, as a dict built in a loop keeps)
        index = dict(zip(tokens, range(n)))
        if len(index) != n:
            log.warning("%s: tokenizer.ggml.tokens holds %d duplicate token texts", path, n - len(index))
        # the ids of control and user-defined tokens (a few dozen of 150k+), without a Python loop
        control = list(compress(range(n), map(_CONTROL.__eq__, types)))
        user = list(compress(range(n), map(_USER_DEFINED.__eq__, types)))

        bos, eos = m.token_id("tokenizer.ggml.bos_token_id", n), m.token_id("tokenizer.ggml.eos_token_id", n)
        unk, pad = m.token_id("tokenizer.ggml.unknown_token_id", n), m.token_id("tokenizer.ggml.padding_token_id", n)
        eot, eom = m.token_id("tokenizer.ggml.eot_token_id", n), m.token_id("tokenizer.ggml.eom_token_id", n)
        add_bos = m.boolean("tokenizer.ggml.add_bos_token")
        if kind == "gpt2":
            tk = cls._gguf_byte_level(path, m, tokens, index, control, user)
            add_bos = bool(add_bos)
            spm = False
        elif kind == "llama":
            tk = cls._gguf_sentencepiece(path, m, tokens, index, control, user, unk)
            # llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise
            add_bos = True if add_bos is None else add_bos
            spm = True
        else:
            raise UnsupportedModelError(path, f"tokenizer type {kind!r} is not supported (supported: gpt2, llama)")

        specials = {name: tokens[i] for name, i in
                    (("bos_token", bos), ("eos_token", eos), ("unk_token", unk), ("pad_token", pad)) if i is not None}
        stops = {i for i in (eos, eot, eom) if i is not None}
        stops |= {i for i in control if tokens[i] in _EOG_TEXTS}
        template = m.string("tokenizer.chat_template", max_len=MAX_TEMPLATE_CHARS) or None
        return cls(tk, path=str(path), vocab_size=n, bos_id=bos, eos_id=eos, add_bos=add_bos,
                   add_eos=m.boolean("tokenizer.ggml.add_eos_token", False), manual_specials=True,
                   special_tokens=specials, stop_ids=stops, chat_template=template, spm_pieces=spm,
                   max_piece_chars=max(map(len, tokens)))

    @staticmethod
    def _gguf_byte_level(path, m: Metadata, tokens: list[str], index: dict[str, int], control: list[int],
                         user: list[int]) -> HFTokenizer:
        alphabet = bytes_to_unicode()
        spelled = set(alphabet.values())
        # A token outside the byte alphabet (rare: some added tokens) is respelled byte by byte,
        # so the vocabulary the BPE model sees is all in one alphabet.
        respell = _outside_alphabet(tokens)
        if respell:
            vocab = {(t if set(t) <= spelled else "".join(alphabet[b] for b in t.encode("utf-8"))): i
                     for i, t in enumerate(tokens)}
        else:
            vocab = index
        merges_raw = m.strings("tokenizer.ggml.merges")
        if not merges_raw:
            raise ModelFormatError(path, "byte-level BPE vocabulary without tokenizer.ggml.merges")
        merges = _split_merges(merges_raw)
        if merges is None:      # some entry has no space, or more than one: the loop says which
            merges = []
            for i, mg in enumerate(merges_raw):
                a, sep, b = mg.partition(" ")
                if not sep:
                    raise m.fail("tokenizer.ggml.merges", f"entry {i} ({mg[:40]!r}) is not two tokens separated by a space")
                merges.append((a, b))
        tk = _built(m, "tokenizer.ggml.merges", "does not fit tokenizer.ggml.tokens",
                    lambda: HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False)))
        pre = m.string("tokenizer.ggml.pre") or "default"
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
        Tokenizer._add_gguf_added_tokens(m, tk, tokens, control, user, lambda t: set(t) <= spelled, vocab)
        return tk

    @staticmethod
    def _gguf_sentencepiece(path, m: Metadata, tokens: list[str], index: dict[str, int], control: list[int],
                            user: list[int], unk: int | None) -> HFTokenizer:
        arch = m.string("general.architecture", "")
        gemma = arch.startswith("gemma")
        vocab = index
        if gemma:
            # Gemma stores its runs-of-spaces pieces with real spaces; the BPE sees U+2581 instead.
            tokens = [_SPM_SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
            rank = {t: -float(i) for i, t in enumerate(tokens)}   # Gemma's merge order is file order
            vocab = {t: i for i, t in enumerate(tokens)}
        else:
            scores = m.numbers("tokenizer.ggml.scores", required=True, length=len(tokens))
            rank = {t: float(s) for t, s in zip(tokens, scores)}
        merges = _spm_merges(tokens, rank)
        tk = _built(m, "tokenizer.ggml.tokens", "does not make a SentencePiece vocabulary",
                    lambda: HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True,
                                                   unk_token=tokens[unk] if unk is not None else None)))
        if gemma:
            tk.normalizer = normalizers.Replace(" ", _SPM_SPACE)
            tk.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
            tk.decoder = decoders.Sequence([decoders.Replace(_SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
        else:
            prepend = m.boolean("tokenizer.ggml.add_space_prefix", True)
            tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement=_SPM_SPACE, prepend_scheme="first" if prepend else "never",
                                                        split=False)
            steps = [decoders.Replace(_SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
            if prepend:
                steps.append(decoders.Strip(" ", 1, 0))
            tk.decoder = decoders.Sequence(steps)
        Tokenizer._add_gguf_added_tokens(m, tk, tokens, control, user, lambda t: True, vocab)
        return tk

    @staticmethod
    def _add_gguf_added_tokens(m: Metadata, tk: HFTokenizer, tokens, control: list[int], user: list[int],
                               may_be_special, vocab) -> None:
        """Control tokens (like <|im_start|>) become special added tokens and user-defined ones
        (like <tool_call>) plain added tokens: both are then matched whole in the text.
        control / user: the ids of those token types."""
        specials = [AddedToken(t, normalized=False, special=True)
                    for t in (tokens[i] for i in control) if t and may_be_special(t)]
        if specials:
            _built(m, "tokenizer.ggml.token_type", "marks control tokens the vocabulary cannot hold",
                   lambda: tk.add_special_tokens(specials))
        plain_added = [AddedToken(t, normalized=False, special=False)
                       for t in (tokens[i] for i in user) if t and t in vocab]
        if plain_added:
            _built(m, "tokenizer.ggml.token_type", "marks user-defined tokens the vocabulary cannot hold",
                   lambda: tk.add_tokens(plain_added))

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

        n = tk.get_vocab_size(with_added_tokens=True)
        m = Metadata(path, md)
        specials = {k: s for k in ("bos_token", "eos_token", "unk_token", "pad_token")
                    if (s := token_str(cfg.get(k))) is not None}
        bos = tk.token_to_id(specials["bos_token"]) if "bos_token" in specials else None
        eos = tk.token_to_id(specials["eos_token"]) if "eos_token" in specials else None
        # else the ids config.json / generation_config.json gave (the loader puts them in metadata)
        bos = bos if bos is not None else m.token_id("tokenizer.ggml.bos_token_id", n)
        eos = eos if eos is not None else m.token_id("tokenizer.ggml.eos_token_id", n)
        for name, i in (("bos_token", bos), ("eos_token", eos)):
            if i is not None and name not in specials and tk.id_to_token(i) is not None:
                specials[name] = tk.id_to_token(i)
        stops = {eos} if eos is not None else set()
        stops |= {i for i, t in tk.get_added_tokens_decoder().items() if t.special and t.content in _EOG_TEXTS}
        # generation_config.json lists the ids the model was trained to stop on
        gen = Path(tokenizer_json).parent / "generation_config.json"
        if gen.is_file():
            try:
                ids = json.loads(gen.read_text()).get("eos_token_id")
                ids = ids if isinstance(ids, list) else [ids] if ids is not None else []
                for i in ids:
                    if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n:
                        raise ModelFormatError(gen, f"eos_token_id holds {i!r}, not a token id of the "
                                                    f"vocabulary of {n}")
                stops |= set(ids)
            except (ValueError, OSError, AttributeError) as e:
                log.warning("%s: unreadable generation_config.json: %s", path, e)
        template = cfg.get("chat_template")
        if isinstance(template, list):   # named templates: [{"name": ..., "template": ...}]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        jinja_file = Path(tokenizer_json).parent / "chat_template.jinja"
        if not template and jinja_file.is_file():
            template = jinja_file.read_text()
        if template is not None and not isinstance(template, str) or template and len(template) > MAX_TEMPLATE_CHARS:
            raise ModelFormatError(path, f"chat_template should be a string of at most {MAX_TEMPLATE_CHARS} "
                                         f"characters, got {type(template).__name__}")
        return cls(tk, path=str(path), vocab_size=n, bos_id=bos, eos_id=eos,
                   add_bos=bool(cfg.get("add_bos_token", False)), add_eos=bool(cfg.get("add_eos_token", False)),
                   manual_specials=False, special_tokens=specials, stop_ids=stops,
                   chat_template=template or None, spm_pieces=False,
                   max_piece_chars=max(map(len, tk.get_vocab(with_added_tokens=True)), default=1))

    # ------------------------------------------------------------------ text <-> ids
    def encode(self, text: str, add_special_tokens: bool = True, limit: int | None = None) -> list[int]:
        """Token ids of `text`. With `limit`, a text of more than `limit` tokens raises
        ContextOverflowError, before the ids are built (the cheap bound on the characters a token
        can cover refuses a huge text without tokenizing it). The work runs with the GIL released,
        so other threads (the event loop) keep running during a long text."""
        if limit is not None and len(text) > self._max_piece_chars * _NORMALIZE_SLACK * (limit + 2):
            raise ContextOverflowError(f"the prompt ({len(text)} characters) is far beyond this server's "
                                       f"context of {limit} tokens", param="prompt")
        specials = add_special_tokens and not self._manual_specials
        try:
            enc = self._tk.encode_batch([text], add_special_tokens=specials)[0]
        except TypeError:     # the Rust side refuses text that is not valid Unicode
            if isinstance(text, str) and _has_surrogate(text):
                raise RequestError("the text holds a lone UTF-16 surrogate (not valid Unicode)",
                                   param="prompt", code="invalid_unicode") from None
            raise
        extra = 0
        if add_special_tokens and self._manual_specials:
            extra = int(self.add_bos and self.bos_id is not None) + int(self.add_eos and self.eos_id is not None)
        if limit is not None and len(enc) + extra > limit:
            raise ContextOverflowError(f"the prompt has {len(enc) + extra} tokens; this server's context is "
                                       f"{limit} tokens", param="prompt")
        ids = enc.ids
        if add_special_tokens and self._manual_specials:
            if self.add_bos and self.bos_id is not None:
                ids.insert(0, self.bos_id)
            if self.add_eos and self.eos_id is not None:
                ids.append(self.eos_id)
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if skip_special_tokens and self._skipped_ids is not self._special_ids:
            # some special tokens are shown (harmony's markers): drop the others here
            return self._tk.decode([int(i) for i in ids if int(i) not in self._skipped_ids],
                                   skip_special_tokens=False)
        return self._tk.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def decode_one(self, id: int, skip_special_tokens: bool = True) -> str:
        """decode([id]), remembered (at most one string per vocabulary entry)."""
        seen = self._one[bool(skip_special_tokens)]
        text = seen.get(id)
        if text is None:
            text = seen[id] = self.decode([int(id)], skip_special_tokens=skip_special_tokens)
        return text

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

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            continue_final_message: bool = False, **kwargs) -> str:
        """The prompt string transformers' `apply_chat_template(messages, tokenize=False, ...)` renders.
        Extra keyword arguments (tools, documents, enable_thinking, ...) are visible to the template.
        continue_final_message: the prompt ends where the final message's content ends (no end of
        turn after it), so the model goes on writing that message, as transformers cuts it.
        It renders in a worker process within the limits (chat_template.py); a template that fails
        or exceeds a limit on these messages is a RequestError (400) for this request."""
        if not self.chat_template:
            raise UnsupportedModelError(self._path, "the model has no chat template (tokenizer.chat_template); "
                                                    "use the completions endpoint with a plain prompt")
        if not isinstance(messages, (list, tuple)) or not messages:
            raise RequestError("messages must be a non-empty list", param="messages")
        chat = []
        for m in messages:
            if not isinstance(m, Mapping):
                raise RequestError(f"every message must be an object, got {type(m).__name__}", param="messages")
            # A None value (OpenAI's content=None, tool_calls=None) is dropped, as transformers does.
            chat.append(alias_reasoning(_tool_call_arguments(plain({k: v for k, v in m.items() if v is not None}))))
        context = {**self.special_tokens, **plain(kwargs), "messages": chat, "tools": plain(kwargs.get("tools")),
                   "documents": plain(kwargs.get("documents")), "add_generation_prompt": add_generation_prompt}
        if self._renderer is None:
            self._renderer = renderer(TemplateLimits.from_settings(Settings()))
        try:
            text = self._renderer.render(self.chat_template, context)
        except ChatTemplateError as e:
            if e.kind == "unavailable":
                raise CapacityError(f"chat templates cannot be rendered now: {e.message}", retry_after_s=5) from None
            if e.kind == "syntax":
                raise UnsupportedModelError(self._path, e.message) from None
            code = "chat_template_limit" if e.kind == "limit" else "chat_template_error"
            raise RequestError(f"{e.message} (with these messages)", param="messages", code=code) from None
        return _continued(text, chat[-1]) if continue_final_message else text


def _built(m: Metadata, key: str, problem: str, build):
    """Run a `tokenizers` constructor on metadata-derived input; its refusals (plain Exception, or
    a Rust panic, a BaseException) become ModelFormatError naming the key."""
    try:
        return build()
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:
        raise m.fail(key, f"{problem}: {str(e)[:200]}") from None


def _has_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _continued(text: str, final: dict) -> str:
    """The rendered chat cut right after the final message's content (transformers' rule: where
    the template kept the content's spacing, after it exactly; else after its stripped text)."""
    content = final.get("content")
    if isinstance(content, list):       # text parts: the last one is what continues
        content = next((p.get("text") for p in reversed(content) if isinstance(p, dict) and "text" in p), None)
    if not isinstance(content, str) or not content.strip() or content.strip() not in text:
        raise RequestError("continue_final_message: the final message's content does not appear in the "
                           "rendered chat (empty, or changed by the chat template)", param="continue_final_message")
    at = text.rindex(content.strip())
    if text[at:at + len(content.lstrip())] == content.lstrip():
        return text[:at + len(content.lstrip())]
    return text[:at + len(content.strip())]


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
        if end - start == 1:
            return self._tok.decode_one(self._ids[start], self._skip)
        return self._tok.decode(self._ids[start:end], skip_special_tokens=self._skip) if end > start else ""

    def add(self, token_id: int) -> str:
        token_id = int(token_id)
        self._ids.append(token_id)
        if not (self._skip and token_id in self._tok._skipped_ids):   # a skipped token does not end a run
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
