"""Raw trees of the shipped Bible laid out like the official lm1b and WMT14 archives.

The real TFDS builders for `lm1b` and `wmt14_translate/fr-en` download archives from
statmt.org and read files at fixed paths inside them. This tool writes those files, with the
same names and formats, from the Bible in `data/`, so that the builders' own
`_split_generators` and `_generate_examples` can run without a network
(`mtrain.data.tfds_prepare.prepare(name, data_dir, data_source=ROOT)`):

    python -m mtrain.data.make_offline lm1b  raw/ [--max_train N]
    python -m mtrain.data.make_offline wmt14 raw/ [--max_train N]

Splits keep their books: the builders' "train" split holds the Bible's training verses
(the first N of them with --max_train), lm1b's "test" and WMT14's "test" (newstest2014) the
test books, WMT14's "validation" (newstest2013) the validation books. lm1b has no validation
split. Both trees may share one directory, as the real archives extracted side by side would.

A tree is written into a temporary directory next to OUT_DIR and renamed into place, and an
existing tree is never overwritten.
"""

import argparse
import gzip
import os
import shutil
import sys
import uuid
from pathlib import Path
from typing import Callable, NamedTuple, Sequence

from mtrain.data.bible import bible_split_verses
from mtrain.errors import UserError

# lm1b: the one top-level directory of 1-billion-word-language-modeling-benchmark-r13output.tar.gz.
# The builder's train split globs `news.en-*` (the archive has news.en-00001..00099-of-00100),
# its test split `news.en.heldout-*` (news.en.heldout-00000..00049-of-00050).
LM1B_TOP = "1-billion-word-language-modeling-benchmark-r13output"
LM1B_TRAIN_DIR = f"{LM1B_TOP}/training-monolingual.tokenized.shuffled"
LM1B_HELDOUT_DIR = f"{LM1B_TOP}/heldout-monolingual.tokenized.shuffled"
LM1B_TRAIN_FILES = 4  # the train verses are spread over news.en-00001.. of this many files

# wmt14_translate/fr-en: (French file, English file) of every sub-dataset, relative to the
# directory that all its archives are extracted into (tensorflow_datasets/translate/wmt.py).
WMT14_TRAIN_SUBSETS = {
    "europarl_v7": ("training/europarl-v7.fr-en.fr", "training/europarl-v7.fr-en.en"),
    "commoncrawl": ("commoncrawl.fr-en.fr", "commoncrawl.fr-en.en"),
    "multiun": ("un/undoc.2000.fr-en.fr", "un/undoc.2000.fr-en.en"),
    "newscommentary_v9": ("training/news-commentary-v9.fr-en.fr",
                          "training/news-commentary-v9.fr-en.en"),
    "gigafren": ("giga-fren.release2.fixed.fr.gz", "giga-fren.release2.fixed.en.gz"),
}
# The validation split is the sub-dataset newstest2013, the test split newstest2014 (SGML).
WMT14_VALIDATION = ("dev/newstest2013.fr", "dev/newstest2013.en")
WMT14_TEST = ("dev/newstest2014-fren-src.fr.sgm", "dev/newstest2014-fren-ref.en.sgm")


class TreeExistsError(UserError, FileExistsError):
    """The output directory already holds (part of) the tree to be written."""


def lm1b_files() -> list[str]:
    """Every file of the lm1b tree, relative to its root."""
    return ([f"{LM1B_TRAIN_DIR}/news.en-{i:05d}-of-00100" for i in range(1, LM1B_TRAIN_FILES + 1)]
            + [f"{LM1B_HELDOUT_DIR}/news.en.heldout-00000-of-00050"])


def wmt14_files() -> list[str]:
    """Every file of the wmt14 fr-en tree, relative to its root."""
    pairs = [*WMT14_TRAIN_SUBSETS.values(), WMT14_VALIDATION, WMT14_TEST]
    return [path for pair in pairs for path in pair]


