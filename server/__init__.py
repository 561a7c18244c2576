"""wakeful's server: records and store, inbox, timers, sessions, worker, outbox, sweeper, HTTP API, CLI.

The front door is small; each concept lives in its own module (`server.inbox`, `server.sessions`, ...).
"""

from server.clock import Clock, FakeClock, SystemClock
from server.errors import WakefulError
from server.runtime import Runtime
from server.settings import Settings, load_settings
from server.worker import RunContext, RunHandler

__all__ = ["Clock", "FakeClock", "RunContext", "RunHandler", "Runtime", "Settings", "SystemClock", "WakefulError",
           "load_settings"]
