"""Several simulators at once on loopback, on one clock, with their webhooks going to one receiver.

    with running(["merchant", "hotel"], clock=SimClock()) as fleet:
        fleet["merchant"].url, fleet["merchant"].sim.effects

`wakeful sim` and `wakeful eval` both start their simulators here. A webhook target is a URL that may name the
simulator as `{sim}` (`http://127.0.0.1:8787/v1/hooks/{sim}`: one webhook source per simulator on the receiver).
With `flush_every`, a thread sends each simulator's pending webhooks that often, as a provider sends them on its own.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from fastapi import FastAPI

from wakeful.server.sims._base import Sim, SimClock, serve
from wakeful.server.sims.airline import create_airline
from wakeful.server.sims.hotel import create_hotel
from wakeful.server.sims.mail import create_mail
from wakeful.server.sims.merchant import create_merchant

__all__ = ["CORRELATION", "SIMULATORS", "Running", "WebhookTarget", "certificate_of", "running", "self_signed_pem"]

SIMULATORS: dict[str, Callable[[SimClock], tuple[FastAPI, Sim]]] = {
    "merchant": lambda clock: create_merchant(clock=clock),
    "airline": lambda clock: create_airline(clock=clock),
    "hotel": lambda clock: create_hotel(clock=clock),
    "mail": lambda clock: create_mail(clock=clock),
}
CORRELATION = {"merchant": "body:subscription", "airline": "body:pnr", "hotel": "body:quote_id",
               "mail": "body:thread_id"}
"""Where each simulator's webhooks carry their correlation key: a receiver's `session_key` for that source."""


@dataclass(frozen=True)
class Running:
    name: str
    url: str
    sim: Sim


@dataclass(frozen=True)
class WebhookTarget:
    url: str
    """Where signed webhooks go; `{sim}` in it is replaced by the simulator's name."""
    secret: str
    sign_with_sim_clock: bool = False
    """Stamp signatures with the simulated clock (the receiver shares it) instead of the wall clock."""


def self_signed_pem(directory: Path) -> Path:
    """A certificate for 127.0.0.1 and localhost and its key, in one PEM file in `directory` (valid for a day)."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "wakeful simulators")])
    now = dt.datetime.now(dt.UTC)
    certificate = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
                   .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(minutes=5))
                   .not_valid_after(now + dt.timedelta(days=1))
                   .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                               x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                                  critical=False)
                   .sign(key, hashes.SHA256()))
    path = directory / "simulators.pem"
    path.write_bytes(certificate.public_bytes(serialization.Encoding.PEM) + key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    path.chmod(0o600)
    return path


def certificate_of(pem: Path) -> bytes:
    """The certificate alone from a `self_signed_pem` file (what a client trusts; the key stays behind)."""
    text = pem.read_bytes()
    end = b"-----END CERTIFICATE-----\n"
    return text[:text.index(end) + len(end)]


@contextmanager
def running(names: Sequence[str], *, clock: SimClock, ports: Sequence[int] = (), tls: Path | None = None,
            webhooks: WebhookTarget | None = None, flush_every: float | None = None) -> Iterator[dict[str, Running]]:
    """Start the named simulators (each on its port in `ports`, else a free one); stop them all at the end."""
    unknown = sorted(set(names) - set(SIMULATORS))
    if unknown:
        raise ValueError(f"no simulator named {', '.join(unknown)} (there are {', '.join(SIMULATORS)})")
    with ExitStack() as stack:
        fleet: dict[str, Running] = {}
        for index, name in enumerate(names):
            app, sim = SIMULATORS[name](clock)
            if webhooks is not None:
                sim.webhooks.configure(webhooks.url.replace("{sim}", name), webhooks.secret)
                sim.webhooks.signing_clock = clock if webhooks.sign_with_sim_clock else None
            port = ports[index] if index < len(ports) else 0
            url = stack.enter_context(serve(app, port=port, tls=str(tls) if tls else None))
            fleet[name] = Running(name=name, url=url, sim=sim)
        if webhooks is not None and flush_every:
            stack.enter_context(_flushing([r.sim for r in fleet.values()], flush_every))
        yield fleet


@contextmanager
def _flushing(sims: list[Sim], every: float) -> Iterator[None]:
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(every):
            for sim in sims:
                if sim.webhooks.pending:
                    sim.webhooks.flush()

    thread = threading.Thread(target=loop, name="sim-webhooks", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=10)
