"""Packing shared by the document pipelines (tfds, grain, hf): a per-process stream of documents becomes
rows of exactly max_target_length tokens, and the stream's position is a small JSON-able state.

Packing. A document of tokens t becomes the sequence s = [BOS] + t + [EOS] (BOS only with add_bos, EOS only
with add_eos) and the (input, target) pairs (s[i], s[i+1]): with both, inputs = [BOS] + t and targets =
t + [EOS]; without BOS the first token is never a target; without EOS the last token is never an input.
Documents with no tokens (or no pair) are skipped. The pairs of consecutive documents fill rows of exactly
max_target_length; a document longer than the rest of a row continues at the start of the next row. Within a
row the pieces are segments 1, 2, 3...: inputs_segmentation = targets_segmentation = the piece's number and
inputs_position counts 0, 1, ... from the start of each piece (a piece continued from the previous row starts
again at 0). Nothing is padded or dropped in training.

Order. The train stream is endless, epoch after epoch; each pipeline defines epoch e's order of this process's
documents (seeded by epoch_seed(data_shuffle_seed, e, process_index)). The eval stream reads its split once,
in the order of epoch EVAL_EPOCH (one fixed shuffled order, so that eval_steps batches sample the whole split
and are the same every time), and then returns all-padding batches (tokens 0, segment 0) so that every
process can run the same number of eval steps.

Resuming. state() = {"epoch": e, "document": d, "offset": k}: the next pair is pair k of document d (its
index in epoch e's order, empty documents counted) of epoch e, for this process. A pipeline made with that
state calls epoch_records(e, skip=d); what skipping costs is the pipeline's (tfds and hf read the skipped
records, grain indexes straight to d).

A pipeline subclasses PackedDocuments and defines epoch_records(epoch, skip) (an iterator over this process's
records of that epoch's order from number `skip` on: text as str or UTF-8 bytes, or a pre-tokenized int
array; or (record, where) with `where` the file and row it came from), source_name() (the split and files,
for messages) and files_key (the key naming them); locate(epoch, document) may say more than "document d of
epoch e".

Bad data met mid-stream. A document that cannot be used (a pre-tokenized id outside vocab_size, a record the
pipeline cannot parse) and a shard with no document raise DataError naming the file, the row and the key to
change; the batch being filled is given up and the stream's position stays where that batch began, so state()
is still the position after the last batch returned.
"""

from __future__ import annotations

import abc

import numpy as np

from MaxText.data.records import BATCH_KEYS, DataError, resume_position
from MaxText.config.errors import clip
from MaxText.data.tokenizer import load_tokenizer

EVAL_EPOCH = 2**31 - 1  # the "epoch" whose order the eval stream reads


def epoch_seed(seed: int, epoch: int, process_index: int) -> int:
    """The shuffle seed of one epoch of one process."""
    return int(np.random.SeedSequence([seed % 2**32, epoch, process_index]).generate_state(1)[0])


