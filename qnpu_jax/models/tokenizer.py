"""Tokenizer: a thin, typed wrapper over a Hugging Face `tokenizers` BPE tokenizer."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from qnpu_jax.errors import QnpuError

# GGUF token types (llama.cpp's llama_token_type): 3 = control, 4 = user-defined.
_GGUF_SPECIAL_TYPES = (3, 4)


@dataclasses.dataclass(frozen=True)
class Tokenizer:
    backend: HFTokenizer
    bos_token_id: int | None
    eos_token_id: int | None
    add_bos: bool = False  # whether the model expects BOS before a prompt (generation)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_bos: bool = False) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_bos:
            if self.bos_token_id is None:
                raise QnpuError("this tokenizer has no BOS token")
            ids = [self.bos_token_id, *ids]
        return ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self.backend.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=False)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def save(self, directory: Path) -> None:
        """Write tokenizer.json + tokenizer_config.json as `save_pretrained` lays them out."""
        self.backend.save(str(directory / "tokenizer.json"))
        config: dict[str, Any] = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "clean_up_tokenization_spaces": False,
            "add_bos_token": self.add_bos,
        }
        for name, idx in (("bos_token", self.bos_token_id), ("eos_token", self.eos_token_id)):
            if idx is not None:
                config[name] = self.backend.id_to_token(idx)
        (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def tokenizer_from_file(
    path: Path, bos_token_id: int | None, eos_token_id: int | None
) -> Tokenizer:
    try:
        backend = HFTokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception on bad JSON
        raise QnpuError(f"cannot read tokenizer {path}: {e}") from e
    return Tokenizer(backend, bos_token_id, eos_token_id)


def tokenizer_from_gguf_vocab(
    *,
    model: str,
    pre: str,
    tokens: Sequence[str],
    merges: Sequence[str],
    token_types: Sequence[int],
    bos_token_id: int | None,
    eos_token_id: int | None,
    add_bos: bool = False,
) -> Tokenizer:
    """Rebuild a byte-level BPE tokenizer from the `tokenizer.ggml.*` fields of a GGUF file."""
    if model != "gpt2":
        raise QnpuError(
            f"GGUF tokenizer model {model!r} is not supported (only byte-level BPE, 'gpt2'); "
            "load the model's Hugging Face directory instead"
        )
    # ByteLevel's own regex is GPT-2's split, which llama.cpp applies for both of these.
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    pre_tok: pre_tokenizers.PreTokenizer
    if pre == "smollm":
        # llama.cpp splits every digit on its own before the GPT-2 regex.
        pre_tok = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    elif pre in ("gpt2", "default"):
        pre_tok = byte_level
    else:
        raise QnpuError(
            f"GGUF pre-tokenizer {pre!r} is not supported (supported: smollm, gpt2); "
            "load the model's Hugging Face directory instead"
        )
    vocab = {tok: i for i, tok in enumerate(tokens)}
    pairs = [(a, b) for a, _, b in (m.partition(" ") for m in merges)]
    try:
        backend = HFTokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))
    except Exception as e:  # tokenizers raises a bare Exception for an inconsistent vocab
        raise QnpuError(f"invalid GGUF tokenizer vocabulary: {e}") from e
    backend.pre_tokenizer = pre_tok
    backend.decoder = decoders.ByteLevel()
    special = [
        AddedToken(tokens[i], special=True, normalized=False)
        for i, kind in enumerate(token_types)
        if kind in _GGUF_SPECIAL_TYPES
    ]
    backend.add_special_tokens(special)
    return Tokenizer(backend, bos_token_id, eos_token_id, add_bos)
