"""The engine's pure core: tokenizer, chat template and the continuous-batching scheduler."""
