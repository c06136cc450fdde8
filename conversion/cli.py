"""Options shared by the conversion commands, and running a command. Imports only the standard library at load
time, so that `--help` answers without loading torch; each command imports its job module after parsing."""

import argparse
import contextlib
import importlib
import re
import sys
import warnings


def parse_size(text):
    """'5GB', '500MB', '2GiB', '123456' -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)?\s*", str(text), re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 5GB, 500MB, 2GiB, 1000000)")
    unit = (m.group(2) or "").upper().rstrip("B")
    mult = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
            "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}[unit]
    value = int(float(m.group(1)) * mult)
    if value <= 0:
        raise argparse.ArgumentTypeError("the size must be positive")
    return value


def parser(doc):
    """An argument parser whose description is the command's module docstring, with the common options."""
    return argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def add_common_args(ap, default_shard_size_help):
    ap.add_argument("source", help="source folder (read only: nothing in it is ever written, moved or touched)")
    ap.add_argument("output", help="output folder; must not exist unless --overwrite. Written as a hidden "
                    "'.<name>.partial' folder next to it (after checking that its file system has room) and renamed "
                    "into place once complete and verified")
    ap.add_argument("--max-shard-size", type=parse_size, default=None, metavar="SIZE",
                    help=f"re-shard the output into files of at most SIZE (e.g. 5GB, 500MB; a single tensor larger "
                         f"than SIZE gets a shard of its own). {default_shard_size_help}")
    ap.add_argument("--dry-run", action="store_true",
                    help="check the source completely (headers, names, shapes, dtypes, every tensor's values), "
                         "print the plan and write nothing at all")
    ap.add_argument("--resume", action="store_true",
                    help="continue an interrupted run: keep the shards of the partial folder that are recorded "
                         "as finished and whose sha256 still matches, write the rest. Without --resume a stale "
                         "partial folder of this tool is discarded and the conversion starts over")
    ap.add_argument("--verify", action=argparse.BooleanOptionalAction, default=True,
                    help="after writing, read every output tensor back and compare it bit for bit with what the "
                         "source gives, and compare logits of source and output models on random tokens when "
                         "they fit in memory (see --forward-check-max-gb). Default: on")
    ap.add_argument("--forward-check-max-gb", type=float, default=16.0, metavar="GB",
                    help="run the forward-pass comparison only when two fp32 copies of the model take at most "
                         "this many GB (8 bytes per parameter); 0 disables it. Default: 16")
    ap.add_argument("--overwrite", action="store_true",
                    help="replace an existing output folder written by these converters (it carries their "
                         ".kimi3-conversion.json manifest) or an empty one; any other folder, and a file, are "
                         "refused. The old folder is swapped out only after the new one is complete")
    ap.add_argument("--quiet", action="store_true",
                    help="no progress bars (Transformers' included), only the final summary and errors")


def run(build_job, args):
    """Plan the job with `build_job(args)` and run it. A bad source or output path, too little free space, and an
    OSError (disk full, no permission) are reported as one line 'error: ...' on stderr with exit status 1."""
    from transformers_kimi3.checkpoint import CheckpointError  # torch and the model: only past argument parsing

    from kimi3_conversion.runner import OutputError, run_job

    try:
        with progress_bars(not args.quiet):
            return run_job(build_job(args), args)
    except (CheckpointError, OutputError) as e:
        print(f"error: {e}", file=sys.stderr)
    except OSError as e:
        print(f"error: cannot access a file: {e.filename}: {e.strerror or e}", file=sys.stderr)
    return 1


@contextlib.contextmanager
def progress_bars(enabled):
    """Transformers' progress bars (model loading in the forward check) and huggingface_hub's off unless `enabled`;
    both settings are restored afterwards."""
    if enabled:
        yield
        return
    from transformers.utils import logging

    hub_tqdm = importlib.import_module("huggingface_hub.utils.tqdm")  # the module (its package exports a class)
    was_on, hub_states = logging.is_progress_bar_enabled(), dict(hub_tqdm.progress_bar_states)
    logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            with warnings.catch_warnings():  # huggingface_hub warns when HF_HUB_DISABLE_PROGRESS_BARS keeps its off
                warnings.simplefilter("ignore")
                logging.enable_progress_bar()
        hub_tqdm.progress_bar_states.clear()
        hub_tqdm.progress_bar_states.update(hub_states)
