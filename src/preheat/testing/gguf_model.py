"""Write a tiny Llama GGUF with random weights and a locally trained byte-level BPE tokenizer.

Real ``llama-server`` loads it like any model, so tests can exercise its HTTP API, prompt
cache and metrics in seconds on a CPU, with no download::

    path = write_tiny_llama_gguf(tmp_path / "tiny.gguf")

The tokenizer is trained with Hugging Face ``tokenizers`` on a built-in English corpus
(GPT-2 byte-level BPE, written as ``tokenizer.ggml.model = "gpt2"``); the weights are
seeded so the file is the same every time.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["write_tiny_llama_gguf"]

_CORPUS = (
    "The model cache keeps weights on each node's local disk before a replica needs them. "
    "Prefix-aware routing sends requests that share a prompt prefix to the instance that "
    "already holds it in its key-value cache, without overloading one instance. "
    "Every replica start is recorded stage by stage with cache hit and miss labels. "
    "A simulator answers what a fleet would do at scales no single machine can run. "
    "The quick brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs. "
    "0123456789 + - * / = ( ) [ ] { } < > , . ; : ! ? ' \" # $ % & @ ^ _ ` | ~ \n\t"
)
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def write_tiny_llama_gguf(
    path: Path,
    *,
    vocab_size: int = 512,
    n_embd: int = 64,
    n_layer: int = 2,
    n_head: int = 4,
    n_head_kv: int = 2,
    n_ff: int = 128,
    context_length: int = 4096,
    seed: int = 0,
) -> Path:
    """Write the model to ``path`` (atomically) and return it."""
    import gguf
    import numpy as np
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    vocab = tok.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    if [vocab[t] for t in tokens] != list(range(len(tokens))):
        raise RuntimeError("trained vocabulary ids are not contiguous")
    import json

    merges_raw = json.loads(tok.to_str())["model"]["merges"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in merges_raw]
    n_vocab = len(tokens)
    types = [gguf.TokenType.CONTROL if t in SPECIALS else gguf.TokenType.NORMAL for t in tokens]

    rng = np.random.default_rng(seed)
    head_dim = n_embd // n_head

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    writer = gguf.GGUFWriter(str(tmp), "llama")
    writer.add_name("preheat-tiny-llama")
    writer.add_context_length(context_length)
    writer.add_embedding_length(n_embd)
    writer.add_block_count(n_layer)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head_kv)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(vocab["<|endoftext|>"])
    writer.add_eos_token_id(vocab["<|im_end|>"])
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML)

    writer.add_tensor("token_embd.weight", w(n_vocab, n_embd))
    writer.add_tensor("output_norm.weight", np.ones(n_embd, dtype=np.float32))
    writer.add_tensor("output.weight", w(n_vocab, n_embd))
    for i in range(n_layer):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(n_embd, dtype=np.float32))
        writer.add_tensor(f"blk.{i}.attn_q.weight", w(n_embd, n_embd))
        writer.add_tensor(f"blk.{i}.attn_k.weight", w(n_head_kv * head_dim, n_embd))
        writer.add_tensor(f"blk.{i}.attn_v.weight", w(n_head_kv * head_dim, n_embd))
        writer.add_tensor(f"blk.{i}.attn_output.weight", w(n_embd, n_embd))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(n_embd, dtype=np.float32))
        writer.add_tensor(f"blk.{i}.ffn_gate.weight", w(n_ff, n_embd))
        writer.add_tensor(f"blk.{i}.ffn_up.weight", w(n_ff, n_embd))
        writer.add_tensor(f"blk.{i}.ffn_down.weight", w(n_embd, n_ff))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(path)
    return path
