"""The egress proxy: a policy decision per request, credential rewriting and the credential vault.

The pure core (`contract`, `decide`, `rewrite`, `credential`, `hosts`, `wire`, `audit`, `clock`) does no I/O;
`vault` and `tls` read and write their files; `channel` (the decider link, both ends) and `server` (with `exchange`,
`upstream` and `malformed`) are the asyncio shell. Errors: `ProxyRefusal` (code, reason) ← `HeaderRejected`,
`InjectionRefused`; `ContractError` for values that break the contract; `VaultError` ← `CredentialNotFound`,
`DecryptFailed`, `VaultFileError`, `CAError`; `ChannelError` for a broken decider-channel frame.

The proxy is the lowest package: it imports only itself (never `wakeful.vm` or `wakeful.server`), and both of those
may import it. So the one clock (`Clock`, `SystemClock`, `FakeClock`) lives here, in `proxy.clock`.
"""

from wakeful.proxy.audit import EgressRecord
from wakeful.proxy.channel import ChannelError, DeciderClient, DeciderServer
from wakeful.proxy.config import ProxyConfig
from wakeful.proxy.contract import (
    Allow,
    ContractError,
    DecisionRequest,
    ProxyRefusal,
    RefusalCode,
    Refuse,
    Verdict,
    encode_request,
    encode_verdict,
    parse_request,
    parse_verdict,
)
from wakeful.proxy.credential import Credential, CredentialInfo, SecretBytes
from wakeful.proxy.decide import AllowRule, agree, check_request, check_verdict, decide_by_allowlist, match_allowlist
from wakeful.proxy.rewrite import HeaderRejected, InjectionRefused, inject, strip_credentials
from wakeful.proxy.server import ProxyServer, run, serve_proxy
from wakeful.proxy.tls import CAError, DeploymentCA, LeafCertificates, ca_pem, load_or_create_ca
from wakeful.proxy.vault import KeyRing, Vault, VaultError

__all__ = [
    "Allow",
    "AllowRule",
    "CAError",
    "ChannelError",
    "ContractError",
    "Credential",
    "CredentialInfo",
    "DeciderClient",
    "DeciderServer",
    "DecisionRequest",
    "DeploymentCA",
    "EgressRecord",
    "HeaderRejected",
    "InjectionRefused",
    "KeyRing",
    "LeafCertificates",
    "ProxyConfig",
    "ProxyRefusal",
    "ProxyServer",
    "RefusalCode",
    "Refuse",
    "SecretBytes",
    "Vault",
    "VaultError",
    "Verdict",
    "agree",
    "ca_pem",
    "check_request",
    "check_verdict",
    "decide_by_allowlist",
    "encode_request",
    "encode_verdict",
    "inject",
    "load_or_create_ca",
    "match_allowlist",
    "parse_request",
    "parse_verdict",
    "run",
    "serve_proxy",
    "strip_credentials",
]
