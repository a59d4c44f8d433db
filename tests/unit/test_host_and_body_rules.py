"""Host names a loopback server answers, and the body types JSON endpoints take."""

import pytest

from xlserve.openai.errors import ApiError
from xlserve.openai.http_edge import allowed_hosts, check_json_content_type, host_name, is_loopback
from xlserve.server_config import ServerConfig, resolve_keys


@pytest.mark.parametrize("header,name", [("127.0.0.1:8000", "127.0.0.1"), ("[::1]:8000", "::1"),
                                         ("localhost", "localhost"), ("evil.example:80", "evil.example"),
                                         ("::1", "::1")])
def test_host_name_drops_the_port(header, name):
    assert host_name(header) == name


def test_loopback_names():
    assert all(is_loopback(h) for h in ("localhost", "127.0.0.1", "127.1.2.3", "::1", "api.localhost"))
    assert not any(is_loopback(h) for h in ("evil.example", "10.0.0.1", "localhost.evil.example", ""))


def test_allowed_hosts_by_bind_address():
    assert allowed_hosts("127.0.0.1", "") == frozenset()  # loopback names only
    assert allowed_hosts("127.0.0.1", "box.lan, Other") == {"box.lan", "other"}
    assert allowed_hosts("127.0.0.1", "*") is None
    assert allowed_hosts("0.0.0.0", "") is None  # bound wide on purpose: any host
    assert allowed_hosts("0.0.0.0", "api.example") == {"api.example"}


def test_only_json_bodies():
    check_json_content_type("application/json")
    check_json_content_type("Application/JSON; charset=utf-8")
    for bad in ("text/plain", "application/x-www-form-urlencoded", None, "multipart/form-data; boundary=x"):
        with pytest.raises(ApiError) as err:
            check_json_content_type(bad)
        assert err.value.status == 415


def test_keys_come_from_flag_file_or_environment(tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text("from-file\n")
    env = {"XLSERVE_API_KEY": "from-env", "XLSERVE_INTERNAL_API_KEY": "internal-env"}
    assert resolve_keys(ServerConfig(api_key="from-flag"), env).api_key == "from-flag"
    assert resolve_keys(ServerConfig(api_key_file=str(key_file)), env).api_key == "from-file"
    resolved = resolve_keys(ServerConfig(), env)
    assert (resolved.api_key, resolved.internal_api_key) == ("from-env", "internal-env")
    assert resolve_keys(ServerConfig(internal_api_key_file=str(key_file)), env).internal_api_key == "from-file"
    with pytest.raises(ValueError, match="cannot read the API key"):
        resolve_keys(ServerConfig(api_key_file=str(tmp_path / "missing")), {})
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="holds no internal key"):
        resolve_keys(ServerConfig(internal_api_key_file=str(tmp_path / "empty")), {})
