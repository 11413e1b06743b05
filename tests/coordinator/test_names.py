"""Contributor names cannot impersonate: unique per run compared folded (coordinator/names.py), a
second machine joins under a name with its contributor key, unnamed workers stay anonymous."""

from __future__ import annotations

import threading

import pytest
from sqlalchemy import select

from coordinator import names
from coordinator.models import Contributor, Worker
from shared import protocol
from tests.conftest import API


def register(api, run: str = "t", **body):
    return api.client.post(f"{API}/runs/{run}/workers", json=body)


# -- the pure rules -------------------------------------------------------------------------------

def same(a: str, b: str) -> bool:
    """Whether registration takes `a` and `b` for one name: they share a form (names.name_keys)."""
    return bool(set(names.name_keys(names.clean(a))) & set(names.name_keys(names.clean(b))))


@pytest.mark.parametrize("lookalike", [
    "Alice", "ALICE", " alice ", "ali\u200bce", "\ufeffalice", "ａｌｉｃｅ",  # case, space, zero-width, full-width
    "\u0430lice", "al\u0456ce", "\U0001d41a\U0001d425\U0001d422\U0001d41c\U0001d41e",  # Cyrillic a / i, bold
    "aIice", "AIice", "a\u0301lice", "ali\u0300ce\u0308", "a\u217cice",  # capital I, accents, roman numeral fifty
])
def test_lookalikes_fold_to_one_key(lookalike):
    assert same(lookalike, "alice")


def test_distinct_names_stay_distinct():
    keys = {names.name_keys(n) for n in ("alice", "alicia", "bob", "a lice", "alice2", "aiice", "alike")}
    assert len(keys) == 7 and not same("aiice", "alice") and not same("AIICE", "alice")
    assert same("b0b", "bob") and same("w1", "wl") and same("rn", "m")  # digit zero, one; r + n looks like m
    assert names.name_keys("a  \t lice") == names.name_keys("a lice")  # runs of white space are one
    assert same("ALICE", "alice") and same("aIice", "alice") and not same("ALICE", "aIice".replace("I", "i"))


# Lookalike pairs of Latin letters, chosen by eye (not taken from the table the keys use), each
# tried inside a name: `ab?de`. docs/reliability.md gives the counts.
LATIN = [("I", "l"), ("1", "l"), ("|", "l"), ("0", "O"), ("rn", "m"), ("\u0251", "a"), ("\u0131", "i"),
         ("\u01c0", "l"), ("\u0269", "i"), ("\u0261", "g"), ("\u1d0f", "o")]
CYRILLIC = [(c, t) for c, t in zip("аеорсухіјѕһԁԛԝӏАВЕКМНОРСТХЅІЈҮԚԜ", "aeopcyxijshdqwlABEKMHOPCTXSIJYQW")]
GREEK = [(c, t) for c, t in zip("οανιρυγΑΒΕΖΗΙΚΜΝΟΡΤΥΧ", "oavipuyABEZHIKMNOPTYX")]
# Pairs that look alike to the eye but Unicode's confusables.txt does not list: still two names
APART = [("vv", "w"), ("cl", "d"), ("\u0237", "j"), ("\u0299", "B"), ("\u03ba", "k"), ("\u017f", "f")]


@pytest.mark.parametrize("look, target", LATIN + CYRILLIC + GREEK)
def test_latin_cyrillic_and_greek_confusables_are_one_name(look, target):
    assert same(f"ab{look}de", f"ab{target}de")


@pytest.mark.parametrize("look, target", APART)
def test_lookalikes_unicode_does_not_list_stay_apart(look, target):
    """UTS #39 maps `κ` to `ĸ` and NFKC makes `ſ` an `s`; `vv`, `cl`, `ȷ` and `ʙ` it leaves alone."""
    assert not same(f"ab{look}de", f"ab{target}de")


def test_the_table_is_unicode_17():
    from coordinator import confusables

    mapping, version = confusables.table()
    assert version == "17.0" and len(mapping) > 9000
    assert confusables.skeleton("m") == "rn" and confusables.skeleton("I") == "l" and confusables.skeleton("\u00ad") == ""


@pytest.mark.parametrize("bad, why", [
    ("ali\nce", "control character"), ("al\x1bice", "control character"), ("\u202eecila", "bidirectional"),
    ("a\u2066b", "bidirectional"), ("tab\there", "control character")])
def test_control_and_bidi_characters_are_refused(bad, why):
    with pytest.raises(ValueError, match=why):
        names.clean(bad)


