"""Running a planned conversion (`plan.Job`): write, verify, publish; or check everything and write nothing.

Order of a run: the output path and the free space checked, shards into the partial folder (finished ones of an
interrupted run kept with --resume), the other files, verification, the index, config.json last, then the rename
into place. An interrupted run therefore never leaves a folder that looks complete at the output path. A source
found bad on the way discards the partial folder (there is nothing worth resuming); an OSError while writing (disk
full, no permission) keeps it, for --resume. The source folder itself is only ever read.
"""

import contextlib
import os
import shutil

from transformers_kimi3.checkpoint import CheckpointError

from kimi3_conversion.progress import Progress, say
from kimi3_conversion.resume import (
    MANIFEST,
    is_conversion_output,
    is_finished,
    load_manifest,
    open_partial,
    partial_dir,
    publish,
    record_finished,
)
from kimi3_conversion.tensor_io import shard_file_size, write_index, write_shard
from kimi3_conversion.verify import verify_shards

OTHER_FILES_BYTES = 10**7  # code files, card, config and index written besides the shards and copied files
_PICKLES = (".bin", ".pt", ".pth", ".ckpt")


class OutputError(Exception):
    """An OSError met while writing the output, as `<what>: <path>: <strerror>`."""

    def __init__(self, what, path, strerror, resumable):
        hint = "; rerun with --resume to continue from the finished shards" if resumable else ""
        super().__init__(f"{what}: {path}: {strerror}{hint}")


@contextlib.contextmanager
def doing(what, path, resumable=True):
    """Re-raise an OSError as an OutputError naming `what` was being done and the file (the error's own, else
    `path`)."""
    try:
        yield
    except OSError as e:
        raise OutputError(what, e.filename or path, e.strerror or str(e), resumable) from e


def check_paths(source, output, overwrite):
    """The output must not overlap the source; an existing output must be a folder, replaced only with --overwrite
    and only when empty or written by these converters (it carries their manifest)."""
    src, out = os.path.realpath(source), os.path.realpath(output)
    if src == out or out.startswith(src + os.sep) or src.startswith(out + os.sep):
        raise CheckpointError(f"output {output} and source {source} must not contain each other")
    if not os.path.lexists(output):
        return
    if not os.path.isdir(output):
        raise CheckpointError(f"{output} exists and is not a folder; the output must be a folder path (nothing "
                              "was written)")
    if not overwrite:
        raise CheckpointError(f"{output} exists; pass --overwrite to replace it")
    if os.listdir(output) and not is_conversion_output(output):
        raise CheckpointError(f"{output} is not a folder written by these converters (it has no {MANIFEST}); "
                              "--overwrite replaces only those: move it away or choose another output")


def space_needed(job):
    """Bytes the run still needs: every planned shard (header and tensors in the output dtypes), the source's other
    files (the most that is copied besides the shards) and `OTHER_FILES_BYTES`, less the finished shards of a
    partial folder of ours at the output (kept with --resume, deleted and so freed without)."""
    shards = sum(shard_file_size(specs) for _, specs in job.shards)
    folder = job.source.folder
    others = [os.path.join(folder, f) for f in os.listdir(folder)]
    copied = sum(os.path.getsize(p) for p in others if os.path.isfile(p) and p not in job.source.files
                 and not p.endswith(_PICKLES))
    manifest = load_manifest(partial_dir(job.output))
    done = manifest.get("shards") if isinstance(manifest, dict) else None
    reclaimed = sum(d.get("bytes", 0) for d in done.values() if isinstance(d, dict)) if isinstance(done, dict) else 0
    return max(shards + copied + OTHER_FILES_BYTES - reclaimed, 0)


def free_space(output):
    """(free bytes, the folder they were measured at): the output's nearest existing parent folder."""
    where = os.path.dirname(os.path.abspath(output))
    while not os.path.isdir(where):
        where = os.path.dirname(where)
    return shutil.disk_usage(where).free, where


