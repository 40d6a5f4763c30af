"""The shipped corpus: the English (KJV) and French (Louis Segond) Bible, verse by verse
(data/bible_kjv_lsg.tsv.xz), with its splits by book. Plain Python: no TensorFlow."""

from __future__ import annotations

import functools
import lzma
from pathlib import Path
from typing import NamedTuple

from mtrain.errors import DataError

DATA_DIR = Path(__file__).resolve().parents[2] / "data"
BIBLE_FILE = DATA_DIR / "bible_kjv_lsg.tsv.xz"
BIBLE_LANGUAGES = ("en", "fr")

SPLITS = ("train", "validation", "test")

# The Bible's splits are disjoint sets of books (numbered 1..66 in the file). Each held-out
# split is about 3% of the 31,102 verses: three Old Testament books of different kinds
# (story, wisdom or poetry, prophecy) and one New Testament letter. "train" is the other 58.
VALIDATION_BOOKS = {8: "Ruth", 21: "Ecclesiastes", 27: "Daniel", 45: "Romans"}  # 1,097 verses
TEST_BOOKS = {17: "Esther", 22: "Song of Solomon", 28: "Hosea", 46: "1 Corinthians"}  # 918 verses


class Verse(NamedTuple):
    book: int
    chapter: int
    verse: int
    en: str
    fr: str


@functools.cache
def bible_verses() -> tuple[Verse, ...]:
    """Every verse of the shipped Bible in file order; the file is read once per process."""
    if not BIBLE_FILE.exists():
        raise DataError(f"the shipped corpus {BIBLE_FILE} is missing")
    with lzma.open(BIBLE_FILE, "rt", encoding="utf-8") as f:
        header = f.readline().rstrip("\n").split("\t")
        if header != list(Verse._fields):
            raise DataError(f"{BIBLE_FILE}: unexpected header {header}")
        verses = []
        for line in f:
            book, chapter, verse, en, fr = line.rstrip("\n").split("\t")
            verses.append(Verse(int(book), int(chapter), int(verse), en, fr))
    return tuple(verses)


def bible_split(book: int) -> str:
    """The split that a Bible book (1..66) belongs to."""
    if book in VALIDATION_BOOKS:
        return "validation"
    if book in TEST_BOOKS:
        return "test"
    return "train"


@functools.cache
def bible_split_verses(split: str) -> tuple[Verse, ...]:
    """The verses of one split, in file order."""
    return tuple(v for v in bible_verses() if bible_split(v.book) == split)


@functools.cache
def bible_column(split: str, language: str) -> tuple[str, ...]:
    """The text of every verse of a split in one language, in file order."""
    return tuple(getattr(v, language) for v in bible_split_verses(split))
