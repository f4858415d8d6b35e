"""An offline text corpus and tokenizer for toy runs: the Python standard library's source.

Every machine with Python has it, it is real text, and it is license-clean (PSF). Files are
split deterministically into train and validation by a hash of their relative path. The
tokenizer is a byte-level BPE trained here on the training files (no download), sized to fit
the model's vocabulary.

    python -m dmuon_titan.toy --out outputs/assets/tokenizer --vocab-size 2048
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sysconfig
import zlib
from pathlib import Path

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
VALIDATION_SHARE = 20  # one file in 20 is validation


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files(split: str, root: Path | None = None) -> list[Path]:
    """Sorted ``.py`` files of the standard library in ``split`` ("train" or "validation")."""
    if split not in ("train", "validation"):
        raise ValueError(f"split must be 'train' or 'validation', got {split!r}")
    root = root or stdlib_dir()
    files = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if "site-packages" in rel or "dist-packages" in rel:
            continue
        is_val = zlib.crc32(rel.encode()) % VALIDATION_SHARE == 0
        if is_val == (split == "validation"):
            files.append(path)
    return files


#: ``training.dataset = "pystdlib_shuffled_<k>"`` reads the training files in an order
#: shuffled with seed k (for k in this range; "pystdlib" reads them sorted)
SHUFFLE_SEEDS = range(10)


def read_texts(split: str, root: Path | None = None, shuffle_seed: int | None = None) -> list[str]:
    """The split's files' texts, in sorted order, or shuffled by ``shuffle_seed`` (the same
    order on every machine: the sorted list shuffled by ``random.Random(seed)``). Sorted
    files put similar modules together, which shows in loss curves as dips."""
    texts = []
    files = corpus_files(split, root)
    if shuffle_seed is not None:
        random.Random(shuffle_seed).shuffle(files)
    for path in files:
        try:
            texts.append(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
    return texts


def build_tokenizer(
    out_dir: str | os.PathLike, vocab_size: int = 2048, max_chars: int = 8_000_000
) -> Path:
    """Train a byte-level BPE on the training split and save it as a torchtitan asset dir
    (``tokenizer.json`` + ``tokenizer_config.json``). Returns the directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    texts, total = [], 0
    for text in read_texts("train"):
        texts.append(text)
        total += len(text)
        if total >= max_chars:
            break
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    tmp = out / "tokenizer.json.tmp"
    tokenizer.save(str(tmp))
    os.replace(tmp, out / "tokenizer.json")
    (out / "tokenizer_config.json").write_text(json.dumps({"bos_token": BOS, "eos_token": EOS}))
    return out


def ensure_tokenizer(out_dir: str | os.PathLike, vocab_size: int = 2048) -> Path:
    out = Path(out_dir)
    if not (out / "tokenizer.json").exists():
        build_tokenizer(out, vocab_size)
    return out


def register_datasets() -> None:
    """Make ``training.dataset = "pystdlib"`` (sorted files), ``"pystdlib_shuffled_<k>"``
    (shuffled by seed k, ``SHUFFLE_SEEDS``) and ``validation.dataset = "pystdlib_val"``
    available in torchtitan (``dataset_path`` may point at another Python's stdlib)."""
    from torchtitan.hf_datasets import DatasetConfig
    from torchtitan.hf_datasets.text_datasets import DATASETS

    def loader(split: str, shuffle_seed: int | None = None):
        def load(path: str):
            import datasets

            texts = read_texts(split, Path(path), shuffle_seed)
            return datasets.Dataset.from_dict({"text": texts})

        return load

    names = [("pystdlib", "train", None), ("pystdlib_val", "validation", None)]
    names += [(f"pystdlib_shuffled_{k}", "train", k) for k in SHUFFLE_SEEDS]
    for name, split, seed in names:
        DATASETS[name] = DatasetConfig(
            path=str(stdlib_dir()),
            loader=loader(split, seed),
            sample_processor=lambda s: s["text"],
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m dmuon_titan.toy", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--out", default="outputs/assets/tokenizer")
    parser.add_argument("--vocab-size", type=int, default=2048)
    parser.add_argument("--force", action="store_true", help="retrain even if present")
    args = parser.parse_args()
    path = (build_tokenizer if args.force else ensure_tokenizer)(args.out, args.vocab_size)
    print(f"tokenizer ready: {path}")
