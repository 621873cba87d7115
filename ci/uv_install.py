"""`uv pip install ARGS...` from the package sources pip is configured with.

    .venv/bin/python ci/uv_install.py --python .venv/bin/python -c ci/constraints.txt -e '.[dev,dali]'

`make setup` installs with uv (parallel downloads and installs, and a user cache that makes a second
clean clone's install take seconds), but uv reads neither pip.conf nor PIP_* variables: a machine
whose pip finds wheels on local disk or on a mirror (find-links, extra-index-url, a constraint that
caps torch at what lies there) would otherwise make uv download several GB of CUDA wheels from PyPI.
This reads pip's own view (`pip config list`: its files and its environment) and says the same to
uv: indexes, find-links, constraints, no-index and trusted hosts as flags, pip's certificate bundle
and proxy in uv's environment (never printed: a proxy URL may carry a password). With no pip
configuration uv uses PyPI, as pip would. If pip's configuration cannot be read, nothing is
installed: falling back to PyPI would be silent and cost gigabytes.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys

# pip's option -> uv's flag, repeated for each value. Every source is searched and the best version
# wins, as with pip (uv's default is the first index that has the package at all).
FLAGS = {"index-url": "--index-url", "extra-index-url": "--extra-index-url", "find-links": "--find-links",
         "constraint": "--constraint", "trusted-host": "--allow-insecure-host"}
ENVIRONMENT = {"cert": ("SSL_CERT_FILE",), "proxy": ("HTTPS_PROXY", "HTTP_PROXY")}
# Where a setting comes from, in pip's order of precedence for `pip install`: the environment wins
# over the files' [install] section, which wins over [global] (`pip config list` prints them sorted
# by name, not in this order).
SECTIONS = {"global": 0, "install": 1, ":env:": 2}


def pip_settings(listing: str) -> dict[str, list[str]]:
    """`pip config list` lines (`global.find-links='/opt/wheels'`, `:env:.find-links='/a /b'`) ->
    option -> its values (split on whitespace, as pip splits them), each from its strongest section."""
    found: dict[str, tuple[int, list[str]]] = {}
    for line in listing.splitlines():
        key, sep, value = line.partition("=")
        section, _, option = key.rpartition(".")
        rank = SECTIONS.get(section)
        if not sep or rank is None or (option not in FLAGS and option not in ENVIRONMENT and option != "no-index"):
            continue
        if option not in found or rank >= found[option][0]:
            found[option] = (rank, str(ast.literal_eval(value)).split())
    return {option: values for option, (_, values) in found.items()}


def uv_arguments(settings: dict[str, list[str]]) -> list[str]:
    arguments = ["--index-strategy", "unsafe-best-match"] if settings else []
    if settings.get("no-index", ["false"])[0].lower() in ("1", "true", "yes", "on"):
        arguments.append("--no-index")
    for option, flag in FLAGS.items():
        for value in settings.get(option, []):
            arguments += [flag, value]
    return arguments


def uv_environment(settings: dict[str, list[str]], environ: dict[str, str]) -> dict[str, str]:
    environment = dict(environ)
    for option, names in ENVIRONMENT.items():
        for name in names:
            if settings.get(option) and name not in environ:
                environment[name] = settings[option][0]
    return environment


def main(argv: list[str]) -> int:
    listing = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True)
    if listing.returncode != 0:
        print(f"uv_install: pip config list failed, nothing installed: {listing.stderr.strip()}", file=sys.stderr)
        return 2
    try:
        settings = pip_settings(listing.stdout)
    except (ValueError, SyntaxError) as error:
        print(f"uv_install: cannot read pip's configuration, nothing installed: {error}", file=sys.stderr)
        return 2
    uv = os.path.join(os.path.dirname(sys.executable), "uv")
    # Compiled as pip compiles: uv leaves it to each package's first import, which then costs every
    # fresh venv's first start (the MLflow server's took 89 s instead of about 15).
    command = [uv, "pip", "install", "--compile-bytecode", *uv_arguments(settings), *argv]
    return subprocess.run(command, env=uv_environment(settings, dict(os.environ))).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
