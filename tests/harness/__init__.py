"""Test harness: storage emulators, a counting proxy, and per-test storage backends."""
