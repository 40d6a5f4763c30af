"""Building the real TFDS datasets, from the web or offline from a raw tree on disk.

`prepare("lm1b", data_dir)` is `tfds.builder(...).download_and_prepare(...)` with one line
of output instead of TFDS's logs, and with errors a user can cause (no network, a missing
raw file) turned into one-line DataErrors. A dataset already prepared in `data_dir` is
reused, never rebuilt or downloaded again.

`prepare("lm1b", data_dir, data_source=RAW)` runs the same real builder (its own
`_split_generators` and `_generate_examples`) without a network: every URL the builder asks
its download manager for, and its manual directory, is the directory RAW, which must hold
the files of the builder's archives as if they were all extracted into it.
`python -m mtrain.data.make_offline {lm1b,wmt14} RAW` writes such trees from the shipped
Bible.

Prepared array_record datasets are read by index, not with tf.data (`as_dataset` raises
NotImplementedError for them): `source = builder.as_data_source("train")`, then `source[i]`
is a dict of decoded features (tfds.features.Text values come back as bytes) and
`source.__getitems__(list_of_indices)` a list of them (`source[list]` is an error). Examples
are stored in an order TFDS draws from their keys, not in the raw files' order.
"""

import contextlib
import glob
import logging
import os
import sys
import socket
import tempfile
import urllib.parse
import urllib.request
from typing import Iterator

import tensorflow_datasets as tfds
import tree
from absl import logging as absl_logging
from etils import epath
from tensorflow_datasets.core import constants, file_adapters
from tensorflow_datasets.core.utils import tqdm_utils

from mtrain.data.make_offline import LM1B_HELDOUT_DIR, LM1B_TRAIN_DIR, tree_for
from mtrain.errors import DataError

# lm1b's raw files, relative to the root of its archive's extraction (as its builder globs
# them in tensorflow_datasets/datasets/lm1b/lm1b_dataset_builder.py).
LM1B_GLOBS = (f"{LM1B_TRAIN_DIR}/news.en-*", f"{LM1B_HELDOUT_DIR}/news.en.heldout-*")


def prepare(name: str, data_dir: str | os.PathLike, data_source: str | os.PathLike | None = None,
            file_format: str = "array_record") -> tfds.core.DatasetBuilder:
    """The builder of TFDS dataset `name` ("lm1b", "wmt14_translate/fr-en", "lm1b:1.1.0"),
    prepared in `data_dir` in `file_format` if it was not already.

    With `data_source=None` the builder downloads its archives (into `data_dir/downloads`);
    with a directory it reads them from that raw tree instead and needs no network. Either
    way a failure leaves no dataset behind (TFDS builds into a temporary directory and
    renames it on success) and raises a DataError with a one-line message.
    """
    try:
        wanted_format = file_adapters.FileFormat.from_value(file_format)
    except ValueError as e:
        raise DataError(str(e)) from None
    with _quiet_tfds():
        try:
            builder = tfds.builder(name, data_dir=os.fspath(data_dir))
        except tfds.core.registered.DatasetNotFoundError as e:
            raise DataError(f"unknown TFDS dataset {name!r}: {_first_line(e)}") from None
        if builder.is_prepared():
            info = builder.info
            if wanted_format not in (info.file_format, *info.alternative_file_formats):
                raise DataError(
                    f"{info.full_name} in {data_dir} is prepared as "
                    f"{info.file_format.value}, not {wanted_format.value}; delete "
                    f"{builder.data_dir} to rebuild it, or ask for {info.file_format.value}")
            return builder
        source = None if data_source is None else epath.Path(data_source).expanduser().absolute()
        if source is not None:
            _check_raw_tree(builder, source)
        _remove_unfinished(builder)
        print(f"preparing {name} in {data_dir} from {source or 'the web'}",
              file=sys.stderr, flush=True)
        # GCS only hosts tfrecord datasets, and asking whether it has one needs a network.
        from_gcs = source is None and wanted_format == file_adapters.FileFormat.TFRECORD
        download_config = tfds.download.DownloadConfig(try_download_gcs=from_gcs)
        if source is None:
            _prepare_online(builder, name, download_config, wanted_format)
        else:
            _prepare_offline(builder, name, source, download_config, wanted_format)
    return builder


