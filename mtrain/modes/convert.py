"""``--mode=import`` and ``--mode=export``: Hugging Face model folders in and out.

Import (`import_model`) makes a model dir of a published model: its ``config.gin`` (the
run's operative config, whose model settings came from config.json: `config.parse_import`),
its ``vocabulary.model`` (the folder's tokenizer) and a step-0 checkpoint of its parameters
alone (`Checkpoints.save_imported`). Each parameter is made by `jax.make_array_from_callback`
in the run's layout: every device's slice read from the safetensors files and converted
there (`huggingface.weights`), so that a host reads and holds only what its devices hold,
a slice at a time. The folder's chat template, if any, is kept as the model dir's
``chat_template.jinja``, and where it came from (its family, folder and adapter) as
``huggingface.json`` (`huggingface.origin`), which export reads. Its config.gin carries
fine-tuning's optimizer where the user's gin names none (`families.FINE_TUNING`: AdamW at
a constant 1e-4 after 10 warmup steps). Everything is written to ``<model_dir>.importing``
and renamed to the model dir at the end (`work_dirs.writing`): a failed or killed import
leaves no model dir behind, and what a killed one leaves is marked as mtrain's and cleared
by the next import or export beside it.

Export (`export_model`) writes a checkpoint of a model dir (the newest, or
``--checkpoint_step``) as a folder Hugging Face loads, as the family the model dir
recorded at import (else the first whose settings the model has: `families.of_model`):
``config.json``, ``generation_config.json``, the weights in safetensors shards of at most
5 GB (with ``model.safetensors.index.json`` when there are several) and the tokenizer's
files. Each parameter is gathered, converted and written in turn (`tensors.write_folder`):
no host holds more than one at a time; the model dir's chat template goes to chat_template.jinja and
tokenizer_config.json. It too writes into ``<output_dir>.exporting`` and renames.
"""

from __future__ import annotations

import json
import logging
import os
import time

import jax
import numpy as np
from jax.experimental import multihost_utils

from mtrain.errors import ConfigError
from mtrain.huggingface import adapters, families, origin, records, tensors, weights
from mtrain.huggingface.vocabulary import chat_template, write_tokenizer
from mtrain.io.checkpoints import Checkpoints
from mtrain.training.start import restore_for_reading
from mtrain.io.model_dir import ModelDir
from mtrain.io.textfiles import write_atomically
from mtrain.io.work_dirs import writing
from mtrain.models import parameters
from mtrain.models.lora import merged
from mtrain.models.quantization import is_meta
from mtrain.modes.experiment import Experiment
from mtrain.data.vocabulary import load_vocabulary

log = logging.getLogger("mtrain")

# Tensors a folder may hold that the model does not read: the copies of T5's shared
# table in each stack, and the rotary frequencies older Llama checkpoints saved.
_IGNORED = ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight")
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


# The top of an import's config.gin (a training run writes its own operative config).
_HEADER = """\
# {} imported from {} (huggingface.json).
# Unless the import's gin said otherwise, a fine-tuning's optimizer, as Hugging Face's
# Trainer and TRL fine-tune: AdamW (b2 0.999, no weight decay), a constant rate of 1e-4
# after 10 warmup steps (mtrain/huggingface/families.py, FINE_TUNING, says why). For LoRA,
# 2e-4 trains a little faster; a large model fine-tuned in full may want 2e-5.

"""


def _unflatten(flat: dict[str, object]) -> dict:
    tree: dict = {}
    for name, value in flat.items():
        node = tree
        *parents, last = name.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    return tree


def check_new_dir(path: str, what: str) -> None:
    """Raises a ConfigError unless `path` is a new or empty directory."""
    if os.path.isfile(path):
        raise ConfigError(f"{what} {path} is a file; name a new directory")
    if os.path.isdir(path) and os.listdir(path):
        raise ConfigError(f"{what} {path} is not empty; name a new directory")


