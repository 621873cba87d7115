"""Print uv's flags for the package sources pip is configured with, one argument a line.

`make setup` installs with uv (parallel downloads and installs, and a user cache that makes a second
clean clone's install take seconds), but uv reads neither pip.conf nor PIP_* variables: a machine
whose pip finds wheels on local disk or on a mirror (find-links, extra-index-url, a constraint that
caps torch at what lies there) would otherwise make uv download several GB of CUDA wheels from PyPI.
This reads pip's own view (`pip config list`: its files and its environment, the environment last)
and says the same to uv. With no pip configuration it prints nothing and uv uses PyPI, as pip would.

    python ci/pip_sources.py    # e.g. --extra-index-url\nfile:///opt/simple\n--find-links\n/opt/wheels
"""

from __future__ import annotations

import shlex
import subprocess
import sys

# pip's option -> uv's flag. Every source is searched and the best version wins, as with pip
# (uv's default is the first index that has the package at all).
FLAGS = {"index-url": "--index-url", "extra-index-url": "--extra-index-url", "find-links": "--find-links",
         "constraint": "--constraint"}


def pip_settings(listing: str) -> dict[str, list[str]]:
    """`pip config list` lines (`global.find-links='/opt/wheels'`, `:env:.find-links='...'`) -> option
    -> values. A later line wins for an option, as pip lets the environment win over its files."""
    found: dict[str, list[str]] = {}
    for line in listing.splitlines():
        key, sep, value = line.partition("=")
        option = key.rsplit(".", 1)[-1]
        if sep and option in FLAGS and key.split(".", 1)[0] in ("global", "install", ":env:"):
            found[option] = shlex.split(value.strip().strip("'\"").replace("\\n", " "))
    return found


def uv_arguments(settings: dict[str, list[str]]) -> list[str]:
    arguments = ["--index-strategy", "unsafe-best-match"] if settings else []
    for option, values in settings.items():
        for value in values:
            arguments += [FLAGS[option], value]
    return arguments


def main() -> int:
    listing = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True)
    print("\n".join(uv_arguments(pip_settings(listing.stdout))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
