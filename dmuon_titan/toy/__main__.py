"""``python -m dmuon_titan.toy --out DIR [--vocab-size N] [--force]``: build the toy
tokenizer (a byte-level BPE trained on the Python standard library, offline)."""

from .data import main

main()
