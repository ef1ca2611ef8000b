"""Warm-window schedules on registry revisions: the register API, the stored column (migration
0003), the CLI and the admin API (SQLite and PostgreSQL through ``db_url``)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from alembic import command
from alembic.config import Config
from sqlalchemy import create_engine, inspect

from loraplex.registry import Registry, RegistryError, base_model_info
from loraplex.registry.cli import main as registry_main
from loraplex.registry.db import MIGRATIONS_DIR, current_revision, head_revision
from loraplex.warm import WarmSchedule, parse_warm

OFFICE = {"device": "Mon-Fri 08:00-18:00", "tz": "Europe/Berlin"}


@pytest.fixture
def root(tmp_path: Path, adapters: dict[str, Path]) -> Path:
    r = tmp_path / "root"
    for name, src in adapters.items():
        shutil.copytree(src, r / name)
    return r


def test_register_stores_a_warm_schedule(reg: Registry, root: Path, tiny_model: Path) -> None:
    base = base_model_info(tiny_model, "tiny")
    m = reg.register(root / "all_r8", "office", base=base, actor="op", warm=OFFICE)
    assert isinstance(m.warm_schedule, WarmSchedule)
    assert m.warm_schedule == parse_warm(OFFICE) and m.warm == m.warm_schedule
    assert m.warm_policy == "on-demand"  # the windows decide; the String(32) column is unchanged
    assert m.to_dict()["warm_schedule"] == {"tz": "Europe/Berlin", "device": "Mon-Fri 08:00-18:00"}
    json.dumps(m.to_dict())  # audit entries and the admin API serialise it
    again = reg.get("office", m.revision)  # read back from the database
    assert again == m and again.warm_schedule == m.warm_schedule
    # a policy string through ``warm`` is the old warm_policy
    h = reg.register(root / "mlp_r16", "plain", base=base, actor="op", warm="host")
    assert (h.warm_policy, h.warm_schedule, h.warm) == ("host", None, "host")
    assert reg.get("plain", h.revision).warm_schedule is None


@pytest.mark.parametrize(
    ("warm", "match"),
    [
        ({"device": "Mon-Fri 08:00-18:00"}, "'warm.tz'"),
        ({"device": "Mon-Fri 08:00-18:00", "tz": "Mars/Olympus"}, "unknown time zone"),
        ({"device": "Mon-Fri 25:00-18:00", "tz": "UTC"}, "warm.device"),
        ({"devcie": "Mon-Fri 08:00-18:00", "tz": "UTC"}, "unknown field warm.devcie"),
        ("always", "'warm' must be one of"),
    ],
)
def test_register_refuses_bad_warm_naming_the_field(
    reg: Registry, root: Path, tiny_model: Path, warm: object, match: str
) -> None:
    base = base_model_info(tiny_model, "tiny")
    with pytest.raises(RegistryError, match=match):
        reg.register(root / "all_r8", "x", base=base, actor="op", warm=warm)
    with pytest.raises(RegistryError, match="either warm_policy or warm"):
        reg.register(root / "all_r8", "x", base=base, actor="op", warm=OFFICE, warm_policy="host")
    assert reg.list() == []


def test_cli_register_warm_json(
    db_url: str, root: Path, tiny_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    common = ["--registry-url", db_url, "--allowed-root", str(root)]
    rc = registry_main(["adapters", "register", "office", str(root / "all_r8"), "--base-model",
                        str(tiny_model), "--warm", json.dumps(OFFICE), "--json", *common])  # fmt: skip
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["warm_schedule"] == {"tz": "Europe/Berlin", "device": "Mon-Fri 08:00-18:00"}
    rc = registry_main(["adapters", "list", *common[:2]])
    assert rc == 0 and "windows (Europe/Berlin)" in capsys.readouterr().out
    rc = registry_main(["adapters", "register", "bad", str(root / "mlp_r16"), "--base-model",
                        str(tiny_model), "--warm", '{"device": "Mon-Fri 08:00-18:00"', *common])  # fmt: skip
    assert rc != 0 and "--warm: not a JSON object" in capsys.readouterr().err


def test_migration_0003_adds_the_column_to_a_0002_database(db_url: str) -> None:
    eng = create_engine(db_url)
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    with eng.begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "0002_canary_limits")
    cols = {c["name"] for c in inspect(eng).get_columns("adapter_revisions")}
    assert "warm_schedule" not in cols and "max_concurrent_requests" in cols
    Registry.open(db_url).close()  # opening migrates to head
    assert current_revision(eng) == head_revision()
    cols = {c["name"] for c in inspect(eng).get_columns("adapter_revisions")}
    assert "warm_schedule" in cols
    with eng.begin() as conn:
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, "0002_canary_limits")
    assert "warm_schedule" not in {c["name"] for c in inspect(eng).get_columns("adapter_revisions")}
    eng.dispose()
