"""Execution: running a batch on the model. The request record and the batch
built from requests, the model runner (weights, KV pool, backends), the model
worker (a batch in, sampled tokens out), the sampler, device graphs, the
profiler and the tensor-parallel collectives."""
