"""The partial output folder that makes a conversion resumable, and the mark of a finished output.

A run writes into a hidden `.<name>.partial` folder next to the output path. Its manifest (`MANIFEST`) holds the
tool, the plan's fingerprint and the sha256 of every finished shard. With `--resume` a later run keeps the finished
shards whose bytes still match the same fingerprint; otherwise the partial folder is discarded. A folder in that
place without a manifest was not made by this tool and is never touched.

The manifest stays in the published output: it marks the folder as written by these converters (and records each
shard's sha256), and `--overwrite` replaces only a folder that carries it.
"""

import json
import os
import shutil

from transformers_kimi3.checkpoint import CheckpointError

from kimi3_conversion.tensor_io import INDEX, sha256_file

MANIFEST = ".kimi3-conversion.json"


def partial_dir(output):
    out = os.path.abspath(output)
    return os.path.join(os.path.dirname(out), f".{os.path.basename(out)}.partial")


def is_conversion_output(folder):
    """Whether `folder` carries the manifest these converters write (a finished output or a partial one)."""
    manifest = load_manifest(folder)
    return isinstance(manifest, dict) and "tool" in manifest and "shards" in manifest


def load_manifest(folder):
    """The manifest of a partial folder, or None when there is none (or it cannot be read)."""
    try:
        with open(os.path.join(folder, MANIFEST)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def save_manifest(folder, manifest):
    path = os.path.join(folder, MANIFEST)
    with open(path + ".tmp", "w") as f:
        json.dump(manifest, f, indent=1)
    os.replace(path + ".tmp", path)  # a killed run leaves the old manifest or the new one, never half of one


def open_partial(folder, tool, fingerprint, resume, say):
    """The manifest of the partial folder `folder`: the existing one when resuming the same plan, else a new
    folder. Files a killed run may have left unfinished (`*.tmp`, the completeness markers config.json and the
    index) are removed."""
    manifest = load_manifest(folder) if os.path.isdir(folder) else None
    if os.path.exists(folder):
        if manifest is None:
            raise CheckpointError(f"{folder} exists and was not made by this tool; move it away")
        if not (resume and manifest.get("fingerprint") == fingerprint):
            say(f"discarding the partial output {folder}" + (
                " (the source or the options changed)" if resume else " (pass --resume to continue it)"))
            shutil.rmtree(folder)
            manifest = None
    if manifest is None:
        os.makedirs(folder)
        manifest = {"tool": tool, "fingerprint": fingerprint, "shards": {}}
        save_manifest(folder, manifest)
    for f in os.listdir(folder):
        if f.endswith(".tmp") or f in ("config.json", INDEX):
            os.remove(os.path.join(folder, f))
    return manifest


def is_finished(folder, manifest, fname):
    """Whether shard `fname` was finished by an earlier run and its bytes are still those recorded."""
    done = manifest["shards"].get(fname)
    path = os.path.join(folder, fname)
    return bool(done) and os.path.exists(path) and sha256_file(path) == done["sha256"]


def record_finished(folder, manifest, fname, digest):
    manifest["shards"][fname] = {"sha256": digest, "bytes": os.path.getsize(os.path.join(folder, fname))}
    save_manifest(folder, manifest)


def publish(folder, output):
    """Rename the complete folder (its manifest kept, as the mark of a converter's output) to `output`. An existing
    output (the user passed --overwrite; `runner.check_paths` allows only a converter's output or an empty folder)
    is moved aside first and deleted only once the new folder is in place; it is moved back when that fails."""
    out = os.path.abspath(output)
    if not os.path.lexists(out):
        os.rename(folder, out)
        return
    old = f"{out}.old-{os.getpid()}"
    os.rename(out, old)
    try:
        os.rename(folder, out)
    except OSError:
        os.rename(old, out)
        raise
    if os.path.isdir(old) and not os.path.islink(old):
        shutil.rmtree(old)
    else:
        os.remove(old)
