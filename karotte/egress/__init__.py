"""Network egress by allow-list: a host-side proxy with one check (docs/egress.md).

    policy = parse_policy(allow=["pypi.org", "*.pythonhosted.org"],
                          upstreams={"model": {"url": "https://api.example.com",
                                               "headers": {"Authorization": "Bearer ..."}}})
    with EgressProxy() as proxy:
        session = proxy.serve(policy, proxy=listener, upstreams={"model": model_listener})
        ...
        session.record()        # EgressRecord: what was reached, allowed or refused and why
"""
from .check import Verdict, check, internal, static_resolver, system_resolver
from .policy import (EgressConfigError, EgressLimits, EgressPolicy, Rule, Upstream,
                     parse_policy)
from .record import REASONS, EgressRecord, Reach
from .process import EgressProcess, ProcessSession
from .server import EgressProxy, EgressSession

__all__ = ["REASONS", "EgressConfigError", "EgressLimits", "EgressPolicy", "EgressProcess",
           "EgressProxy", "EgressRecord", "EgressSession", "ProcessSession", "Reach", "Rule",
           "Upstream", "Verdict", "check", "internal", "parse_policy", "static_resolver",
           "system_resolver"]