def import_model(exp: Experiment, input_dir: str, settings: families.Settings, vocab,
                 adapter_dir: str | None = None) -> dict:
    """Writes the model dir of `exp` from the Hugging Face folder `input_dir` (`settings`
    of its config.json, `vocab` its tokenizer), with the PEFT LoRA adapter of
    `adapter_dir` if given (its settings already in the gin config: `adapters`); returns
    what it did."""
    start = time.time()
    model_dir = exp.model_dir
    folder = tensors.Folder(input_dir)
    c = exp.model_config
    family = records.named(settings.family)
    sources = weights.parameters(family, c, settings.vocab_size)
    if adapter_dir is not None:
        folder.add(adapter_dir, adapters.WEIGHTS)
        sources |= weights.adapters(sources, c.lora)
    params = exp.trainer.abstract_state.params
    shardings = parameters.paths(exp.trainer.state_shardings.params)
    wanted = {path: leaf for path, leaf in parameters.paths(params).items()
              if not is_meta(path)}  # (delayed fp8 scaling's state: fresh when a run starts)
    if sorted(wanted) != sorted(sources):
        odd = sorted(set(wanted) ^ set(sources))
        raise ConfigError(f"the model's parameters do not match {settings.family}'s tensors "
                          f"({odd[0]}): a setting of the gin config changes the model")
    _check_tensors(folder, sources, settings.family, adapter_dir)
    template = chat_template(input_dir)
    check_new_dir(model_dir, "the model dir")
    with writing(model_dir, ".importing", "the model dir") as work:
        arrays = {}
        for name, leaf in wanted.items():
            source = sources[name]
            arrays[name] = jax.make_array_from_callback(
                leaf.shape, shardings[name],
                lambda index, s=source, shape=leaf.shape: s.read(
                    folder, weights.ranges(index, shape)).astype(np.float32))
        record = origin.Origin(settings.family, origin.location(input_dir),
                               adapter_dir and origin.location(adapter_dir))
        imported = {"from": record.source, "architecture": record.architecture}
        if adapter_dir is not None:
            imported["adapter"] = record.adapter
        meta = {"model": exp.model_meta(vocab), "imported": imported}
        checkpoints = Checkpoints(ModelDir(work).checkpoints, async_save=False)
        try:
            checkpoints.save_imported(0, _unflatten(arrays), meta)
        finally:
            checkpoints.close()
        del arrays
        if jax.process_index() == 0:
            vocab.save(ModelDir(work).vocabulary)
            write_atomically(ModelDir(work).config, _HEADER.format(record.architecture,
                                                                   record.source) + exp.config_text)
            origin.write(work, record)
            if template is not None:
                write_atomically(ModelDir(work).chat_template, template)
    count = sum(int(np.prod(leaf.shape)) for leaf in wanted.values())
    log.info("imported %s (%d parameters, %s) from %s into %s in %.1f s", settings.family,
             count, f"{len(folder.names())} tensors", input_dir, model_dir, time.time() - start)
    return {"parameters": count, "seconds": time.time() - start}


def _check_tensors(folder: tensors.Folder, sources: dict, family: str,
                   adapter_dir: str | None = None) -> None:
    """Every tensor the model reads is in `folder` with its shape, and `folder` holds no
    other (a config.json that does not describe these weights; an adapter of another base
    or of other modules than its config says)."""
    needed = {}
    for source in sources.values():
        needed.update(dict(source.tensors()))
    copies = weights.copies(sources.values())  # (need not be there: never read)
    for name, shape in needed.items():
        if name in copies and name not in folder:
            continue
        if adapter_dir is not None and name.startswith(weights.PEFT_PREFIX):
            if name not in folder:
                raise ConfigError(f"the adapter in {adapter_dir} has no tensor {name}, which "
                                  f"its {adapters.CONFIG} asks for")
            if tuple(folder.shape(name)) != tuple(shape):
                raise ConfigError(f"the adapter in {adapter_dir} is not of this base model: "
                                  f"its {name} is {list(folder.shape(name))}, the base's "
                                  f"projection makes it {list(shape)}")
            continue
        if name not in folder:
            raise ConfigError(f"{folder.path} has no tensor {name}, which config.json's "
                              f"{family} needs")
        if tuple(folder.shape(name)) != tuple(shape):
            raise ConfigError(f"tensor {name} in {folder.path} has shape "
                              f"{list(folder.shape(name))}; config.json makes it {list(shape)}")
    for name in folder.names():
        if adapter_dir is not None and name.startswith(weights.PEFT_PREFIX) \
                and name not in needed:
            raise ConfigError(f"the adapter in {adapter_dir} holds tensor {name}, which its "
                              f"{adapters.CONFIG} does not ask for")
        if name not in needed and name not in _IGNORED and not name.endswith(_IGNORED_SUFFIXES) \
                and name != "lm_head.weight":  # (a tied model may keep a copy of its table)
            raise ConfigError(f"{folder.path} holds tensor {name}, which config.json's "
                              f"{family} does not have (a setting config.json does not show)")


DTYPES = {"float32": np.float32, "bfloat16": tensors.DTYPES["BF16"], "float16": np.float16}