def check_free_space(job):
    need = space_needed(job)
    free, where = free_space(job.output)
    if need > free:
        raise CheckpointError(f"not enough free space for the output: needs {need / 1e9:.3f} GB, "
                              f"{free / 1e9:.3f} GB free at {where}")


def dry_run(job, quiet):
    """Every check of a real run (every tensor read and checked), nothing written."""
    progress = Progress(job.total_bytes, "checking", quiet)
    produce = job.producer.fresh()
    for _, specs in job.shards:
        for t in specs:
            produce(t)
            progress.update(t.nbytes)
    progress.close()
    print(f"dry run: {job.tool} {job.source.folder} -> {os.path.abspath(job.output)}")
    print(f"  source: {len(job.source.files)} shard(s), {len(job.source.tensors)} tensors, "
          f"{sum(os.path.getsize(f) for f in job.source.files) / 1e9:.3f} GB; all checks passed")
    print(f"  output: {len(job.shards)} shard(s), {job.num_tensors} tensors, {job.total_bytes / 1e9:.3f} GB")
    for fname, specs in job.shards:
        print(f"    {fname}: {len(specs)} tensors, {sum(t.nbytes for t in specs) / 1e9:.3f} GB")
    need, (free, where) = space_needed(job), free_space(job.output)
    print(f"  disk: needs {need / 1e9:.3f} GB, {free / 1e9:.3f} GB free at {where}"
          + ("" if need <= free else " - not enough: a real run would be refused"))
    for note in job.notes:
        print(f"  note: {note}")
    print("  nothing was written")
    return 0


def _write_shards(job, folder, manifest, quiet):
    """Shards not finished by an earlier run are written; returns (written, kept)."""
    written = kept = 0
    progress = Progress(job.total_bytes, "writing", quiet)
    for fname, specs in job.shards:
        if is_finished(folder, manifest, fname):
            kept += 1
            progress.update(sum(t.nbytes for t in specs))
            continue
        with doing("writing the output", os.path.join(folder, fname)):
            digest = write_shard(os.path.join(folder, fname), specs, job.producer, progress)
            record_finished(folder, manifest, fname, digest)
        written += 1
    progress.close()
    return written, kept


def _verify(job, folder, args):
    progress = Progress(job.total_bytes, "verifying", args.quiet)
    n = verify_shards(job, folder, progress)
    progress.close()
    lines = [f"verified {n} tensors bit for bit against the source"]
    if job.forward_check is not None:
        lines.append(job.forward_check([os.path.join(folder, f) for f, _ in job.shards], args.forward_check_max_gb))
    return lines


def run_job(job, args):
    """Carry out `job` with the common options (`cli.add_common_args`). Returns the exit status."""
    check_paths(job.source.folder, job.output, args.overwrite)
    if args.dry_run:
        return dry_run(job, args.quiet)
    check_free_space(job)
    folder = partial_dir(job.output)
    with doing("creating the partial output", folder, resumable=False):
        manifest = open_partial(folder, job.tool, job.fingerprint(), args.resume, lambda msg: say(args.quiet, msg))
    try:
        written, kept = _write_shards(job, folder, manifest, args.quiet)
        with doing("writing the output", folder):
            extras = job.write_extras(folder) or []
        with doing("reading the output back", folder):
            summary = _verify(job, folder, args) if args.verify else []
        with doing("writing the output", folder):
            if job.wants_index():
                write_index(folder, job.shards)
            job.write_config(folder)  # config.json last: the folder looks complete only from here on
    except CheckpointError:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    finally:
        job.source.close()
    with doing("moving the output into place", job.output):
        publish(folder, job.output)
    print(f"{job.tool}: wrote {os.path.abspath(job.output)}: {len(job.shards)} shard(s) ({written} written, "
          f"{kept} kept from an interrupted run), {job.num_tensors} tensors, {job.total_bytes / 1e9:.3f} GB, "
          f"{len(extras)} other files")
    for line in summary + job.notes:
        print(f"  {line}")
    return 0
