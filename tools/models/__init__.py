"""Model drivers: the interface (`api`), how a record's driver is found (`registry`), the driver
for plain two-function files (`generic`), and the drivers that ship with omskills (SAM 3, SAM 3.1),
which register through the `omskills.drivers` entry points like any third-party driver."""
