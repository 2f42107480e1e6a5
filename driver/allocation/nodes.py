"""Which slices and devices a node can see: ``nodeName``, ``allNodes`` or a node selector.

Node selectors follow core ``v1.NodeSelector``: terms are ORed, the requirements inside a term
are ANDed, and a term without any requirement matches nothing.
"""

from __future__ import annotations

from flexgpu.driver.allocation.model import Node, NodeSelector, NodeSelectorRequirement


def _integer(text: str) -> int | None:
    try:
        return int(text)
    except ValueError:
        return None


def requirement_matches(req: NodeSelectorRequirement, value: str | None) -> bool:
    op = req.operator
    if op == "In":
        return value is not None and value in req.values
    if op == "NotIn":
        return value is None or value not in req.values
    if op == "Exists":
        return value is not None
    if op == "DoesNotExist":
        return value is None
    if op in ("Gt", "Lt") and value is not None and len(req.values) == 1:
        have, want = _integer(value), _integer(req.values[0])
        if have is None or want is None:
            return False
        return have > want if op == "Gt" else have < want
    return False


def selector_matches(selector: NodeSelector, node: Node) -> bool:
    for term in selector.terms:
        if not term.match_expressions and not term.match_fields:
            continue
        labels_ok = all(
            requirement_matches(r, node.labels.get(r.key)) for r in term.match_expressions
        )
        fields_ok = all(
            requirement_matches(r, node.name if r.key == "metadata.name" else None)
            for r in term.match_fields
        )
        if labels_ok and fields_ok:
            return True
    return False


def node_matches(
    node: Node, node_name: str | None, all_nodes: bool, selector: NodeSelector | None
) -> bool:
    """The scheduler's precedence: a node name, then all nodes, then a selector."""
    if node_name:
        return node.name == node_name
    if all_nodes:
        return True
    if selector is not None:
        return selector_matches(selector, node)
    return False
