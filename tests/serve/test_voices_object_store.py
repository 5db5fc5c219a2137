"""The voice registry on an object store (`voices_dir: s3://bucket/prefix`), against a real S3-protocol server the
test starts (moto's server mode over HTTP on 127.0.0.1), driven by s3fs as a deployment would be: two registries
are two encoder replicas sharing the bucket. No Ray here (tests/serve/test_voices_cluster.py runs the app)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest
import s3fs

from engine.errors import UnknownVoiceError
from engine.voices.cloning import VoicePrompt
from engine.voices.registry import EVERYONE, VoiceRegistry, VoiceRegistryFullError
from engine.voices.store import LOCK_NAME, ObjectStore, VoiceStoreBusyError, VoiceStoreError
from tests.serve.conftest import concurrent_adds, s3_server
from tests.serve.test_voice_registry import ALICE, BOB, assert_same_prompt, make_prompt


@pytest.fixture(scope="module")
def bucket() -> Iterator[str]:
    with s3_server() as url:
        yield url


@pytest.fixture
def location(bucket: str, request: pytest.FixtureRequest) -> str:
    """A fresh prefix per test."""
    return f"{bucket}/{request.node.name.replace('[', '-').replace(']', '')}"


def objects(location: str) -> list[str]:
    fs = s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False)
    return sorted(path.rsplit("/", 1)[-1] for path in fs.find(location.removeprefix("s3://")))


def test_two_replicas_share_the_bucket(location: str) -> None:
    replica_a, replica_b = VoiceRegistry(location), VoiceRegistry(location)
    record = replica_a.add(make_prompt(7), "shared", duration_s=1.0, caller=EVERYONE)
    assert objects(location) == [f"{record.id}.json", f"{record.id}.npz"], "no lock or other object is left"
    assert_same_prompt(replica_b.get(record.id, EVERYONE), make_prompt(7))
    assert replica_b.records(EVERYONE) == [record]
    assert_same_prompt(replica_a.get(record.id, EVERYONE), make_prompt(7))  # cached in A from here
    assert replica_b.delete(record.id, EVERYONE)
    assert objects(location) == []
    with pytest.raises(UnknownVoiceError):
        replica_a.get(record.id, EVERYONE)  # cached in A, deleted through B
    assert replica_a.records(EVERYONE) == [] and not replica_a.delete(record.id, EVERYONE)


def test_a_prompt_without_its_record_is_no_voice(location: str) -> None:
    """A writer that died between its two PUTs leaves a prompt and no record: no reader sees a voice."""
    registry = VoiceRegistry(location)
    orphan = "voice_0123456789ab"
    registry.store.write(f"{orphan}.npz", make_prompt().to_bytes())
    assert registry.records(EVERYONE) == []
    with pytest.raises(UnknownVoiceError):
        registry.get(orphan, EVERYONE)


def test_the_cache_is_revalidated_by_the_record_version(location: str, monkeypatch: pytest.MonkeyPatch) -> None:
    replica_a, replica_b = VoiceRegistry(location), VoiceRegistry(location)
    voice_id = "voice_00000000000a"
    replica_a.provision(voice_id, "narrator", "source-1", lambda: (make_prompt(1), 1.0))
    loads: list[str] = []
    real = VoicePrompt.from_bytes
    monkeypatch.setattr(VoicePrompt, "from_bytes", lambda data, name: loads.append(name) or real(data, name))
    for _ in range(3):
        assert_same_prompt(replica_b.get(voice_id, EVERYONE), make_prompt(1))
    assert len(loads) == 1, "read once, then from memory while the record is unchanged"
    # The operator changes the voice (a new source): A replaces it; B's cached prompt is stale and is read again.
    replica_a.provision(voice_id, "narrator", "source-2", lambda: (make_prompt(2), 1.0))
    assert_same_prompt(replica_b.get(voice_id, EVERYONE), make_prompt(2))
    assert len(loads) == 2


def test_concurrent_adds_through_two_replicas_respect_the_cap(location: str) -> None:
    registries = [VoiceRegistry(location, max_voices=5) for _ in range(2)]
    outcomes = concurrent_adds(registries, make_prompt, attempts=8, timeout_s=60)
    assert sorted(outcomes) == ["added"] * 5 + ["full"] * 3
    assert len(registries[1].records(EVERYONE)) == 5 and LOCK_NAME not in objects(location)


def test_the_per_key_bound_holds_across_replicas(location: str) -> None:
    replica_a, replica_b = (VoiceRegistry(location, max_voices=10, max_voices_per_key=2) for _ in range(2))
    replica_a.add(make_prompt(0), None, duration_s=1.0, caller=ALICE)
    replica_b.add(make_prompt(1), None, duration_s=1.0, caller=ALICE)
    with pytest.raises(VoiceRegistryFullError, match="this API key has registered 2 voices"):
        replica_a.add(make_prompt(2), None, duration_s=1.0, caller=ALICE)
    replica_a.add(make_prompt(3), None, duration_s=1.0, caller=BOB)
    assert len(replica_b.records(ALICE)) == 2 and len(replica_b.records(BOB)) == 1


def test_a_held_lock_waits_and_an_abandoned_one_is_broken(location: str) -> None:
    store = ObjectStore(location, lease_s=2.0, wait_s=0.5)
    store.write(LOCK_NAME, json.dumps({"token": "other", "at": time.time()}).encode())
    start = time.monotonic()
    with pytest.raises(VoiceStoreBusyError, match="busy") as busy, store.exclusive():
        pass
    assert busy.value.http_status == 503 and time.monotonic() - start >= 0.5
    store.write(LOCK_NAME, json.dumps({"token": "dead", "at": time.time() - 3.0}).encode())  # its lease ran out
    with store.exclusive():
        assert json.loads(store.read(LOCK_NAME))["token"] != "dead"
    assert LOCK_NAME not in objects(location)


def test_provisioning_is_idempotent(location: str) -> None:
    """Replicas that start together provision one voice, cloned once when it is already there."""
    replicas = [VoiceRegistry(location) for _ in range(3)]
    clones: list[int] = []

    def clone() -> tuple[VoicePrompt, float]:
        clones.append(1)
        return make_prompt(5), 2.0

    records = [replica.provision("voice_00000000000b", "alloy voice", "digest", clone) for replica in replicas]
    assert {json.dumps(record.as_dict()) for record in records} == {json.dumps(records[0].as_dict())}
    assert len(clones) == 1 and [record.id for record in replicas[2].records(BOB)] == ["voice_00000000000b"]
    assert records[0].source == "digest" and "source" not in records[0].shown() and records[0].shown()["shared"]


def test_a_missing_bucket_stops_the_replica_at_start(bucket: str) -> None:
    with pytest.raises(VoiceStoreError, match="s3://no-such-bucket/voices cannot be listed"):
        VoiceRegistry("s3://no-such-bucket/voices")
