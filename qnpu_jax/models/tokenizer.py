"""Tokenizer: a thin, typed wrapper over a Hugging Face `tokenizers` BPE tokenizer."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from qnpu_jax.errors import QnpuError

# GGUF token types (llama.cpp's llama_token_type): 3 = control, 4 = user-defined.
_GGUF_SPECIAL_TYPES = (3, 4)
_GGUF_CONTROL, _GGUF_USER_DEFINED = 3, 4
# SentencePiece's word boundary, which Gemma's vocabulary spells spaces with
_SPM_SPACE = "\u2581"
# Architectures whose SentencePiece ("llama") GGUF vocabulary is Gemma's
_GEMMA_VOCABS = ("gemma3",)


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
    architecture: str = "llama",
    model: str,
    pre: str,
    tokens: Sequence[str],
    merges: Sequence[str],
    token_types: Sequence[int],
    bos_token_id: int | None,
    eos_token_id: int | None,
    add_bos: bool = False,
) -> Tokenizer:
    """Rebuild a byte-level BPE tokenizer from the `tokenizer.ggml.*` fields of a GGUF file
    (Gemma's SentencePiece vocabulary: `gemma_tokenizer`)."""
    if model == "llama" and architecture in _GEMMA_VOCABS:
        return gemma_tokenizer(
            tokens=tokens,
            token_types=token_types,
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            add_bos=add_bos,
        )
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


def order_merges(vocab: dict[str, int]) -> list[tuple[str, str]]:
    """The BPE merges a vocabulary without merges implies, best first: every split of a token
    into two tokens of the vocabulary, ranked by the token's position in the file (earlier
    first), then by the pieces' lengths (longer first). transformers' `generate_merges` with
    scores −position, which is what its GGUF loader builds for Gemma."""
    merges: list[tuple[str, str, int]] = []
    for merge, index in vocab.items():
        local = [
            (merge[:i], merge[i:], index)
            for i in range(1, len(merge))
            if merge[:i] in vocab and merge[i:] in vocab
        ]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        merges.extend(local)
    # generate_merges sorts (−index, len, len) descending, stably: the same order as this
    merges.sort(key=lambda m: (-m[2], len(m[0]), len(m[1])), reverse=True)
    return [(a, b) for a, b, _ in merges]


def gemma_tokenizer(
    *,
    tokens: Sequence[str],
    token_types: Sequence[int],
    bos_token_id: int | None,
    eos_token_id: int | None,
    add_bos: bool,
    unk_token: str = "<unk>",
) -> Tokenizer:
    """Gemma's tokenizer from a GGUF vocabulary (SentencePiece BPE, no merges stored), built
    as transformers' GGUF loader builds it (`GemmaTokenizer`): all-space tokens respelled as
    "▁"·n, merges from the file order (`order_merges`), byte fallback, spaces normalized to
    "▁"; control tokens special, user-defined ones matched whole."""
    respelled = [_SPM_SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {tok: i for i, tok in enumerate(respelled)}
    if unk_token not in vocab:
        raise QnpuError(f"GGUF Gemma vocabulary has no {unk_token!r} token")
    try:
        backend = HFTokenizer(
            models.BPE(
                vocab=vocab,
                merges=order_merges(vocab),
                fuse_unk=True,
                unk_token=unk_token,
                byte_fallback=True,
            )
        )
    except Exception as e:  # tokenizers raises a bare Exception for an inconsistent vocab
        raise QnpuError(f"invalid GGUF tokenizer vocabulary: {e}") from e
    backend.normalizer = normalizers.Replace(" ", _SPM_SPACE)
    backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    backend.decoder = decoders.Sequence(
        [decoders.Replace(_SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    # the special tokens transformers' tokenizer knows by role, then the control tokens
    special_ids = [vocab[unk_token], *(i for i in (bos_token_id, eos_token_id) if i is not None)]
    special_ids += [i for i, kind in enumerate(token_types) if kind == _GGUF_CONTROL]
    backend.add_special_tokens(
        [
            AddedToken(tokens[i], special=True, normalized=False)
            for i in dict.fromkeys(special_ids)
            if i < len(tokens)
        ]
    )
    backend.add_tokens(
        [
            AddedToken(tokens[i], special=False, normalized=False)
            for i, kind in enumerate(token_types)
            if kind == _GGUF_USER_DEFINED and tokens[i] in vocab
        ]
    )
    return Tokenizer(backend, bos_token_id, eos_token_id, add_bos)
