"""Every kind of source a user names, trained and evaluated through the command line (the
readers themselves: test_data_files): a mixture of a Parquet file read by a named column, an
ArrayRecord file of JSON records and a folder laid out as a Hugging Face dataset; and a TFDS
dataset by name and version that TFDS prepared and mtrain's builders do not know."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mtrain.__main__ import main
from mtrain.data.sources import BibleLM

from tiny_config import TINY

LAYOUT = "--gin_param=run.mesh_shape='batch:4;model:2'"
RUN = ["run.train_steps=2", "run.checkpoint_every=2", "run.log_every=1", "run.eval_every=0"]


@pytest.fixture(scope="module")
def verses():
    return list(BibleLM("en").texts("train", limit=600))


def cli(model_dir, params):
    return main([LAYOUT, f"--model_dir={model_dir}",
                 *[f"--gin_param={p}" for p in [*TINY, *RUN, *params]]])


def records(model_dir):
    with open(model_dir / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


@pytest.mark.slow  # (each reader in the fast tier: test_data_files)
def test_parquet_arrayrecord_and_a_dataset_folder_in_one_mixture(tmp_path, verses):
    from array_record.python.array_record_module import ArrayRecordWriter

    pq.write_table(pa.table({"content": verses[:200], "n": list(range(200))}),
                   tmp_path / "web.parquet")
    writer = ArrayRecordWriter(str(tmp_path / "books.array_record"), "group_size:1")
    for verse in verses[200:400]:
        writer.write(json.dumps({"text": verse}).encode())
    writer.close()
    folder = tmp_path / "hub_dataset"
    (folder / "data").mkdir(parents=True)
    for split, part in (("train", verses[400:580]), ("validation", verses[580:])):
        pq.write_table(pa.table({"text": part}), folder / "data" / f"{split}-00000-of-00001.parquet")
    params = ["run.task=@task()",
              "task.data={'web': @web/files(), 'books': @books/files(), 'hub': @hub/files()}",
              "task.mixture={'web': 0.5, 'books': 0.3, 'hub': 0.2}",
              f"web/files.train='{tmp_path / 'web.parquet'}'", "web/files.validation=0.1",
              "web/files.columns={'text': 'content'}",
              f"books/files.train='{tmp_path / 'books.array_record'}'",
              "books/files.validation=0.1", f"hub/files.train='{folder}'",
              "run.eval_split='validation'", f"run.data_dir='{tmp_path / 'data'}'"]
    assert cli(tmp_path / "run", params) == 0
    logged = records(tmp_path / "run")
    last = [r for r in logged if "train/loss" in r][-1]
    fractions = {k.split("/")[-1]: v for k, v in last.items() if k.startswith("train/mixture/")}
    assert set(fractions) == {"web", "books", "hub"} and abs(sum(fractions.values()) - 1) < 1e-9
    evaluated = [r for r in logged if "eval/loss" in r][-1]
    assert np.isfinite(evaluated["eval/loss"]) and evaluated["eval/num_tokens"] > 0
    prepared = sorted(p.name.split("-")[0] for p in (tmp_path / "data" / "prepared").iterdir())
    assert prepared == ["books", "hub", "web"]


@pytest.mark.slow  # (the shipped task files read TFDS by name in the fast tier: test_tasks)
def test_a_tfds_dataset_by_name_and_version(tmp_path, verses, capsys):
    """A dataset TFDS prepared (here by its ad hoc builder, as a user's own builder would),
    named with its version and the feature to read; no download, no builder of mtrain's."""
    import tensorflow as tf
    import tensorflow_datasets as tfds

    data = tmp_path / "data"
    builder = tfds.dataset_builders.TfDataBuilder(
        name="my_sayings", version="1.0.0", config=None,
        features=tfds.features.FeaturesDict({"saying": tfds.features.Text()}),
        split_datasets={split: tf.data.Dataset.from_tensor_slices({"saying": part})
                        for split, part in (("train", verses[:500]), ("test", verses[500:]))},
        data_dir=str(data / "tfds"), file_format="array_record")
    builder.download_and_prepare()
    params = ["run.task=@task()", "task.data=@tfds_data()",
              "tfds_data.name='my_sayings:1.0.0'", "tfds_data.features={'targets': 'saying'}",
              "run.eval_split='test'", f"run.data_dir='{data}'"]
    assert cli(tmp_path / "run", params) == 0
    evaluated = [r for r in records(tmp_path / "run") if "eval/loss" in r][-1]
    assert evaluated["eval/num_tokens"] > 0 and evaluated["step"] == 2
    # a name TFDS does not have: one line
    params[2] = "tfds_data.name='no_such_dataset:1.0.0'"
    capsys.readouterr()
    assert cli(tmp_path / "other", params) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert error[-1].startswith("mtrain: error: unknown TFDS dataset 'no_such_dataset:1.0.0'")
    assert len([line for line in error if "error" in line]) == 1, error
