"""The URL-list downloader (shards/download.py): Retry-After dates read as GMT whatever the local zone,
and options that are not numbers at least zero refused by name."""

from __future__ import annotations

import email.utils
import time

import pytest

from vitforge.core import UsageError
from vitforge.shards import DownloadOptions
from vitforge.shards.download import _retry_after


def test_retry_after_dates_are_gmt_whatever_the_local_zone(monkeypatch):
    when = time.time() + 20
    forms = [email.utils.formatdate(when, usegmt=True),  # IMF-fixdate
             time.strftime("%a %b %d %H:%M:%S %Y", time.gmtime(when))]  # asctime: no zone
    for zone in ("UTC", "America/New_York", "Asia/Tokyo"):
        monkeypatch.setenv("TZ", zone)
        time.tzset()
        for form in forms:
            assert 15 < _retry_after(form) <= 21, (zone, form)
    monkeypatch.undo()
    time.tzset()
    assert _retry_after("7") == 7 and _retry_after("soon") is None


@pytest.mark.parametrize("field", ["host_rate", "retry_after_cap", "retries", "max_redirects"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -1])
def test_options_refuse_values_that_are_not_numbers_at_least_zero(field, value):
    with pytest.raises(UsageError, match=f"{field} must be a number >= 0"):
        DownloadOptions(**{field: value})
