"""The deployment topology of a PrfaaS-PD system (PrfaaS §3.1, Figure 3): clusters with their role and size,
and the inter-cluster links with their bandwidth, read from JSON or YAML and checked; it connects nothing.

    clusters:
      - {name: dc-a, role: pd, instances: 8, hardware: 8xH20}
      - {name: dc-b, role: prfaas, instances: 4, hardware: 8xH200}
    links:
      - {between: [dc-b, dc-a], gbps: 100}

A `pd` cluster serves requests end to end (PD-P and PD-D instances, split by the planner); a `prfaas`
cluster only prefills and ships KV to a PD cluster over a link, so every PrfaaS cluster needs a link to
a PD cluster. A link's `gbps` (Gbit/s) is what it carries each way; at most one link per pair. Errors
name the field, e.g. `topology: links[0].between[1]: unknown cluster 'dc-c'`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Literal, cast

from kvcentric.core.prfaas.inputs import Fields, InputError, load_document

Role = Literal["pd", "prfaas"]


@dataclasses.dataclass(frozen=True)
class Cluster:
    name: str
    role: Role
    instances: int
    """Serving instances (each one model replica, e.g. 8 GPUs); for `pd`, N_p + N_d."""
    hardware: str = ""


@dataclasses.dataclass(frozen=True)
class Link:
    between: tuple[str, str]
    gbps: float


@dataclasses.dataclass(frozen=True)
class Topology:
    clusters: tuple[Cluster, ...]
    links: tuple[Link, ...]

    def cluster(self, name: str) -> Cluster:
        for cluster in self.clusters:
            if cluster.name == name:
                return cluster
        raise KeyError(f"no cluster {name!r}")

    def of_role(self, role: Role) -> tuple[Cluster, ...]:
        return tuple(c for c in self.clusters if c.role == role)

    def link_gbps(self, a: str, b: str) -> float:
        """Bandwidth between two clusters, 0 when no link joins them."""
        return sum(link.gbps for link in self.links if set(link.between) == {a, b})

    def egress_gbps(self, name: str) -> float:
        """B_out of a PrfaaS cluster: its links to PD clusters together."""
        return sum(self.link_gbps(name, pd.name) for pd in self.of_role("pd"))

    def planner_counts(self) -> tuple[int, int, float]:
        """(N_prfaas, N_pd, B_out) summed over clusters, for the planner's one-PrfaaS one-PD model."""
        prfaas = self.of_role("prfaas")
        return (sum(c.instances for c in prfaas), sum(c.instances for c in self.of_role("pd")),
                sum(self.egress_gbps(c.name) for c in prfaas))

    @classmethod
    def from_dict(cls, data: dict) -> Topology:
        top = Fields(data, "topology")
        top.reject_unknown(("clusters", "links", "notes"))
        clusters = tuple(_cluster(f) for f in _items(top, "clusters", min_items=1))
        names = [c.name for c in clusters]
        for index, name in enumerate(names):
            if name in names[:index]:
                raise InputError(f"topology: clusters[{index}].name: duplicate cluster {name!r}")
        links = tuple(_link(f, names) for f in _items(top, "links", min_items=0))
        pairs = [frozenset(link.between) for link in links]
        for index, pair in enumerate(pairs):
            if pair in pairs[:index]:
                raise InputError(f"topology: links[{index}]: a second link between {sorted(pair)}")
        topology = cls(clusters, links)
        _check_roles(topology)
        return topology

    @classmethod
    def load(cls, path: str | Path) -> Topology:
        return cls.from_dict(load_document(path, "topology"))


def _items(top: Fields, key: str, min_items: int) -> list[Fields]:
    value = top.raw(key, default=[] if min_items == 0 else ...)
    if not isinstance(value, list) or len(value) < min_items:
        raise top.fail(key, f"expected a list of at least {min_items} item(s), got {value!r}")
    return [Fields(item, "topology", f"{key}[{i}]") for i, item in enumerate(value)]


def _cluster(fields: Fields) -> Cluster:
    fields.reject_unknown(("name", "role", "instances", "hardware", "notes"))
    name = fields.text("name")
    if "." in name or " " in name:
        raise fields.fail("name", f"may not contain '.' or spaces, got {name!r}")
    role = cast(Role, fields.text("role", choices=("pd", "prfaas")))
    return Cluster(name, role, fields.integer("instances", minimum=1),
                   fields.text("hardware", default="-"))


def _link(fields: Fields, names: list[str]) -> Link:
    fields.reject_unknown(("between", "gbps", "notes"))
    ends = fields.raw("between")
    if not isinstance(ends, list) or len(ends) != 2:
        raise fields.fail("between", f"expected two cluster names, got {ends!r}")
    for index, end in enumerate(ends):
        if end not in names:
            raise fields.fail(f"between[{index}]", f"unknown cluster {end!r}; clusters: {', '.join(names)}")
    if ends[0] == ends[1]:
        raise fields.fail("between", f"a link joins two different clusters, got {ends!r}")
    return Link((ends[0], ends[1]), fields.number("gbps", positive=True))


def _check_roles(topology: Topology) -> None:
    if not topology.of_role("pd"):
        raise InputError("topology: clusters: at least one cluster must have role 'pd' (decode happens there)")
    for index, cluster in enumerate(topology.clusters):
        if cluster.role == "prfaas" and topology.egress_gbps(cluster.name) <= 0:
            raise InputError(f"topology: clusters[{index}]: PrfaaS cluster {cluster.name!r} has no link to a "
                             f"PD cluster, so its KV cannot reach decode")
