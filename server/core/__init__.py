"""The durable core of one wake: inbox, sessions and leases, waits, timers, the outbox, the worker and the sweeper.

Modules: `signatures` and `inbox` (persist on receive), `authority` (who sent a delivery, who may satisfy a wait),
`keys` (a task's correlation keys), `triage` (the session of deliveries that found no task) and `attach` (giving a
task one of them as information), `sessions` (lease and fencing token), `waits`, `schedule` (pure due-ness) and
`timers`, `agenda` (the reply waits, follow-ups and checks the agent sets for a task, admitted like actions),
`control` (STOP, pause, close), `holds` (the user's chat about a task, and the hold it puts on the task until a run
reads it), `widening` (pure: does a steer widen a task?) and `steers` (what the agent may write to a delegation;
proposals the user confirms), `helper_tasks` (read-only sub-tasks with a run and session of their own), `outbox`,
`worker` (claim, run, commit under the token), `sweeper`, `faults` (crash points for the tests), `nudge`.
The core never imports the tool layer or the harness: a run calls its tools through `worker.Tools` and is driven
by a `worker.RunHandler`, protocols the core owns and the upper layers implement.
May import: `server.store`, `server.errors`, `server.settings`.
"""
