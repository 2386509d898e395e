"""Fixtures of the TLS tests: one throwaway PKI per session."""
from __future__ import annotations

import pytest

from tls_certs import PKI, make_pki


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> PKI:
    return make_pki(tmp_path_factory.mktemp("pki"))
