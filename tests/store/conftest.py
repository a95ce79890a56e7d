"""A real SeaweedFS S3 server on loopback for the S3 tests (one per test session)."""

from collections.abc import Iterator

import pytest

from shipyard.config.schema import StoreConfig
from shipyard.store.seaweed import SeaweedServer


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedServer]:
    server = SeaweedServer(tmp_path_factory.mktemp("seaweedfs")).start()
    yield server
    server.stop()


@pytest.fixture
def s3_cfg(
    seaweed: SeaweedServer, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> StoreConfig:
    monkeypatch.setenv("SHIPYARD_TEST_S3_KEY", "shipyard")
    monkeypatch.setenv("SHIPYARD_TEST_S3_SECRET", "shipyard")
    return StoreConfig(
        type="s3",
        root=f"shipyard-test/{request.node.name[:40]}",
        endpoint_url=seaweed.endpoint,
        key_env="SHIPYARD_TEST_S3_KEY",
        secret_env="SHIPYARD_TEST_S3_SECRET",
        connections=4,
        part_mb=5,
    )
