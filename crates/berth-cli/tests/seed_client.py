#!/usr/bin/env python3
"""A desired-state agent written from seed 001 alone (standard library only).

It knows nothing of berth: bearer-token mode, the four calls at the seed's paths, the seed's
bundle sha, the grant flow against OpenBao. One tick:

  bootstrap.jwt -> OpenBao jwt login -> token
  POST /v1/agent/checkin (Bearer token)            -> action apply, bundle_url, vault
  GET  bundle_url                                   -> tar; recompute the sha, compare
  POST /v1/agent/lease                              -> login_jwt -> OpenBao login -> new token,
                                                       revoke-self of the old one
  GET  /v1/<kv mount>/data/<env>/see/<name>?version -> each manifest value
  POST /v1/agent/report  result applied             (with the new token)

Usage: seed_client.py SERVER CA_FILE BAO_ADDR AUTH_MOUNT ROLE ENV_ID BOOTSTRAP_FILE
Prints one JSON object: what it saw (never a secret value, only their count and sha256).
Exit codes as the seed's agent: 0 ok, 1 fatal, 75 temporary, 78 configuration.
"""

import hashlib
import io
import json
import ssl
import sys
import tarfile
import urllib.error
import urllib.request


def call(method, url, body=None, token=None, headers=None, context=None, raw=False):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    if token:
        req.add_header("Authorization", "Bearer " + token)
    for k, v in (headers or {}).items():
        req.add_header(k, v)
    try:
        with urllib.request.urlopen(req, context=context, timeout=30) as resp:
            payload = resp.read()
            if raw:
                return resp.status, dict(resp.headers), payload
            return resp.status, dict(resp.headers), json.loads(payload or b"{}")
    except urllib.error.HTTPError as e:
        payload = e.read()
        try:
            err = json.loads(payload)
        except ValueError:
            err = {"code": "HTTP_%d" % e.code, "detail": payload.decode(errors="replace")}
        return e.code, dict(e.headers), err


def fail(code, why, exit_code):
    print(json.dumps({"error": code, "detail": why}))
    sys.exit(exit_code)


def check(status, body, what):
    if status == 403 and body.get("code") == "AGENT_ENV_MISMATCH":
        fail(body["code"], what, 78)
    if status == 401:
        fail(body.get("code", "UNAUTHENTICATED"), what, 1)
    if status == 429:
        fail(body.get("code", "RATE_LIMITED"), what, 75)
    if status >= 300:
        fail(body.get("code", "HTTP_%d" % status), "%s: %s" % (what, body.get("detail")), 1)


def bundle_sha(tar_bytes):
    files = {}
    with tarfile.open(fileobj=io.BytesIO(tar_bytes), mode="r:") as tar:
        for member in tar.getmembers():
            if member.isfile():
                files[member.name] = tar.extractfile(member).read()
    digest = hashlib.sha256()
    for name in sorted(files):
        digest.update(name.encode() + b"\0" + files[name] + b"\0")
    return digest.hexdigest(), files


def bao_login(bao, mount, role, jwt):
    status, _, body = call("POST", "%s/v1/auth/%s/login" % (bao, mount), {"role": role, "jwt": jwt})
    if status != 200:
        fail("BAO_LOGIN", "%s: %s" % (status, body.get("errors")), 1)
    return body["auth"]["client_token"]


def main():
    server, ca_file, bao, auth_mount, role, env_id, bootstrap = sys.argv[1:8]
    ctx = ssl.create_default_context(cafile=ca_file)
    seen = {}

    with open(bootstrap) as f:
        token = bao_login(bao, auth_mount, role, f.read().strip())
    seen["bootstrap_login"] = True

    status, _, checkin = call(
        "POST",
        server + "/v1/agent/checkin",
        {"env_id": env_id, "agent_version": "seed-0.1", "applied_sha": None,
         "host": {"hostname": "seed-client", "transport": "sdk", "future_field": 1},
         "containers": [], "unknown_top_level": True},
        token=token, context=ctx)
    check(status, checkin, "checkin")
    seen["action"] = checkin["action"]
    if checkin["action"] != "apply":
        print(json.dumps(seen))
        return

    status, headers, tar = call("GET", server + checkin["bundle_url"], token=token, context=ctx, raw=True)
    if status != 200:
        check(status, json.loads(tar or b"{}"), "bundle")
    lower = {k.lower(): v for k, v in headers.items()}
    seen["content_type"] = lower.get("content-type")
    seen["cache_control"] = lower.get("cache-control")
    header_sha = lower.get("x-bundle-sha") or lower.get("x-bundle-sha256")
    sha, files = bundle_sha(tar)
    if sha != checkin["desired_sha"]:
        fail("BUNDLE_SHA_MISMATCH", "%s != %s" % (sha, checkin["desired_sha"]), 1)
    seen["sha_verified"] = sha == header_sha
    manifest = json.loads(files.get("secrets.manifest.json", b'{"entries": []}'))
    for entry in manifest.get("entries", []):
        if "value" in entry:
            fail("BUNDLE_INVALID", "manifest entry carries a value", 1)

    status, _, lease = call("POST", server + "/v1/agent/lease",
                            {"env_id": env_id, "reason": "apply"}, token=token, context=ctx)
    check(status, lease, "lease")
    if "wrapping_token" in lease or "role_id" in lease:
        fail("LEASE_SHAPE", "AppRole lease", 1)
    new_token = bao_login(bao, lease["mount"], lease["role"], lease["login_jwt"])
    call("POST", bao + "/v1/auth/token/revoke-self", {}, token=token)
    token = new_token
    seen["lease_keys"] = sorted(lease)

    kv_mount = checkin["vault"]["mount"]
    values = {}
    for entry in manifest.get("entries", []):
        parts = entry["path"].split("/")
        rest = parts[2:] if parts[1] != "data" else parts[3:]
        env = parts[1] if parts[1] != "data" else parts[2]
        url = "%s/v1/%s/data/%s/%s" % (bao, kv_mount, env, "/".join(rest))
        if entry.get("version") is not None:
            url += "?version=%d" % entry["version"]
        status, _, doc = call("GET", url, token=token)
        if status == 200:
            values[entry["var"]] = doc["data"]["data"]["value"]
    seen["resolved"] = sorted(values)
    seen["value_sha256"] = {k: hashlib.sha256(v.encode()).hexdigest() for k, v in values.items()}

    status, _, report = call(
        "POST", server + "/v1/agent/report",
        {"env_id": env_id, "sha": sha, "result": "applied",
         "log_tail": "INFO checkin: action=apply\nINFO applied %s" % sha[:12],
         "containers": [{"name": "web", "state": "running", "health": "healthy"}],
         "ignored_by_the_server": "yes"},
        token=token, context=ctx)
    check(status, report, "report")
    seen["reported"] = True
    print(json.dumps(seen))


if __name__ == "__main__":
    main()
