"""An activated LoRA's invocation sequence is recorded in its manifest (column added by
migration 0004), read back from the database, and shown by ``adapters show``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from alembic import command
from alembic.config import Config
from sqlalchemy import create_engine, inspect

from loraplex.registry import Registry, base_model_info
from loraplex.registry.cli import main as registry_main
from loraplex.registry.db import MIGRATIONS_DIR, current_revision, head_revision
from loraplex.testing import make_random_adapter

INVOCATION = [5, 6, 7]


@pytest.fixture
def root(tmp_path: Path, tiny_model: Path) -> Path:
    r = tmp_path / "root"
    make_random_adapter(
        tiny_model, r / "alora", r=4, target_modules=["q_proj", "v_proj"],
        alora_invocation_tokens=INVOCATION,
    )  # fmt: skip
    make_random_adapter(tiny_model, r / "plain", r=4, target_modules=["q_proj", "v_proj"])
    return r


def test_register_records_the_invocation(reg: Registry, root: Path, tiny_model: Path) -> None:
    base = base_model_info(tiny_model, "tiny")
    m = reg.register(root / "alora", "checker", base=base, actor="op")
    assert m.alora_invocation_tokens == tuple(INVOCATION)
    assert reg.get("checker", m.revision).alora_invocation_tokens == tuple(INVOCATION)
    assert m.to_dict()["alora_invocation_tokens"] == INVOCATION
    json.dumps(m.to_dict())
    plain = reg.register(root / "plain", "plain", base=base, actor="op")
    assert plain.alora_invocation_tokens is None
    assert reg.get("plain", plain.revision).to_dict()["alora_invocation_tokens"] is None


def test_cli_show_prints_it(
    db_url: str, root: Path, tiny_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    common = ["--registry-url", db_url, "--allowed-root", str(root)]
    rc = registry_main(["adapters", "register", "checker", str(root / "alora"), "--base-model",
                        str(tiny_model), "--json", *common])  # fmt: skip
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["alora_invocation_tokens"] == INVOCATION
    show = ["adapters", "show", "checker", "--revision", out["revision"], *common[:2]]
    assert registry_main(show) == 0
    line = [ln for ln in capsys.readouterr().out.splitlines() if "alora_invocation" in ln]
    assert line and "[5, 6, 7]" in line[0]


def test_migration_0004_adds_the_column_to_a_0003_database(db_url: str) -> None:
    eng = create_engine(db_url)
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    with eng.begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "0003_warm_schedule")
    cols = {c["name"] for c in inspect(eng).get_columns("adapter_revisions")}
    assert "alora_invocation_tokens" not in cols and "warm_schedule" in cols
    Registry.open(db_url).close()  # opening migrates to head
    assert current_revision(eng) == head_revision() == "0004_alora_invocation"
    cols = {c["name"] for c in inspect(eng).get_columns("adapter_revisions")}
    assert "alora_invocation_tokens" in cols
    with eng.begin() as conn:
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, "0003_warm_schedule")
    cols = {c["name"] for c in inspect(eng).get_columns("adapter_revisions")}
    assert "alora_invocation_tokens" not in cols
    eng.dispose()
