"""Topology files: clusters, roles and links from JSON or YAML, with errors that name the field."""

import json

import pytest

from kvcentric.core.prfaas.inputs import InputError
from kvcentric.core.prfaas.topology import Topology

TWO_DC = {"clusters": [{"name": "dc-a", "role": "pd", "instances": 8, "hardware": "8xH20"},
                       {"name": "dc-b", "role": "prfaas", "instances": 4, "hardware": "8xH200"}],
          "links": [{"between": ["dc-b", "dc-a"], "gbps": 100}]}


def test_two_datacenters_give_the_planner_its_counts_and_egress():
    topology = Topology.from_dict(TWO_DC)
    assert topology.planner_counts() == (4, 8, 100.0)
    assert topology.cluster("dc-b").hardware == "8xH200"
    assert topology.link_gbps("dc-a", "dc-b") == 100 and topology.egress_gbps("dc-b") == 100


def test_egress_adds_the_links_to_every_pd_cluster_but_not_to_other_prfaas_clusters():
    data = {"clusters": [{"name": "a", "role": "pd", "instances": 4}, {"name": "b", "role": "pd", "instances": 4},
                         {"name": "p", "role": "prfaas", "instances": 2},
                         {"name": "q", "role": "prfaas", "instances": 2}],
            "links": [{"between": ["p", "a"], "gbps": 10}, {"between": ["p", "b"], "gbps": 5},
                      {"between": ["p", "q"], "gbps": 40}, {"between": ["q", "a"], "gbps": 1}]}
    topology = Topology.from_dict(data)
    assert topology.egress_gbps("p") == 15 and topology.egress_gbps("q") == 1
    assert topology.planner_counts() == (4, 8, 16.0)


def test_json_and_yaml_files_load_alike(tmp_path):
    import yaml
    (tmp_path / "t.json").write_text(json.dumps(TWO_DC))
    (tmp_path / "t.yml").write_text(yaml.safe_dump(TWO_DC))
    assert Topology.load(tmp_path / "t.json") == Topology.load(tmp_path / "t.yml")


def bad(**change):
    data = json.loads(json.dumps(TWO_DC))
    for path, value in change.items():
        kind, index, key = path.split("__")
        data[kind][int(index)][key] = value
    return data


@pytest.mark.parametrize("data, message", [
    (bad(clusters__1__role="decode"), r"clusters\[1\].role: expected one of 'pd', 'prfaas'"),
    (bad(clusters__0__instances=0), r"clusters\[0\].instances: must be >= 1"),
    (bad(clusters__0__instances="8"), r"clusters\[0\].instances: expected an integer"),
    (bad(clusters__1__name="dc-a"), r"clusters\[1\].name: duplicate cluster 'dc-a'"),
    (bad(clusters__1__name="dc.b"), r"clusters\[1\].name: may not contain"),
    (bad(links__0__between=["dc-b", "dc-c"]), r"links\[0\].between\[1\]: unknown cluster 'dc-c'"),
    (bad(links__0__between=["dc-b"]), r"links\[0\].between: expected two cluster names"),
    (bad(links__0__between=["dc-a", "dc-a"]), r"links\[0\].between: a link joins two different clusters"),
    (bad(links__0__gbps=0), r"links\[0\].gbps: must be > 0"),
    ({"clusters": []}, "clusters: expected a list of at least 1"),
    ({"clusters": TWO_DC["clusters"], "links": TWO_DC["links"] * 2}, r"links\[1\]: a second link"),
    ({"clusters": TWO_DC["clusters"][1:], "links": []}, "clusters: at least one cluster must have role 'pd'"),
    ({"clusters": TWO_DC["clusters"]}, r"clusters\[1\]: PrfaaS cluster 'dc-b' has no link to a PD cluster"),
    ({"clusters": TWO_DC["clusters"], "link": []}, r"unknown field\(s\) link"),
])
def test_bad_topologies_name_the_field(data, message):
    with pytest.raises(InputError, match="^topology: " + message):
        Topology.from_dict(data)
