"""The command line: ``python -m mtrain --gin_file=quickstart.gin --model_dir=DIR``.

Flags are parsed before jax is imported, so that ``--cpu_devices`` can still set the number
of simulated CPU devices. Mistakes a user can make end in one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import os
import sys
import types

from mtrain import MODES, python_too_old
from mtrain.errors import Interrupted, UserError  # neither imports jax


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else None


class _ArgumentParser(argparse.ArgumentParser):
    def error(self, message):
        """A flag that is wrong: one line, as every other mistake (the usage is --help's)."""
        raise UserError(f"{message} (see --help)")


def parse_args(argv=None) -> argparse.Namespace:
    p = _ArgumentParser(
        prog="python -m mtrain",
        description="Train or evaluate a mesh-sharded Transformer described by gin files.",
    )
    p.add_argument("--gin_file", action="append", default=[], metavar="FILE",
                   help="gin config file, searched in the working directory and then in configs/ "
                        "(repeatable; later files override earlier ones)")
    p.add_argument("--gin_param", action="append", default=[], metavar="BINDING",
                   help="a gin binding such as \"run.train_steps=100\" applied after the files "
                        "(repeatable)")
    p.add_argument("--model_dir", default=None,
                   help="where checkpoints, metrics.jsonl, TensorBoard events and config.gin go; "
                        "a run on a dir with checkpoints resumes from the latest one "
                        "(default: run.model_dir from gin, else ./runs/default)")
    p.add_argument("--restart", action="store_true",
                   help="train from step 0 in a --model_dir whose checkpoints cannot be resumed "
                        "(damaged, or of a run with other settings): its checkpoints, metrics and "
                        "config are first moved to <model_dir>/before-restart-<n>/, nothing is "
                        "deleted")
    p.add_argument("--data_source", default=None, metavar="DIR",
                   help="TFDS tasks (lm1b, wmt14_enfr): run the real TFDS builder on raw files in "
                        "DIR, laid out as the official archives (make them with python -m "
                        "mtrain.data.make_offline), or 'shipped' to make them from the corpus in "
                        "data/; without it TFDS downloads (same as run.data_source, and "
                        "recorded as it in the model dir's config.gin)")
    p.add_argument("--mode", choices=MODES, default=None,
                   help="train (default); eval: evaluate the latest checkpoint of --model_dir "
                        "(loss, accuracy, perplexity or BLEU); infer: translate --input_file "
                        "with it (an LM: continue each line); score: the log-likelihood of each line of --input_file "
                        "(translation: 'source<TAB>target'), as JSON lines; plan: compile the train step for the configured mesh on "
                        "simulated CPU devices and report memory, FLOPs, collectives and a "
                        "step-time estimate for --target, without data or accelerators; "
                        "import: make --model_dir from the Hugging Face model folder "
                        "--input_dir; export: write its checkpoint as one, to --output_dir; "
                        "lm_eval: lm-evaluation-harness's --tasks on the latest checkpoint")
    p.add_argument("--target", default="tpu-v3", metavar="NAME",
                   help="--mode=plan: the accelerator to estimate for: tpu-v2, tpu-v3, tpu-v4, "
                        "tpu-v5e, tpu-v5p, h100 or h200 (default tpu-v3)")
    p.add_argument("--format", default="text", choices=["text", "json"],
                   help="--mode=plan: a report for people (text) or one JSON object")
    p.add_argument("--auto_layout", action="store_true",
                   help="--mode=plan: try every 1-, 2- and 3-D mesh of --devices devices with "
                        "the candidate layout rules; print the fastest that fit as gin lines")
    p.add_argument("--prompt_length", type=int, default=None, metavar="N",
                   help="--mode=plan, a decoder-only LM: generation's figures (prefill, first "
                        "token, tokens/s) for prompts of N tokens (default: half the row)")
    p.add_argument("--devices", type=int, default=None, metavar="N",
                   help="--mode=plan --auto_layout: the number of devices to lay the model out "
                        "on (default: the size of run.mesh_shape)")
    p.add_argument("--slices", type=int, default=1, metavar="N",
                   help="--mode=plan: the devices are N slices (TPU multislice) or GPU nodes "
                        "joined by the data-centre network, which the first mesh dimension "
                        "spans (its size a multiple of N): collectives over it at --target's "
                        "DCN bandwidth (default 1)")
    p.add_argument("--tasks", default=None, metavar="T1,T2",
                   help="--mode=lm_eval: lm-eval's task or group names (hellaswag,arc_easy)")
    p.add_argument("--include_path", default=None, metavar="DIR",
                   help="--mode=lm_eval: a folder of task YAMLs of your own, besides lm-eval's")
    p.add_argument("--limit", type=int, default=None, metavar="N",
                   help="--mode=lm_eval: at most N documents a task (default: all)")
    p.add_argument("--num_fewshot", type=int, default=None, metavar="K",
                   help="--mode=lm_eval: K examples before each document (default: the task's)")
    p.add_argument("--apply_chat_template", action="store_true",
                   help="--mode=lm_eval: prompts through the model dir's chat template")
    p.add_argument("--log_samples", action="store_true",
                   help="--mode=lm_eval: every document's requests and responses, as JSON lines")
    p.add_argument("--input_file", default=None, metavar="FILE",
                   help="--mode=infer: sentences to translate (an LM: prompts), one per line; --mode=score: "
                        "lines to score (default: stdin)")
    p.add_argument("--output_file", default=None, metavar="FILE",
                   help="--mode=infer: where the translations (continuations) go, one per line; --mode=score: "
                        "one JSON object per line (default: stdout; logs go to stderr)")
    p.add_argument("--output_dir", default=None, metavar="DIR",
                   help="--mode=eval, score and lm_eval: where their metrics, TensorBoard events "
                        "and decodes go (default: the model dir, where it can be written; a "
                        "model dir that cannot be written, shared or published, keeps none); "
                        "--mode=export: the Hugging Face folder to write (new)")
    p.add_argument("--input_dir", default=None, metavar="DIR",
                   help="--mode=import: a Hugging Face model folder (config.json, "
                        "model.safetensors or shards with their index, the tokenizer) of a "
                        "LlamaForCausalLM, MixtralForCausalLM or T5ForConditionalGeneration")
    p.add_argument("--adapter_dir", default=None, metavar="DIR",
                   help="--mode=import: a PEFT LoRA adapter folder (adapter_config.json, "
                        "adapter_model.safetensors) of the --input_dir model, imported with it")
    p.add_argument("--ignore_adapter_base", action="store_true",
                   help="--mode=import --adapter_dir: import the adapter even where its "
                        "adapter_config.json names another base model than --input_dir "
                        "(compared by their last names; refused without this flag)")
    p.add_argument("--adapter", action="store_true",
                   help="--mode=export of a LoRA model: its adapter alone, as a PEFT folder "
                        "(adapter_config.json, adapter_model.safetensors); without it, the "
                        "model with its adapters merged into its weights")
    p.add_argument("--checkpoint_step", type=int, default=None, metavar="N",
                   help="--mode=export: the checkpoint to export (default: the newest)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="--mode=export: the weights' dtype (default float32)")
    p.add_argument("--cpu_devices", type=int, default=None, metavar="N",
                   help="run on N simulated CPU devices (sets XLA's host device count before jax "
                        "starts), so that e.g. a batch:4;model:2 mesh runs on a laptop")
    env = os.environ.get
    p.add_argument("--coordinator_address", default=env("MTRAIN_COORDINATOR_ADDRESS"),
                   metavar="HOST:PORT",
                   help="multi-process runs: where process 0 listens (also "
                        "$MTRAIN_COORDINATOR_ADDRESS); not needed on Cloud TPU or under Slurm, "
                        "where JAX finds it")
    p.add_argument("--num_processes", type=int, default=_env_int("MTRAIN_NUM_PROCESSES"),
                   metavar="N", help="multi-process runs: how many processes (also "
                                     "$MTRAIN_NUM_PROCESSES)")
    p.add_argument("--process_id", type=int, default=_env_int("MTRAIN_PROCESS_ID"),
                   metavar="I", help="multi-process runs: this process, 0 .. N-1 (also "
                                     "$MTRAIN_PROCESS_ID)")
    p.add_argument("--distributed_timeout", type=int, default=300, metavar="SECONDS",
                   help="multi-process runs: how long to wait for every process to join")
    p.add_argument("--heartbeat_timeout", type=int, default=100, metavar="SECONDS",
                   help="multi-process runs: a process silent this long is taken for dead, "
                        "and the others stop")
    p.add_argument("--verbose", action="store_true",
                   help="debug logging, and full tracebacks for errors (by default an error is "
                        "one line)")
    return p.parse_args(argv)


def _plan_devices(args: argparse.Namespace) -> int:
    """Makes jax see as many CPU devices as the plan needs (the mesh's size, or --devices),
    which works because nothing has started jax's backends yet; returns that number."""
    import gin
    import jax

    from mtrain.errors import ConfigError
    from mtrain.parallel.layout import Layout

    if args.devices is not None and args.devices < 1:
        raise ConfigError("--devices must be at least 1")
    try:
        mesh_shape = gin.query_parameter("run.mesh_shape")
    except ValueError:
        mesh_shape = ""
    needed = args.devices or Layout(mesh_shape).size
    if args.cpu_devices is None:
        try:
            jax.config.update("jax_platforms", "cpu")  # plans compile for CPU, on any machine
            jax.config.update("jax_num_cpu_devices", needed)
            # A plan compiles but never runs: skip LLVM's optimisations (they change no
            # number the plan reads, and take most of the compile time).
            os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                       + " --xla_backend_optimization_level=0"
                                       + " --xla_llvm_disable_expensive_passes=true").strip()
        except RuntimeError:  # backends already started (mtrain used as a library)
            pass
    if jax.device_count() < needed:
        raise ConfigError(f"the plan needs {needed} devices but jax has {jax.device_count()}; "
                          f"drop --cpu_devices (plan simulates as many as it needs)")
    return needed


def _quiet_library_noise(verbose: bool) -> None:
    """orbax restores arrays with asyncio coroutines and tensorstore callbacks. When one read
    fails (a damaged checkpoint), the others are abandoned, and Python reports each of them
    as it is collected: thousands of "Exception ignored in: <coroutine ...>" and "Event loop
    is closed" tracebacks on stderr, asyncio logs "Task exception was never retrieved" and
    Python warns "coroutine ... was never awaited" for some, after mtrain has said in one
    line what happened. Unless `verbose`, those reports go to the debug log instead (mtrain
    itself uses no asyncio)."""
    if verbose or getattr(sys.unraisablehook, "mtrain_quiet", False):
        return  # (installed once per process, however often main runs)
    import logging
    import warnings

    logging.getLogger("asyncio").setLevel(logging.CRITICAL)
    warnings.filterwarnings("ignore", message="coroutine .* was never awaited",
                            category=RuntimeWarning)
    debug = logging.getLogger("mtrain").debug
    unraisable, excepthook = sys.unraisablehook, sys.excepthook

    def on_unraisable(report):
        if isinstance(report.object, types.CoroutineType) or _loop_closed(report.exc_value):
            debug("ignored: %s in %r", report.exc_value, report.object)
        else:
            unraisable(report)

    def on_exception(kind, value, traceback):
        if _loop_closed(value):
            debug("ignored: %s", value)
        else:
            excepthook(kind, value, traceback)

    on_unraisable.mtrain_quiet = True
    sys.unraisablehook, sys.excepthook = on_unraisable, on_exception


def _loop_closed(error: BaseException | None) -> bool:
    return isinstance(error, RuntimeError) and str(error) == "Event loop is closed"


def main(argv=None) -> int:
    if why := python_too_old():
        print(f"mtrain: error: {why}", file=sys.stderr)
        return 2
    try:
        args = parse_args(argv)
        if (args.input_dir is None) != (args.mode != "import"):
            raise UserError("--mode=import needs --input_dir (a Hugging Face model folder)"
                            if args.mode == "import" else "--input_dir goes with --mode=import")
        if args.adapter_dir is not None and args.mode != "import":
            raise UserError("--adapter_dir goes with --mode=import")
        if args.mode == "import" and not args.model_dir:
            raise UserError("--mode=import needs --model_dir (a new directory to write)")
        lm_eval_flags = (args.tasks, args.include_path, args.limit, args.num_fewshot)
        if args.mode == "lm_eval" and not args.tasks:
            raise UserError("--mode=lm_eval needs --tasks (lm-eval's task names, comma-separated)")
        if args.mode != "lm_eval" and (any(f is not None for f in lm_eval_flags)
                                       or args.apply_chat_template or args.log_samples):
            raise UserError("--tasks, --include_path, --limit, --num_fewshot, "
                            "--apply_chat_template and --log_samples go with --mode=lm_eval")
        if args.mode == "export":
            if not (args.model_dir and args.output_dir):
                raise UserError("--mode=export needs --model_dir and --output_dir (the "
                                "Hugging Face folder to write)")
        elif args.mode != "import" and (args.checkpoint_step is not None
                                        or args.dtype != "float32" or args.adapter):
            raise UserError("--checkpoint_step, --dtype and --adapter go with --mode=export")
        if not (args.gin_file or args.gin_param or args.mode in ("import", "export")):
            raise UserError("nothing to run: give a --gin_file (the quickstart's is "
                            "--gin_file=quickstart.gin; see --help)")
    except UserError as e:
        print(f"mtrain: error: {e}", file=sys.stderr)
        return 2
    _quiet_library_noise(args.verbose)
    if args.mode != "plan" and (args.auto_layout or args.devices is not None):
        print("mtrain: error: --auto_layout and --devices go with --mode=plan", file=sys.stderr)
        return 2
    if args.slices != 1 and (args.mode != "plan" or args.slices < 1):
        print("mtrain: error: --slices (at least 1) goes with --mode=plan", file=sys.stderr)
        return 2
    if args.restart and args.mode not in (None, "train"):
        print("mtrain: error: --restart goes with --mode=train", file=sys.stderr)
        return 2
    if args.prompt_length is not None and (args.mode != "plan" or args.prompt_length < 1):
        print("mtrain: error: --prompt_length (at least 1) goes with --mode=plan", file=sys.stderr)
        return 2
    if args.cpu_devices is not None:
        if args.cpu_devices < 1:
            print("mtrain: error: --cpu_devices must be at least 1", file=sys.stderr)
            return 2
        from mtrain.parallel.cpu_devices import simulate_cpu_devices

        simulate_cpu_devices(args.cpu_devices)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # TensorFlow only feeds the input pipeline
    os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")  # and should not log about oneDNN
    if args.mode != "plan":  # a plan is one process however many devices it plans for
        from mtrain.parallel import distributed

        try:  # before anything else touches jax
            distributed.initialize(args.coordinator_address, args.num_processes,
                                   args.process_id, args.distributed_timeout,
                                   args.heartbeat_timeout)
        except UserError as e:
            print(f"mtrain: error: {e}", file=sys.stderr)
            return 2

    try:
        return _run(args)
    except KeyboardInterrupt:
        if args.verbose:
            raise
        print("mtrain: interrupted (Ctrl-C)", file=sys.stderr)
        return 130


def _run(args: argparse.Namespace) -> int:
    from mtrain import config as config_lib
    from mtrain import run as run_lib  # imports jax: only after the flags set in main
    from mtrain.io.metrics import setup_logging

    try:
        if args.mode == "export" and not (args.gin_file or args.gin_param):
            from mtrain.io.model_dir import ModelDir  # (the model dir's own config)

            args.gin_file = [ModelDir(args.model_dir).config]
            if not os.path.isfile(args.gin_file[0]):
                raise UserError(f"{args.model_dir} has no {os.path.basename(args.gin_file[0])}: "
                                f"give the run's --gin_file")
        imported = None
        if args.mode == "import":
            imported = (args.input_dir, *config_lib.parse_import_config(
                args.gin_file, args.gin_param, args.input_dir, args.adapter_dir,
                args.ignore_adapter_base),
                args.adapter_dir)
        else:
            run_lib.parse_config(args.gin_file, args.gin_param)
        if args.mode == "plan":
            plan_devices = _plan_devices(args)  # before anything starts jax (logging does)
        setup_logging(args.verbose)
        kwargs = {}
        if args.model_dir is not None:
            kwargs["model_dir"] = args.model_dir
        elif not run_lib.model_dir_is_bound():
            kwargs["model_dir"] = os.path.join("runs", "default")
        if args.mode is not None:
            kwargs["mode"] = args.mode
        if args.data_source is not None:  # (recorded in config.gin: a path made absolute)
            local = args.data_source != "shipped" and "://" not in args.data_source
            kwargs["data_source"] = (os.path.abspath(os.path.expanduser(args.data_source))
                                     if local else args.data_source)
        if args.mode in ("infer", "score"):
            kwargs.update(input_file=args.input_file, output_file=args.output_file)
        if args.output_dir is not None:
            if args.mode not in ("eval", "score", "export", "lm_eval"):
                raise UserError("--output_dir goes with --mode=eval, score, lm_eval or export")
            kwargs["output_dir"] = args.output_dir
        if imported:
            kwargs["imported"] = imported
        if args.mode == "lm_eval":
            from mtrain.modes.lm_eval import Tasks

            kwargs["lm_eval_tasks"] = Tasks.parse(
                args.tasks, include_path=args.include_path, limit=args.limit,
                num_fewshot=args.num_fewshot, apply_chat_template=args.apply_chat_template,
                batch_size=config_lib.decoding().batch_size, log_samples=args.log_samples)
        if args.mode == "export":
            kwargs["export_options"] = {"step": args.checkpoint_step, "dtype": args.dtype,
                                        "adapter": args.adapter}
        if args.restart:
            kwargs["restart"] = True
        if args.mode == "plan":
            kwargs["plan_options"] = {"target": args.target, "output_format": args.format,
                                      "auto_layout": args.auto_layout, "devices": plan_devices,
                                      "prompt_length": args.prompt_length,
                                      "slices": args.slices}
            if args.auto_layout:  # the search replaces the configured mesh and rules
                kwargs.update(mesh_shape="", layout_rules="", parameter_layout_rules="")
        run_lib.run(**kwargs)
    except Interrupted as e:
        print(f"mtrain: {e}", file=sys.stderr)
        return 130
    except (UserError, OSError) as e:  # OSError: a file system that fails us (full, gone)
        if args.verbose:
            raise
        # gin appends "In call to configurable ..." lines to errors raised inside a
        # configurable: the first line is the message.
        message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"mtrain: error: {message}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
