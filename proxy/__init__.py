"""The egress proxy: a policy decision per request, credential rewriting and the credential vault.

The pure core (`contract`, `decide`, `rewrite`, `credential`, `hosts`) does no I/O; `vault` reads and writes its
files. Errors: `ProxyRefusal` (code, reason) ← `HeaderRejected`, `InjectionRefused`; `ContractError` for values
that break the contract; `VaultError` ← `CredentialNotFound`, `DecryptFailed`, `VaultFileError`.
"""

from proxy.contract import (
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
from proxy.credential import Credential, CredentialInfo, SecretBytes
from proxy.decide import AllowRule, agree, check_request, check_verdict, decide_by_allowlist, match_allowlist
from proxy.rewrite import HeaderRejected, InjectionRefused, inject, strip_credentials
from proxy.vault import KeyRing, Vault, VaultError

__all__ = [
    "Allow",
    "AllowRule",
    "ContractError",
    "Credential",
    "CredentialInfo",
    "DecisionRequest",
    "HeaderRejected",
    "InjectionRefused",
    "KeyRing",
    "ProxyRefusal",
    "RefusalCode",
    "Refuse",
    "SecretBytes",
    "Vault",
    "VaultError",
    "Verdict",
    "agree",
    "check_request",
    "check_verdict",
    "decide_by_allowlist",
    "encode_request",
    "encode_verdict",
    "inject",
    "match_allowlist",
    "parse_request",
    "parse_verdict",
    "strip_credentials",
]