def test_empty_and_invisible_names():
    assert names.clean(None) is None and names.clean("") is None and names.clean("   ") is None
    with pytest.raises(ValueError, match="no visible characters"):
        names.name_keys(names.clean("\u200b\u200d"))


# -- registration ---------------------------------------------------------------------------------

def test_a_taken_name_is_refused_and_its_key_adds_a_machine(api, run):
    first = register(api, name="alice", team="blue")
    assert first.status_code == 201, first.text
    key = first.json()["contributor_key"]
    assert key and len(key) >= 16
    for lookalike in ("alice", "Alice", "ali\u200bce", "\u0430lice", "ＡＬＩＣＥ"):
        resp = register(api, name=lookalike)
        assert resp.status_code == 409, resp.text
        detail = resp.json()["detail"]
        assert "taken" in detail and "--contributor-key" in detail
    wrong = register(api, name="alice", contributor_key="not-the-key")
    assert wrong.status_code == 403 and "wrong contributor key" in wrong.json()["detail"]
    second = register(api, name="ALICE", team="red", contributor_key=key)  # her laptop, another team
    assert second.status_code == 201 and second.json()["contributor_key"] is None
    with api.db() as s:
        rows = s.execute(select(Worker.name, Worker.team, Worker.contributor_id).order_by(Worker.id)).all()
        (claimed,) = s.scalars(select(Contributor)).all()
    assert [(n, t) for n, t, _ in rows] == [("alice", "blue"), ("alice", "red")]  # the name as first claimed
    assert {cid for _, _, cid in rows} == {claimed.id} and claimed.key_hash != key  # stored hashed


def test_lookalikes_of_a_taken_name_are_refused(api, run):
    """Issue 34, item 6: with `alice` registered, `aIice` (capital I) and `a` + U+0301 + `lice` got 201."""
    assert register(api, name="alice").status_code == 201
    for lookalike in ("aIice", "a\u0301lice", "AIice", "\u0430l\u0456ce", "ALICE"):
        resp = register(api, name=lookalike)
        assert resp.status_code == 409, (lookalike, resp.text)
        assert "'alice'" in resp.json()["detail"]
    assert register(api, name="aiice").status_code == 201  # small i looks like no l: another name
    with api.db() as s:
        assert sorted(s.scalars(select(Contributor.name))) == ["aiice", "alice"]


def test_a_name_claimed_with_the_volunteers_own_key(api, run):
    """A volunteer may bring a key of their own (the one of another run): it is not answered back."""
    first = register(api, name="bob", contributor_key="bobs-own-key-1234")
    assert first.status_code == 201 and first.json()["contributor_key"] is None
    assert register(api, name="Bob", contributor_key="bobs-own-key-1234").status_code == 201
    assert register(api, name="bob").status_code == 409


def test_anonymous_workers_and_teams_are_never_unique(api, run):
    for _ in range(3):
        resp = register(api)
        assert resp.status_code == 201 and resp.json()["contributor_key"] is None
    assert register(api, name="  ").status_code == 201  # only white space: no name
    assert register(api, name="carol", team="blue").status_code == 201
    assert register(api, name="dave", team="blue").status_code == 201
    with api.db() as s:
        assert s.scalar(select(Contributor.id).where(Contributor.name == "  ")) is None
        assert sorted(filter(None, s.scalars(select(Worker.name)))) == ["carol", "dave"]


def test_names_are_unique_per_run_not_per_coordinator(api, run_config):
    api.create_run(run_config("one"))
    api.create_run(run_config("two"))
    assert register(api, "one", name="erin").status_code == 201
    assert register(api, "two", name="erin").status_code == 201


@pytest.mark.parametrize("body, field", [
    ({"name": "ali\nce"}, "name"), ({"name": "\u202eecila"}, "name"), ({"name": "x", "team": "blue\x00"}, "team"),
    ({"name": "\u200b"}, "name")])
def test_unshowable_names_are_refused_with_422_and_change_nothing(api, run, body, field):
    resp = register(api, **body)
    assert resp.status_code == 422, resp.text
    assert field in resp.json()["detail"]
    with api.db() as s:
        assert s.scalar(select(Worker.id)) is None and s.scalar(select(Contributor.id)) is None