def write_lm1b_tree(out_dir: str | os.PathLike, max_train: int | None = None) -> Path:
    """Writes the lm1b tree of the English Bible into `out_dir`; returns the root to prepare
    from (`out_dir` itself).

    One verse per line: the first `max_train` training verses (all by default) spread over
    LM1B_TRAIN_FILES train files, and the test books' verses in the one heldout file.
    """
    train, _, test = _bible_splits(max_train)

    def write(root: Path) -> None:
        train_files = lm1b_files()[:LM1B_TRAIN_FILES]
        for path, chunk in zip(train_files, _chunks(train, len(train_files))):
            _write_lines(root / path, [v.en for v in chunk])
        _write_lines(root / lm1b_files()[-1], [v.en for v in test])

    return _write_tree(out_dir, "lm1b", lm1b_files(), write)


def write_wmt14_tree(out_dir: str | os.PathLike, max_train: int | None = None) -> Path:
    """Writes the wmt14 fr-en tree of the Bible into `out_dir`; returns the root to prepare
    from (`out_dir` itself).

    The first `max_train` training verses (all by default) are cut into contiguous chunks,
    one per training sub-dataset in WMT14_TRAIN_SUBSETS order, as parallel files with one
    verse per line (gigafren gzipped). The validation books are newstest2013 (plain text),
    the test books newstest2014 (SGML, one <doc> per book).
    """
    train, validation, test = _bible_splits(max_train)

    def write(root: Path) -> None:
        for (fr, en), chunk in zip(WMT14_TRAIN_SUBSETS.values(),
                                   _chunks(train, len(WMT14_TRAIN_SUBSETS))):
            _write_lines(root / fr, [v.fr for v in chunk])
            _write_lines(root / en, [v.en for v in chunk])
        _write_lines(root / WMT14_VALIDATION[0], [v.fr for v in validation])
        _write_lines(root / WMT14_VALIDATION[1], [v.en for v in validation])
        _write_sgm(root / WMT14_TEST[0], test, "fr", "src")
        _write_sgm(root / WMT14_TEST[1], test, "en", "ref")

    return _write_tree(out_dir, "wmt14", wmt14_files(), write)


class Tree(NamedTuple):
    tfds_name: str  # the TFDS dataset whose raw files it is
    write: Callable[..., Path]
    gin_file: str  # the small experiment that trains on it


# The trees this module writes, by their name on the command line.
TREES = {"lm1b": Tree("lm1b", write_lm1b_tree, "quickstart.gin"),
         "wmt14": Tree("wmt14_translate/fr-en", write_wmt14_tree,
                       "experiments/wmt14_enfr_tiny.gin")}


def tree_for(tfds_name: str) -> str | None:
    """The tree (a key of `TREES`) holding the raw files of a TFDS dataset ("lm1b:1.1.0",
    "wmt14_translate/fr-en"), or None."""
    name = tfds_name.split(":")[0]
    return next((k for k, t in TREES.items() if name in (t.tfds_name, t.tfds_name.split("/")[0])),
                None)


def _bible_splits(max_train: int | None):
    if max_train is not None and max_train < 1:
        raise UserError(f"max_train must be at least 1, not {max_train}")

    train = bible_split_verses("train")[:max_train]
    return train, bible_split_verses("validation"), bible_split_verses("test")


