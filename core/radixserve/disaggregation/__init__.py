"""Prefill/decode disaggregation: moving a request's KV from the worker that
prefilled it to the one that decodes it (the contract: radixserve.kernels.kv_transfer)."""