def export_model(exp: Experiment, output_dir: str, step: int | None, dtype: str,
                 model_size: int | None = None,
                 max_shard_bytes: int = tensors.MAX_SHARD_BYTES, adapter: bool = False) -> dict:
    """Writes checkpoint `step` (None: the newest) of `exp`'s model dir as a Hugging Face
    folder `output_dir` of `dtype` weights (`model_size`: ``vocabulary.model_size``, the
    rows of its vocabulary dimension if more than the pieces); returns what it wrote. A
    LoRA model's adapters are merged into its weights (W + scale x A B), or with `adapter`
    written alone as a PEFT adapter folder."""
    start = time.time()
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    model_dir = ModelDir(exp.model_dir)
    if not os.path.exists(model_dir.vocabulary):
        raise ConfigError(f"{exp.model_dir} has no {os.path.basename(model_dir.vocabulary)}: "
                          f"not a model dir that trained or imported a model")
    vocab = load_vocabulary(model_dir.vocabulary)
    rows = max(vocab.vocab_size, model_size or 0)
    came_from = origin.read(exp.model_dir, exp.config.init_from)
    family = (records.named(came_from.architecture) if came_from
              else families.of_model(exp.model_config))
    config = families.hf_config(family, exp.model_config, rows, vocab.eos_id, vocab.bos_id,
                                vocab.pad_id)
    sources = weights.parameters(family, exp.model_config, rows)
    lora = exp.model_config.lora
    if adapter and lora is None:
        raise ConfigError(f"--adapter: {exp.model_dir} has no LoRA adapters (lora.rank is 0)")
    state, step = restore_for_reading(model_dir.checkpoints, exp.trainer.sharded_abstract_state(),
                                      exp.reader_meta(vocab), step)
    params = parameters.paths(state.params)
    if adapter:
        return _export_adapter(exp, output_dir, dtype, sources, params, step, start,
                               came_from.source if came_from else None)
    template_file = model_dir.chat_template
    template = None
    if os.path.isfile(template_file):
        with open(template_file, encoding="utf-8") as f:
            template = f.read()
    check_new_dir(output_dir, "--output_dir")
    with writing(output_dir, ".exporting", "--output_dir") as work:
        entries = weights.entries(sources.values())

        def produce():  # (a tensor made of several parameters written with its last)
            for name, source in sources.items():
                value = _gathered(params, name, lora)  # (adapters merged in)
                yield from source.to_hf(value)

        written = []
        if jax.process_index() == 0:
            written = tensors.write_folder(work, entries, DTYPES[dtype],
                                           lambda: weights.whole(produce()),
                                           max_shard_bytes)
            config["dtype"] = dtype
            generation = families.generation_config(family, config)
            for name, content in (("config.json", config),
                                  ("generation_config.json", generation)):
                with open(os.path.join(work, name), "w") as f:
                    json.dump(content, f, indent=2)
            written += ["config.json", "generation_config.json",
                        *write_tokenizer(vocab, config, work, template)]
        else:
            for _ in produce():  # (the gathers are collective)
                pass
    log.info("exported step %d of %s as %s (%s, %d tensors) to %s in %.1f s", step,
             exp.model_dir, family, dtype, len(entries), output_dir, time.time() - start)
    return {"step": step, "files": sorted(written), "seconds": time.time() - start}


def _gathered(params: dict, name: str, lora) -> np.ndarray:
    """The whole parameter `name`; a weight with an adapter with it merged in, W + scale x
    A B (`models.lora`)."""
    gather = lambda path: np.asarray(  # noqa: E731
        multihost_utils.process_allgather(params[path], tiled=True))
    if f"{name}_lora_a" not in params:
        return gather(name)
    return merged(gather(name), gather(f"{name}_lora_a"), gather(f"{name}_lora_b"),
                  lora.scale)


def _export_adapter(exp: Experiment, output_dir: str, dtype: str, sources: dict,
                    params: dict, step: int, start: float, base: str | None) -> dict:
    """Writes the adapters of `params` as a PEFT adapter folder (`huggingface.adapters`) of
    the base model `base` (the folder the model dir was imported from; None: a model
    trained here, whose model dir it names)."""
    if base is None:
        base = os.path.abspath(exp.model_dir)
        log.warning("%s records no Hugging Face import: the adapter's base_model_name_or_path "
                    "names the model dir; export the base too (--mode=export without "
                    "--adapter) and name that folder there", exp.model_dir)
    lora = exp.model_config.lora
    adapted = weights.adapters(sources, lora)
    unwritten = sorted(p.removesuffix("_lora_a") for p in params
                       if p.endswith("_lora_a") and p not in adapted)
    if unwritten:
        raise ConfigError(f"--adapter: the adapter of {unwritten[0]} has no PEFT module to "
                          f"be (gpt-oss's experts are parameters, which PEFT adapts by "
                          f"target_parameters, not LoRA modules); export the model merged "
                          f"(without --adapter), or train without it in lora.targets")
    entries = [t for source in adapted.values() for t in source.tensors()]
    modules = sorted({name.split(".")[-3] for name, _ in entries})  # q_proj, w1, ...

    def produce():
        for name, source in adapted.items():
            yield from source.to_hf(_gathered(params, name, lora))

    with writing(output_dir, ".exporting", "--output_dir") as work:
        written = []
        if jax.process_index() == 0:
            written = tensors.write_folder(work, entries, DTYPES[dtype], produce,
                                           single=adapters.WEIGHTS)
            adapters.write_config(work, lora, base, modules)
            written.append(adapters.CONFIG)
        else:
            for _ in produce():
                pass
    log.info("exported the LoRA adapter of step %d of %s (%d tensors, %s) to %s in %.1f s",
             step, exp.model_dir, len(entries), dtype, output_dir, time.time() - start)
    return {"step": step, "files": sorted(written), "seconds": time.time() - start}
