"""Real models' prompt handling for the router's KV index: ``tokenizer.json`` + chat template.

The precise KV index (router/kvprecise.py) hashes a prompt's token blocks as the engine
does, so it must see the engine's tokens. For a real model that means:

* **Tokenizer.** ``tokenizer.json`` from the model's snapshot (the node store holds it),
  through the ``tokenizers`` package, the same Rust code transformers' fast tokenizers
  (and so vLLM) run.
* **Chat template.** ``chat_template`` from ``tokenizer_config.json`` (a string, or a
  list of ``{name, template}``: the one named ``default``), or ``chat_template.jinja``
  beside it, rendered as transformers' ``apply_chat_template`` does: a sandboxed jinja2
  environment with ``trim_blocks``, ``lstrip_blocks`` and loop controls, the ``tojson``
  filter, ``raise_exception`` and ``strftime_now``; variables ``messages``, ``tools``,
  ``add_generation_prompt=True`` and the special tokens (``bos_token``, ...).
* **Special tokens.** As vLLM's OpenAI server: a chat prompt is tokenized with
  ``add_special_tokens=False`` (the template writes them); a completions prompt with
  ``add_special_tokens=True`` (what the tokenizer's post-processor puts first, e.g.
  Llama's ``<|begin_of_text|>``, is the codec's lead; a post-processor that appends
  tokens is not supported: such prompts are hashed without them).

A template that fails on a request (``raise_exception``, a missing variable) makes the
request unhashable: the policy uses the learned index for it. Chunked tokenization
(router/kvprompt.py) is used only when the tokenizer passes ``check_chunking``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

from preheat.errors import ConfigError
from preheat.router.kvprompt import _completion_prompt, check_chunking

__all__ = ["HFCodec", "load_codec"]


def _token_text(v: Any) -> str | None:
    if isinstance(v, str):
        return v
    if isinstance(v, Mapping) and isinstance(v.get("content"), str):
        return v["content"]
    return None


def _template_of(cfg: Mapping[str, Any], root: Path) -> str | None:
    t = cfg.get("chat_template")
    if isinstance(t, list):
        named = {d.get("name"): d.get("template") for d in t if isinstance(d, Mapping)}
        t = named.get("default")
    if isinstance(t, str):
        return t
    f = root / "chat_template.jinja"
    return f.read_text(encoding="utf-8") if f.is_file() else None


class HFCodec:
    """A model's ``tokenizer.json`` and chat template (see the module header)."""

    def __init__(
        self, tokenizer_json: Path, config: Mapping[str, Any], template: str | None
    ) -> None:
        from tokenizers import Tokenizer

        try:
            self._tok = Tokenizer.from_file(str(tokenizer_json))
        except Exception as exc:  # the Rust side raises a bare Exception
            raise ConfigError(
                f"kv_events tokenizer {tokenizer_json}: not a readable tokenizer.json ({exc})"
            ) from exc
        self.name = f"hf:{tokenizer_json.resolve()}"
        self.specials = {
            k: s
            for k, v in config.items()
            if k.endswith("_token") and (s := _token_text(v)) is not None
        }
        with_special = self._tok.encode("x", add_special_tokens=True).ids
        plain = self._tok.encode("x", add_special_tokens=False).ids
        i = with_special.index(plain[0]) if plain and plain[0] in with_special else 0
        self.lead = tuple(with_special[:i])
        self._template = self._compile(template) if template else None
        self.chunking = check_chunking(self)

    @staticmethod
    def _compile(source: str) -> Any:
        from jinja2 import TemplateError
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        def tojson(
            x: Any,
            ensure_ascii: bool = False,
            indent: Any = None,
            separators: Any = None,
            sort_keys: bool = False,
        ) -> str:
            return json.dumps(
                x,
                ensure_ascii=ensure_ascii,
                indent=indent,
                separators=separators,
                sort_keys=sort_keys,
            )

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
        )
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            return env.from_string(source)
        except TemplateError as exc:
            raise ConfigError(
                f"kv_events tokenizer: the chat template does not compile ({exc})"
            ) from exc

    def render(self, messages: Any, tools: Any = None) -> str | None:
        """The chat prompt text (None: no template, or the template refused the request)."""
        if self._template is None or not isinstance(messages, list) or not messages:
            return None
        from jinja2 import TemplateError

        try:
            return str(
                self._template.render(
                    messages=messages, tools=tools, add_generation_prompt=True, **self.specials
                )
            )
        except (TemplateError, TypeError, ValueError, KeyError, AttributeError):
            return None

    def prompt(self, body: Mapping[str, Any]) -> tuple[tuple[int, ...], str] | list[int] | None:
        msgs = body.get("messages")
        if msgs is not None:
            text = self.render(msgs, body.get("tools"))
            return ((), text) if text is not None else None
        return _completion_prompt(body.get("prompt"), self.lead)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)


def load_codec(path: str | Path) -> HFCodec:
    """The codec of a model snapshot directory (or its ``tokenizer.json``)."""
    p = Path(path)
    f = p / "tokenizer.json" if p.is_dir() else p
    if not f.is_file():
        raise ConfigError(
            f"kv_events tokenizer {str(path)!r}: no tokenizer.json there; give the model's "
            "snapshot directory (as the node store lays it out) or the tokenizer.json path, "
            "or tokenizer: engine for the simulated engine"
        )
    cfg_file = f.parent / "tokenizer_config.json"
    cfg: dict[str, Any] = {}
    if cfg_file.is_file():
        try:
            cfg = json.loads(cfg_file.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ConfigError(f"kv_events tokenizer: {cfg_file} is not JSON ({exc})") from exc
    return HFCodec(f, cfg, _template_of(cfg, f.parent))
