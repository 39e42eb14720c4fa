"""Where the weights come from: a local directory, a HuggingFace hub repo id
(downloaded, or found in the hub cache when ``HF_HUB_OFFLINE=1``), or, with no
model given, the built-in demo model."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
from pathlib import Path

from radixserve.checkpoints.gguf import is_gguf_file, materialize
from radixserve.config import ServerArgs

logger = logging.getLogger(__name__)

# "name" or "org/name", as the hub spells repo ids; anything else is a path.
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
# Any one of these makes a directory loadable by AutoTokenizer.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json", "tekken.json")
SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"
# Files a model directory needs; the rest of a repo (other formats, images) is skipped.
_ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]


def resolve_model_path(args: ServerArgs) -> str:
    if args.model_path is None:
        from radixserve.checkpoints.demo import demo_model_path

        path = str(demo_model_path())
        warn_demo_model(path)
        return path
    if is_hub_id(args.model_path):
        return check_model_dir(_download(args.model_path))
    check_model_source(args.model_path)
    return args.model_path


def open_gguf_model(args: ServerArgs) -> ServerArgs:
    """``args`` with a GGUF file's ``--model`` replaced by the model directory that stands
    for it (checkpoints/gguf.py), served under the file's path unless
    ``--served-model-name`` says otherwise; other ``args`` as they are. Called once,
    first, by the CLI and the Engine, so that everything after sees a directory."""
    if args.model_path is None or not is_gguf_file(args.model_path):
        return args
    from radixserve.checkpoints.demo import cache_dir

    directory = materialize(args.model_path, args.tokenizer_path, cache_dir())
    return dataclasses.replace(
        args, model_path=str(directory), served_model_name=args.served_model_name or args.model_path
    )


def warn_demo_model(path: str) -> None:
    logger.warning(
        "no --model given: serving the built-in demo model from %s. It has RANDOM weights "
        "(its output is gibberish); pass --model PATH_OR_HUB_ID for a real one.",
        path,
    )


def model_path_at_hand(args: ServerArgs) -> str | None:
    """``resolve_model_path(args)`` where it takes no time, and without its warning
    about the demo model (the server logs it once it boots): a local model
    directory, or the demo model built by an earlier start; None for a hub id (a
    download, or a check for one), the demo model's first build, and a path that
    is no model directory (``check_model_source`` says why)."""
    if args.model_path is None:
        from radixserve.checkpoints.demo import demo_model_built, demo_model_path

        return str(demo_model_path()) if demo_model_built() else None
    if is_hub_id(args.model_path):
        return None
    try:
        return resolve_model_path(args)
    except ValueError:
        return None


def is_hub_id(model_path: str) -> bool:
    return bool(_REPO_ID.match(model_path)) and not os.path.exists(model_path)


def check_model_source(model_path: str) -> None:
    """A ValueError naming the problem unless ``model_path`` is a local model
    directory or looks like a hub repo id (checked once downloaded). A GGUF file is
    a directory by now (``open_gguf_model``). Cheap, so
    it runs before the server starts listening."""
    if is_hub_id(model_path):
        return
    if not os.path.exists(model_path):
        raise ValueError(f"model_path: {model_path!r} is not a directory (it does not exist)")
    if not os.path.isdir(model_path):
        raise ValueError(f"model_path: {model_path!r} is not a directory (nor a .gguf file)")
    check_model_dir(model_path)


def check_model_dir(path: str) -> str:
    """A model directory must hold a HuggingFace config.json; checked before
    anything reads it, so an empty directory is not reported as a tokenizer problem."""
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"model_path: {path!r} has no config.json; it is not a HuggingFace model directory")
    return path


def check_tokenizer_source(path: str) -> None:
    """A ValueError unless ``path`` (``--tokenizer-path``, or the model's
    directory) is a hub repo id or a local directory with tokenizer files."""
    if is_hub_id(path):
        return
    if not os.path.isdir(path):
        raise ValueError(f"tokenizer_path: {path!r} is not a directory")
    if not any(os.path.isfile(os.path.join(path, name)) for name in _TOKENIZER_FILES):
        raise ValueError(
            f"tokenizer_path: {path!r} has no tokenizer files (one of {', '.join(_TOKENIZER_FILES)}); "
            f"pass --tokenizer-path"
        )


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _download(repo_id: str) -> str:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError

    offline = _offline()
    logger.info("fetching %s from the HuggingFace hub%s", repo_id, " cache (HF_HUB_OFFLINE is set)" if offline else "")
    try:
        return snapshot_download(repo_id, allow_patterns=_ALLOW_PATTERNS, local_files_only=offline)
    except LocalEntryNotFoundError as exc:
        if offline:
            raise ValueError(
                f"model_path: {repo_id!r} is not in the HuggingFace cache and HF_HUB_OFFLINE is set; "
                f"download it once online, or pass a local directory"
            ) from exc
        raise ValueError(
            f"model_path: could not reach the HuggingFace hub for {repo_id!r} and it is not cached: {exc}"
        ) from exc
    except GatedRepoError as exc:
        raise ValueError(
            f"model_path: {repo_id!r} is gated; accept its terms on huggingface.co and log in (HF_TOKEN)"
        ) from exc
    except RepositoryNotFoundError as exc:
        raise ValueError(f"model_path: {repo_id!r} is neither a local directory nor a HuggingFace repo") from exc


def safetensors_files(model_path: str | Path) -> list[Path]:
    """The checkpoint's safetensors files: the shards named by the index, the single
    ``model.safetensors``, or (failing both) every ``*.safetensors`` file."""
    root = Path(model_path)
    index = root / SAFETENSORS_INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [root / name for name in sorted(set(weight_map.values()))]
    if (root / SAFETENSORS_SINGLE).is_file():
        return [root / SAFETENSORS_SINGLE]
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors checkpoint in {root} (only safetensors is supported)")
    return files
