"""Where the weights come from: a local directory, a HuggingFace hub repo id
(downloaded, or found in the hub cache when ``HF_HUB_OFFLINE=1``), or, with no
model given, the built-in demo model."""

from __future__ import annotations

import logging
import os
import re

from radixserve.config import ServerArgs

logger = logging.getLogger(__name__)

# "name" or "org/name", as the hub spells repo ids; anything else is a path.
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
# Files a model directory needs; the rest of a repo (other formats, images) is skipped.
_ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]


def resolve_model_path(args: ServerArgs) -> str:
    if args.model_path is None:
        from radixserve.demo_model import demo_model_path

        path = str(demo_model_path())
        logger.warning("no --model given: serving the built-in demo model from %s. It has RANDOM weights "
                       "(its output is gibberish); pass --model PATH_OR_HUB_ID for a real one.", path)
        return path
    if os.path.isdir(args.model_path):
        return args.model_path
    if _REPO_ID.match(args.model_path) and not os.path.exists(args.model_path):
        return _download(args.model_path)
    raise ValueError(f"model_path: {args.model_path!r} is not a directory")


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
            raise ValueError(f"model_path: {repo_id!r} is not in the HuggingFace cache and HF_HUB_OFFLINE is set; "
                             f"download it once online, or pass a local directory") from exc
        raise ValueError(f"model_path: could not reach the HuggingFace hub for {repo_id!r} and it is not cached: "
                         f"{exc}") from exc
    except GatedRepoError as exc:
        raise ValueError(f"model_path: {repo_id!r} is gated; accept its terms on huggingface.co and log in "
                         f"(HF_TOKEN)") from exc
    except RepositoryNotFoundError as exc:
        raise ValueError(f"model_path: {repo_id!r} is neither a local directory nor a HuggingFace repo") from exc
