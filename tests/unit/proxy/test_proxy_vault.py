"""The vault: secrets encrypted at rest, bound to their entry, readable across a key rotation."""

from __future__ import annotations

import base64
import json
import stat
import tempfile
from datetime import UTC, datetime
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from wakeful.proxy.credential import CredentialInfo
from wakeful.proxy.vault import (
    CredentialNotFound,
    DecryptFailed,
    Key,
    KeyRing,
    Vault,
    VaultFileError,
    generate_key,
    init_key,
    keys_from_env,
    load_keys,
    rotate_key_file,
)

SECRET = b"sk_live_canary_91c3e0aa"
WHEN = datetime(2026, 3, 1, 12, tzinfo=UTC)


class FixedClock:
    def now(self) -> datetime:
        return WHEN


def make_vault(path: Path, keys: KeyRing | None = None) -> Vault:
    return Vault(path / "vault.json", keys or KeyRing(current=generate_key()), clock=FixedClock())


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_stored_secret_reads_back_with_its_binding(tmp_path: Path) -> None:
    vault = make_vault(tmp_path)
    info = vault.set("merchant_api", SECRET, "API.merchant.com.", "Authorization", "Bearer {secret}")
    cred = vault.get("merchant_api")
    assert (cred.name, cred.host, cred.header, cred.template) == (
        "merchant_api", "api.merchant.com", "Authorization", "Bearer {secret}")
    assert cred.secret.reveal() == SECRET
    assert vault.list() == [CredentialInfo(name="merchant_api", host="api.merchant.com", header="Authorization",
                                           template="Bearer {secret}", key_id=vault.keys.current.key_id,
                                           created_at=WHEN)] == [info]


def test_listing_shows_no_secret_and_removing_forgets_the_entry(tmp_path: Path) -> None:
    vault = make_vault(tmp_path)
    vault.set("a", SECRET, "a.example.com", "X-Api-Key", "{secret}")
    vault.set("b", SECRET, "b.example.com", "X-Api-Key", "{secret}")
    assert [i.name for i in vault.list()] == ["a", "b"]
    assert SECRET.decode() not in repr(vault.list())
    vault.remove("a")
    assert [i.name for i in vault.list()] == ["b"]
    with pytest.raises(CredentialNotFound):
        vault.get("a")
    with pytest.raises(CredentialNotFound):
        vault.remove("a")


def test_setting_a_name_again_replaces_its_secret(tmp_path: Path) -> None:
    vault = make_vault(tmp_path)
    vault.set("a", b"first-secret", "a.example.com", "X-Api-Key", "{secret}")
    vault.set("a", b"second-secret", "a.example.com", "X-Api-Key", "{secret}")
    assert vault.get("a").secret.reveal() == b"second-secret"
    assert len(vault.list()) == 1


def test_the_vault_file_is_private_to_its_owner(tmp_path: Path) -> None:
    vault = make_vault(tmp_path)
    vault.set("a", SECRET, "a.example.com", "X-Api-Key", "{secret}")
    assert mode(vault.path) == 0o600


def test_a_secret_that_would_break_a_header_is_refused_before_it_is_stored(tmp_path: Path) -> None:
    vault = make_vault(tmp_path)
    with pytest.raises(ValueError):
        vault.set("a", b"line\nbreak", "a.example.com", "X-Api-Key", "{secret}")
    with pytest.raises(ValueError):
        vault.set("a", SECRET, "a.example.com", "Host", "{secret}")
    assert not vault.path.exists()


def test_the_wrong_key_does_not_decrypt(tmp_path: Path) -> None:
    make_vault(tmp_path).set("a", SECRET, "a.example.com", "X-Api-Key", "{secret}")
    with pytest.raises(DecryptFailed):
        make_vault(tmp_path).get("a")


def test_the_same_key_id_with_other_key_material_does_not_decrypt(tmp_path: Path) -> None:
    vault = make_vault(tmp_path)
    vault.set("a", SECRET, "a.example.com", "X-Api-Key", "{secret}")
    forged = Key(key_id=vault.keys.current.key_id, material=generate_key().material)
    with pytest.raises(DecryptFailed):
        make_vault(tmp_path, KeyRing(current=forged)).get("a")


def swap(path: Path, a: int, b: int, *fields: str) -> None:
    doc = json.loads(path.read_bytes())
    entries = doc["entries"]
    for f in fields:
        entries[a][f], entries[b][f] = entries[b][f], entries[a][f]
    path.write_text(json.dumps(doc))


def test_a_ciphertext_swapped_into_another_entry_does_not_decrypt(tmp_path: Path) -> None:
    vault = make_vault(tmp_path)
    vault.set("a", b"secret-for-a", "a.example.com", "X-Api-Key", "{secret}")
    vault.set("b", b"secret-for-b", "b.example.com", "X-Api-Key", "{secret}")
    swap(vault.path, 0, 1, "nonce", "ciphertext")
    for name in ("a", "b"):
        with pytest.raises(DecryptFailed):
            vault.get(name)


@pytest.mark.parametrize("field", ["host", "header", "template"])
def test_an_entry_whose_binding_was_edited_does_not_decrypt(tmp_path: Path, field: str) -> None:
    vault = make_vault(tmp_path)
    vault.set("a", SECRET, "a.example.com", "X-Api-Key", "{secret}")
    doc = json.loads(vault.path.read_bytes())
    doc["entries"][0][field] = {"host": "evil.com", "header": "X-Other", "template": "Token {secret}"}[field]
    vault.path.write_text(json.dumps(doc))
    with pytest.raises(DecryptFailed):
        vault.get("a")


