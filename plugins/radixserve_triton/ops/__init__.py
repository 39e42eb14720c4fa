"""The Triton kernels and their launchers. Importing this package imports
triton: only the backends' constructors do so, never selection.

Triton decides at decoration time whether a kernel is compiled for a GPU or run
by its CPU interpreter (``TRITON_INTERPRET=1``), so the variable must be set
before this package is first imported in a process. ``INTERPRETED`` records
which mode the kernels were built in.
"""

from radixserve_triton.ops.common import INTERPRETED

__all__ = ["INTERPRETED"]
