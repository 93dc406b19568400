"""A small real Hugging Face tokenizer, built offline, laid out as a model snapshot.

``build_snapshot(dir)`` trains a byte-level BPE (the ``tokenizers`` package, as GPT-2,
Llama 3 and Qwen ship) on a fixed corpus, with Llama-3 special tokens and a
post-processor that puts ``<|begin_of_text|>`` first, and writes ``tokenizer.json`` plus
a ``tokenizer_config.json`` whose ``chat_template`` is Llama 3's shape (tools in the
system turn as ``tojson``). Tests and benchmarks of the router's real-model path use it
where no model can be downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["CHAT_TEMPLATE", "SPECIALS", "build_snapshot"]

SPECIALS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
]

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|start_header_id|>system<|end_header_id|>\n\n"
    "{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|eot_id|>{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}{% endif %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{{ message['content'] | trim }}<|eot_id|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)

_CORPUS = (
    "the cache keeps every prefix warm and the router sends each request where its "
    "prefix already is; documents, questions, answers and code: def main(): return 42 "
    "while the engines publish which blocks they store and which they evict. "
)


def build_snapshot(root: Path, vocab_size: int = 600) -> Path:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` under ``root``; return it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 50, trainer=trainer)
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A",
        pair="<|begin_of_text|> $A $B",
        special_tokens=[("<|begin_of_text|>", bos)],
    )
    root.mkdir(parents=True, exist_ok=True)
    tok.save(str(root / "tokenizer.json"))
    cfg = {
        "bos_token": "<|begin_of_text|>",
        "eos_token": {"content": "<|eot_id|>", "special": True},
        "chat_template": CHAT_TEMPLATE,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (root / "tokenizer_config.json").write_text(json.dumps(cfg), encoding="utf-8")
    return root
