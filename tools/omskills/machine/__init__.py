"""What this machine can run: its packages, devices, toolchains, the registered backends that run
here, so which stages can run."""
