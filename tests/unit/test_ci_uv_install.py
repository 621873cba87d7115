"""ci/uv_install.py: uv is told what pip is configured with, in pip's order of precedence."""

from __future__ import annotations

from ci.uv_install import pip_settings, uv_arguments, uv_environment

# As `pip config list` prints them: sorted by name, so the environment's lines come first.
LISTING = """:env:.extra-index-url='file:///env/simple'
:env:.proxy='http://user:secret@proxy:3128'
global.cert='/etc/ssl/custom.pem'
global.extra-index-url='file:///opt/pypi/simple file:///opt/pypi-more/simple'
global.find-links="/opt/it's wheels"
global.no-index='true'
global.trusted-host='mirror.local\\nother.local'
install.constraint='/etc/caps.txt'
global.constraint='/etc/ignored.txt'
global.timeout='60'
"""


def test_the_environment_beats_install_which_beats_global_whatever_the_printed_order():
    settings = pip_settings(LISTING)
    assert settings["extra-index-url"] == ["file:///env/simple"]
    assert settings["constraint"] == ["/etc/caps.txt"]
    assert "timeout" not in settings  # nothing uv is told about


def test_values_are_read_as_pip_prints_them_and_become_uv_flags():
    arguments = uv_arguments(pip_settings(LISTING))
    assert arguments[:3] == ["--index-strategy", "unsafe-best-match", "--no-index"]
    pairs = list(zip(arguments[3::2], arguments[4::2]))
    assert ("--find-links", "/opt/it's") in pairs  # pip splits a value on whitespace too
    assert ("--allow-insecure-host", "mirror.local") in pairs and ("--allow-insecure-host", "other.local") in pairs
    assert ("--constraint", "/etc/caps.txt") in pairs and ("--extra-index-url", "file:///env/simple") in pairs
    assert not any("secret" in argument for argument in arguments)  # a proxy's password is never a flag


def test_no_configuration_means_pypi_and_the_callers_environment_wins():
    assert uv_arguments(pip_settings("")) == []
    settings = pip_settings(LISTING)
    environment = uv_environment(settings, {"HTTPS_PROXY": "http://mine:3128"})
    assert environment["HTTPS_PROXY"] == "http://mine:3128"
    assert environment["HTTP_PROXY"] == "http://user:secret@proxy:3128"
    assert environment["SSL_CERT_FILE"] == "/etc/ssl/custom.pem"
