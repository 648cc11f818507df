"""The certificates `kvcentric up --secure` makes, and how a service reads its TLS and credentials from the files
its flags name: a missing or bad file stops the command with that flag named, a secret never shows in a repr or
a log line, and API keys are matched against every key in constant time."""

from __future__ import annotations

import datetime
import os
import ssl
import stat
import subprocess
import sys

import pytest
from cryptography import x509

from kvcentric.cli import _config_class, build_parser
from kvcentric.config import KV_SERVER_NAME, ConfigError, from_namespace
from kvcentric.runtime import security
from kvcentric.tools import certs
from kvcentric.tools.secure import make_secure_files

NOW = datetime.datetime(2026, 11, 28, tzinfo=datetime.UTC)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return make_secure_files(str(tmp_path_factory.mktemp("secure") / "s"), ["gw.example"])


def config(command: str, *argv: str):
    return from_namespace(_config_class(command), build_parser().parse_args([command, *argv]))


def test_a_certificate_is_signed_by_the_ca_for_its_hosts_and_valid_from_a_little_before_now():
    ca = certs.new_ca("test CA", NOW)
    issued = certs.issue(ca, "svc", ["127.0.0.1", "kvcentric-kv"], NOW)
    cert = issued.certificate
    cert.verify_directly_issued_by(ca.certificate)
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert [str(ip) for ip in names.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    assert names.get_values_for_type(x509.DNSName) == ["kvcentric-kv"]
    assert cert.not_valid_before_utc < NOW < cert.not_valid_after_utc
    assert not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert "key_pem" not in repr(issued) and b"PRIVATE KEY" in issued.key_pem


def test_the_secure_folder_is_the_owners_alone_and_so_is_every_secret_in_it(files):
    assert stat.S_IMODE(os.stat(files.folder).st_mode) == 0o700
    for path in (files.service_key, files.nats_password("gateway"), files.redis_password, files.api_keys,
                 files.nats_conf, files.redis_conf):
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600, path
    assert "gw.example" in x509.load_pem_x509_certificate(open(files.gateway_cert, "rb").read()).extensions \
        .get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)


def test_the_flags_up_gives_each_service_parse_and_name_no_secret(files):
    for command in ("gateway", "conductor", "prefill", "decode", "kvs-meta", "messenger"):
        flags = files.service_flags(command)
        parsed = config(command, *flags)
        security.check_files(parsed)
        for secret_file in (files.nats_password("engine"), files.redis_password, files.api_keys):
            assert open(secret_file).read().strip() not in " ".join(flags)
    assert config("prefill", *files.service_flags("prefill")).nats_user == "engine"


@pytest.mark.parametrize("flag, bad, said", [
    ("--tls-ca", "missing", "--tls-ca {path}: No such file or directory"),
    ("--tls-ca", "garbage", "--tls-ca {path}: not a PEM CA certificate"),
    ("--tls-cert", "garbage", "--tls-cert {path} / --tls-key"),
    ("--nats-password-file", "empty", "--nats-password-file {path}: the file is empty"),
])
def test_a_missing_or_bad_file_stops_the_command_naming_its_flag(files, tmp_path, flag, bad, said):
    path = tmp_path / "file"
    if bad != "missing":
        path.write_text("" if bad == "empty" else "not a certificate\n")
    flags = files.service_flags("conductor")
    flags[flags.index(flag) + 1] = str(path)
    with pytest.raises(ConfigError, match=said.format(path=path).replace("(", r"\(")):
        security.check_files(config("conductor", *flags))


