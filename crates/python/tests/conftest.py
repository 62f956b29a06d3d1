"""Shared fixtures: SGLang 0.5.23's own planner module, fetched on first use."""

import pytest

from kvbridge import reference


@pytest.fixture(scope="session")
def sglang_utils():
    """``sglang.srt.disaggregation.common.utils`` of SGLang 0.5.23 (numpy only, no torch).

    Fetched with pip into ``kvbridge.reference.DEFAULT_DEST`` unless already there (``.ci/run``
    fetches it first); the tests that need it are skipped, with the reason, when it cannot be.
    """
    try:
        dest = reference.fetch_sglang()
    except Exception as e:  # no network, no pip: skip, saying why
        pytest.skip(
            f"SGLang {reference.VERSION} could not be fetched ({type(e).__name__}: {e}); "
            "run `python -m kvbridge.reference` where PyPI is reachable"
        )
    return reference.load_sglang_utils(dest)
