"""How the server sends connector requests: through the egress proxy with a grant, or directly.

Through the proxy (the default), every request is first granted in the database (`egress.issue_grant`, in the
caller's transaction) and carries the grant's one-time token in `X-Wakeful-Attempt`; the proxy asks the server
whether that exact request may go, strips the token and adds the credential. Directly (proxy off, or a test
transport), nothing is granted and no credential is ever added.
"""

from __future__ import annotations

import ssl
import threading
from collections.abc import Mapping
from datetime import datetime, timedelta
from pathlib import Path

import httpx
from sqlalchemy import Connection

from wakeful.proxy.contract import EgressRequest
from wakeful.proxy.rewrite import ATTEMPT_HEADER
from wakeful.server.egress.grants import issue_grant
from wakeful.server.settings import Settings
from wakeful.server.store.tables import GrantPurpose

__all__ = ["ConnectorHTTP"]


class ConnectorHTTP:
    def __init__(self, *, timeout: float, proxy_url: str | None = None, ca_file: Path | None = None,
                 grant_ttl: timedelta = timedelta(seconds=60), transport: httpx.BaseTransport | None = None) -> None:
        self.via_proxy = proxy_url is not None
        self._timeout = timeout
        self._proxy_url = proxy_url
        self._ca_file = ca_file
        self._grant_ttl = grant_ttl
        self._transport = transport
        self._client: httpx.Client | None = None
        self._lock = threading.Lock()

    @classmethod
    def from_settings(cls, settings: Settings) -> ConnectorHTTP:
        if not settings.proxy:
            return cls(timeout=settings.connector_timeout)
        return cls(timeout=settings.connector_timeout, proxy_url=f"http://127.0.0.1:{settings.proxy_port}",
                   ca_file=settings.proxy_dir / "ca.pem", grant_ttl=settings.egress_grant_ttl)

    def _http(self) -> httpx.Client:
        # Built on first use: the deployment CA the proxy presents may be created after the runtime.
        with self._lock:
            if self._client is None:
                if self._proxy_url is None or self._transport is not None:  # a test's transport stands in
                    self._client = httpx.Client(transport=self._transport, timeout=self._timeout)
                else:
                    if self._ca_file is None or not self._ca_file.exists():
                        raise httpx.ConnectError(f"the egress proxy's CA {self._ca_file} does not exist yet: the "
                                                 "proxy has not been started (`wakeful serve` starts it)")
                    trust = ssl.create_default_context(cafile=str(self._ca_file))
                    self._client = httpx.Client(proxy=self._proxy_url, verify=trust, timeout=self._timeout)
            return self._client

    def grant(self, conn: Connection, *, purpose: GrantPurpose, user_id: str, task_id: str, tool: str,
              request: EgressRequest, credential: str | None, now: datetime, action_id: str | None = None,
              attempt_id: str | None = None) -> dict[str, str]:
        """The headers that let exactly `request` through the proxy; none when the proxy is off."""
        if not self.via_proxy:
            return {}
        token = issue_grant(conn, user_id=user_id, task_id=task_id, purpose=purpose, tool=tool, request=request,
                            credential=credential, now=now, ttl=self._grant_ttl, action_id=action_id,
                            attempt_id=attempt_id)
        return {ATTEMPT_HEADER: token}

    def send(self, request: EgressRequest, grant: Mapping[str, str]) -> httpx.Response:
        """Send `request` as it was built and granted, with the grant's headers; raises `httpx.HTTPError`."""
        return self._http().request(request.method, request.url, headers={**dict(request.headers), **grant},
                                    content=request.body)

    def close(self) -> None:
        with self._lock:
            if self._client is not None:
                self._client.close()
