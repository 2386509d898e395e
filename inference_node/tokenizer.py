"""Text in and out: the checkpoint's tokenizer.json (HF `tokenizers`) and its chat template,
rendered as transformers' apply_chat_template renders it: the same sandboxed Jinja
environment (loop controls, the `generation` tag, `tojson` without HTML escapes,
`raise_exception`, `strftime_now`, `namespace`), the same variables (the messages, `tools`
and `documents` as None, the tokenizer's named special tokens), so every family's template
(Qwen's tool branches, Gemma's role checks, ...) gives the prompt its model was trained on."""
from __future__ import annotations

import json
import re
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Sequence

import jinja2.ext
import jinja2.nodes
from jinja2.exceptions import SecurityError, TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace
from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

# The named special tokens transformers hands a chat template (its special_tokens_map).
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")   # a byte-fallback token of a SentencePiece vocabulary


def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level map from a vocabulary's characters back to bytes: printable bytes
    stand for themselves, the others for the characters from U+0100 on, in byte order."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return table


class ChatTemplateError(ValueError):
    """The messages could not be rendered with the model's chat template."""


class TextCodec:
    def __init__(self, path: Path) -> None:
        self.tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        decoder = json.loads((path / "tokenizer.json").read_text()).get("decoder") or {}
        self._byte_level = byte_level_alphabet() if decoder.get("type") == "ByteLevel" else None
        self._token_bytes: dict[int, bytes] = {}
        config_path = path / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.exists() else {}
        self.special_tokens = {k: t for k in SPECIAL_TOKENS if (t := _token_text(config.get(k))) is not None}
        self.bos_token = self.special_tokens.get("bos_token")
        self.eos_token = self.special_tokens.get("eos_token")
        template = config.get("chat_template")
        jinja_path = path / "chat_template.jinja"
        if jinja_path.exists():
            template = jinja_path.read_text()
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        self.chat_template: str | None = template
        self._template = None
        if template:
            self._template = _environment().from_string(template)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for in the text (a token may hold part of a character):
        exact for byte-level vocabularies and SentencePiece byte pieces; a special token's
        bytes are its name's."""
        known = self._token_bytes.get(token_id)
        if known is not None:
            return known
        piece = self.tokenizer.id_to_token(token_id) or ""
        alphabet = self._byte_level
        if alphabet is not None and all(c in alphabet for c in piece):
            data = bytes(alphabet[c] for c in piece)
        elif (match := BYTE_PIECE.fullmatch(piece)) is not None:
            data = bytes([int(match.group(1), 16)])
        else:
            data = piece.replace("\u2581", " ").encode()   # SentencePiece's word-start mark
        self._token_bytes[token_id] = data
        return data

    def step_decoder(self) -> Callable[[int], str | None]:
        """An incremental decoder for one output: fed token by token, it returns the text each
        token completes (None while a character is incomplete), so that the pieces join into
        decode(all tokens)."""
        stream, tokenizer = DecodeStream(skip_special_tokens=True), self.tokenizer
        return lambda token_id: stream.step(tokenizer, token_id)

    def render_chat(self, messages: Sequence[dict[str, str]]) -> str:
        if self._template is None:
            raise ChatTemplateError("this model has no chat template; send a raw prompt instead")
        try:
            return self._template.render(messages=[dict(m) for m in messages], tools=None, documents=None,
                                         add_generation_prompt=True, **self.special_tokens)
        except TemplateError as exc:
            raise ChatTemplateError(f"chat template failed: {exc}") from exc

    def encode_chat(self, messages: Sequence[dict[str, str]]) -> list[int]:
        # The rendered template already holds its special tokens (as HF apply_chat_template).
        return self.encode(self.render_chat(messages), add_special_tokens=False)


def _token_text(token: object) -> str | None:
    if isinstance(token, dict):
        return token.get("content")
    return token if isinstance(token, str) else None


def _raise(message: str) -> None:
    raise TemplateError(message)


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (assistant spans for training masks): rendered
    as its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Callable[[], str]) -> str:
        return caller()


class _Namespace(Namespace):
    """`namespace(...)` refusing underscore attributes (no path to the interpreter's internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"chat templates cannot store underscore attributes on a namespace ({name!r})")


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["dict"] = lambda *args, **kwargs: dict(*args, **kwargs)
    env.globals["namespace"] = _Namespace
    return env
