"""Processes: starting and wiring the runtime. Spawning the scheduler groups,
the detokenizer and the DP controller (`spawn`), each process's main loop, and a
worker node of a multi-node group."""
