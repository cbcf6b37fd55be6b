"""The model-driver framework: the `ModelDriver` interface (`api`, `kit` for driver authors), how a
record's driver is found (`registry`), the driver of plain two-function files (`generic`), the
scaffold of a new driver."""
