"""The documents of the lm-eval tasks in this folder, made from mtrain's shipped corpus (the
King James Bible's test split: books no shipped task trains on), so that they run offline.
lm-eval calls these through ``custom_dataset: !function bible_tasks.<name>``."""

import random

import datasets

from mtrain.data.bible import bible_split_verses

SEED = 0  # the distractors are the same every run


def next_verse(**kwargs) -> datasets.DatasetDict:
    """``bible_next_verse``: a verse, and which of 4 verses follows it (the true next one and
    3 others of the split). 200 documents, spread over the split."""
    verses = bible_split_verses("test")
    rng = random.Random(SEED)
    docs = []
    for i in range(0, len(verses) - 1, (len(verses) - 1) // 200)[:200]:
        verse, following = verses[i], verses[i + 1]
        others = rng.sample([v.en for v in verses if v.en not in (verse.en, following.en)], 3)
        label = rng.randrange(4)
        choices = others[:label] + [following.en] + others[label:]
        docs.append({"context": verse.en, "choices": choices, "label": label})
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(docs)})


def chapters(**kwargs) -> datasets.DatasetDict:
    """``bible_test_perplexity``: every chapter of the split as one document."""
    texts: dict[tuple[int, int], list[str]] = {}
    for v in bible_split_verses("test"):
        texts.setdefault((v.book, v.chapter), []).append(v.en)
    docs = [{"text": " ".join(t)} for t in texts.values()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(docs)})
