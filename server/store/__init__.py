"""The records' home: every table, the database and its migrations, IDs, users and their tokens.

Modules: `tables` (every table, states as `StrEnum`s mirrored by `CHECK` constraints), `db` (engine, transactions,
migrations), `ids`, `users`, `toml_lines`.
May import: `server.errors` only (and the clock, `wakeful.proxy.clock`).
"""
