"""Test equipment shared by the suites in tests/unit and tests/integration: the CLI and training
launches as a user makes them (cli), what the tests read back from outputs (checks), the fault proxy,
the multi-host cluster harness, the image zoo, the runs built once for every xdist worker (once) and
the services' start (services). None of it is product code or a fake of it."""
