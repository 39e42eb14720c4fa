"""A discrete-event fleet simulator that drives the router's real policy objects.

The workers are a *model*, not servers: each is a set of rate curves (``devices``), a
radix cache over token blocks (``block_cache``) and a scheduler at the level those
rates describe (``sim_worker``: FCFS admission within KV capacity, chunked prefill ahead
of decoding, continuous batching). The router side is the real thing: ``make_policy``'s
policy, its ``PrefixTree``, ``router.worker.Worker`` objects fed by ``observe`` (load
reports at the router's poll interval) and ``hold`` (requests sent and ended), as
``router/forwarder.py`` and ``router/fleet.py`` feed them (``simulator``). Workloads
(``workload``) and the figures per run (``report``) complete it; the CLI is
``benchmarks/simulate_fleet.py``.
"""