class PackedDocuments(abc.ABC):
    """This process's rows of each global batch: dicts of [global_batch // process_count, max_target_length]
    int32 arrays (see the module docstring for order, packing and state). `state=` resumes the eval stream in
    the same way, though a fresh eval iterator is what gives the same eval batches every time."""

    def __init__(self, cfg, global_batch: int, process_index: int = 0, process_count: int = 1, *,
                 split: str = "train", state: dict | None = None):
        if split not in ("train", "eval"):
            raise ValueError(f"split={split!r}: must be 'train' or 'eval'")
        self.tokenizer = load_tokenizer(cfg)
        self.train = split == "train"
        self.rows, self.length = global_batch // process_count, cfg.max_target_length
        self.seed, self.process_index, self.process_count = cfg.data_shuffle_seed, process_index, process_count
        self.vocab_size = cfg.vocab_size
        self.bos = [self.tokenizer.bos_id] if cfg.add_bos else []
        self.eos = [self.tokenizer.eos_id] if cfg.add_eos else []
        state = resume_position(state, ("epoch", "document", "offset"), f"dataset_type={cfg.dataset_type}") \
            if state else {"epoch": 0, "document": 0, "offset": 0}
        self.epoch, self.document, self.offset = state["epoch"], state["document"], state["offset"]
        self.pairs = None  # (inputs, targets) of document self.document once read
        self.records = None  # this epoch's records, positioned after self.document (or at it while pairs is None)
        self.opened_at, self.found_in_epoch, self.exhausted = 0, False, False
        self.here = None  # the (file, row) of the record being read, when its pipeline says
        self.column_key = "train_data_columns" if self.train else "eval_data_columns"

    # ------------------------------------------------------------------ what a pipeline defines

    @abc.abstractmethod
    def epoch_records(self, epoch: int, skip: int = 0):
        """An iterator over this process's records (str, UTF-8 bytes or int token arrays) in epoch `epoch`'s
        order, from record number `skip` on."""

    @abc.abstractmethod
    def source_name(self) -> str:
        """The split or files read, for messages."""

    files_key = "dataset_name"  # the key naming what is read (a pipeline sets its own)

    def locate(self, epoch: int, document: int) -> str:
        """Where document `document` of epoch `epoch`'s order came from, for messages."""
        return f"document {document} of {'epoch ' + str(epoch) if self.train else 'the eval split'}'s order"

    def where(self) -> str:
        """The document being read, as a message names it: its file and row where the pipeline knows them."""
        return self.here or f"{self.source_name()}, {self.locate(self.epoch, self.document)}"

    # ------------------------------------------------------------------ the iterator

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        batch = {k: np.zeros((self.rows, self.length), np.int32) for k in BATCH_KEYS}
        began = self.state()
        try:
            for r in range(self.rows):
                self.fill_row(*(batch[k][r] for k in BATCH_KEYS[:4]))
        except DataError:  # give the batch up: the position stays where it began (the records are reopened there)
            self.epoch, self.document, self.offset = began["epoch"], began["document"], began["offset"]
            self.pairs, self.records, self.exhausted = None, None, False
            raise
        batch["targets_segmentation"][:] = batch["inputs_segmentation"]
        return batch

    def state(self) -> dict:
        """Where the next batch starts, for this process (JSON-able)."""
        return {"epoch": self.epoch, "document": self.document, "offset": self.offset}

    def order_epoch(self, epoch: int) -> int:
        """The epoch whose order epoch `epoch` of this stream reads: itself in training, EVAL_EPOCH in eval."""
        return epoch if self.train else EVAL_EPOCH

    def fill_row(self, inputs_L, targets_L, position_L, segment_L) -> None:
        """Writes the next max_target_length pairs into the (zeroed) row arrays; at the end of the eval split
        the rest stays padding."""
        filled, segment = 0, 0
        while filled < self.length and (pairs := self.current_pairs()) is not None:
            n = min(self.length - filled, len(pairs[0]) - self.offset)
            if n <= 0:  # only a resumed position can point past its document's end
                raise ValueError(f"the input position offset={self.offset} lies past the end of {self.where()} "
                                 f"({len(pairs[0])} tokens)")
            segment += 1
            inputs_L[filled:filled + n] = pairs[0][self.offset:self.offset + n]
            targets_L[filled:filled + n] = pairs[1][self.offset:self.offset + n]
            position_L[filled:filled + n] = np.arange(n)
            segment_L[filled:filled + n] = segment
            filled, self.offset = filled + n, self.offset + n
            if self.offset == len(pairs[0]):
                self.pairs, self.document, self.offset = None, self.document + 1, 0

    def current_pairs(self) -> tuple[np.ndarray, np.ndarray] | None:
        """The (inputs, targets) of the document being emitted, reading on past empty documents and (train)
        into the next epoch; None once the eval split is used up."""
        while self.pairs is None and not self.exhausted:
            if self.records is None:
                self.records = iter(self.epoch_records(self.order_epoch(self.epoch), skip=self.document))
                self.opened_at, self.found_in_epoch = self.document, False
            self.here = None
            try:
                record = next(self.records, None)
            except DataError:
                raise
            except Exception as e:  # noqa: BLE001 - a record the pipeline (or its worker process) cannot read
                reason = " ".join(str(e).split()) or type(e).__name__
                raise DataError(f"{self.where()}: {clip(reason, 300)}; fix or remove that file from "
                                f"{self.files_key}") from None
            if isinstance(record, tuple):
                record, self.here = record
            if record is None:
                self.records = None
                if not self.train:
                    self.exhausted = True
                elif self.opened_at == 0 and not self.found_in_epoch:
                    raise DataError(f"{self.source_name()} has no document with tokens for process "
                                    f"{self.process_index} (every record is empty or null); check "
                                    f"{self.files_key} and the text column ({self.column_key})")
                else:
                    self.epoch, self.document = self.epoch + 1, 0
            elif (pairs := self._pairs(record)) is None:
                self.document += 1
            else:
                self.pairs, self.found_in_epoch = pairs, True
        return self.pairs

    def _pairs(self, record):
        """document_pairs(record); a failure there (a value of another type in the text column, say) is a
        DataError naming the document."""
        try:
            return self.document_pairs(record)
        except DataError:
            raise
        except Exception as e:  # noqa: BLE001 - the tokenizer's or numpy's own error on a value it cannot take
            reason = " ".join(str(e).split()) or type(e).__name__
            raise DataError(f"{self.where()}: this document cannot be tokenized ({clip(reason, 200)}); check the "
                            f"text column ({self.column_key}) or remove the file from {self.files_key}") from None

    def tokens(self, record) -> np.ndarray:
        """A record's tokens: text (str or UTF-8 bytes) through the tokenizer; a pre-tokenized array as it is,
        checked against vocab_size."""
        if isinstance(record, bytes):
            record = record.decode("utf-8", errors="replace")
        if isinstance(record, str):
            return self.tokenizer.encode(record)
        tokens = np.asarray(record, np.int64)
        outside = tokens[(tokens < 0) | (tokens >= self.vocab_size)]
        if outside.size:
            raise DataError(f"{self.where()}: a pre-tokenized document holds id {int(outside[0])} outside "
                            f"vocab_size={self.vocab_size}: it was tokenized for another vocabulary; set vocab_size "
                            f"and tokenizer_path to the ones it was made with, or remove the file from "
                            f"{self.files_key}")
        return tokens.astype(np.int32)

    def document_pairs(self, record) -> tuple[np.ndarray, np.ndarray] | None:
        """(inputs, targets) of one document: [BOS] + tokens + [EOS] shifted by one; None when empty."""
        tokens = self.tokens(record)
        if len(tokens) == 0:
            return None
        seq = np.concatenate([np.asarray(self.bos, np.int32), tokens, np.asarray(self.eos, np.int32)])
        return (seq[:-1], seq[1:]) if len(seq) > 1 else None
