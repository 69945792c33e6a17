from __future__ import annotations

import pytest

from pagedserve.common.errors import InvalidParameterError
from pagedserve.gateway.auth import parse_api_keys, tenant_for


def test_keys_from_file_and_environment(tmp_path):
    keys_file = tmp_path / "keys"
    keys_file.write_text("# comment\nsk-a team-a\nsk-b\n\n")
    keys = parse_api_keys(str(keys_file), "sk-c:team-c, sk-d")
    assert keys["sk-a"] == "team-a" and keys["sk-c"] == "team-c"
    # a key without a tenant is its own tenant, named without revealing the key
    assert keys["sk-b"].startswith("key-") and "sk-b" not in keys["sk-b"] and keys["sk-b"] != keys["sk-d"]
    assert tenant_for(keys, "Bearer sk-a") == "team-a"
    assert tenant_for(keys, "bearer sk-c") == "team-c"
    assert tenant_for(keys, "Bearer sk-x") is None
    assert tenant_for(keys, "sk-a") is None
    assert tenant_for(keys, None) is None
    assert parse_api_keys(None, None) == {}


def test_authentication_never_fails_open(tmp_path):
    empty = tmp_path / "empty-keys"
    empty.write_text("# only a comment\n\n")
    with pytest.raises(InvalidParameterError, match="holds no API key"):
        parse_api_keys(str(empty), None)
    for env in (":team-a", "sk-a, :team-b", "  :  "):
        with pytest.raises(InvalidParameterError, match="empty key"):
            parse_api_keys(None, env)
    # an empty key would have matched "Authorization: Bearer " (compare_digest of b"" and b"")
    assert tenant_for(parse_api_keys(None, "sk-a"), "Bearer ") is None


def test_tenant_limits_from_the_keys_file(tmp_path):
    from pagedserve.gateway.auth import TenantLimits, parse_tenant_limits

    keys_file = tmp_path / "keys"
    keys_file.write_text("sk-a team-a max_requests=4 max_queued_tokens=900\n"
                         "sk-a2 team-a max_requests=4 max_queued_tokens=900  # the same tenant, the same limits\n"
                         "sk-b team-b\n"
                         "sk-c max_requests=2\n")
    limits = parse_tenant_limits(str(keys_file))
    key_c_tenant = parse_api_keys(str(keys_file), None)["sk-c"]
    assert limits == {"team-a": TenantLimits(4, 900), key_c_tenant: TenantLimits(max_requests=2)}
    assert parse_api_keys(str(keys_file), None)["sk-a2"] == "team-a"
    assert parse_tenant_limits(None) == {}
    for bad, match in [("sk-a team-a max_requests=0\n", "max_requests=N"), ("sk-a team-a burst=3\n", "burst"),
                       ("sk-a t max_requests=2\nsk-b t max_requests=3\n", "two different limits")]:
        keys_file.write_text(bad)
        with pytest.raises(InvalidParameterError, match=match):
            parse_tenant_limits(str(keys_file))
