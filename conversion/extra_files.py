"""The files of a checkpoint folder besides its weights: tokenizer, processor, license, and our code files."""

import importlib
import json
import os
import shutil
import tempfile

from transformers import AutoTokenizer
from transformers.dynamic_module_utils import get_relative_import_files

from transformers_kimi3 import Kimi3ImageProcessor, Kimi3Processor
from transformers_kimi3.tokenization_kimi3 import convert_kimi3_tokenizer

from kimi3_conversion.tensor_io import dump_json

TOKENIZER_FILES = ("tiktoken.model", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "chat_template.jinja", "chat_template.json", "generation_config.json")
PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json", "video_preprocessor_config.json")
LICENSE_FILES = ("LICENSE", "LICENSE.md", "LICENSE.txt", "LICENCE", "NOTICE", "NOTICE.md", "USE_POLICY.md")


def code_files(*modules):
    """The flat modules of transformers_kimi3 that `save_pretrained` copies for these modules: each module's file
    and its relative imports, recursively."""
    files = []
    for name in modules:
        path = importlib.import_module(f"transformers_kimi3.{name}").__file__
        for f in [path] + list(get_relative_import_files(path)):
            if f not in files:
                files.append(f)
    return files


def copy_code(folder, *modules):
    """Copy `code_files(*modules)` into `folder`; returns the paths written."""
    written = []
    for f in code_files(*modules):
        dst = os.path.join(folder, os.path.basename(f))
        shutil.copyfile(f, dst)
        written.append(dst)
    return written


def copy_if_present(src, folder, names):
    """Copy the files `names` that exist in `src` into `folder`; returns the paths written."""
    written = []
    for n in names:
        p = os.path.join(src, n)
        if os.path.isfile(p):
            shutil.copyfile(p, os.path.join(folder, n))
            written.append(os.path.join(folder, n))
    return written


def auto_map_modules(data):
    """Module names referenced by every `auto_map` in a JSON document ('repo--module.Class' counts as 'module')."""
    mods = set()

    def walk(d):
        if isinstance(d, dict):
            for k, v in d.items():
                if k == "auto_map" and isinstance(v, dict):
                    for ref in v.values():
                        for r in (ref if isinstance(ref, (list, tuple)) else [ref]):
                            if isinstance(r, str) and "." in r:
                                mods.add(r.split("--")[-1].rsplit(".", 1)[0])
                else:
                    walk(v)
        elif isinstance(d, list):
            for v in d:
                walk(v)

    walk(data)
    return mods


# ------------------------------------------------------------------------------------------------ K3 tokenizer, processor
PROCESSOR_AUTO_MAP = {"AutoProcessor": "processing_kimi3.Kimi3Processor"}
IMAGE_PROCESSOR_AUTO_MAP = {"AutoImageProcessor": "image_processing_kimi3.Kimi3ImageProcessor",
                            "AutoProcessor": "processing_kimi3.Kimi3Processor"}


def _fix_processor_auto_map(data):
    """Processor JSON: point AutoProcessor / AutoImageProcessor at our classes, drop references to other code."""
    if "processor_class" in data or "image_processor" in data:
        data["auto_map"] = dict(PROCESSOR_AUTO_MAP)
    else:
        data["auto_map"] = dict(IMAGE_PROCESSOR_AUTO_MAP)
    if isinstance(data.get("image_processor"), dict):
        data["image_processor"]["auto_map"] = dict(IMAGE_PROCESSOR_AUTO_MAP)
    return data


def write_tokenizer_and_processor(src, folder, notes):
    """The tokenizer and processor files of K3 folder `src`, written into `folder` for our classes. An official
    tokenizer (`tiktoken.model` and Moonshot's remote class) is converted with `convert_kimi3_tokenizer`; a folder
    with a tokenizer but no processor config gets Kimi3Processor's defaults. Returns the paths written; what was
    done is appended to `notes`."""
    written = []
    tok_cfg_path = os.path.join(src, "tokenizer_config.json")
    tok_cfg = json.load(open(tok_cfg_path)) if os.path.isfile(tok_cfg_path) else {}
    official_tok = os.path.isfile(os.path.join(src, "tiktoken.model")) and (
        not os.path.isfile(os.path.join(src, "tokenizer.json")) or auto_map_modules(tok_cfg))
    if official_tok:
        convert_kimi3_tokenizer(src, folder)
        notes.append("tokenizer: converted from tiktoken.model with convert_kimi3_tokenizer (fast tokenizer.json, "
                     "no remote code needed)")
        written += [os.path.join(folder, f) for f in os.listdir(folder) if f in TOKENIZER_FILES]
        written += copy_if_present(src, folder, ["generation_config.json"])
    else:
        written += copy_if_present(src, folder, TOKENIZER_FILES)
    has_tokenizer = any(os.path.isfile(os.path.join(folder, f)) for f in ("tokenizer.json", "tiktoken.model"))
    for name in PROCESSOR_FILES:
        p = os.path.join(src, name)
        if os.path.isfile(p):
            dump_json(os.path.join(folder, name), _fix_processor_auto_map(json.load(open(p))))
            written.append(os.path.join(folder, name))
    if has_tokenizer and not any(os.path.isfile(os.path.join(folder, f)) for f in PROCESSOR_FILES):
        written += _write_default_processor(folder, notes)
    if not has_tokenizer:
        notes.append("the source has no tokenizer files: none were written")
    return written


def _write_default_processor(folder, notes):
    with tempfile.TemporaryDirectory() as scratch:
        try:
            tokenizer = AutoTokenizer.from_pretrained(folder)
            Kimi3Processor(image_processor=Kimi3ImageProcessor(), tokenizer=tokenizer).save_pretrained(scratch)
        except (ValueError, OSError) as e:
            notes.append(f"no processor config written: {e}")
            return []
        data = _fix_processor_auto_map(json.load(open(os.path.join(scratch, "processor_config.json"))))
    dump_json(os.path.join(folder, "processor_config.json"), data)
    notes.append("processor_config.json: the source has none; wrote Kimi3Processor's defaults (SPEC 0.10)")
    return [os.path.join(folder, "processor_config.json")]
