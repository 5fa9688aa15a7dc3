"""Fair shares between tenants: virtual token counters (Sheng et al., "Fairness in Serving
Large Language Models", OSDI 2024).

Each tenant (an API key, or the name a trusted proxy or the request gives: the gateway
decides) has a counter that grows with the tokens it was served, weighted: input tokens by
`input_weight`, output tokens by `output_weight` (the paper's defaults: 1 and 2, an output
token costing a decode step), the sum divided by the tenant's weight. Within each priority
class the queue serves the tenant with the smallest counter first (batcher/queue.py), and
admission, which predicts from that order, refuses first the requests of tenants above
their share. A tenant that returns from idle has its counter lifted to the smallest of the
active ones (those with work queued or running), so idling banks no credit; one that never
left keeps its own.

Quotas are optional, per tenant: tokens a minute (input and output tokens served in the last
60 s) and sequences at once (items queued or running); over either, the request is refused
at once with `TenantQuota` and how long until it would fit.

Pure bookkeeping on an injected clock's times: no asyncio, no HTTP.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .errors import TenantQuota

__all__ = ["DEFAULT", "WINDOW", "TenantPolicy", "TenantQuota", "Tenants"]

WINDOW = 60.0  # seconds of service the quotas and the fairness index look back over
MAX_TENANTS = 4096  # tenants kept; past it, those with nothing active nor served lately are forgotten
DEFAULT = "default"  # the tenant of requests that name none
CUT_IN_TENANTS = 32  # the busiest tenants admission counts the arrivals of (`Tenants.cut_ins`)
CUT_IN_RERANK = 1.0  # seconds between re-rankings of them


@dataclass(frozen=True, slots=True)
class TenantPolicy:
    """What the operator set for one tenant: its weight and optional quotas."""

    weight: float = 1.0
    tokens_per_minute: int | None = None
    max_concurrent: int | None = None


@dataclass(slots=True)
class _Tenant:
    policy: TenantPolicy
    counter: float = 0.0
    active: int = 0  # items queued or running
    # (time, tokens, weighted service) of what it was served, over the last WINDOW seconds.
    served: deque[tuple[float, int, float]] = field(default_factory=deque)
    tokens_in_window: int = 0
    service_in_window: float = 0.0
    tokens: dict[str, int] = field(default_factory=lambda: {"input": 0, "output": 0})


class Tenants:
    """The counters, weights and quotas of every tenant seen."""

    def __init__(
        self,
        policies: Mapping[str, TenantPolicy] | None = None,
        *,
        input_weight: float = 1.0,
        output_weight: float = 2.0,
        enabled: bool = True,
    ) -> None:
        self.policies: dict[str, TenantPolicy] = dict(policies or {})
        self.input_weight, self.output_weight = input_weight, output_weight
        self.enabled = enabled
        self._tenants: dict[str, _Tenant] = {}
        # The counter of the last tenant to go idle when none stayed active: what a tenant
        # arriving at an empty server is lifted to (the paper's rule for an empty queue).
        self._last_idle = 0.0
        self._active_tenants = 0  # tenants with items active
        self._cut_in_names: list[str] = []  # the busiest tenants lately (`cut_ins`)
        self._cut_in_ranked = -math.inf  # when they were ranked

    # -- who ----------------------------------------------------------------------
    def _get(self, name: str) -> _Tenant:
        t = self._tenants.get(name)
        if t is None:
            t = self._tenants[name] = _Tenant(self.policies.get(name, TenantPolicy()))
        return t

    def weight(self, name: str) -> float:
        return self._get(name).policy.weight

    def set_policies(self, policies: Mapping[str, TenantPolicy]) -> None:
        """New weights and quotas, live; counters stay (a weight applies to service from now on)."""
        self.policies = dict(policies)
        for name, t in self._tenants.items():
            t.policy = self.policies.get(name, TenantPolicy())

    @property
    def names(self) -> list[str]:
        return list(self._tenants)

    def counter(self, name: str) -> float:
        """The tenant's virtual token counter (0 for one never served)."""
        return self._get(name).counter

    def active(self, name: str) -> int:
        return self._get(name).active

    # -- admission ----------------------------------------------------------------
    def check_quota(self, name: str, items: int, now: float) -> None:
        """Raise TenantQuota if `items` more would take the tenant past a quota."""
        t = self._get(name)
        p = t.policy
        if p.max_concurrent is not None and t.active + items > p.max_concurrent:
            raise TenantQuota(
                f"tenant {name!r} has {t.active} requests in flight; its quota is {p.max_concurrent} at once",
                retry_after=1,
            )
        if p.tokens_per_minute is not None:
            self._trim(t, now)
            if t.tokens_in_window >= p.tokens_per_minute:
                # Until enough of the window's service ages out to fall under the quota.
                over, wait = t.tokens_in_window - p.tokens_per_minute, WINDOW
                for at, tokens, _ in t.served:
                    over -= tokens
                    if over < 0:
                        wait = at + WINDOW - now
                        break
                raise TenantQuota(
                    f"tenant {name!r} was served {t.tokens_in_window} tokens in the last minute; "
                    f"its quota is {p.tokens_per_minute} a minute",
                    retry_after=max(1, math.ceil(wait)),
                )

    def arrive(self, name: str, items: int) -> None:
        """`items` of the tenant accepted (queued). One returning from idle has its counter
        lifted to the smallest active tenant's, so it cannot bank credit while away."""
        if len(self._tenants) >= MAX_TENANTS and name not in self._tenants:
            self.forget_idle()  # bounded memory under many names (a forgotten one is lifted on return)
        t = self._get(name)
        t.counter = self.arriving_counter(name)
        if t.active == 0 and items > 0:
            self._active_tenants += 1
        t.active += items

    def arriving_counter(self, name: str) -> float:
        """The tenant's counter once a new item of it is accepted: its own, or if it has
        nothing active, lifted to the smallest active tenant's (to the last idle one's when
        none is active)."""
        t = self._get(name)
        if t.active:
            return t.counter
        if not self._active_tenants:
            return max(t.counter, self._last_idle)
        floor = min((o.counter for o in self._tenants.values() if o.active > 0), default=self._last_idle)
        return max(t.counter, floor)

    def cut_ins(self, name: str, turn: float, now: float) -> list[tuple[float, float]]:
        """What other tenants' arrivals will put ahead of an item of `name` whose turn is
        `turn` (`RequestQueue.fair_turn`) while it waits: for each other tenant served in the
        window whose counter (lifted, for an idle one, as on its return) is below the turn,
        (its input tokens a second lately, the most input tokens it can take before its
        counter passes the turn). A quiet tenant's requests keep going ahead of a flood's
        queued ones: admission counts them, or the flood's admitted work is served late.
        Only the `CUT_IN_TENANTS` served most lately are counted (ranked once a
        `CUT_IN_RERANK`), so that each admission costs the same under thousands of tenant
        names; the arrivals of the rest are not counted."""
        if not now - CUT_IN_RERANK < self._cut_in_ranked <= now:
            self._cut_in_names = self.busiest(CUT_IN_TENANTS, now)
            self._cut_in_ranked = now
        floor: float | None = None
        out = []
        for other in self._cut_in_names:
            t = self._tenants.get(other)  # (forgotten since it was ranked: None)
            if t is None or other == name:
                continue
            self._trim(t, now)
            if not t.served:
                continue
            if t.active:
                counter = t.counter
            else:
                if floor is None:
                    floor = min((o.counter for o in self._tenants.values() if o.active > 0), default=self._last_idle)
                counter = max(t.counter, floor)
            if counter >= turn:
                continue
            inputs = t.tokens_in_window  # (an embedding's tokens are all input; a prompt's mostly)
            rate = inputs / max(now - t.served[0][0], 1.0)
            room = (turn - counter) * t.policy.weight / self.input_weight if self.input_weight > 0 else math.inf
            out.append((rate, room))
        return out

    def left(self, name: str, items: int = 1) -> None:
        """Items of the tenant finished (any outcome)."""
        t = self._get(name)
        if t.active == 0:
            return
        t.active = max(0, t.active - items)
        if t.active == 0:
            self._active_tenants -= 1
            if self._active_tenants == 0:
                self._last_idle = t.counter

    # -- service --------------------------------------------------------------------
    def charge(self, name: str, now: float, input_tokens: int = 0, output_tokens: int = 0) -> float:
        """Tokens served to the tenant: its counter grows by their weighted cost over its
        weight. The weighted service, returned."""
        if input_tokens <= 0 and output_tokens <= 0:
            return 0.0
        t = self._get(name)
        service = (self.input_weight * input_tokens + self.output_weight * output_tokens) / t.policy.weight
        t.counter += service
        tokens = input_tokens + output_tokens
        t.served.append((now, tokens, service))
        t.tokens_in_window += tokens
        t.service_in_window += service
        t.tokens["input"] += max(0, input_tokens)
        t.tokens["output"] += max(0, output_tokens)
        self._trim(t, now)
        return service

    def price(self, name: str, input_tokens: int, output_tokens: float = 0.0) -> float:
        """What serving an item of `input_tokens` expected to generate `output_tokens` would
        add to the tenant's counter (the queue's order within a class simulates service with
        it: without the output, a tenant whose turn came when many slots freed at once would
        take them all for the price of its prompts)."""
        cost = self.input_weight * max(input_tokens, 1) + self.output_weight * max(output_tokens, 0.0)
        return cost / self._get(name).policy.weight

    def _trim(self, t: _Tenant, now: float) -> None:
        while t.served and t.served[0][0] <= now - WINDOW:
            _, tokens, service = t.served.popleft()
            t.tokens_in_window -= tokens
            t.service_in_window -= service

    # -- what operators see ------------------------------------------------------------
    def service(self, now: float) -> dict[str, float]:
        """Each tenant's weighted service over the last WINDOW seconds (tenants served in it)."""
        out = {}
        for name, t in self._tenants.items():
            self._trim(t, now)
            if t.served:
                out[name] = max(t.service_in_window, 0.0)
        return out

    def jain(self, now: float) -> float | None:
        """Jain's fairness index over the weighted service of the tenants active now or
        served in the window: 1 when each got service in proportion to its weight, 1/n when
        one got all; None with fewer than two such tenants."""
        service = self.service(now)
        xs = [service.get(name, 0.0) for name, t in self._tenants.items() if t.active > 0 or name in service]
        if len(xs) < 2:
            return None
        total, squares = sum(xs), sum(x * x for x in xs)
        return (total * total) / (len(xs) * squares) if squares > 0 else None

    def busiest(self, n: int, now: float) -> list[str]:
        """The `n` tenants served most in the window, then the most active (metric labels)."""
        service = self.service(now)
        ranked = sorted(self._tenants, key=lambda k: (-service.get(k, 0.0), -self._tenants[k].active, k))
        return ranked[:n]

    def configure(self, enabled: bool, input_weight: float, output_weight: float) -> None:
        """The batching settings' `fairness`, `fair_input_weight` and `fair_output_weight`."""
        self.enabled, self.input_weight, self.output_weight = enabled, input_weight, output_weight

    def report(self, now: float, depths: Mapping[str, int]) -> dict[str, dict[str, Any]]:
        """Each tenant's weight, counter, items active and queued (`depths`), tokens served
        and weighted service in the last minute (the admin API's view)."""
        service = self.service(now)
        return {
            name: {
                "weight": t.policy.weight,
                "counter": round(t.counter, 3),
                "active": t.active,
                "queued": depths.get(name, 0),
                "tokens": dict(t.tokens),
                "service_last_minute": round(service.get(name, 0.0), 3),
            }
            for name, t in self._tenants.items()
        }

    def tokens(self, name: str) -> dict[str, int]:
        return dict(self._get(name).tokens)

    def forget_idle(self, keep: Iterable[str] = ()) -> None:
        """Drop tenants with nothing active nor served in the window (bounded memory under many
        keys); their counters would be lifted on return anyway."""
        keep = set(keep)
        for name in [k for k, t in self._tenants.items() if not t.active and not t.served and k not in keep]:
            del self._tenants[name]
