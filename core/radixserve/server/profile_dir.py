"""Where ``/start_profile`` may write: under the one directory the operator chose
at start-up (``--profile-dir``; unset: ``$RADIXSERVE_PROFILE_DIR``, else a
temporary directory made at the first profile). A request's ``output_dir`` is a
path relative to it; an absolute one, or one that leads out of it (``..``, a
symbolic link), is refused, so a client cannot make the server write elsewhere."""

from __future__ import annotations

import os
import tempfile

from radixserve.messages import PROFILE_DIR_ENV


class ProfileDir:
    def __init__(self, configured: str | None):
        self._configured = configured or os.environ.get(PROFILE_DIR_ENV)
        self._root: str | None = None

    @property
    def root(self) -> str:
        """The directory, symbolic links resolved (made now when none was configured)."""
        if self._root is None:
            self._root = os.path.realpath(self._configured or tempfile.mkdtemp(prefix="radixserve-profile-"))
        return self._root

    def resolve(self, output_dir: str | None) -> str:
        """The absolute directory for a request's ``output_dir`` (None: the root); a
        ValueError naming ``output_dir`` when it is absolute or leads outside."""
        if output_dir is None:
            return self.root
        if os.path.isabs(output_dir):
            raise ValueError(f"output_dir: must be a path relative to the profile directory, got {output_dir!r}")
        path = os.path.realpath(os.path.join(self.root, output_dir))
        if os.path.commonpath([path, self.root]) != self.root:
            raise ValueError(f"output_dir: {output_dir!r} leads outside the profile directory")
        return path
