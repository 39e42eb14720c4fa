"""Speculative decoding: the proposers' contract (``base.py``) and the built-in
proposers (``ngram.py``, registered by ``builtin.py``). Verification lives in
the runtime (``runtime/execution/verifier.py``, ``runtime/scheduling/speculation.py``)."""
