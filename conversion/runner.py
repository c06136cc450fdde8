"""Running a planned conversion (`plan.Job`): write, verify, publish; or check everything and write nothing.

Order of a run: shards into the partial folder (finished ones of an interrupted run kept with --resume), the other
files, verification, the index, config.json last, then the rename into place. An interrupted run therefore never
leaves a folder that looks complete at the output path. A source found bad on the way discards the partial folder
(there is nothing worth resuming); the source folder itself is only ever read.
"""

import os
import shutil

from transformers_kimi3.checkpoint import CheckpointError

from kimi3_conversion.progress import Progress, say
from kimi3_conversion.resume import is_finished, open_partial, partial_dir, publish, record_finished
from kimi3_conversion.tensor_io import write_index, write_shard
from kimi3_conversion.verify import verify_shards


def check_paths(source, output, overwrite):
    src, out = os.path.realpath(source), os.path.realpath(output)
    if src == out or out.startswith(src + os.sep) or src.startswith(out + os.sep):
        raise CheckpointError(f"output {output} and source {source} must not contain each other")
    if os.path.exists(out) and not overwrite:
        raise CheckpointError(f"{output} exists; pass --overwrite to replace it")


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
    folder = partial_dir(job.output)
    manifest = open_partial(folder, job.tool, job.fingerprint(), args.resume, lambda msg: say(args.quiet, msg))
    try:
        written, kept = _write_shards(job, folder, manifest, args.quiet)
        extras = job.write_extras(folder) or []
        summary = _verify(job, folder, args) if args.verify else []
        if job.wants_index():
            write_index(folder, job.shards)
        job.write_config(folder)  # config.json last: the folder looks complete only from here on
    except CheckpointError:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    finally:
        job.source.close()
    publish(folder, job.output)
    print(f"{job.tool}: wrote {os.path.abspath(job.output)}: {len(job.shards)} shard(s) ({written} written, "
          f"{kept} kept from an interrupted run), {job.num_tensors} tensors, {job.total_bytes / 1e9:.3f} GB, "
          f"{len(extras)} other files")
    for line in summary + job.notes:
        print(f"  {line}")
    return 0
