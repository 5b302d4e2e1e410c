"""Tokenizers for `dataset_type=tfds`, chosen by `tokenizer_path`.

  null              built-in byte-level: pad 0, BOS 1, EOS 2, byte b -> b + 3 (259 ids, no file needed)
  *.model           SentencePiece (its own BOS/EOS/pad ids)
  *.json            Hugging Face `tokenizers` tokenizer.json (BOS/EOS: the first of the usual special-token
                    names it knows, e.g. <s> / </s>, <|endoftext|>)

Each has `encode(text) -> int32 ids` (no BOS/EOS: the packer adds them per add_bos/add_eos), `bos_id`,
`eos_id`, `pad_id` (None when the tokenizer has no such token) and `vocab_size`.
"""

from __future__ import annotations

import os

import numpy as np

from MaxText.config.errors import ConfigError, clip

BOS_NAMES = ("<s>", "<bos>", "<|begin_of_text|>", "<|startoftext|>", "[BOS]", "<|endoftext|>")
EOS_NAMES = ("</s>", "<eos>", "<|end_of_text|>", "<|endoftext|>", "[EOS]")
PAD_NAMES = ("<pad>", "[PAD]", "<|pad|>", "<|padding|>")


class ByteTokenizer:
    """UTF-8 bytes shifted past three special ids: lossless for any text, vocabulary 259."""

    pad_id, bos_id, eos_id, vocab_size = 0, 1, 2, 259
    OFFSET = 3

    def encode_bytes(self, data: bytes) -> np.ndarray:
        return np.frombuffer(data, np.uint8).astype(np.int32) + self.OFFSET

    def encode(self, text: str) -> np.ndarray:
        return self.encode_bytes(text.encode("utf-8"))

    def decode(self, ids) -> str:
        """The text of `ids`, special ids dropped."""
        ids = np.asarray(ids)
        return bytes((ids[ids >= self.OFFSET] - self.OFFSET).astype(np.uint8)).decode("utf-8", errors="replace")


class SentencePieceTokenizer:
    """A SentencePiece `.model` file."""

    def __init__(self, path: str):
        import sentencepiece

        self.sp = sentencepiece.SentencePieceProcessor(model_file=path)
        self.vocab_size = self.sp.get_piece_size()
        # SentencePiece reports a disabled special id as -1.
        self.bos_id, self.eos_id, self.pad_id = (i if i >= 0 else None
                                                 for i in (self.sp.bos_id(), self.sp.eos_id(), self.sp.pad_id()))

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.sp.encode(text), np.int32)

    def decode(self, ids) -> str:
        return self.sp.decode([int(i) for i in ids])


class HuggingFaceTokenizer:
    """A Hugging Face `tokenizers` tokenizer.json file."""

    def __init__(self, path: str):
        import tokenizers

        self.tok = tokenizers.Tokenizer.from_file(path)
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        self.bos_id, self.eos_id, self.pad_id = (self._first_known(names)
                                                 for names in (BOS_NAMES, EOS_NAMES, PAD_NAMES))

    def _first_known(self, names) -> int | None:
        for name in names:
            if (i := self.tok.token_to_id(name)) is not None:
                return i
        return None

    def encode(self, text: str) -> np.ndarray:
        # add_special_tokens=False: a post-processor's own BOS/EOS would double the packer's.
        return np.asarray(self.tok.encode(text, add_special_tokens=False).ids, np.int32)

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids])


def load_tokenizer(cfg):
    """The tokenizer of cfg.tokenizer_path, checked against cfg.vocab_size and cfg.add_bos/add_eos."""
    path = cfg.tokenizer_path
    if path is None:
        tokenizer, name = ByteTokenizer(), "tokenizer_path=null (byte-level)"
    else:
        name = f"tokenizer_path={path}"
        if not os.path.isfile(path):
            raise ConfigError(f"{name} does not exist; point it at a SentencePiece .model or a Hugging Face "
                              f"tokenizer.json file, or set tokenizer_path=null for the byte-level tokenizer")
        if not path.endswith((".model", ".json")):
            raise ConfigError(f"{name}: unknown tokenizer format; use a SentencePiece .model, a Hugging Face "
                              f"tokenizer .json, or null for the byte-level tokenizer")
        kind = SentencePieceTokenizer if path.endswith(".model") else HuggingFaceTokenizer
        try:
            tokenizer = kind(path)
        except Exception as e:  # noqa: BLE001 - sentencepiece and tokenizers raise their own types, or OSError
            reason = " ".join(str(e).split()) or type(e).__name__
            raise ConfigError(f"{name} is not a {'SentencePiece' if kind is SentencePieceTokenizer else 'Hugging Face'}"
                              f" tokenizer file ({clip(reason, 160)}); point tokenizer_path at the model's "
                              "tokenizer") from None
    if tokenizer.vocab_size > cfg.vocab_size:
        raise ConfigError(f"vocab_size={cfg.vocab_size} is smaller than the {tokenizer.vocab_size} ids of {name}; "
                          f"set vocab_size >= {tokenizer.vocab_size}")
    for key, token, names in (("add_bos", "bos_id", BOS_NAMES), ("add_eos", "eos_id", EOS_NAMES)):
        if cfg[key] and getattr(tokenizer, token) is None:
            looked = f" (none of {', '.join(names)})" if isinstance(tokenizer, HuggingFaceTokenizer) else ""
            raise ConfigError(f"{key}=true but {name} has no {token[:3].upper()} token{looked}; set {key}=false "
                              f"or use a tokenizer that has one")
    return tokenizer