def test_the_command_line_says_which_file_is_wrong_and_exits_2(tmp_path):
    result = subprocess.run([sys.executable, "-m", "kvcentric", "gateway", "--api-keys-file", str(tmp_path / "keys")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and f"--api-keys-file {tmp_path / 'keys'}: No such file" in result.stderr


def test_a_kv_certificate_must_carry_the_name_peers_check(files, tmp_path):
    ca = certs.new_ca("other", NOW)
    cert, key = certs.write_pair(certs.issue(ca, "no kv name", ["127.0.0.1"], NOW), str(tmp_path), "plain")
    with open(tmp_path / "ca.pem", "wb") as out:
        out.write(ca.cert_pem)
    engine = config("prefill", "--tls-ca", str(tmp_path / "ca.pem"), "--tls-cert", cert, "--tls-key", key)
    with pytest.raises(ConfigError, match=f"--tls-cert {cert}: does not name '{KV_SERVER_NAME}'"):
        security.transfer_tls(engine)
    tls = security.transfer_tls(config("prefill", *files.service_flags("prefill")))
    assert tls is not None and "key" not in repr(tls).replace("KEY", "")


def test_flags_that_go_together_are_refused_apart(files):
    with pytest.raises(ConfigError, match="--tls-key: --tls-cert and --tls-key go together"):
        config("conductor", "--tls-ca", files.ca, "--tls-cert", files.service_cert)
    with pytest.raises(ConfigError, match="--tls-ca: --tls-cert needs the CA"):
        config("conductor", "--tls-cert", files.service_cert, "--tls-key", files.service_key)
    with pytest.raises(ConfigError, match="--nats-user: --nats-password-file needs the user"):
        config("conductor", "--nats-password-file", files.nats_password("conductor"))
    with pytest.raises(ConfigError, match="--https-key: --https-cert and --https-key go together"):
        config("gateway", "--https-cert", files.gateway_cert)


def test_nats_access_takes_the_password_from_its_file_else_the_environment_and_never_shows_it(files, monkeypatch):
    secret = open(files.nats_password("conductor")).read().strip()
    access = security.nats_access(config("conductor", *files.service_flags("conductor")))
    assert access.password == secret and secret not in repr(access)
    options = access.options()
    assert options["user"] == "conductor" and options["inbox_prefix"] == "_INBOX.conductor"
    assert isinstance(options["tls"], ssl.SSLContext) and options["tls"].verify_mode == ssl.CERT_REQUIRED
    monkeypatch.setenv("KVC_NATS_PASSWORD", "from-the-environment")
    assert security.nats_access(config("conductor", "--nats-user", "conductor")).password == "from-the-environment"
    monkeypatch.delenv("KVC_NATS_PASSWORD")
    with pytest.raises(ConfigError, match="--nats-user conductor: no password"):
        security.nats_access(config("conductor", "--nats-user", "conductor"))
    assert security.NatsAccess("nats://127.0.0.1:4222").options() == {}  # the plain path is unchanged


def test_a_password_in_a_url_is_hidden_from_log_lines():
    assert security.redact_url("nats://app:s3cret@nats:4222") == "nats://app:***@nats:4222"
    assert security.redact_url("tls://nats:4222") == "tls://nats:4222"
    assert security.redact_url("nats://token@nats:4222") == "nats://token@nats:4222"


def test_redis_gets_the_password_of_its_file_and_tls_only_with_rediss(files, monkeypatch):
    monkeypatch.delenv("KVC_REDIS_PASSWORD", raising=False)
    secret = open(files.redis_password).read().strip()
    plain = security.redis_options("redis://r:6379/0", "", files.redis_password, files.ca, "", "")
    assert plain == {"password": secret}
    tls = security.redis_options("rediss://r:6379/0", "kvs", files.redis_password, files.ca, files.service_cert,
                                 files.service_key)
    assert tls["ssl_ca_certs"] == files.ca and tls["ssl_cert_reqs"] == "required" and tls["username"] == "kvs"
    assert security.redis_options("redis://r:6379/0", "", "", "", "", "") == {}


def test_api_keys_come_one_a_line_and_any_of_them_is_taken(tmp_path):
    keys_file = tmp_path / "keys"
    keys_file.write_text("# rotated 2026-11\nsk-old\n\n  sk-new  \n")
    keys = security.read_api_keys(str(keys_file))
    assert keys == ("sk-old", "sk-new")
    assert security.key_matches("sk-new", keys) and security.key_matches("sk-old", keys)
    assert not security.key_matches("sk-ne", keys) and not security.key_matches("", keys)
    keys_file.write_text("# none yet\n")
    with pytest.raises(ConfigError, match=f"--api-keys-file {keys_file}: holds no key"):
        security.read_api_keys(str(keys_file))


def test_up_secure_starts_its_own_servers_and_gives_each_service_its_user(files):
    def up(*argv: str):
        from kvcentric.tools.up import UpConfig
        return from_namespace(UpConfig, build_parser().parse_args(["up", *argv]))
    with pytest.raises(ConfigError, match="--secure: --secure starts its own NATS and Redis"):
        up("--secure", "--nats-url", "nats://10.0.0.1:4222")
    with pytest.raises(ConfigError, match="--secure-dir: only with --secure"):
        up("--secure-dir", "/tmp/x")
    assert up("--secure").secure
    users = {command: config(command, *files.service_flags(command)).nats_user
             for command in ("gateway", "conductor", "prefill", "decode", "colocated", "kvs-meta", "messenger")}
    assert users == {"gateway": "gateway", "conductor": "conductor", "prefill": "engine", "decode": "engine",
                     "colocated": "engine", "kvs-meta": "kvs-meta", "messenger": "messenger"}