def _chunks(items: Sequence, count: int) -> list[Sequence]:
    """`items` cut into `count` contiguous chunks whose sizes differ by at most one."""
    bounds = [len(items) * i // count for i in range(count + 1)]
    return [items[a:b] for a, b in zip(bounds, bounds[1:])]


def _check_line(text: str) -> str:
    # The builders split files into lines (and lm1b strips them): a sentence must be one
    # non-empty line without surrounding space to come back unchanged.
    if not text or text != text.strip() or "\n" in text or "\r" in text:
        raise ValueError(f"sentence {text!r} cannot be one line of a raw corpus file")
    return text


def _write_lines(path: Path, lines: Sequence[str]) -> None:
    """One sentence per line, each ending in "\\n" as in the real files (gzipped for .gz)."""
    data = "".join(_check_line(line) + "\n" for line in lines).encode("utf-8")
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".gz":
        with open(path, "wb") as f, gzip.GzipFile(fileobj=f, mode="wb", mtime=0) as g:
            g.write(data)
    else:
        path.write_bytes(data)


def _write_sgm(path: Path, verses, language: str, kind: str) -> None:
    """A newstest-style SGML file: one <doc> per book, one <seg> per line.

    The builder reads each `<seg id="N">TEXT</seg>` line with a regular expression and does
    not unescape entities, so TEXT is written as is (the corpus has no "<" or "&").
    """
    if kind == "src":
        lines = [f'<srcset setid="newstest2014" srclang="{language}">']
    else:
        lines = [f'<refset setid="newstest2014" srclang="fr" trglang="{language}">']
    book = None
    for v in verses:
        if v.book != book:
            if book is not None:
                lines.append("</doc>")
            book, seg = v.book, 0
            lines.append(f'<doc sysid="ref" docid="bible-book-{book:02d}" genre="bible" '
                         f'origlang="en">')
        seg += 1
        text = _check_line(getattr(v, language))
        if "</seg>" in text:
            raise ValueError(f"sentence {text!r} cannot be an SGML segment")
        lines.append(f'<seg id="{seg}">{text}</seg>')
    if book is not None:
        lines.append("</doc>")
    lines.append(f"</{kind}set>")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")


def _write_tree(out_dir, dataset: str, files: list[str],
                write: Callable[[Path], None]) -> Path:
    """Writes `files` with `write(tmp_root)` into a temporary directory next to `out_dir`,
    then renames it (or, when `out_dir` exists, each of its top-level entries) into place.

    Raises TreeExistsError, touching nothing, if any top-level entry of the tree already
    exists in `out_dir`. The tree appears at once when `out_dir` is new or the tree has one
    top-level entry (lm1b); otherwise entry by entry.
    """
    out = Path(out_dir).absolute()
    entries = sorted({f.split("/")[0] for f in files})

    def check_free() -> None:
        taken = [e for e in entries if os.path.lexists(out / e)]
        if taken:
            raise TreeExistsError(
                f"{out} already holds a {dataset} tree ({out / taken[0]} exists); "
                "delete it or choose another directory")

    check_free()
    if out.exists() and not out.is_dir():
        raise TreeExistsError(f"{out} exists and is not a directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    # Not tempfile.mkdtemp: its mode 0700 would become the mode of `out`.
    tmp = out.parent / f".{out.name}.{dataset}-{uuid.uuid4().hex[:8]}.tmp"
    tmp.mkdir()
    try:
        write(tmp)
        missing = [f for f in files if not (tmp / f).is_file()]
        if missing:  # a writer's bug, not the user's: the files are the builders' list
            raise RuntimeError(f"make_offline wrote no {missing}")
        try:
            os.rename(tmp, out)  # atomic when out does not exist (or is an empty directory)
        except OSError:
            check_free()
            for entry in entries:
                os.rename(tmp / entry, out / entry)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return Path(out_dir)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m mtrain.data.make_offline",
        description="Write a raw tree laid out like the official lm1b or WMT14 (fr-en) "
                    "archives, made from the shipped Bible, for building the real TFDS "
                    "datasets without a network (mtrain.data.tfds_prepare.prepare(..., "
                    "data_source=OUT_DIR)).")
    p.add_argument("dataset", choices=sorted(TREES),
                   help="lm1b (for TFDS 'lm1b') or wmt14 (for 'wmt14_translate/fr-en')")
    p.add_argument("out_dir", metavar="OUT_DIR",
                   help="directory to write the tree into (created if needed); must not "
                        "already hold a tree of this dataset")
    p.add_argument("--max_train", type=int, default=None, metavar="N",
                   help="write only the first N training verses (default: all 29,087)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        root = TREES[args.dataset].write(args.out_dir, max_train=args.max_train)
    except UserError as e:
        print(f"make_offline: error: {e}", file=sys.stderr)
        return 2
    # The small experiment of each task, on this tree instead of the shipped one.
    gin_file = TREES[args.dataset].gin_file
    print(f"wrote a raw {args.dataset} tree to {root}; train on it with\n"
          f"  python -m mtrain --gin_file={gin_file} --cpu_devices=8 --data_source={root} "
          f"--model_dir=runs/{args.dataset}_raw")
    return 0


if __name__ == "__main__":
    sys.exit(main())
