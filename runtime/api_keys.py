"""``--api-keys-file``: the keys a server takes, one tenant each (docs/serving.md, "Tenants").

The file has one key per line, optionally followed by the tenant's name (``KEY`` or
``KEY NAME``, separated by whitespace); blank lines and lines starting with ``#`` are skipped.
A key without a name is the tenant ``key-`` plus the first 8 hex digits of the key's SHA-256,
a name that does not reveal the key. Several keys may name one tenant (a key being rotated).
"""

from __future__ import annotations

import hashlib
from collections.abc import Hashable
from pathlib import Path

# The tenant of ``--api-key`` on a server that also reads a keys file.
DEFAULT_TENANT = "default"
# How a tenant's cache salts begin: ``tenant-<tenant_label>-<hash of tenant and salt>``.
TENANT_SALT_PREFIX = "tenant-"


def derived_tenant(key: str) -> str:
    """The name of a tenant whose line gives only its key."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:8]


def tenant_label(tenant: str) -> str:
    """The short hash that stands for ``tenant`` where others may read it (``/metrics``)."""
    return hashlib.sha256(tenant.encode()).hexdigest()[:12]


def tenant_cache_salt(tenant: str, salt: str | None) -> str:
    """The cache salt (the scheduler's namespace) of ``tenant``'s requests with ``salt``: the
    tenant's label, then a hash of the tenant and the salt (no salt included), so tenants never
    share cached KV or request ids whatever salts they send, and the scheduler can tell whose a
    namespace is (``salt_tenant``) without learning the name. Printable ASCII, 84 characters."""
    scoped = hashlib.sha256(f"{tenant}\x1f{salt or ''}".encode()).hexdigest()
    return f"{TENANT_SALT_PREFIX}{tenant_label(tenant)}-{scoped}"


def salt_tenant(namespace: Hashable) -> str | None:
    """The tenant label (``tenant_label``) of a namespace that ``tenant_cache_salt`` made; None
    for any other namespace (requests without a tenant: the default tenant of the radix cache's
    fair eviction). A caller without a tenant (the admin) could send such a salt itself; its
    KV then counts as that tenant's."""
    if not isinstance(namespace, str) or not namespace.startswith(TENANT_SALT_PREFIX):
        return None
    label, _, scoped = namespace[len(TENANT_SALT_PREFIX) :].partition("-")
    return label if scoped else None


def read_api_keys(path: str, reserved: dict[str, str] | None = None) -> dict[str, str]:
    """``{key: tenant name}`` from the keys file at ``path``. ``reserved``: keys the server
    takes otherwise, by the flag that gives them (``{"--api-key": key}``), which the file must
    not repeat.

    Raises ValueError naming the file and the line for an unreadable file, a line of more than
    two fields, a repeated key or one of ``reserved``; a file without any key is an error too.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeError) as exc:
        raise ValueError(f"api_keys_file {path}: cannot read it: {exc}") from None
    keys: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        fields = line.split()
        if not fields or fields[0].startswith("#"):
            continue
        where = f"api_keys_file {path}, line {number}"
        if len(fields) > 2:
            raise ValueError(f"{where}: expected 'KEY' or 'KEY TENANT', got {len(fields)} fields")
        key = fields[0]
        if key in keys:
            raise ValueError(f"{where}: the key is already on an earlier line")
        for flag, taken in (reserved or {}).items():
            if key == taken:
                raise ValueError(f"{where}: the key is also given as {flag}")
        keys[key] = fields[1] if len(fields) == 2 else derived_tenant(key)
    if not keys:
        raise ValueError(f"api_keys_file {path}: no key in it")
    return keys
