"""``loraplex adapters ...`` / ``loraplex tenants ...`` in-process (SQLite and PostgreSQL) and
once as a real subprocess."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from loraplex.cli import main
from loraplex.registry import Registry


@pytest.fixture
def root(tmp_path: Path, adapters: dict[str, Path]) -> Path:
    r = tmp_path / "root"
    for name in ("all_r8", "mlp_r16", "all_r64_layer1"):
        shutil.copytree(adapters[name], r / name)
    return r


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def ok_json(capsys: pytest.CaptureFixture[str], *argv: str) -> object:
    code, out, err = run(capsys, *argv, "--json")
    assert code == 0, err
    return json.loads(out)


def fails(capsys: pytest.CaptureFixture[str], cmd: str, *argv: str) -> str:
    code, out, err = run(capsys, cmd, *argv)
    assert code == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"loraplex {cmd}: error: "), err
    return lines[0]


def test_adapter_lifecycle_from_the_command_line(
    capsys: pytest.CaptureFixture[str], db_url: str, root: Path, tiny_model: Path, tmp_path: Path
) -> None:
    u = ["--registry-url", db_url, "--actor", "alice"]
    pol = ["--allowed-root", str(root)]
    reg = ["adapters", "register", "--base-model", str(tiny_model), *u, *pol]
    m = ok_json(capsys, *reg, "x", str(root / "all_r8"), "--activate", "--priority", "2")
    assert (m["revision"], m["status"], m["priority"], m["rank"]) == ("r1", "active", 2, 8)
    # same content again: idempotent, still r1 and active
    assert ok_json(capsys, *reg, "x", str(root / "all_r8"), "--activate")["revision"] == "r1"
    m2 = ok_json(capsys, *reg, "x", str(root / "mlp_r16"), "--stage", "--warm-policy", "host")
    assert (m2["revision"], m2["status"], m2["warm_policy"]) == ("r2", "staged", "host")

    code, out, _ = run(capsys, "adapters", "list", *u)
    assert code == 0 and "NAME" in out and "REVISION" in out and "r2" in out and "staged" in out
    rows = ok_json(capsys, "adapters", "list", *u, "--status", "active")
    assert [(r["name"], r["revision"]) for r in rows] == [("x", "r1")]
    shown = ok_json(capsys, "adapters", "show", "x", *u)
    assert shown["manifest"]["revision"] == "r1" and shown["release"]["active_revision"] == "r1"
    code, out, _ = run(capsys, "adapters", "show", "x", "--revision", "r2", *u)
    assert code == 0 and "sha256" in out and m2["sha256"] in out

    rel = ok_json(capsys, "adapters", "canary", "x", "r2", "--weight", "0.1", *u)
    assert (rel["canary_revision"], rel["canary_weight"]) == ("r2", 0.1)
    rel = ok_json(capsys, "adapters", "promote", "x", *u)
    assert (rel["active_revision"], rel["previous_revision"]) == ("r2", "r1")
    rel = ok_json(capsys, "adapters", "rollback", "x", *u)
    assert rel["active_revision"] == "r1"
    v = ok_json(capsys, "adapters", "validate", "x", "--base-model", str(tiny_model), *u)
    assert v["revision"] == "r1"
    d = ok_json(capsys, "adapters", "disable", "x", *u)
    assert (d["revision"], d["status"]) == ("r1", "disabled")
    entries = ok_json(capsys, "adapters", "audit", "--target", "x", *u)
    actions = [e["action"] for e in entries]
    for a in ("register", "stage", "promote", "canary", "rollback", "validate", "disable"):
        assert a in actions
    assert all(e["actor"] == "alice" for e in entries)
    code, out, _ = run(capsys, "adapters", "audit", *u, "--limit", "3")
    assert code == 0 and len(out.strip().splitlines()) == 2 + 3  # header, rule, 3 rows

    # errors: one line, exit 2, naming the reason
    assert "unknown adapter 'nope'" in fails(capsys, "adapters", "promote", "nope", *u)
    assert "illegal transition disabled -> active" in fails(
        capsys, "adapters", "promote", "x", "--revision", "r1", *u
    )
    line = fails(capsys, *reg, "--max-rank", "16", "big", str(root / "all_r64_layer1"))
    assert "rank_too_large" in line
    line = fails(capsys, "adapters", "register", "--base-model", str(tiny_model), *u,
                 "out", str(root / "all_r8"))  # fmt: skip
    assert "source_not_allowed" in line
    assert "--weight" in fails(capsys, "adapters", "canary", "x", "r2", "--weight", "2", *u)
    assert "invalid choice" in fails(capsys, "adapters", "frobnicate")

    # tenants and keys
    t = ok_json(capsys, "tenants", "create", "acme", "--max-waiting", "4", "--rate-limit", "2.5",
                "--host-bytes", "2GiB", *u)  # fmt: skip
    assert (t["max_waiting"], t["rate_limit_rps"], t["host_bytes_budget"]) == (4, 2.5, 2 * 1024**3)
    code, out, _ = run(capsys, "tenants", "list", *u)
    assert code == 0 and "acme" in out and str(2 * 1024**3) in out
    k = ok_json(capsys, "tenants", "keys", "create", "--tenant", "acme", "--label", "ci", *u)
    assert k["secret"].startswith("lpx-") and k["scopes"] == ["inference"]
    code, out, _ = run(
        capsys, "tenants", "keys", "create", "--admin", "--scope", "admin:promote", *u
    )
    assert code == 0 and "secret: lpx-" in out and "shown once" in out
    keys = ok_json(capsys, "tenants", "keys", "list", *u)
    assert len(keys) == 2 and k["secret"] not in json.dumps(keys)
    assert ok_json(capsys, "tenants", "keys", "revoke", k["key_id"], *u)["revoked"] is True
    with Registry.open(db_url) as r:
        assert r.authenticate(k["secret"]) is None
    assert "already exists" in fails(capsys, "tenants", "create", "acme", *u)
    assert "one of the arguments --tenant --admin is required" in fails(
        capsys, "tenants", "keys", "create", *u
    )
    assert "only hold the 'inference' scope" in fails(
        capsys, "tenants", "keys", "create", "--tenant", "acme", "--scope", "admin:*", *u
    )
    assert "unknown key" in fails(capsys, "tenants", "keys", "revoke", "key_zz", *u)
    assert "2GiB" in fails(capsys, "tenants", "create", "b", "--host-bytes", "lots", *u)


def test_signing_from_the_command_line(
    capsys: pytest.CaptureFixture[str], root: Path, tiny_model: Path, tmp_path: Path
) -> None:
    u = ["--registry-url", f"sqlite:///{tmp_path / 'reg.db'}"]
    keys = ok_json(capsys, "adapters", "keygen", "--out", str(tmp_path / "keys"))
    priv, pub = Path(keys["private_key"]), Path(keys["public_key"])
    assert oct(priv.stat().st_mode & 0o777) == "0o600" and "PUBLIC KEY" in pub.read_text()
    assert "exists" in fails(capsys, "adapters", "keygen", "--out", str(tmp_path / "keys"))
    strict = ["--require-signatures", "--trusted-key", str(pub), "--allowed-root", str(root)]
    reg = ["adapters", "register", "--base-model", str(tiny_model), *u, *strict]
    assert "unsigned" in fails(capsys, *reg, "s", str(root / "all_r8"))
    assert "bad_signature" in fails(capsys, *reg, "s", str(root / "all_r8"), "--signature", "AAAA")
    m = ok_json(capsys, *reg, "s", str(root / "all_r8"), "--sign-key", str(priv))
    assert m["signed_by"] == keys["key_id"] and m["signature"]
    # a key the registry does not trust
    other = ok_json(capsys, "adapters", "keygen", "--out", str(tmp_path / "k2"))
    line = fails(capsys, *reg, "t", str(root / "mlp_r16"), "--sign-key", other["private_key"])
    assert "bad_signature" in line
    assert "cannot read trusted key" in fails(
        capsys, *reg, "s2", str(root / "all_r8"), "--trusted-key", str(tmp_path / "nope.pem")
    )
    # list takes no policy options: argparse refuses the flag
    code, _, err = run(capsys, "adapters", "list", *u, "--trusted-key", "x")
    assert code == 2 and "unrecognized arguments" in err


def test_bad_urls_and_unreachable_databases(capsys: pytest.CaptureFixture[str]) -> None:
    assert "bad registry URL" in fails(capsys, "adapters", "list", "--registry-url", "nonsense")
    line = fails(capsys, "adapters", "list", "--registry-url",
                 "postgresql+psycopg://u:pw@127.0.0.1:1/db")  # fmt: skip
    assert "cannot open registry" in line and ":pw@" not in line
    line = fails(capsys, "tenants", "list", "--registry-url", "sqlite:////proc/nope/x.db")
    assert "cannot open registry" in line


def test_cli_runs_as_a_real_command(tmp_path: Path, root: Path, tiny_model: Path) -> None:
    """One real subprocess: exit codes and output of the installed entry point's module."""
    env = {**os.environ, "LORAPLEX_HOME": str(tmp_path / "h")}
    env["LORAPLEX_REGISTRY_URL"] = f"sqlite:///{tmp_path / 'sub.db'}"
    cmd = [sys.executable, "-m", "loraplex.cli"]
    p = subprocess.run(
        [*cmd, "adapters", "register", "x", str(root / "all_r8"), "--base-model", str(tiny_model),
         "--allowed-root", str(root), "--activate", "--json"],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["status"] == "active"
    p = subprocess.run([*cmd, "adapters", "show", "nope"], capture_output=True, text=True,
                       timeout=120, env=env)  # fmt: skip
    assert (
        p.returncode == 2 and p.stderr.strip() == "loraplex adapters: error: unknown adapter 'nope'"
    )


def test_limits_canary_policy_and_rollback_reason_from_the_command_line(
    capsys: pytest.CaptureFixture[str], db_url: str, root: Path, tiny_model: Path
) -> None:
    u = ["--registry-url", db_url, "--actor", "alice"]
    reg = ["adapters", "register", "--base-model", str(tiny_model), *u, "--allowed-root", str(root)]
    m = ok_json(capsys, *reg, "x", str(root / "all_r8"), "--activate",
                "--max-concurrent-requests", "8")  # fmt: skip
    assert m["max_concurrent_requests"] == 8
    ok_json(capsys, *reg, "x", str(root / "mlp_r16"), "--stage")
    line = fails(capsys, *reg, "y", str(root / "mlp_r16"), "--max-concurrent-requests", "0")
    assert "max_concurrent_requests" in line
    rel = ok_json(capsys, "adapters", "canary", "x", "r2", "--weight", "0.2", *u,
                  "--window", "60", "--min-requests", "10", "--max-error-rate", "0.1",
                  "--scorer", "json", "--canary-max-concurrent", "2")  # fmt: skip
    assert rel["canary_policy"] == {
        "window_s": 60.0, "min_requests": 10, "max_error_rate": 0.1, "max_ttft_p95_s": None,
        "max_tpot_p95_s": None, "min_quality": None, "scorer": "json",
        "max_concurrent_requests": 2,
    }  # fmt: skip
    assert "window_s" in fails(capsys, "adapters", "canary", "x", "r2", "--weight", "0.2", *u,
                               "--window", "0")  # fmt: skip
    rel = ok_json(capsys, "adapters", "rollback", "x", *u, "--reason", "too slow")
    assert rel["canary_revision"] is None and rel["last_rollback"]["reason"] == "too slow"
    (entry,) = [e for e in ok_json(capsys, "adapters", "audit", "--target", "x", *u)
                if e["action"] == "rollback"]  # fmt: skip
    assert entry["after"]["reason"] == "too slow" and entry["actor"] == "alice"
