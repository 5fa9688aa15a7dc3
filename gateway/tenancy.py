"""Whose work a request is: its tenant, for fair shares and quotas (batcher/fairness.py).

With API keys (`--api-key`, or a tenant's `key` in `--config`), the key decides: each key
is a tenant, named as the config file names it, else `key-` and a short digest of the key
(a metric label never shows a key). A tenant header or `user` field is then ignored, so a
client cannot claim another's share. Without keys, `--tenant-source` says where the name
comes from: `header` (`X-Ferry-Tenant`, set by a trusted proxy in front), `user` (the
request's OpenAI `user` field), or `none` (everyone is `default`).
"""

from __future__ import annotations

import hashlib
import hmac
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from batcher.fairness import DEFAULT, TenantPolicy

if TYPE_CHECKING:  # the engine cores' supervisor reads the policies and imports no starlette
    from starlette.requests import Request

TENANT_HEADER = "x-ferry-tenant"
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@+-]{0,63}$")


def key_tenant(key: str) -> str:
    """The name of a key's tenant where the config file gives none: a digest, never the key."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:8]


@dataclass(frozen=True)
class Tenancy:
    source: str = "header"  # header | user | none
    keys: dict[str, str] = field(default_factory=dict)  # API key -> tenant name
    policies: dict[str, TenantPolicy] = field(default_factory=dict)

    @classmethod
    def of(cls, cfg: Any) -> Tenancy:
        """From the server's config: its keys, and the config file's tenants."""
        keys = {k: key_tenant(k) for k in cfg.api_keys}
        policies: dict[str, TenantPolicy] = {}
        if cfg.config:
            from .models.config_file import load_file

            for t in load_file(cfg.config).tenants:
                policies[t.name] = TenantPolicy(t.weight, t.tokens_per_minute, t.max_concurrent)
                if t.key is not None:
                    keys[t.key] = t.name
        return cls(cfg.tenant_source, keys, policies)

    def owner_tenant(self, owner: str | None) -> str:
        """The tenant of a batch job's creator, from the digest `endpoint.key_owner` recorded."""
        if owner is None:
            return DEFAULT
        for key, name in self.keys.items():
            if hashlib.sha256(key.encode()).hexdigest()[:32] == owner:
                return name
        return DEFAULT

    @property
    def named(self) -> set[str]:
        """Tenants the operator named: their metric labels are their own."""
        return set(self.policies) | set(self.keys.values())

    def tenant(self, request: Request, body: Any = None) -> str:
        """The request's tenant (the endpoint has checked its key, if keys are on)."""
        from .errors import APIError
        from .request_body import header

        if self.keys:
            token = (header(request, "authorization") or "").partition(" ")[2].encode()
            for key, name in self.keys.items():  # compare with each: timing reveals nothing
                if hmac.compare_digest(token, key.encode()):
                    return name
            return DEFAULT
        if self.source == "header":
            raw = header(request, TENANT_HEADER)
            if raw is None:
                return DEFAULT
            if not NAME.match(raw):
                raise APIError(
                    400,
                    "header X-Ferry-Tenant must be 1-64 letters, digits or ._:@+- (starting with a letter or digit)",
                    code="invalid_value",
                    param="X-Ferry-Tenant",
                )
            return raw
        if self.source == "user":
            user = getattr(body, "user", None)
            if not user:
                return DEFAULT
            return user if NAME.match(user) else "user-" + hashlib.sha256(user.encode()).hexdigest()[:8]
        return DEFAULT
