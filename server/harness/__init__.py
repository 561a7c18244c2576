"""The model's side of a wake: the context assembled from records, the model behind one interface, the run that
ends in exactly one outcome, and replay from the records. It implements `server.core.worker.RunHandler`.

Modules: `context`, `model` (and `model_anthropic`, the only module that imports `anthropic`), `wake`
(`ModelHarness`), `handlers` (the echo and scripted handlers), `replay`, `helper_run` (a helper
task's context and run).
May import: `server.store`, `server.memory` (recall, into the tail), `server.core`, `server.acting`,
`server.computers`, `server.tools`, `server.errors`, `server.settings`.
"""
