"""The PrfaaS profile: interpolation of Table 5-style curves and errors that name the field at fault."""

import json

import pytest

from kvcentric.core.prfaas.inputs import InputError
from kvcentric.core.prfaas.profile import MIB, Curve, PrfaasProfile

K = 1024


def table5(**changes) -> dict:
    data = {"prfaas": {"name": "8xH200", "lengths": [K, 8 * K, 32 * K, 128 * K],
                       "prefill_s": [0.44, 0.72, 1.84, 7.40], "kv_mib": [190.8, 308.9, 701.3, 2316.3]},
            "pd_prefill": {"name": "8xH20", "lengths": [K, 128 * K], "prefill_s": [1.0, 20.0]},
            "decode": {"name": "8xH20", "max_batch": 20, "step_s": 0.025},
            "egress_gbps": 100}
    for path, value in changes.items():
        *parents, leaf = path.split("__")
        node = data
        for key in parents:
            node = node[key]
        if value is None:
            del node[leaf]
        else:
            node[leaf] = value
    return data


def test_curve_is_linear_between_points_and_extends_the_end_segments():
    curve = Curve((1000.0, 2000.0, 4000.0), (1.0, 2.0, 6.0))
    assert curve(1500) == pytest.approx(1.5)
    assert curve(3000) == pytest.approx(4.0)
    assert curve(5000) == pytest.approx(8.0)  # last slope, 2 per 1000
    assert curve(500) == pytest.approx(0.5)  # first slope ... and the line through the origin agree here
    assert list(curve([1000, 4000])) == pytest.approx([1.0, 6.0])


def test_curve_below_the_first_point_stays_positive():
    steep = Curve((1000.0, 2000.0), (0.1, 10.0))
    assert steep(10) == pytest.approx(0.1 * 10 / 1000)  # the first segment would go negative
    assert steep(10) > 0


def test_table5_profile_reads_kv_in_mib_and_derives_decode_tokens_per_second():
    profile = PrfaasProfile.from_dict(table5())
    assert profile.prfaas.kv_bytes(32 * K) == pytest.approx(701.3 * MIB)
    assert profile.prfaas.t_prefill(32 * K) == pytest.approx(1.84)
    assert profile.decode.tokens_per_s == pytest.approx(800)  # BS_max / T_decode = 20 / 0.025
    assert profile.decode.throughput(1024) == pytest.approx(0.78125)  # eq (5) for one instance
    assert profile.egress_bytes_per_s == pytest.approx(12.5e9)
    # Table 5's KV throughput column, Φ_kv = S_kv / T_prefill, e.g. 3.19 Gbps at 32K:
    assert profile.prfaas.kv_bytes(32 * K) / profile.prfaas.t_prefill(32 * K) * 8 / 1e9 == pytest.approx(3.19, abs=0.02)


def test_decode_may_be_given_as_tokens_per_second():
    profile = PrfaasProfile.from_dict(table5(decode={"tokens_per_s": 640}))
    assert profile.decode.throughput(640) == pytest.approx(1.0)


def test_profile_round_trips_through_to_dict(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps(PrfaasProfile.from_dict(table5()).to_dict()))
    again = PrfaasProfile.load(path)
    assert again.prfaas.kv_bytes(8 * K) == pytest.approx(308.9 * MIB)
    assert again.decode.tokens_per_s == pytest.approx(800)


@pytest.mark.parametrize("changes, field", [
    ({"prfaas__kv_mib": None}, "prfaas.kv_mib: missing"),
    ({"prfaas__prefill_s": [0.44, 0.72, -1, 7.4]}, "prfaas.prefill_s[2]: must be > 0"),
    ({"prfaas__prefill_s": [0.44, 0.72, 1.84]}, "prfaas.prefill_s: has 3 values for 4 lengths"),
    ({"prfaas__lengths": [K, K, 32 * K, 128 * K]}, "prfaas.lengths: must be strictly increasing"),
    ({"prfaas__kv_mib": [190.8, 308.9, 100, 2316.3]}, "prfaas.kv_mib: may not decrease"),
    ({"prfaas__kv_bytes": [1, 2, 3, 4]}, "prfaas.kv_mib: give kv_mib or kv_bytes, not both"),
    ({"pd_prefill__prefill_s": "fast"}, "pd_prefill.prefill_s: expected a list"),
    ({"decode__step_s": 0}, "decode.step_s: must be > 0"),
    ({"decode__max_batch": 2.5}, "decode.max_batch: expected an integer"),
    ({"decode": {"name": "x"}}, "decode: give max_batch"),
    ({"decode__tokens_per_s": 800}, "decode.tokens_per_s: give tokens_per_s or max_batch"),
    ({"egress_gbps": None}, "egress_gbps: missing"),
    ({"egress_gbps": "100"}, "egress_gbps: expected a finite number"),
    ({"pd_prefil": {}}, "unknown field(s) pd_prefil"),
    ({"prfaas__prefil_s": [1]}, "prfaas: unknown field(s) prefil_s"),
])
def test_bad_profiles_are_refused_with_the_field_named(changes, field):
    with pytest.raises(InputError, match="^profile: " + field.replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[").replace("]", r"\]")):
        PrfaasProfile.from_dict(table5(**changes))


def test_unreadable_and_malformed_files_name_the_file(tmp_path):
    with pytest.raises(InputError, match="profile: cannot read"):
        PrfaasProfile.load(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(InputError, match="profile: .*bad.json is not valid json"):
        PrfaasProfile.load(bad)
    bad.write_text("[1, 2]")
    with pytest.raises(InputError, match="profile: the top level: expected an object"):
        PrfaasProfile.load(bad)


def test_profile_may_be_yaml(tmp_path):
    import yaml
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(table5()))
    assert PrfaasProfile.load(path).egress_gbps == 100
