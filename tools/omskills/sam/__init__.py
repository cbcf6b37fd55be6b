"""The built-in SAM 3 / SAM 3.1 drivers, registered through the `omskills.drivers` entry points like
any third-party driver."""