def test_concurrent_claims_of_one_name_give_it_to_one(api, run):
    """Eight registrations of one name at once (threads, each its own connection): one claims it."""
    codes: list[int] = []
    start = threading.Barrier(8)

    def claim() -> None:
        start.wait()
        try:
            api.coordinator.workers.register("t", protocol.RegisterRequest(name="frank"), client=None)
            codes.append(201)
        except Exception as exc:  # noqa: BLE001 - the service's refusal carries its status
            codes.append(getattr(exc, "status_code", 500))

    threads = [threading.Thread(target=claim) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(codes) == [201] + [409] * 7, codes
    with api.db() as s:
        assert s.scalars(select(Worker.name)).all() == ["frank"]


# -- the worker's side ----------------------------------------------------------------------------

def test_the_worker_sends_its_key_and_tells_the_key_it_was_given(api, run, tmp_path, caplog):
    """worker/connection.py: the first machine logs the key it was answered; the second, started with
    --contributor-key, joins under the name (through the real registration route)."""
    from worker.caches import TokenStore
    from worker.connection import Connection
    from worker.control import StopFlag
    from worker.settings import WorkerSettings

    class Client:  # the worker's CoordinatorClient, over the in-process app
        token = None

        def register(self, run_name: str, req: protocol.RegisterRequest) -> protocol.RegisterResponse:
            resp = register(api, run_name, **req.model_dump(exclude_none=True))
            assert resp.status_code == 201, resp.text
            return protocol.RegisterResponse.model_validate(resp.json())

    def connect(machine: str, **extra) -> Connection:
        settings = WorkerSettings(coordinator="http://127.0.0.1:9", run="t", name="alice", state_dir=tmp_path / machine,
                                  **extra)
        conn = Connection(Client(), settings, TokenStore(settings.state_dir), StopFlag(), device_type="cpu")
        conn.ensure_token()
        return conn

    with caplog.at_level("INFO", logger="worker.connection"):
        connect("desktop")
    (said,) = [r.getMessage() for r in caplog.records if "--contributor-key" in r.getMessage()]
    key = said.split("--contributor-key ")[1].split(" ")[0]
    caplog.clear()
    with caplog.at_level("INFO", logger="worker.connection"):
        connect("laptop", contributor_key=key)
    assert not [r for r in caplog.records if "--contributor-key" in r.getMessage()]  # told once
    with api.db() as s:
        assert s.scalars(select(Worker.name)).all() == ["alice", "alice"]


# -- names claimed before the forms changed ------------------------------------------------------

def test_names_claimed_before_the_rekey_keep_working(open_api, db_url, tmp_path, corpus_dir, run_config):
    """A database of the release before (0006: one folded form per name) where `alice` and `aIice`
    were both claimed: migration 0007 keeps both (found, each joined with its own key), the start
    does not break, and a new lookalike of either is refused."""
    from coordinator import migrate
    from coordinator.db import make_engine
    from coordinator.services.common import hash_secret
    from coordinator.settings import CoordinatorSettings

    settings = CoordinatorSettings(data_dir=tmp_path / "d", database_url=db_url, corpus_dirs=[corpus_dir])
    with open_api(settings) as api:
        api.create_run(run_config())
        alice_key = register(api, name="alice").json()["contributor_key"]
    engine = make_engine(settings.resolved_database_url)
    try:
        assert migrate.downgrade(engine, "0006") == "0006"
        with engine.begin() as c:  # what the release before let through: its fold kept capital I an i
            run_id = c.exec_driver_sql("SELECT id FROM runs").scalar_one()
            c.exec_driver_sql("INSERT INTO contributors (run_id, name, name_key, key_hash, created_at) VALUES "
                              f"({run_id}, 'aIice', 'aiice', '{hash_secret('the-other-key')}', '2026-12-01')")
    finally:
        engine.dispose()
    with open_api(settings) as api:  # the start migrates to 0007
        assert register(api, name="aIice", contributor_key="the-other-key").status_code == 201
        assert register(api, name="alice", contributor_key=alice_key).status_code == 201
        for lookalike in ("aIice", "alice", "a\u0301lice", "aiice"):
            assert register(api, name=lookalike).status_code == 409, lookalike
        assert register(api, name="aIice", contributor_key="wrong").status_code == 403
        with api.db() as s:
            rows = s.execute(select(Worker.name, Contributor.name).join(
                Contributor, Contributor.id == Worker.contributor_id).order_by(Worker.id)).all()
        assert [tuple(r) for r in rows] == [("alice", "alice"), ("aIice", "aIice"), ("alice", "alice")]
        assert api.client.get(f"{API}/runs/t/contributors/aIice/history").json()["name"] == "aIice"
