"""Input pipelines: the one a config names (make_data) and its start-up checks (validate); what the pipelines
share is records.py's. Each is an iterator over this process's rows of global batches: dicts of [rows, L] int32
numpy arrays inputs, targets, inputs_position, inputs_segmentation, targets_segmentation (segment 0 =
padding), with `state()` (a JSON-able position after the last batch returned) and a `state=` argument that
resumes exactly there. split="train" is the endless training stream; split="eval" starts from the same
first batch every time it is made.
"""

from __future__ import annotations

from MaxText.config.errors import ConfigError
from MaxText.data.synthetic import SyntheticData

# The built-in byte-level tokenizer's 259 ids fill under 1/16 of a vocabulary larger than this: a model that
# size (DeepSeek-V3: 129280) trained on bytes would leave nearly all of its embedding untrained.
BYTE_LEVEL_MAX_VOCAB = 16 * 259


def corpus_problem(cfg) -> str | None:
    """One line on what the config leaves unnamed for real text (dataset_name; a tokenizer for a large
    vocabulary), or None. Shared by the trainer's start-up check and the preflight's data row."""
    if cfg.dataset_type == "synthetic":
        return None
    if cfg.dataset_type == "grain" and cfg.grain_train_files is None:
        return ("grain_train_files is not set: dataset_type=grain reads ArrayRecord files you name, e.g. "
                "grain_train_files=/data/c4/train-*.array_record (python -m MaxText.data.to_array_record writes them)")
    if cfg.dataset_type == "hf" and cfg.hf_path is None and cfg.hf_train_files is None:
        return ("hf_path and hf_train_files are not set: dataset_type=hf reads local files you name, e.g. "
                "hf_path=parquet hf_train_files=/data/c4/train-*.parquet")
    if cfg.dataset_type == "tfds" and cfg.dataset_name is None:
        return ("dataset_name is not set: this config (a GPU recipe) trains on a corpus you name, e.g. "
                "dataset_name=c4/en:3.0.1 dataset_path=/data/tfds tokenizer_path=/data/tokenizer.json")
    if cfg.tokenizer_path is None and cfg.vocab_size > BYTE_LEVEL_MAX_VOCAB:
        return (f"tokenizer_path is not set: the built-in byte-level tokenizer (259 ids) would use almost none of "
                f"vocab_size={cfg.vocab_size}; set tokenizer_path to the model's tokenizer.json or SentencePiece "
                "*.model")
    return None


def validate(cfg) -> None:
    """Fails fast (ConfigError naming the key and path) on a dataset or tokenizer that is not there or not
    named; builds the embedded python_stdlib dataset when it is missing. Cheap when everything is in place."""
    problem = corpus_problem(cfg)
    if problem:
        raise ConfigError(problem)
    if cfg.dataset_type != "synthetic":
        pipeline_module(cfg.dataset_type).validate(cfg)


def pipeline_module(dataset_type: str):
    """The module of a document pipeline (tfds, grain, hf): its validate(cfg) and its PackedDocuments class."""
    import importlib

    return importlib.import_module(f"MaxText.data.{dataset_type}_data")


PIPELINE_CLASSES = {"tfds": "TfdsData", "grain": "GrainData", "hf": "HfData"}


def make_data(cfg, global_batch: int, process_index: int = 0, process_count: int = 1, *, split: str = "train",
              state: dict | None = None):
    """The iterator for cfg.dataset_type; `state` (from a previous iterator's state()) resumes it."""
    if global_batch % process_count:
        raise ValueError(f"global batch {global_batch} does not split over {process_count} processes")
    if cfg.dataset_type == "synthetic":
        return SyntheticData(cfg, global_batch, process_index, process_count, split=split, state=state)
    cls = getattr(pipeline_module(cfg.dataset_type), PIPELINE_CLASSES[cfg.dataset_type])
    return cls(cfg, global_batch, process_index, process_count, split=split, state=state)
