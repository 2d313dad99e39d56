"""The E2B egress policy model: parsing, and every policy loading into nftables."""

from __future__ import annotations

import ipaddress
import subprocess

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aenv_node.net import ALL_TRAFFIC, EgressPolicy, EgressPolicyError, EgressRule, open_slot

from .conftest import Lab

networks = st.builds(
    lambda addr, plen: ipaddress.IPv4Network((addr, plen), strict=False),
    st.integers(0, 2**32 - 1),
    st.integers(0, 32),
)
port_ranges = st.none() | st.tuples(st.integers(1, 65535), st.integers(1, 65535)).map(lambda t: tuple(sorted(t)))
rules = st.builds(EgressRule, networks, port_ranges)


@given(rules)
def test_rule_text_round_trips(rule: EgressRule) -> None:
    assert EgressRule.parse(str(rule)) == rule


@pytest.mark.parametrize(
    "entry",
    ["::1", "fd00::/8", "1.2.3.4:0", "1.2.3.4:70000", "1.2.3.4:9-3", "1.2.3.4:x", "999.1.1.1", "", "1.2.3.4/33"],
)
def test_bad_entries_are_rejected_with_a_message(entry: str) -> None:
    with pytest.raises(EgressPolicyError, match=repr(entry).strip("'") or "''"):
        EgressPolicy.from_e2b(deny_out=[entry])


def test_e2b_fields() -> None:
    p = EgressPolicy.from_e2b(allow_out=["8.8.8.8", "1.1.1.0/24:443"], deny_out=[ALL_TRAFFIC, ALL_TRAFFIC])
    assert [str(r) for r in p.allow] == ["8.8.8.8/32", "1.1.1.0/24:443"]
    assert [str(r) for r in p.deny] == ["0.0.0.0/0"]  # duplicates merged
    assert p.internet  # something is allowed
    assert not EgressPolicy.from_e2b(allow_internet_access=False).internet
    assert EgressPolicy().internet and EgressPolicy.from_e2b(allow_internet_access=True) == EgressPolicy()
    # domains: checked by name (the egress proxy), and they open the DNS servers by address (as E2B)
    d = EgressPolicy.from_e2b(allow_out=["Example.com", "*.foo.org", "api.x.io:8443"], deny_out=[ALL_TRAFFIC])
    assert [str(r) for r in d.domains] == ["example.com", "*.foo.org", "api.x.io:8443"]
    assert d.domain_ports == ((80, 80), (443, 443), (8443, 8443))
    assert [str(r) for r in d.allow] == ["8.8.8.8/32"]
    assert EgressPolicy.from_e2b(allow_out=["a.com"], dns_servers=[]).allow == ()
    assert d.to_e2b() == {"allowOut": ["8.8.8.8/32", "example.com", "*.foo.org", "api.x.io:8443"],
                          "denyOut": ["0.0.0.0/0"]}
    with pytest.raises(EgressPolicyError, match="deny rules"):
        EgressPolicy.from_e2b(deny_out=["example.com"])
    with pytest.raises(EgressPolicyError, match="bad port range"):
        EgressPolicy.from_e2b(allow_out=["example.com:0"])


@pytest.mark.parametrize(
    "entry,name,port,allowed",
    [
        ("example.com", "example.com", 443, True),
        ("example.com", "EXAMPLE.com.", 80, True),
        ("example.com", "example.com", 8080, False),  # 80 and 443 only, unless the entry names a port
        ("example.com", "www.example.com", 443, False),
        ("example.com", "badexample.com", 443, False),
        ("*.example.com", "www.example.com", 443, True),
        ("*.example.com", "a.b.example.com", 80, True),
        ("*.example.com", "example.com", 443, False),  # the apex is not below itself
        ("*.example.com", "wwwexample.com", 443, False),
        ("example.com:8000-8100", "example.com", 8080, True),
        ("example.com:8000-8100", "example.com", 443, False),
    ],
)
def test_domain_entries_match_names(entry: str, name: str, port: int, allowed: bool) -> None:
    policy = EgressPolicy.from_e2b(allow_out=[entry], deny_out=[ALL_TRAFFIC])
    assert policy.allows_name(name, port) is allowed


def test_from_e2b_json_bodies() -> None:
    # PUT /sandboxes/{id}/network body
    put = {"allowOut": ["1.1.1.1"], "denyOut": ["0.0.0.0/0"], "allow_internet_access": True}
    p = EgressPolicy.from_e2b_json(put)
    assert [str(r) for r in p.allow] == ["1.1.1.1/32"] and [str(r) for r in p.deny] == ["0.0.0.0/0"]
    assert not EgressPolicy.from_e2b_json({"allow_internet_access": False}).internet
    # POST /v2/sandboxes: network object + top-level allow_internet_access
    assert not EgressPolicy.from_e2b_json(None, allow_internet_access=False).internet
    assert EgressPolicy.from_e2b_json({}) == EgressPolicy()
    for bad in ({"allowOut": "1.1.1.1"}, {"denyOut": [1]}, {"allow_internet_access": "no"}, ["x"]):
        with pytest.raises(EgressPolicyError):
            EgressPolicy.from_e2b_json(bad)  # type: ignore[arg-type]


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(allow=st.lists(rules, max_size=6), deny=st.lists(rules, max_size=6))
async def test_any_policy_loads_into_a_live_slot(lab: Lab, allow: list[EgressRule], deny: list[EgressRule]) -> None:
    policy = EgressPolicy.from_e2b(allow_out=[str(r) for r in allow], deny_out=[str(r) for r in deny])
    cfg = lab.config()
    async with open_slot(cfg, 0) as slot:
        await slot.apply_egress(policy)
        chain = subprocess.run(
            [*slot.nsenter_argv(), "nft", "list", "chain", "inet", "aenv", "egress_user"],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        body = [line.strip() for line in chain.splitlines()[2:-2] if line.strip()]

        def n_rules(rs: tuple[EgressRule, ...]) -> int:  # whole networks share one rule
            return (1 if any(r.ports is None for r in rs) else 0) + sum(r.ports is not None for r in rs)

        assert sum(line.endswith(" drop") for line in body) == n_rules(policy.deny)
        assert sum(line.endswith(" accept") for line in body) == n_rules(policy.allow)
        # and again, replacing it on the live slot
        await slot.apply_egress(EgressPolicy())
        chain = subprocess.run(
            [*slot.nsenter_argv(), "nft", "list", "chain", "inet", "aenv", "egress_user"],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        assert not [line for line in chain.splitlines()[2:-2] if line.strip()]
