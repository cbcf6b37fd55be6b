"""Model drivers: the interface (`api`, and `kit` for driver authors), how a record's driver is
found (`registry`), the driver for plain two-function files (`generic`), the scaffold of a new one
(`scaffold`), and the drivers that ship with omskills, which register through the
`omskills.drivers` entry points like any third-party driver."""
