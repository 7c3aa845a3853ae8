"""Tokenizer layer: HF / GGUF tokenizers, chat templates, streaming detokenization, stop strings."""

from mlxserve.tokenizer.chat_template import ChatTemplate
from mlxserve.tokenizer.detokenizer import IncrementalDetokenizer, StopChecker, TextStream
from mlxserve.tokenizer.tokenizer import Tokenizer

__all__ = [
    "ChatTemplate",
    "IncrementalDetokenizer",
    "StopChecker",
    "TextStream",
    "Tokenizer",
]