def _remove_unfinished(builder) -> None:
    """Deletes what preparations of the builder's dataset that were killed left: TFDS builds
    into ``incomplete.<random>_<version>`` beside the version's directory and renames it when
    done. mtrain prepares holding the data dir's lock (`lock.preparing_data`), so none of
    them is still under way."""
    version = epath.Path(builder.data_dir)
    for unfinished in version.parent.glob(f"{constants.INCOMPLETE_PREFIX}*_{version.name}"):
        print(f"removing {unfinished}, left by a preparation that did not finish",
              file=sys.stderr, flush=True)
        unfinished.rmtree()


def _prepare_online(builder, name, download_config, file_format) -> None:
    _check_network(builder, name)
    try:
        with _hooks(builder, **_SILENT):
            builder.download_and_prepare(download_config=download_config,
                                         file_format=file_format)
    except OSError as e:  # requests' ConnectionError and the like are OSErrors
        raise DataError(
            f"could not download {name}: {_first_line(e)}; without a network, write a raw "
            "tree with `python -m mtrain.data.make_offline` and pass it as data_source"
        ) from None


def _prepare_offline(builder, name, source: epath.Path, download_config, file_format) -> None:
    def make_download_manager(download_dir, download_config):
        return OfflineDownloadManager(
            source,
            download_dir=download_dir,
            manual_dir=source,
            manual_dir_instructions=builder.MANUAL_DOWNLOAD_INSTRUCTIONS,
            dataset_name=builder.name,
        )

    # TFDS has no supported way to give a builder another download manager: shadow the
    # builder's `_make_download_manager` (called once by download_and_prepare) on this
    # instance only. The real manager would create <data_dir>/downloads/extracted; this one
    # gets a temporary download directory that it never uses.
    try:
        with (_hooks(builder, _make_download_manager=make_download_manager, **_SILENT),
              tempfile.TemporaryDirectory(prefix="mtrain-tfds-offline-") as download_dir):
            builder.download_and_prepare(download_dir=download_dir,
                                         download_config=download_config,
                                         file_format=file_format)
    except DataError:
        raise
    except Exception as e:
        # A raw file that _check_raw_tree did not know of (the wmt builder asserts that its
        # files exist), or one that is not what the builder reads (not UTF-8 text, not gzip).
        kind = "" if isinstance(e, (OSError, AssertionError)) else f"{type(e).__name__}: "
        raise DataError(f"could not build {name} from the raw tree {source}: "
                        f"{kind}{_first_line(e)}") from None


# download_and_prepare prints two lines of its own (with termcolor, not through absl): the
# one line `prepare` prints says it all.
_SILENT = {"_log_download_bytes": lambda: None, "_log_download_done": lambda: None}


@contextlib.contextmanager
def _hooks(builder: tfds.core.DatasetBuilder, **methods) -> Iterator[None]:
    """Shadows methods of `builder` (this instance only) with `methods` inside the block."""
    for attr, method in methods.items():
        setattr(builder, attr, method)
    try:
        yield
    finally:
        for attr in methods:
            delattr(builder, attr)


