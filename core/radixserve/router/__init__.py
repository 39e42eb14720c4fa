"""``radixserve router``: one OpenAI-compatible endpoint over a fleet of workers (radixserve
servers on any device, or any OpenAI-compatible server). It imports no torch."""
