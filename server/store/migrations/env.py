"""Alembic environment: the caller hands us a live connection (see `server.db.migrate`)."""

from alembic import context

from wakeful.server.store.tables import metadata

connection = context.config.attributes["connection"]
context.configure(connection=connection, target_metadata=metadata, render_as_batch=True)
with context.begin_transaction():
    context.run_migrations()