class OfflineDownloadManager(tfds.download.DownloadManager):
    """A download manager whose every download and extraction is one local directory.

    `download`, `extract` and `download_and_extract` take a URL, path or
    `tfds.download.Resource`, or a list, tuple or dict of them nested in any way, and return
    the same structure (as the real manager does, via dm-tree) with `source` in place of
    each. `requested` lists what was asked for.
    """

    def __init__(self, source: epath.PathLike, **kwargs):
        super().__init__(**kwargs)
        self.source = epath.Path(source)
        self.requested: list[str] = []

    def _local(self, url_or_urls):
        def one(resource):
            if isinstance(resource, tfds.download.Resource):
                resource = resource.url or resource.path
            self.requested.append(os.fspath(resource))
            return self.source

        return tree.map_structure(one, url_or_urls)

    def download(self, url_or_urls):
        return self._local(url_or_urls)

    def extract(self, path_or_paths):
        return self._local(path_or_paths)

    def download_and_extract(self, url_or_urls):
        return self._local(url_or_urls)

    def download_checksums(self, checksums_url):
        raise DataError(f"{self._dataset_name}: cannot download checksums {checksums_url} "
                        "offline")

    def download_kaggle_data(self, competition_or_dataset):
        raise DataError(f"{self._dataset_name}: cannot download Kaggle data "
                        f"{competition_or_dataset} offline")


def raw_files(builder: tfds.core.DatasetBuilder) -> list[str] | None:
    """Glob patterns, relative to a raw tree, that must each match a file for `builder` to
    build offline; None for builders this module does not know (they are run unchecked).
    """
    if builder.name == "lm1b":
        return list(LM1B_GLOBS)
    from tensorflow_datasets.translate import wmt

    if isinstance(builder, wmt.WmtTranslate):
        source_language = builder.builder_config.language_pair[0]
        patterns = []
        for subset in dict.fromkeys(s for ss in builder.subsets.values() for s in ss):
            paths = wmt.DATASET_MAP[subset].get_path(source_language)
            patterns += [p for p in paths if p and p not in patterns]
        return patterns
    return None


def _check_raw_tree(builder: tfds.core.DatasetBuilder, source: epath.Path) -> None:
    """Raises a DataError naming the first file of `raw_files(builder)` missing in `source`."""
    name = builder.name + (f"/{builder.builder_config.name}" if builder.builder_config else "")
    command = f"python -m mtrain.data.make_offline {tree_for(name) or '...'} {source}"
    if not source.is_dir():
        raise DataError(f"the raw tree {source} for {name} is not a directory; write one "
                        f"with `{command}`")
    missing = [p for p in raw_files(builder) or ()
               if not glob.glob(os.path.join(os.fspath(source), p))]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise DataError(
            f"the raw tree {source} for {name} lacks {os.path.join(os.fspath(source), missing[0])}"
            f"{more}; write a tree with `{command}` (into a new directory)")


def _check_network(builder: tfds.core.DatasetBuilder, name: str) -> None:
    """Fails at once if no host of the builder's registered URLs resolves: TFDS would
    retry every download ten times with backoff, for more than three minutes.

    Skipped where proxies are configured (the proxy resolves names) or the builder
    registers no URLs.
    """
    hosts = sorted({urllib.parse.urlsplit(url).hostname for url in builder.url_infos or ()}
                   - {None})
    if not hosts or urllib.request.getproxies():
        return
    errors = []
    for host in hosts:
        try:
            socket.getaddrinfo(host, None)
            return
        except OSError as e:
            errors.append(f"{host}: {e}")
    raise DataError(
        f"could not download {name}: no network ({errors[0]}); write a raw tree with "
        "`python -m mtrain.data.make_offline` and pass it as data_source")


def _first_line(error: BaseException) -> str:
    text = str(error).strip() or type(error).__name__
    return text.splitlines()[0]


@contextlib.contextmanager
def _quiet_tfds() -> Iterator[None]:
    """TFDS logs every step through absl at INFO and WARNING, and shows tqdm progress bars:
    only errors, while preparing."""
    verbosity = absl_logging.get_verbosity()
    loggers = [logging.getLogger(name) for name in ("absl", "urllib3")]  # urllib3 logs retries
    levels = [logger.level for logger in loggers]
    progress_bar = getattr(tqdm_utils, "_active", True)
    absl_logging.set_verbosity(absl_logging.ERROR)
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    tfds.display_progress_bar(False)
    try:
        yield
    finally:
        absl_logging.set_verbosity(verbosity)
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
        tfds.display_progress_bar(progress_bar)