@pytest.mark.parametrize("content", [b"", b"{}", b"[]", b"not json", b'{"format":"wakeful-vault","version":1}',
                                     b'{"format":"wakeful-vault","version":1,"entries":[{"name":"a"}]}'])
def test_a_malformed_vault_file_is_a_vault_file_error(tmp_path: Path, content: bytes) -> None:
    vault = make_vault(tmp_path)
    vault.path.write_bytes(content)
    with pytest.raises(VaultFileError):
        vault.list()


def test_rotation_keeps_every_secret_readable_and_old_ciphertext_unreadable_with_only_the_new_key(
        tmp_path: Path) -> None:
    vault = make_vault(tmp_path)
    old_key = vault.keys.current
    secrets = {f"c{i}": f"secret-number-{i}".encode() for i in range(3)}
    for name, secret in secrets.items():
        vault.set(name, secret, f"{name}.example.com", "X-Api-Key", "{secret}")
    before = vault.path.read_bytes()
    new_key = generate_key()
    vault.rotate(new_key)
    assert vault.keys == KeyRing(current=new_key)
    assert {i.key_id for i in vault.list()} == {new_key.key_id}
    assert all(vault.get(n).secret.reveal() == s for n, s in secrets.items())
    fresh = make_vault(tmp_path, KeyRing(current=new_key))
    assert all(fresh.get(n).secret.reveal() == s for n, s in secrets.items())
    old_copy = tmp_path / "old" / "vault.json"
    old_copy.parent.mkdir()
    old_copy.write_bytes(before)
    for name in secrets:
        with pytest.raises(DecryptFailed):
            make_vault(old_copy.parent, KeyRing(current=new_key)).get(name)
        with pytest.raises(DecryptFailed):
            make_vault(tmp_path, KeyRing(current=old_key)).get(name)


def test_a_rotation_that_cannot_decrypt_an_entry_changes_nothing(tmp_path: Path) -> None:
    vault = make_vault(tmp_path)
    vault.set("a", SECRET, "a.example.com", "X-Api-Key", "{secret}")
    before = vault.path.read_bytes()
    stranger = make_vault(tmp_path)
    with pytest.raises(DecryptFailed):
        stranger.rotate(generate_key())
    assert vault.path.read_bytes() == before


def test_the_key_file_is_created_private_once_and_never_overwritten(tmp_path: Path) -> None:
    key_path = tmp_path / "keys" / "vault.key"
    ring = init_key(key_path)
    assert mode(key_path) == 0o600
    assert init_key(key_path) == ring == load_keys(key_path)


def test_a_key_file_readable_by_others_is_refused(tmp_path: Path) -> None:
    key_path = tmp_path / "vault.key"
    init_key(key_path)
    key_path.chmod(0o644)
    with pytest.raises(VaultFileError):
        load_keys(key_path)


def test_the_key_can_come_from_the_environment_with_the_same_id(tmp_path: Path) -> None:
    ring = init_key(tmp_path / "vault.key")
    assert keys_from_env({"WAKEFUL_VAULT_KEY": ring.current.encoded()}) == ring
    for bad in ("", "not base64!", base64.b64encode(b"short").decode()):
        with pytest.raises(VaultFileError):
            keys_from_env({"WAKEFUL_VAULT_KEY": bad})


def test_rotating_the_key_file_leaves_one_new_key_that_reads_every_secret(tmp_path: Path) -> None:
    key_path = tmp_path / "vault.key"
    vault = make_vault(tmp_path, init_key(key_path))
    vault.set("a", SECRET, "a.example.com", "X-Api-Key", "{secret}")
    new_key = rotate_key_file(vault, key_path)
    assert load_keys(key_path) == KeyRing(current=new_key)
    assert mode(key_path) == 0o600
    assert make_vault(tmp_path, load_keys(key_path)).get("a").secret.reveal() == SECRET


def test_a_running_reader_follows_a_rotation_done_by_another_process(tmp_path: Path) -> None:
    key_path = tmp_path / "vault.key"
    ring = init_key(key_path)
    reader = Vault(tmp_path / "vault.json", ring, key_file=key_path)  # the proxy's vault
    frozen = Vault(tmp_path / "vault.json", ring)                     # one that never looks at the key file
    writer = Vault(tmp_path / "vault.json", load_keys(key_path))      # `wakeful secret rotate-key`
    writer.set("a", SECRET, "a.example.com", "X-Api-Key", "{secret}")
    rotate_key_file(writer, key_path)
    assert reader.get("a").secret.reveal() == SECRET
    with pytest.raises(DecryptFailed):
        frozen.get("a")


def test_keys_and_vaults_never_print_key_material(tmp_path: Path) -> None:
    vault = make_vault(tmp_path)
    material = vault.keys.current.encoded()
    assert material not in repr(vault.keys) and material not in repr(vault)


@given(st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=12, max_size=40),
       st.sampled_from(["Bearer {secret}", "{secret}", "Token token={secret}"]))
@settings(max_examples=25, deadline=None)
def test_the_vault_file_never_contains_the_plaintext_secret(body: str, template: str) -> None:
    secret = f"canary:{body}".encode()
    with tempfile.TemporaryDirectory() as tmp:
        vault = make_vault(Path(tmp))
        vault.set("merchant_api", secret, "api.merchant.com", "Authorization", template)
        vault.rotate(generate_key())
        written = b"".join(p.read_bytes() for p in Path(tmp).iterdir() if p.is_file())
        assert secret not in written
        assert base64.b64encode(secret) not in written
        assert vault.get("merchant_api").secret.reveal() == secret
