"""The verifiable ledger: every history row and attempt chained with SHA-256, checkpoints signed with Ed25519.

`canonical` (a row's canonical form and hashes, pure), `signing` (the deployment's ledger key and checkpoint
signatures), `chain` (the checks, pure, over entries from the database or an export), `seal` (hashes new entries
into the chain and signs a checkpoint), `verify` (the database against its chain) and `export` (the chain and its
rows to a file an auditor checks offline). Imports the store, never the runtime above it.
"""

from __future__ import annotations

__all__: list[str] = []
