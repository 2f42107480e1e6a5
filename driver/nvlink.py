"""NVLink grouping shared by both backends.

GPUs reachable from each other over NVLink (directly, through other GPUs, or through the node's
NVSwitch fabric) share one ``nvlinkDomain`` string, so multi-GPU claims can match on it. A GPU
without NVLink gets a domain of its own.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Mapping

# Pseudo-peer meaning "this GPU has a link into the node's NVSwitch fabric". All NVSwitches of one
# node form one fabric, so every GPU linked to any of them is in the same domain.
NVSWITCH = "nvswitch"


def nvlink_peers(links: Mapping[str, Collection[str]]) -> dict[str, frozenset[str]]:
    """GPU key -> keys of GPUs it talks to over one NVLink hop or one NVSwitch hop.

    ``links`` maps each GPU key (its UUID) to the keys of its link partners; a partner may be
    ``NVSWITCH``. Links are treated as symmetric even if only one side lists them.
    """
    neighbours: dict[str, set[str]] = {gpu: set() for gpu in links}
    on_switch = {gpu for gpu, partners in links.items() if NVSWITCH in partners}
    for gpu, partners in links.items():
        for partner in partners:
            if partner in neighbours and partner != gpu:
                neighbours[gpu].add(partner)
                neighbours[partner].add(gpu)
    for gpu in on_switch:
        neighbours[gpu] |= on_switch - {gpu}
    return {gpu: frozenset(peers) for gpu, peers in neighbours.items()}


def nvlink_domains(links: Mapping[str, Collection[str]]) -> dict[str, str]:
    """GPU key -> domain name; equal names mean NVLink-connected (connected components)."""
    peers = nvlink_peers(links)
    domain_of: dict[str, str] = {}
    for start in sorted(peers):
        if start in domain_of:
            continue
        component = _component(start, peers)
        name = _domain_name(component)
        for member in component:
            domain_of[member] = name
    return domain_of


def _component(start: str, peers: Mapping[str, frozenset[str]]) -> set[str]:
    seen = {start}
    stack = [start]
    while stack:
        for peer in peers[stack.pop()]:
            if peer not in seen:
                seen.add(peer)
                stack.append(peer)
    return seen


def _domain_name(members: Collection[str]) -> str:
    # Derived from the members' UUIDs so it is stable across restarts and unique across nodes.
    digest = hashlib.sha256("\n".join(sorted(members)).encode()).hexdigest()
    return f"nvl-{digest[:12]}"
