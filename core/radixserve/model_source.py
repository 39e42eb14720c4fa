"""Where the weights come from: a local directory, a hub repo id, or the demo model."""

from __future__ import annotations

import os

from radixserve.config import ServerArgs


def resolve_model_path(args: ServerArgs) -> str:
    if args.model_path is None:
        raise ValueError("model_path: no model given")
    if os.path.isdir(args.model_path):
        return args.model_path
    raise ValueError(f"model_path: {args.model_path!r} is not a directory")
