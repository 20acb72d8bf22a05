"""schemathesis hooks for scripts/schemathesis.sh.

Fenced agent calls carry the generation of the session the run last acquired (at first the one
the script acquired, BERTH_GENERATION), so that they reach their handlers instead of all stopping
at 409 FENCED. A generated value that is not an integer is left as it is: the fencing refusal is
exercised by those.
"""

import os
import threading

import schemathesis

GENERATION_HEADER = "X-Berth-Generation"
SESSION_PATH = "/api/v1/agents/{id}/session"

_lock = threading.Lock()
_generation = os.environ.get("BERTH_GENERATION")


@schemathesis.hook
def after_call(ctx, case, response):
    global _generation
    if case.method.upper() == "POST" and case.path == SESSION_PATH and response.status_code == 200:
        with _lock:
            _generation = response.json()["generation"]


@schemathesis.hook
def before_call(ctx, case, **kwargs):
    headers = case.headers or {}
    value = headers.get(GENERATION_HEADER)
    with _lock:
        generation = _generation
    if generation is None or value is None:
        return
    try:
        int(str(value).strip())
    except ValueError:
        return
    headers[GENERATION_HEADER] = str(generation)
