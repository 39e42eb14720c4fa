"""The flags of the servers that several modules share (conftest.py starts each
once per session): each flag here is one that some module tests, and no flag of
one module changes what another module's tests see.

``single_slot``: test_queue.py and test_shutdown.py. One running slot, so a
long request holds it while the test fills the queue; the priority policy
(test_queue) admits requests of equal priority in arrival order, as the
shutdown test's queue expects; the header limit and the drain deadline are
test_shutdown's.

``guarded``: test_server_api.py and test_hostile_inputs.py. An API key (every
client of the module sends it), a body limit above the largest hostile body
(a million-character stop list), and small request limits that the hostile
cases reach (the API tests stay well under them)."""

from __future__ import annotations

from helpers_server import PRIORITY_BACKENDS

QUEUE_LIMIT = 5
HEADER_LIMIT = 8192
DRAIN_DEADLINE_S = 600  # never reached by a passing run: the shutdown test ends the drain itself
SINGLE_SLOT_FLAGS = (
    "--max-total-tokens",
    "65536",
    "--max-running-requests",
    "1",
    "--schedule-policy",
    "priority",
    "--max-queued-requests",
    str(QUEUE_LIMIT),
    "--shutdown-timeout",
    str(DRAIN_DEADLINE_S),
    "--max-header-size",
    str(HEADER_LIMIT),
    "--log-level",
    "info",
    *PRIORITY_BACKENDS,
)

API_KEY = "test-key"
MAX_PAYLOAD = 2 * 1024 * 1024
MAX_N, MAX_STOP_STRINGS, MAX_STOP_CHARS = 8, 4, 64
GUARDED_MAX_TOTAL_TOKENS = 16384
GUARDED_FLAGS = (
    "--api-key",
    API_KEY,
    "--max-payload-size",
    str(MAX_PAYLOAD),
    "--max-total-tokens",
    str(GUARDED_MAX_TOTAL_TOKENS),
    "--max-n",
    str(MAX_N),
    "--max-stop-strings",
    str(MAX_STOP_STRINGS),
    "--max-stop-chars",
    str(MAX_STOP_CHARS),
    *PRIORITY_BACKENDS,
)
